"""The bench: the synthetic cache, one methods table on a tiny model (JSON shape, phase
times, speedups), the profile-only path, and input errors."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tests.tiny import tiny_model
from vegas_jax import bench


def test_synthetic_cache_is_random_and_sized():
    cfg = tiny_model().config
    c = bench.synthetic_cache(cfg, 2, 256, 200, jnp.bfloat16)
    assert c.k.shape == (cfg.num_layers, 2, cfg.num_kv_heads, 256, cfg.head_dim)
    assert c.k.dtype == jnp.bfloat16 and c.lengths.tolist() == [200, 200]
    k, v = np.asarray(c.k, np.float32), np.asarray(c.v, np.float32)
    assert 0.8 < k.std() < 1.2 and abs(k.mean()) < 0.05  # ~unit variance, no constant runs
    assert np.abs(k).max() <= 1.71 and not np.array_equal(k, v)
    assert len(np.unique(k[0, 0, 0, :, 0])) > 200  # positions differ


@pytest.fixture(scope="module")
def prompts_json(tmp_path_factory):
    rng = np.random.default_rng(0)
    p = tmp_path_factory.mktemp("bench") / "prompts.json"
    p.write_text(json.dumps({"prompts": [rng.integers(0, 100, 300).tolist() for _ in range(2)]}))
    return str(p)


def test_methods_table_tiny_model(prompts_json, capsys):
    rc = bench.main(["--prompts-json", prompts_json, "--batch", "2", "--context", "256",
                     "--new-tokens", "16", "--min-tokens", "8", "--gamma", "3",
                     "--methods", "vanilla,stream,vegas", "--profile-methods", "vegas",
                     "--profile-reps", "1", "--attn-impl", "xla", "--json"],
                    model=tiny_model(scale=0.3))
    assert rc == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"vanilla", "stream", "vegas"}
    assert rows["vanilla"]["speedup"] == pytest.approx(1.0)
    for m in ("stream", "vegas"):
        r = rows[m]
        assert 1 <= r["tau"] <= 4 and len(r["acceptance"]) == 3 and r["tok_s"] > 0
        assert r["speedup"] == pytest.approx(r["tok_s"] / rows["vanilla"]["tok_s"])
    v = rows["vegas"]
    for k in ("round_ms", "draft_ms", "verify_ms", "verify_capture_ms", "select_ms",
              "vanilla_step_ms"):
        assert v[k] > 0, k
    assert "round_ms" not in rows["stream"]  # only the methods asked for are profiled


def test_sparsities_run_each_method_at_each_budget(prompts_json, capsys):
    rc = bench.main(["--prompts-json", prompts_json, "--batch", "2", "--context", "256",
                     "--new-tokens", "12", "--min-tokens", "8", "--gamma", "3",
                     "--methods", "vanilla,vegas", "--sparsities", "0.05,0.5",
                     "--profile-reps", "0", "--attn-impl", "xla"],
                    model=tiny_model(scale=0.3))
    assert rc == 0
    out = capsys.readouterr().out
    assert "| vegas | 3 | 0.05 |" in out and "| vegas | 3 | 0.5 |" in out
    assert "tail vegas g3 s0.05:" in out


def test_profile_only_projects(capsys):
    rc = bench.main(["--profile-only", "--batch", "1", "--context", "200", "--gamma", "2",
                     "--min-tokens", "8", "--methods", "vegas", "--profile-reps", "1",
                     "--project-tau", "2.5", "--attn-impl", "xla", "--json"],
                    model=tiny_model(scale=0.3))
    assert rc == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["projected_tok_s"] == pytest.approx(2.5 / row["round_ms"] * 1e3)
    assert row["projected_vanilla_tok_s"] == pytest.approx(1 / row["vanilla_step_ms"] * 1e3)


@pytest.mark.parametrize("flags, msg", [
    (["--methods", "vanilla,nope"], "unknown method 'nope'"),
    (["--batch", "0"], "must be >= 1"),
    (["--sparsities", "0.07,0"], "sparsity must be in (0, 1]"),
])
def test_bad_input(flags, msg, capsys):
    assert bench.main(flags, model=tiny_model()) == 2
    assert msg in capsys.readouterr().err

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
    for r in rows.values():  # a call is timed only where the host waited on the device
        assert len(r["tokens_by_call"]) == len(r["call_ms"])
        timed = any(m is not None and a == 2 for m, a in zip(r["call_ms"], r["active_by_call"]))
        assert (r["full_batch_tok_s"] > 0) if timed else r["full_batch_tok_s"] is None
    # every token after each method's first call is in the trace
    assert sum(rows["vanilla"]["tokens_by_call"]) == 2 * 16 - 2 - 2 * 8
    assert 0 < sum(rows["vegas"]["tokens_by_call"]) <= 2 * 16 - 2


def test_full_batch_rate_counts_only_whole_batch_calls():
    row = {"call_ms": [10.0, 20.0, None, 5.0], "active_by_call": [2, 2, 2, 1],
           "tokens_by_call": [8, 3, 6, 5]}
    # calls 0 and 1 ran both sequences; call 2 untimed, call 3 one sequence
    assert bench.full_batch_tok_s(row, 2) == pytest.approx(11 / 30.0 * 1e3)
    assert bench.full_batch_tok_s(dict(row, active_by_call=[1, 1, 1, 1]), 2) is None
    line = bench.tail_line(dict(row, method="vegas", gamma=3, sparsity=0.07,
                                full_batch_tok_s=366.7), 2)
    assert line == ("tail vegas g3 s0.07: all 2 active 15.00 ms (2 calls, 367 tok/s), "
                    "<= 0 active -")


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

"""The bench: the synthetic cache, one methods table on a tiny model (JSON shape, phase
times, speedups), the profile-only path, and input errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tiny import BENCH_WORKLOAD, tiny_model
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


# One workload for every run here and in test_tune (`tests.tiny.BENCH_WORKLOAD`), at one
# speculative setting.
SPEC = ["--gamma", "2", "--sparsity", "0.5"]


@pytest.fixture(scope="module")
def prompts_json(tmp_path_factory):
    rng = np.random.default_rng(0)
    p = tmp_path_factory.mktemp("bench") / "prompts.json"
    p.write_text(json.dumps({"prompts": [rng.integers(0, 100, 300).tolist() for _ in range(2)]}))
    return str(p)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(scale=0.3)


def test_methods_table_tiny_model(prompts_json, tiny, capsys):
    rc = bench.main(["--prompts-json", prompts_json, *BENCH_WORKLOAD, *SPEC,
                     "--methods", "vanilla,vegas", "--profile-reps", "1", "--json"], model=tiny)
    assert rc == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"vanilla", "vegas"}
    assert rows["vanilla"]["speedup"] == pytest.approx(1.0)
    v = rows["vegas"]
    assert 1 <= v["tau"] <= 3 and len(v["acceptance"]) == 2 and v["tok_s"] > 0
    assert v["speedup"] == pytest.approx(v["tok_s"] / rows["vanilla"]["tok_s"])
    assert v["equal_sequences"] == 2  # greedy: vanilla's tokens
    assert {r["backend"] for r in rows.values()} == {"xla"}
    for k in ("round_ms", "draft_ms", "verify_ms", "verify_capture_ms", "select_ms",
              "vanilla_step_ms"):
        assert v[k] > 0, k
    assert v["e2e_over_jitted"] == pytest.approx(v["ms_per_call"] / v["round_ms"])
    assert "round_ms" not in rows["vanilla"]  # nothing to split
    for r in rows.values():  # a call is timed only where the host waited on the device
        assert len(r["tokens_by_call"]) == len(r["call_ms"])
        timed = any(m is not None and a == 2 for m, a in zip(r["call_ms"], r["active_by_call"]))
        assert (r["full_batch_tok_s"] > 0) if timed else r["full_batch_tok_s"] is None
    # every token after each method's first call is in the trace
    assert sum(rows["vanilla"]["tokens_by_call"]) == 2 * 16 - 2 - 2 * 8
    assert 0 < sum(v["tokens_by_call"]) <= 2 * 16 - 2


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


@pytest.mark.slow
def test_sparsities_run_each_method_at_each_budget(prompts_json, tiny, capsys):
    """Each speculative method at each budget; only the methods asked for have their
    round split into phases (here none)."""
    rc = bench.main(["--prompts-json", prompts_json, *BENCH_WORKLOAD, *SPEC,
                     "--methods", "vanilla,vegas", "--sparsities", "0.05,0.5",
                     "--profile-methods", "stream"], model=tiny)
    assert rc == 0
    out = capsys.readouterr().out
    assert "| vegas | 2 | 0.05 |" in out and "| vegas | 2 | 0.5 |" in out
    assert "tail vegas g2 s0.05:" in out

    def cells(line):
        return [c.strip() for c in line.split("|")[1:-1]]

    head = cells(out.splitlines()[1])
    for line in out.splitlines():
        if line.startswith("| vegas |"):
            row = cells(line)
            assert row[head.index("tok/s")] and not row[head.index("round ms")]


def test_profile_only_projects(tiny, capsys):
    rc = bench.main(["--profile-only", *BENCH_WORKLOAD, *SPEC, "--methods", "vegas",
                     "--profile-reps", "1", "--project-tau", "2.5", "--json"], model=tiny)
    assert rc == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["projected_tok_s"] == pytest.approx(2 * 2.5 / row["round_ms"] * 1e3)
    assert row["projected_vanilla_tok_s"] == pytest.approx(2 / row["vanilla_step_ms"] * 1e3)


@pytest.mark.parametrize("flags, msg", [
    (["--methods", "vanilla,nope"], "unknown method 'nope'"),
    (["--batch", "0"], "must be >= 1"),
    (["--sparsities", "0.07,0"], "sparsity must be in (0, 1]"),
    (["--gamma", "0"], "gamma must be"),
])
def test_bad_input(flags, msg, capsys):
    assert bench.main(flags, model=tiny_model()) == 2
    assert msg in capsys.readouterr().err


_COMPILES: list = []  # backend compiles while a test listens
_LISTEN = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: _COMPILES.append(event) if (
        _LISTEN and event.endswith("backend_compile_duration")) else None)


@pytest.mark.slow
def test_auto_is_timed_with_its_candidates_compiled(prompts_json, tiny, capsys, monkeypatch):
    """auto's timed run compiles nothing: a first generation of the same shapes built every
    candidate (as a fixed method's first call compiles its round, untimed), so the timed
    run builds from the caches and explores from its first calls."""
    from vegas_jax.auto_choice import AutoPolicy

    warm = bench._compile_auto

    def compile_then_listen(*a, **k):
        warm(*a, **k)
        _LISTEN.append(True)
    monkeypatch.setattr(bench, "_compile_auto", compile_then_listen)
    try:
        rc = bench.main(["--prompts-json", prompts_json, *BENCH_WORKLOAD, *SPEC,
                         "--methods", "vanilla,auto", "--profile-reps", "0", "--json"],
                        model=tiny,  # 16 tokens: a few calls; a round could pay little here
                        auto_policy=AutoPolicy(build_min_calls=0, min_gain=1.0))
    finally:
        _LISTEN.clear()
    assert rc == 0 and _COMPILES == []
    auto = {r["method"]: r for r in json.loads(capsys.readouterr().out)["rows"]}["auto"]
    assert auto["auto"]["build"] == "done" and auto["equal_sequences"] == 2

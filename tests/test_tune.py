"""The tuner: the stopping rule, the three steps on a synthetic surface, input errors, and
one real run of the CLI on a tiny random model (JSON shape, plot)."""

import json

import numpy as np
import pytest

from tests.tiny import BENCH_WORKLOAD, tiny_model
from vegas_jax import tune

SPARSITIES = [0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15]
GAMMAS = [2, 4, 6, 8, 10]


def test_plateau_index():
    assert tune.plateau_index([2.0, 3.0, 3.5, 3.55, 3.6], 0.03) == 2  # +1.4 % after 3.5
    assert tune.plateau_index([2.0, 3.0, 4.0], 0.03) is None  # still growing
    assert tune.plateau_index([2.0, 1.9], 0.03) == 0  # a drop stops too
    assert tune.plateau_index([2.0, 2.05], 0.0) is None  # threshold 0: any gain continues


def synthetic(calls):
    """tau saturates at sparsity 0.05; drafting costs grow with sparsity and gamma."""
    def evaluate(s, g):
        calls.append((s, g))
        a = min(s / 0.05, 1.0) * 0.8  # per-token acceptance
        tau = (1 - a ** (g + 1)) / (1 - a)
        round_s = 1.0 + g * (0.1 + 2.0 * s)
        return {"tau": tau, "tok_s": tau / round_s}
    return evaluate


def test_steps_on_synthetic_surface():
    calls = []
    t = tune.Tuner(synthetic(calls), SPARSITIES, GAMMAS, large_gamma=8, threshold=0.03)
    res = t.tune()
    # step 1 stops one point after the plateau (0.07 gains nothing over 0.05): 0.1+ unmeasured
    assert [p["sparsity"] for p in res["step1"]["curve"]] == [0.01, 0.02, 0.03, 0.05, 0.07]
    assert res["step1"]["sparsity"] == 0.05
    assert [p["gamma"] for p in res["step2"]["curve"]] == GAMMAS
    assert [p["sparsity"] for p in res["step3"]["curve"]] == [0.03, 0.05, 0.07]
    ch = res["chosen"]
    assert ch["sparsity"] in SPARSITIES and ch["gamma"] in GAMMAS
    assert len(calls) == len(set(calls))  # every point measured once
    n_tuner = len(calls)
    g = t.grid(ch)
    assert g["evaluated"] == len(SPARSITIES) * len(GAMMAS)
    assert len(calls) == len(SPARSITIES) * len(GAMMAS)  # the grid reused the tuner's points
    assert n_tuner < len(calls)
    assert 0 < g["ratio"] <= 1
    best = max(synthetic([])(s, k)["tok_s"] for s in SPARSITIES for k in GAMMAS)
    assert g["best"]["tok_s"] == pytest.approx(best)


def test_halfway_refinement_and_no_plateau():
    t = tune.Tuner(lambda s, g: {"tau": 1 + 10 * s, "tok_s": s * (g + 1)}, [0.1, 0.2, 0.4],
                   [1, 3], large_gamma=3, refine="halfway")
    res = t.tune()
    assert res["step1"]["sparsity"] == 0.4  # never stabilised: the largest sparsity
    assert [p["sparsity"] for p in res["step3"]["curve"]] == [0.3, 0.4]


@pytest.mark.parametrize("flags, msg", [
    (["--sparsities", ""], "empty sparsity list"),
    (["--sparsities", " , "], "empty sparsity list"),
    (["--sparsities", "0.05,0"], "sparsity must be in (0, 1]"),
    (["--sparsities", "1.5"], "sparsity must be in (0, 1]"),
    (["--gammas", "0,2"], "gamma must be"),
    (["--gammas", "2.5"], "gamma must be"),
    (["--large-gamma", "0"], "--large-gamma must be >= 1"),
])
def test_bad_input(flags, msg, capsys):
    assert tune.main(flags, model=object()) == 2  # fails before touching the model
    assert msg in capsys.readouterr().err


@pytest.mark.slow
def test_cli_tiny_model(tmp_path, capsys):
    """The tuner end to end on the bench tests' workload (`BENCH_WORKLOAD`: the programs
    their runs compiled are in the session's compilation cache), two sparsities at one
    gamma."""
    rng = np.random.default_rng(0)
    pj = tmp_path / "prompts.json"
    pj.write_text(json.dumps({"prompts": [rng.integers(0, 100, 160).tolist()]}))
    png = tmp_path / "tune.png"
    rc = tune.main(["--prompts-json", str(pj), *BENCH_WORKLOAD, "--sparsities", "0.05,0.5",
                    "--gammas", "2", "--large-gamma", "2", "--grid",
                    "--no-vanilla", "--json", "--plot", str(png)],
                   model=tiny_model(scale=0.3))
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"args", "step1", "step2", "step3", "chosen", "grid", "points",
                        "vanilla_tok_s"}
    ch = out["chosen"]
    assert (ch["sparsity"], ch["gamma"]) in {(0.05, 2), (0.5, 2)}
    assert ch["tau"] >= 1 and ch["tok_s"] > 0 and len(ch["acceptance"]) == ch["gamma"]
    assert [p["sparsity"] for p in out["step1"]["curve"]] == [0.05, 0.5]
    assert len(out["points"]) == 2 and out["grid"]["evaluated"] == 2  # each point run once
    assert out["grid"]["ratio"] == pytest.approx(ch["tok_s"] / out["grid"]["best"]["tok_s"])
    assert out["vanilla_tok_s"] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the human report renders from the same result
    text = tune.format_report(out, [0.05, 0.5], [2])
    assert "chosen: sparsity" in text and "tuner / best" in text

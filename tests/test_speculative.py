"""Speculative decoding on tiny random models: lossless greedy and sampled output for every
product method on the XLA path and through the Pallas kernels (interpret mode on the CPU),
budgets, sparse reads, the selection from the verify pass itself, and auto's generations
(its controller's parts: test_auto; exact mode: test_exact).

Most of the time here is XLA compiling: the greedy tests share one model, one batch of
prompts (one prompt bucket: one prefill program per capture) and one length, and each
(method, score, backend) runs once (`run`)."""

import dataclasses
import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import vegas_jax.model as model_mod
from tests import rand
from tests.compiled import call
from conftest import SPEC_EOS, SPEC_NEW
from tests.tiny import tiny_model
from vegas_jax import attention as attn_mod
from vegas_jax import auto_build, decode
from vegas_jax import methods as meth
from vegas_jax.attention import CAUSAL, AttnPlan
from vegas_jax.auto import AutoController
from vegas_jax.auto_choice import AutoPolicy, Config
from vegas_jax.cache import init_cache
from vegas_jax.driver import DecodeClock, Progress, TokenCollector, drive
from vegas_jax.execution import ExecConfig
from vegas_jax.generate import generate
from vegas_jax.methods import Auto, Quest, Stream, Vanilla, VerifyGuided
from vegas_jax.model import forward
from vegas_jax.quant import DRAFT_WEIGHTS
from vegas_jax.sampling import SamplingParams
from vegas_jax.speculative import SpecConfig, speculative_generate

# Every speculative product method (`methods.METHODS` less vanilla).
METHODS = ["vegas", "vegas-paper", "last", "stream", "quest", "auto"]
XLA = ExecConfig(backend="xla", layers="scan")
PALLAS = ExecConfig(backend="pallas", layers="scan")
NEW = SPEC_NEW
GAMMA = 3
AUTO_GAMMA = 1  # auto's candidates: gammas 1 and 3 (and plain steps)
# auto speculating wherever a round could tie plain steps: on these tiny models and short
# contexts no round can beat them (`auto_bound`), and auto's default decodes plainly
ROUNDS = AutoPolicy(min_gain=1.0)
FORMATS = ("same", "int8", "int4")
QUANTIZED = set(DRAFT_WEIGHTS) - {"same"}  # every quantized format (`quant.DRAFT_WEIGHTS`)


def test_method_lists_are_the_products():
    assert set(METHODS) == {m for m, obj in meth.METHODS.items() if obj.speculative}


@pytest.fixture(scope="module")
def setup(spec_model):
    """(model, prompts, vanilla result): conftest's tiny model, whose EOS ends prompt 1
    after 6 tokens, in the middle of a round, while prompts 0 and 2 run to the limit:
    every greedy test also stops a sequence mid-round while the others go on."""
    model, prompts = spec_model
    prompts = prompts[:3]
    vanilla = generate(model, prompts, NEW)
    lens = [len(t) for t in vanilla.tokens]
    assert lens == [NEW, 6, NEW] and vanilla.tokens[1][-1] == SPEC_EOS, vanilla.tokens
    return model, prompts, vanilla


@pytest.fixture(scope="module")
def run(setup):
    """run(method, score="weight", xc=XLA, **spec) -> speculative_generate's result, each
    configuration run once per module (the Pallas tests compare with the XLA runs)."""
    model, prompts, _ = setup
    done = {}

    def get(method, score="weight", xc=XLA, **kw):
        key = (method, score, xc, tuple(sorted(kw.items())))
        if key not in done:
            gamma = AUTO_GAMMA if method == "auto" else GAMMA
            spec = SpecConfig(**{"method": method, "gamma": gamma, "min_tokens": 8,
                                 "score": score, **kw})
            done[key] = speculative_generate(model, prompts, NEW, spec, exec_config=xc,
                                             auto_policy=ROUNDS)
        return done[key]

    return get


def test_first_token_streams_while_the_first_state_compiles(setup, run, monkeypatch):
    """The prefill's token reaches `on_tokens` before the first state's selection is
    compiled (on a thread): that compile does not hold the first token."""
    from vegas_jax import speculative as spec_mod

    model, prompts, vanilla = setup
    run("vegas")  # the prefill compiled
    streamed, real = threading.Event(), spec_mod.init_state

    class Gated:  # init_state whose compile waits for the first streamed token
        def lower(self, *a):
            assert streamed.wait(60), "the first token waited for init_state's compile"
            return real.lower(*a)

        def __call__(self, *a):  # compiles here unless compiled before
            assert streamed.is_set(), "init_state ran before the first token was streamed"
            return real(*a)

    monkeypatch.setattr(spec_mod, "init_state", Gated())
    res = speculative_generate(model, prompts, NEW, SpecConfig(method="vegas", gamma=GAMMA,
                                                               min_tokens=8),
                               exec_config=XLA, on_tokens=lambda new: streamed.set())
    assert res.tokens == vanilla.tokens


def _check_stats(st, n_prompts, gamma):
    # tau (mean acceptance length) = 1 + the sum of the cumulative acceptance by position,
    # and the cumulative is the running product of the conditional one
    assert st["tau"] == pytest.approx(1 + sum(st["acceptance_cumulative"]))
    cond = [0.0 if c is None else c for c in st["acceptance_conditional"]]  # None: unreached
    assert np.allclose(np.cumprod(cond), st["acceptance_cumulative"])
    # per sequence: each prompt's own tau, whose round-weighted mean is the batch's
    r = np.array(st["rounds_by_sequence"])
    assert len(r) == n_prompts and (r > 0).all()
    assert np.dot(st["tau_by_sequence"], r) / r.sum() == pytest.approx(st["tau"])
    # per call and slot (slot = prompt here): the rounds and tokens of each sequence
    acc = np.array(st["accepted_by_call"])  # [calls, b], -1 = slot inactive
    assert acc.shape == (st["rounds"], n_prompts) and acc.max() <= gamma
    np.testing.assert_array_equal((acc >= 0).sum(0), r)
    np.testing.assert_allclose(np.where(acc >= 0, acc + 1, 0).sum(0),
                               np.array(st["tau_by_sequence"]) * r)


# Raw logits (score="logit") take other capture and carry paths than softmax weights in
# the verify and the selection; they are the same for every capturing method (which rows
# the verify captures is the method's), so vegas's stands for all (the selection itself
# for both scores: test_policies).
@pytest.mark.parametrize("method,score",
                         [(m, "weight") for m in METHODS if m != "auto"]
                         + [pytest.param("vegas", "logit", marks=pytest.mark.slow)])
def test_greedy_equals_vanilla(setup, run, method, score):
    _, prompts, vanilla = setup
    res = run(method, score)
    assert res.tokens == vanilla.tokens
    assert res.stats["method"] == method and res.stats["backend"] == "xla"
    _check_stats(res.stats, len(prompts), GAMMA)


def test_eos_stops_each_sequence(setup, run):
    """Prompt 1 ends at its EOS (its 6th token), in the middle of a round; the others run
    to the limit, rounds after it."""
    res = run("stream")
    assert [len(t) for t in res.tokens] == [NEW, 6, NEW] and res.tokens[1][-1] == SPEC_EOS
    r = res.stats["rounds_by_sequence"]
    assert r[1] < min(r[0], r[2])


def test_auto_equals_vanilla_and_reports_its_choices(setup, run):
    _, prompts, vanilla = setup
    res = run("auto")
    assert res.tokens == vanilla.tokens
    _check_stats(res.stats, len(prompts), AUTO_GAMMA)  # gamma 1 alone: see below
    assert res.stats["gamma"] == 1 and list(res.stats["by_gamma"]) == [1]
    auto = res.stats["auto"]
    assert auto["calls"]["gamma 1"] >= 1
    assert set(auto["tokens_per_s_per_seq"]) <= {"vanilla", "gamma 1", "gamma 3"}
    # the model's own weights only, unless quantized formats are named
    assert auto["formats"] == ["same"] and set(auto["formats_dropped"]) == QUANTIZED
    assert all("Auto(formats=...)" in why for why in auto["formats_dropped"].values())
    assert auto["by_config"]["gamma 1"]["tau"] == pytest.approx(res.stats["tau"])
    # 24 tokens at gamma 1 (tau <= 2): fewer calls left at the first read than exploring
    # the other candidates takes; they are not built, every call is the configured gamma
    assert auto["build"] == "skipped" and auto["compile_s"] is None
    assert auto["calls"] == {"gamma 1": auto["calls"]["gamma 1"]} and auto["compiled"] == 1


def test_auto_builds_in_the_background_while_it_decodes(setup, run):
    """The other candidates compiled in a thread while the calls run (build_min_calls 0:
    however short the generation): lossless whichever calls ran once they were built."""
    _, _, vanilla = setup
    run("auto")  # gamma 1's round
    model, prompts, *_ = setup
    res = speculative_generate(model, prompts, NEW, SpecConfig(method="auto", gamma=AUTO_GAMMA,
                                                               min_tokens=8), exec_config=XLA,
                               auto_policy=AutoPolicy(build_min_calls=0, build_min_cover=0.0,
                                                      background=True,  # also on the CPU
                                                      min_gain=1.0))
    _join_builds()
    assert res.tokens == vanilla.tokens
    auto = res.stats["auto"]
    assert auto["build"] in ("running", "done") and auto["build_background"]
    if auto["build"] == "running":
        assert set(auto["calls"]) == {"gamma 1"}


def _join_builds():
    """Wait for auto's background builds (they stop once their generation has returned)."""
    for t in threading.enumerate():
        if t.name == auto_build.THREAD_NAME:
            t.join()


def test_auto_decodes_before_its_other_candidates_are_built(setup, run, monkeypatch):
    """The background build held back for the whole generation: auto decodes every call
    with its configured gamma, times none, and its tokens are vanilla's."""
    _, _, vanilla = setup
    run("auto")  # gamma 1's round, compiled by the unforced run
    gate = threading.Event()
    monkeypatch.setattr(auto_build, "compile_only", lambda run, spent: gate.wait(60))
    model, prompts, *_ = setup
    res = speculative_generate(model, prompts, NEW, SpecConfig(method="auto", gamma=AUTO_GAMMA,
                                                               min_tokens=8), exec_config=XLA,
                               auto_policy=AutoPolicy(build_min_calls=0, build_min_cover=0.0,
                                                      background=True, min_gain=1.0))
    gate.set()
    _join_builds()
    assert res.tokens == vanilla.tokens
    auto = res.stats["auto"]
    assert set(auto["calls"]) == {"gamma 1"} and auto["calls"]["gamma 1"] >= 6
    assert auto["build"] == "running" and auto["compile_s"] is None
    assert auto["built_after_calls"] is None
    assert auto["compiled"] == 1 and auto["timed_calls"] == {"gamma 1": [0, 0]}
    assert auto["choice"] is None
    assert res.stats["acceptance_conditional"][0] is not None  # acceptance still counted


_MAIN_COMPILES: list = []  # compile events on the main thread while a test listens
_LISTEN = threading.Event()
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: _MAIN_COMPILES.append(event) if (
        _LISTEN.is_set() and "compil" in event
        and threading.current_thread() is threading.main_thread()) else None)


def test_auto_built_before_its_second_call_explores_and_chooses(setup, run):
    """background=False: the first read waits for the other candidates' build (however
    short the generation); the calls after it explore (gamma 1, then 3), time and choose
    as before, and stay lossless; the main thread compiles nothing (`compile_only` filled
    the caches that the calls hit) beyond what the first auto run did (the prefill and
    gamma 1)."""
    _, _, vanilla = setup
    run("auto")
    _join_builds()
    model, prompts, *_ = setup
    _MAIN_COMPILES.clear()
    _LISTEN.set()
    try:
        res = speculative_generate(model, prompts, NEW, SpecConfig(
            method="auto", gamma=AUTO_GAMMA, min_tokens=8), exec_config=XLA,
            auto_policy=AutoPolicy(background=False, min_gain=1.0))
    finally:
        _LISTEN.clear()
    assert res.tokens == vanilla.tokens
    assert _MAIN_COMPILES == []
    auto = res.stats["auto"]
    # the second call was dispatched before the first read
    assert auto["build"] == "done" and auto["built_after_calls"] == 2 and auto["compiled"] == 3
    assert auto["compile_s"] >= 0 and auto["calls"]["gamma 3"] >= 1
    assert auto["choice"] in ("gamma 1", "gamma 3", "vanilla")


def test_auto_switching_gammas_and_plain_steps_stays_lossless(setup, run, monkeypatch):
    """Every configuration in turn (rounds after a larger gamma's, after plain steps, plain
    steps after plain steps): the tokens stay vanilla's. Same programs as the test above."""
    _, _, vanilla = setup
    run("auto")  # the programs, compiled by the unforced run
    order = itertools.cycle([3, 1, 0, 3, 0, 0, 1, 1, 3, 3])
    monkeypatch.setattr(AutoController, "choose", lambda self: Config(next(order)))
    model, prompts, *_ = setup
    res = speculative_generate(model, prompts, NEW, SpecConfig(method="auto", gamma=AUTO_GAMMA,
                                                               min_tokens=8), exec_config=XLA,
                               auto_policy=ROUNDS)
    assert res.tokens == vanilla.tokens
    st = res.stats
    calls = st["auto"]["calls"]
    assert calls["vanilla"] >= 2 and calls["gamma 1"] >= 2 and calls["gamma 3"] >= 2
    # the stats add up over the rounds run: tau = 1 + the cumulative acceptance, pooled and
    # for each gamma; the rounds of each gamma and the plain calls are the calls read
    assert st["tau"] == pytest.approx(1 + sum(st["acceptance_cumulative"]))
    assert len(st["acceptance_cumulative"]) == 3 and set(st["by_gamma"]) == {1, 3}
    for g, r in st["by_gamma"].items():
        assert r["tau"] == pytest.approx(1 + sum(r["acceptance_cumulative"]))
        assert len(r["acceptance_cumulative"]) == g
    assert sum(r["rounds"] for r in st["by_gamma"].values()) == st["rounds"]
    assert st["rounds"] + st["plain_calls"] == st["device_calls"] == len(st["accepted_by_call"])
    assert st["gamma"] in (1, 3)


AUTO_FORMATS = Auto(gammas=(1, 3), formats=FORMATS)  # named: quantized drafts on XLA too


@pytest.mark.slow
def test_auto_switching_formats_stays_lossless(setup, monkeypatch):
    """Every (gamma, draft format) in turn, plain steps among them: vanilla's tokens
    (greedy, fp32, the ragged batch whose prompt 1 ends mid-round), and stats that add up:
    the rounds of each configuration are the rounds read, and per gamma they pool to
    the tally's tau."""
    from vegas_jax import quant

    model, prompts, vanilla = setup
    order = itertools.cycle([Config(3, "int4"), Config(1), Config(0), Config(1, "int8"),
                             Config(3), Config(1, "int4"), Config(0), Config(3, "int8")])
    monkeypatch.setattr(AutoController, "choose", lambda self: next(order))
    made, real = [], quant.quantize_params
    monkeypatch.setattr(quant, "quantize_params", lambda p, f: made.append(f) or real(p, f))
    res = speculative_generate(model, prompts, NEW, SpecConfig(method=AUTO_FORMATS, gamma=1,
                                                               min_tokens=8), exec_config=XLA,
                               auto_policy=ROUNDS)
    assert res.tokens == vanilla.tokens
    assert made == ["int4", "int8"]  # each copy made once, by its first round
    st, auto = res.stats, res.stats["auto"]
    assert auto["formats"] == list(FORMATS) and auto["formats_dropped"] == {}
    by = auto["by_config"]
    assert {c for c in by if c.endswith("int4")} and {c for c in by if c.endswith("int8")}
    assert sum(r["rounds"] for r in by.values()) == st["rounds"]
    assert sum(r["sequence_rounds"] for r in by.values()) == sum(st["rounds_by_sequence"])
    for g, pooled in st["by_gamma"].items():
        runs = [r for c, r in by.items() if c.split()[1] == str(g)]
        tokens = sum(r["tau"] * r["sequence_rounds"] for r in runs)
        assert tokens / sum(r["sequence_rounds"] for r in runs) == pytest.approx(pooled["tau"])
    assert st["rounds"] + st["plain_calls"] == st["device_calls"]
    # the command line's lines name each (gamma, format) that ran
    lines = decode._auto_lines(SpecConfig(method=AUTO_FORMATS, gamma=1), st, "")
    assert f"gamma 3 int4 x{by['gamma 3 int4']['rounds']} tau " in lines[0]
    assert lines[2] == "auto: draft weights same, int8, int4"


@pytest.mark.slow
def test_sampled_auto_round_in_a_format_is_that_formats_round():
    """Sampled: auto's round of gamma 1 in int4 (its only candidate; too few tokens to
    build plain steps) draws exactly what vegas's round with int4 drafts draws, seed for
    seed: the lossless round whose law test_quant_drafts checks, whatever its format."""
    m = tiny_model(vocab=100, scale=0.5, seed=3)
    prompts = [list(range(1, 41)), list(range(7, 30))]
    sp = SamplingParams(1.0, top_k=5)
    out = {}
    for method in (Auto(gammas=(1,), formats=("int4",)), "vegas"):
        spec = SpecConfig(method=method, gamma=1, min_tokens=8, draft_weights="int4")
        res = speculative_generate(m, prompts, 12, spec, sp, seed=5, exec_config=XLA,
                                   auto_policy=ROUNDS)
        out[spec.name] = res.tokens
        if spec.name == "auto":
            assert set(res.stats["auto"]["calls"]) == {"gamma 1 int4"}
    assert out["auto"] == out["vegas"]


def test_auto_drops_a_format_whose_copy_does_not_fit(setup, monkeypatch):
    """Memory for the int4 copy beside the cache, not for int8's too: int8 is left out
    (the start's format first, then the highest bound: int4), with the reason. Neither
    copy is made: too few tokens to build their rounds."""
    from vegas_jax import auto_formats, quant

    model, prompts, vanilla = setup
    need = {f: quant.quantized_bytes(model.params, f) for f in ("int8", "int4")}
    assert need["int4"] < need["int8"]
    made, real = [], quant.quantize_params
    monkeypatch.setattr(quant, "quantize_params", lambda p, f: made.append(f) or real(p, f))
    monkeypatch.setattr(auto_formats, "check_memory", lambda *a: 0)  # the cache: nothing
    monkeypatch.setattr(auto_formats, "available_bytes",
                        lambda: (need["int4"] + need["int8"] / 2) / 0.9)
    res = speculative_generate(model, prompts, NEW, SpecConfig(method=AUTO_FORMATS, gamma=1,
                                                               min_tokens=8), exec_config=XLA,
                               auto_policy=ROUNDS)
    assert res.tokens == vanilla.tokens
    auto = res.stats["auto"]
    assert auto["formats"] == ["same", "int4"] and list(auto["formats_dropped"]) == ["int8"]
    assert auto["formats_dropped"]["int8"].startswith("its copy")
    assert auto["build"] == "skipped" and made == []


def test_auto_formats_default_to_the_models_own_and_the_start():
    """Unnamed: the model's own weights and the format auto starts in, on either path (the
    others left out with why); named: those; a candidate the model cannot draft with fails
    in one line."""
    from types import SimpleNamespace

    from vegas_jax.config import get_config
    from vegas_jax.auto_formats import candidate_formats

    dense = SimpleNamespace(config=get_config("smollm2-135m"))
    moe = SimpleNamespace(config=get_config("qwen3-30b-a3b"))
    auto = SpecConfig(method="auto")
    for model, xc in ((dense, PALLAS), (dense, XLA), (moe, PALLAS)):
        spec, dropped = candidate_formats(auto, model, xc)
        assert spec.method.formats == ("same",) and set(dropped) == QUANTIZED
    start_int4 = dataclasses.replace(auto, draft_weights="int4")
    spec, dropped = candidate_formats(start_int4, dense, XLA)
    assert spec.method.formats == ("same", "int4") and set(dropped) == {"int8"}
    every = SpecConfig(method=Auto(formats=DRAFT_WEIGHTS))
    assert candidate_formats(every, dense, PALLAS) == (every, {})
    for spec in (start_int4, SpecConfig(method=Auto(formats=("int8",)))):
        with pytest.raises(ValueError, match="mixture of experts") as e:
            candidate_formats(spec, moe, PALLAS)
        assert "\n" not in str(e.value)


def test_auto_decodes_plainly_where_no_round_can_pay(setup):
    """One prompt, the default budget floor (256 positions: the whole context): a draft
    step reads what a plain step reads, so no round can pay (`auto_bound`) and auto runs
    vanilla's own programs (it compiles nothing a vanilla run of the same shapes did not)
    and tokens; its stats say so, and add up (tau 1, no rounds, every call plain)."""
    model, prompts, _ = setup
    vanilla = generate(model, prompts[:1], NEW)
    _MAIN_COMPILES.clear()
    _LISTEN.set()
    try:
        res = speculative_generate(model, prompts[:1], NEW, SpecConfig(method="auto", gamma=3))
    finally:
        _LISTEN.clear()
    assert res.tokens == vanilla.tokens and _MAIN_COMPILES == []
    st, auto = res.stats, res.stats["auto"]
    assert st["method"] == "auto" and not auto["rounds_allowed"]
    assert max(auto["round_bound"].values()) < auto["min_gain"] == AutoPolicy().min_gain
    # the calls read, and one dispatched after the last (never read)
    assert st["device_calls"] == vanilla.stats["device_calls"] == st["plain_calls"]
    assert auto["calls"] == {"vanilla": st["device_calls"] + 1}
    assert auto["choice"] == "vanilla" and auto["build"] == "none" and auto["compiled"] == 1
    assert st["rounds"] == 0 and st["gamma"] == 0 and st["tau"] == 1.0
    assert st["acceptance_cumulative"] == [] and st["by_gamma"] == {}


# At sparsity 1 every position is selected whatever the scores (the draft is the target
# model itself): one method per draft path (stream's window, quest's pages; the per-layer
# lists that vegas, vegas-paper and last draft from: below, in auto's rounds).
@pytest.mark.parametrize("method", ["stream", pytest.param("quest", marks=pytest.mark.slow)])
def test_select_everything_accepts_every_draft(setup, method):
    model, prompts, vanilla = setup
    res = speculative_generate(model, prompts, NEW, SpecConfig(method=method, gamma=4,
                                                               sparsity=1.0, min_tokens=1))
    assert res.tokens == vanilla.tokens
    assert res.stats["tau"] == pytest.approx(5.0)
    assert res.stats["acceptance_cumulative"] == [1.0] * 4
    assert res.stats["acceptance_conditional"] == [1.0] * 4


@pytest.mark.slow
def test_auto_rounds_after_a_larger_gamma_see_their_own_positions(setup, monkeypatch):
    """Rounds alternate gamma 6 and 2 at sparsity 1 (the draft reads everything: every
    draft is accepted) only if each round's tail reaches its own positions; a gamma 2
    round's own tail (5 entries) ends before them after a gamma 6 round accepted 7."""
    model, prompts, vanilla = setup
    order = itertools.cycle([6, 2])
    monkeypatch.setattr(AutoController, "choose", lambda self: Config(next(order)))
    res = speculative_generate(model, prompts, NEW, SpecConfig(method=Auto(gammas=(2, 6)),
                                                               gamma=6, sparsity=1.0,
                                                               min_tokens=1), auto_policy=ROUNDS)
    assert res.tokens == vanilla.tokens
    calls = res.stats["auto"]["calls"]
    assert calls["gamma 2"] >= 2 and calls["gamma 6"] >= 2
    assert res.stats["acceptance_conditional"] == [1.0] * 6


# ---------------------------------------------------------------------------------------
# The Pallas backend (every kernel in interpret mode on the CPU) against the XLA path
# ---------------------------------------------------------------------------------------

# One method per kernel path: vegas (the raw capture selected in one kernel, fused drafts,
# the draft MLP kernel), stream (fused drafts, no capture), last (the verify kernel's
# per-row capture, the fused top-k kernel), quest (drafts around the sparse-attention
# kernel), vegas with logits (the verify kernel's logit capture). vegas-paper runs vegas's
# kernels without the carried scores; auto vegas's rounds and the decode kernel.
@pytest.mark.parametrize("method,score", [
    ("vegas", "weight"), ("stream", "weight"),
    pytest.param("last", "weight", marks=pytest.mark.slow),
    pytest.param("quest", "weight", marks=pytest.mark.slow),
    pytest.param("vegas", "logit", marks=pytest.mark.slow),
])
def test_pallas_backend_equals_the_xla_path(setup, run, monkeypatch, method, score):
    """speculative_generate on the Pallas backend (prefill and verify with its capture
    through the verify kernel, the selection from the raw capture in one kernel where the
    capture allows it else the fused top-k kernel, sparse drafts as one fused kernel a
    layer, Quest's around the sparse-attention kernel, the draft MLP input as one kernel)
    gives vanilla's tokens, and the XLA drafts' acceptance (same attention and MLP to
    rounding, so the same drafts)."""
    from pallas_kernels import draft_mlp

    _, _, vanilla = setup
    xla = run(method, score, XLA)
    kernels = []  # the Pallas kernels traced

    def spy(mod, name):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, **k: kernels.append(name) or real(*a, **k))

    # `_layer` is jitted on its own: a layer traced by an earlier run (the same verify in
    # another method's round) would not call the spies again
    model_mod._layer.clear_cache()
    spy(attn_mod, "verify_attention")
    spy(attn_mod, "sparse_step")
    spy(attn_mod, "sparse_attention")
    spy(meth, "select_from_capture")
    spy(meth, "select_topk_fast")
    spy(draft_mlp, "norm_gate_up")
    # the draft MLP kernel serves drafts of 64 rows or more: here three
    monkeypatch.setattr(draft_mlp, "MIN_ROWS", 1)
    pallas = run(method, score, PALLAS)
    assert pallas.stats["backend"] == "pallas"
    assert pallas.tokens == vanilla.tokens
    assert xla.tokens == vanilla.tokens
    if method != "auto":  # auto's choices depend on timings
        assert pallas.stats["tau"] == xla.stats["tau"]
    assert "verify_attention" in kernels
    fused = method != "quest"  # Quest picks its pages from the rotated query outside
    assert ("sparse_step" in kernels) == fused and ("sparse_attention" in kernels) != fused
    assert ("norm_gate_up" in kernels) == fused
    captures = meth.method_named(method).capture(SpecConfig()) is not None
    # the raw capture (mean of softmax weights) is selected from in one kernel
    raw = captures and score == "weight" and method != "last"
    assert ("select_from_capture" in kernels) == raw
    # the prefill's selection, and the non-raw rounds', by the top-k kernel
    assert ("select_topk_fast" in kernels) == captures


# ---------------------------------------------------------------------------------------
# Budgets and the selection
# ---------------------------------------------------------------------------------------

def test_budget_rule():
    spec = SpecConfig(gamma=6, sparsity=0.07, min_tokens=256)
    max_len = 10_000
    n = jnp.array([10, 300, 3000, 5000, 9990])
    k = np.asarray(meth.budget(spec, n, max_len))
    # capped at n + 1, floored at min_tokens, ceil(0.07 (n + 7)), capped at ceil(0.07 max_len)
    assert k.tolist() == [11, 256, 256, 351, 700]
    assert meth.max_budget(spec, max_len) == 700
    assert meth.max_budget(SpecConfig(sparsity=1.0, min_tokens=1), 512) == 512


def test_topk_selection_ranks_only_the_ranked_range():
    spec = SpecConfig(gamma=2, sparsity=0.25, min_tokens=2)
    scores = jnp.array([[[0.1, 0.9, 0.3, 0.8, 5.0, 7.0, 0.0, 0.0]]])  # [L=1, b=1, s=8]
    idx, count = call(meth.select_topk, scores, jnp.array([3]), spec, 8)
    # ranked range 0..3: top-2 are positions 1 and 3; 4 and 5 lie beyond it
    assert int(count[0, 0]) == 2
    assert sorted(np.asarray(idx[0, 0, :2]).tolist()) == [1, 3]


def test_selection_prefix_is_the_exact_top_count():
    """The draft reads the first `count` of the K padded entries: they must be the top
    `count` positions by score, for counts below K too."""
    spec = SpecConfig(gamma=4, sparsity=0.07, min_tokens=8)
    max_len = 512
    scores = rand.normal(jax.random.PRNGKey(0), (2, 2, max_len))
    r_end = jnp.array([200, 480])
    idx, count = call(meth.select_topk, scores, r_end, spec, max_len)
    assert idx.shape[-1] == meth.max_budget(spec, max_len) == 36
    for layer in range(2):
        for b in range(2):
            c = int(count[layer, b])
            masked = np.where(np.arange(max_len) <= int(r_end[b]),
                              np.asarray(scores[layer, b]), -np.inf)
            want = set(np.argsort(-masked, kind="stable")[:c].tolist())
            assert set(np.asarray(idx[layer, b, :c]).tolist()) == want
    assert int(count[0, 0]) == 15 and int(count[0, 1]) == 34  # below K = 36


def test_draft_reads_only_the_budget(setup):
    """The draft forward's attention touches K + tail rows, never the cache length."""
    model = setup[0]
    cfg = model.config
    s, kk, tail = 1000, 24, 9  # s distinct from every other dimension of the model
    b, L = 2, cfg.num_layers
    cache = init_cache(cfg, b, s, jnp.float32)
    plan = AttnPlan(mode="sparse", tail_len=tail,
                    idx=jnp.zeros((L, b, kk), jnp.int32), count=jnp.full((L, b), kk),
                    tail_start=jnp.array([500, 600]))
    jaxpr = jax.make_jaxpr(lambda c: forward(model.params, cfg, XLA,
                                             jnp.ones((b, 1), jnp.int32),
                                             jnp.array([[505], [603]]), c, plan))(cache)
    sizes = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name in ("dot_general", "gather", "exp", "reduce_max"):
                for v in eqn.outvars:
                    sizes.append((eqn.primitive.name, tuple(v.aval.shape)))
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    if hasattr(sub, "jaxpr"):
                        walk(sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr)
                    elif hasattr(sub, "eqns"):
                        walk(sub)

    walk(jaxpr.jaxpr)
    gathers = [shape for name, shape in sizes if name == "gather"]
    assert any(kk in shape for shape in gathers) and any(tail in shape for shape in gathers)
    assert not any(s in shape for _, shape in sizes), [x for x in sizes if s in x[1]]


@pytest.mark.parametrize("xc", [XLA, PALLAS], ids=["xla", "pallas"])
def test_selection_comes_from_the_verify_pass(setup, monkeypatch, xc):
    """A vegas round runs exactly one full-attention call (the verify), and it is the one
    that captures rows 0 and gamma (on the Pallas path handed over raw, to the selection's
    own kernel); drafts are sparse (on the Pallas path one fused kernel a layer). Traced
    only; batch 2 and 256 positions, shapes no other test here traces (`_layer` is jitted:
    a trace it cached would not call the spies)."""
    import vegas_jax.speculative as spm

    calls = []
    real, real_block = model_mod.attention, model_mod.sparse_block

    def spy(plan, *a, **k):
        calls.append((plan.mode, plan.capture))
        return real(plan, *a, **k)

    def spy_block(plan, *a, **k):
        calls.append(("fused", plan.capture))
        return real_block(plan, *a, **k)

    monkeypatch.setattr(model_mod, "attention", spy)
    monkeypatch.setattr(model_mod, "sparse_block", spy_block)
    model = setup[0]
    cfg = model.config
    spec = SpecConfig(method="vegas", gamma=4, min_tokens=4)
    L, K = cfg.num_layers, meth.max_budget(spec, 256)
    lens = jnp.array([40, 70])
    cache = init_cache(cfg, 2, 256, jnp.float32).replace(lengths=lens)
    x0 = jnp.array([1, 2])
    sel = meth.TopK(jnp.zeros((L, 2, K), jnp.int32), jnp.full((L, 2), K, jnp.int32), lens,
                    jnp.zeros((L, 2, 256)))  # what `init` returns (decay: the carried scores)
    state = spm.SpecState(cache, x0, jax.random.PRNGKey(0), sel, Progress.start(x0, 10, ()))
    jax.eval_shape(lambda st: spm.spec_round.__wrapped__(model.params, cfg, xc, st, spec,
                                                         SamplingParams()), state)
    causal = [c for c in calls if c[0] == "causal"]
    assert [(mode, cap.rows, cap.reduce, cap.raw) for mode, cap in causal] == [
        ("causal", (0, 4), "mean", xc.pallas)]
    drafts = [c for c in calls if c[0] != "causal"]
    assert drafts and all(c[0] == ("fused" if xc.pallas else "sparse") for c in drafts)


# ---------------------------------------------------------------------------------------
# Sampling: the target distribution
# ---------------------------------------------------------------------------------------

def softmax64(x, sp: SamplingParams):
    """The processed law (temperature 1; top-k, top-p, min-p in Hugging Face's order) in
    float64, written independently of `sampling.process_logits`."""
    x = np.asarray(x, np.float64).copy()

    def probs():
        e = np.exp(x - x.max())
        return e / e.sum()

    if sp.top_k:
        x[x < np.sort(x)[::-1][sp.top_k - 1]] = -np.inf
    if sp.top_p < 1:
        p = probs()
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]  # mass strictly above each token
        x[order[before >= sp.top_p]] = -np.inf
    if sp.min_p:
        p = probs()
        x[p < sp.min_p * p.max()] = -np.inf
    return probs()


# The plain law (temperature alone) is the bonus case's without its filters. Rows of the
# same 40-token prompt, vocab 100 (the other tests' weight shapes: their random init
# compiled): top-k 5 leaves 25 cells of the joint law, top-p and min-p a few dozen.
@pytest.mark.parametrize("sp,gamma", [
    (SamplingParams(1.0, top_k=5), 2),
    pytest.param(SamplingParams(1.0, top_p=0.95, min_p=0.2), 1, marks=pytest.mark.slow),
], ids=["top-k-sparse-q", "top-p-min-p-bonus"])
def test_sampled_output_has_target_distribution(sp, gamma):
    """Many independent rows of one prompt; the first two tokens decoded after the
    prompt's own must follow the model's exact joint law (of the processed distribution:
    with top-k the draft's q takes its sparse form). At gamma 1 the second token is the
    round's bonus token whenever the draft was accepted, so the bonus is tested too."""
    check_joint_law(sp, gamma)


def check_joint_law(sp: SamplingParams, gamma: int, draft_weights: str = "same"):
    """3000 rows of one 40-token prompt (vocab 100) decoded by stream with `draft_weights`:
    the two tokens after the first follow the model's exact joint law (chi-square), and
    drafts were rejected along the way."""
    vocab = 100
    m = tiny_model(vocab=vocab, scale=0.5, seed=3)
    prompt = list(range(1, 41))
    n_rows = 3000
    # stream reads 16 sink + ceil(0.25 n) window entries: most of the prompt, not all
    res = speculative_generate(m, [prompt] * n_rows, 3,
                               SpecConfig(method="stream", gamma=gamma, sparsity=0.25,
                                          min_tokens=2, draft_weights=draft_weights),
                               sp, seed=1)
    toks = np.array([t[:3] for t in res.tokens])
    # exact law of (t1, t2) given the prompt and t0, for the most frequent t0
    t0 = np.bincount(toks[:, 0], minlength=vocab).argmax()
    rows = toks[toks[:, 0] == t0]
    t = len(prompt) + 2
    cache = init_cache(m.config, vocab, 128, jnp.float32)
    # every continuation in one forward: row a is the prompt, t0, a
    ctx = jnp.array([prompt + [int(t0), a] for a in range(vocab)])
    lg, _, _ = jax.jit(forward, static_argnums=(1, 2))(
        m.params, m.config, XLA, ctx, jnp.broadcast_to(jnp.arange(t), (vocab, t)), cache, CAUSAL)
    p1 = softmax64(lg[0, -2], sp)
    joint = np.stack([p1[a] * softmax64(lg[a, -1], sp) for a in range(vocab)])
    observed = np.bincount(rows[:, 1] * vocab + rows[:, 2], minlength=vocab ** 2).astype(float)
    expected = joint.reshape(-1) / joint.sum() * len(rows)
    assert observed[expected == 0].sum() == 0  # filtered tokens never come out
    keep = expected > 5  # chi-square needs enough mass per cell; pool the rest
    obs, exp = observed[keep], expected[keep]
    if expected[~keep].sum() > 0:
        obs = np.append(obs, observed[~keep].sum())
        exp = np.append(exp, expected[~keep].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-4
    assert 1.0 < res.stats["tau"] < gamma + 1  # drafts really were rejected sometimes


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(gamma=0), dict(gamma=2.5), dict(sparsity=0.0),
                                dict(sparsity=1.5), dict(sparsity=-0.1), dict(method="magic"),
                                dict(method="vegas-all"), dict(score="max"),
                                dict(min_tokens=0), dict(min_tokens=1.5)])
def test_bad_spec(kw):
    with pytest.raises(ValueError):
        SpecConfig(**kw)


def test_bad_method_settings():
    with pytest.raises(ValueError, match="page_size"):
        Quest(page_size=24)
    with pytest.raises(ValueError, match="sink"):
        Stream(sink=-1)
    with pytest.raises(ValueError, match="rows"):
        VerifyGuided("accepted")
    with pytest.raises(ValueError, match="decay"):
        VerifyGuided("pair", decay=1.0)
    with pytest.raises(ValueError, match="speculative base"):
        Auto(base=Vanilla())
    with pytest.raises(ValueError, match="gammas"):
        Auto(gammas=(0, 2))
    assert SpecConfig(method=Stream(sink=4)).method == Stream(sink=4)
    assert SpecConfig(method="stream").name == "stream"
    assert SpecConfig().name == meth.DEFAULT_METHOD == "auto"


def test_bad_inputs(setup):
    tiny = setup[0]
    with pytest.raises(ValueError, match="empty batch"):
        speculative_generate(tiny, [], 8)
    with pytest.raises(ValueError, match="empty"):
        speculative_generate(tiny, [[]], 8)
    with pytest.raises(ValueError, match="context"):
        speculative_generate(tiny, [[1] * 40960], 8)
    with pytest.raises(ValueError, match="outside"):
        speculative_generate(tiny, [[1, 100]], 8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(tiny, [[1, 2]], 0)
    with pytest.raises(TypeError):
        speculative_generate(tiny, [1, 2, 3], 8)
    with pytest.raises(ValueError, match="tokenizer"):
        speculative_generate(tiny, ["hello"], 8)
    with pytest.raises(TypeError, match="SpecConfig"):
        speculative_generate(tiny, [[1, 2]], 8, spec="vegas")
    with pytest.raises(TypeError, match="SamplingParams"):
        speculative_generate(tiny, [[1, 2]], 8, sampling=1.0)
    with pytest.raises(TypeError, match="ExecConfig"):
        speculative_generate(tiny, [[1, 2]], 8, exec_config="xla")
    with pytest.raises(ValueError, match="max_batch"):
        speculative_generate(tiny, [[1, 2]], 8, max_batch=0)


# ---------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------

def test_progress_stops_at_eos_and_limit():
    p = Progress.start(jnp.array([5, 6, 7]), 4, eos=(9,))
    toks = jnp.array([[1, 9, 2, -1], [1, 2, 3, 4], [1, 2, -1, -1]])
    kept, p = p.emit(toks)
    assert kept.tolist() == [[1, 9, -1, -1], [1, 2, 3, -1], [1, 2, -1, -1]]
    assert p.done.tolist() == [True, True, False] and p.n_gen.tolist() == [3, 4, 3]
    kept, p = p.emit(jnp.array([[3, 3, 3, 3]] * 3))
    assert kept.tolist() == [[-1] * 4, [-1] * 4, [3, -1, -1, -1]]
    assert p.done.tolist() == [True, True, True]


def test_drive_keeps_one_call_in_flight():
    """Call k + 1 is dispatched before call k's output is read."""
    events = []

    def step(i):
        events.append(("dispatch", i))
        done = np.array([i >= 2])
        return i + 1, (np.array([[i]]), done)

    col = TokenCollector(1, 10, (), on_tokens=lambda new: events.append(("read", new[0][0])))
    drive(step, 0, col, DecodeClock(col))
    assert events[:4] == [("dispatch", 0), ("dispatch", 1), ("read", 0), ("dispatch", 2)]
    assert events[-1] == ("read", 2)

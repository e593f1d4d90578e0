"""Speculative decoding on tiny random models: lossless greedy and sampled output for every
product method on the XLA path and through the Pallas kernels (interpret mode on the CPU),
budgets, sparse reads, the selection from the verify pass itself, and auto's controller
(exact mode: test_exact).

Most of the time here is XLA compiling: the greedy tests share one model, one batch of
prompts (one prompt bucket: one prefill program per capture) and one length, and each
(method, score, backend) runs once (`run`)."""

import functools
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
from vegas_jax import auto as auto_mod
from vegas_jax import methods as meth
from vegas_jax.attention import CAUSAL, AttnPlan
from vegas_jax.auto import AutoController
from vegas_jax.cache import init_cache
from vegas_jax.driver import DecodeClock, Progress, TokenCollector, drive
from vegas_jax.execution import ExecConfig
from vegas_jax.generate import generate
from vegas_jax.methods import Auto, Quest, Stream, Vanilla, VerifyGuided
from vegas_jax.model import forward
from vegas_jax.sampling import SamplingParams
from vegas_jax.speculative import SpecConfig, speculative_generate

# Every speculative product method (`methods.METHODS` less vanilla).
METHODS = ["vegas", "vegas-paper", "last", "stream", "quest", "auto"]
XLA = ExecConfig(backend="xla", layers="scan")
PALLAS = ExecConfig(backend="pallas", layers="scan")
NEW = SPEC_NEW
GAMMA = 3
AUTO_GAMMA = 1  # auto's candidates: gammas 1 and 3 (and plain steps)


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
            done[key] = speculative_generate(model, prompts, NEW, spec, exec_config=xc)
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
    assert np.allclose(np.cumprod(st["acceptance_conditional"]), st["acceptance_cumulative"])
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
    _, _, vanilla = setup
    res = run("auto")
    assert res.tokens == vanilla.tokens
    auto = res.stats["auto"]
    assert auto["calls"]["gamma 1"] >= 1
    assert set(auto["tokens_per_s_per_seq"]) <= {"vanilla", "gamma 1", "gamma 3"}
    # 24 tokens at gamma 1 (tau <= 2): fewer calls left at the first read than exploring
    # the other candidates takes; they are not built, every call is the configured gamma
    assert auto["build"] == "skipped" and auto["compile_s"] is None
    assert auto["calls"] == {"gamma 1": auto["calls"]["gamma 1"]} and auto["compiled"] == 1


def test_auto_builds_in_the_background_while_it_decodes(setup, run, monkeypatch):
    """The other candidates compiled in a thread while the calls run (BUILD_MIN_CALLS 0:
    however short the generation): lossless whichever calls ran once they were built."""
    _, _, vanilla = setup
    run("auto")  # gamma 1's round
    monkeypatch.setattr(AutoController, "BUILD_MIN_CALLS", 0)
    monkeypatch.setattr(AutoController, "BUILD_MIN_COVER", 0.0)
    monkeypatch.setattr(AutoController, "BACKGROUND", True)  # also on the CPU
    model, prompts, *_ = setup
    res = speculative_generate(model, prompts, NEW, SpecConfig(method="auto", gamma=AUTO_GAMMA,
                                                               min_tokens=8), exec_config=XLA)
    _join_builds()
    assert res.tokens == vanilla.tokens
    auto = res.stats["auto"]
    assert auto["build"] in ("running", "done") and auto["build_background"]
    if auto["build"] == "running":
        assert set(auto["calls"]) == {"gamma 1"}


def _join_builds():
    """Wait for auto's background builds (they stop once their generation has returned)."""
    for t in threading.enumerate():
        if t.name == "vegas_jax auto build":
            t.join()


def test_auto_decodes_before_its_other_candidates_are_built(setup, run, monkeypatch):
    """The background build held back for the whole generation: auto decodes every call
    with its configured gamma, times none, and its tokens are vanilla's."""
    _, _, vanilla = setup
    run("auto")  # gamma 1's round, compiled by the unforced run
    gate = threading.Event()
    monkeypatch.setattr(auto_mod, "compile_only", lambda run, spent: gate.wait(60))
    monkeypatch.setattr(AutoController, "BUILD_MIN_CALLS", 0)
    monkeypatch.setattr(AutoController, "BUILD_MIN_COVER", 0.0)
    monkeypatch.setattr(AutoController, "BACKGROUND", True)
    model, prompts, *_ = setup
    res = speculative_generate(model, prompts, NEW, SpecConfig(method="auto", gamma=AUTO_GAMMA,
                                                               min_tokens=8), exec_config=XLA)
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


def test_auto_built_before_its_second_call_explores_and_chooses(setup, run, monkeypatch):
    """BACKGROUND = False: the first read waits for the other candidates' build (however
    short the generation); the calls after it explore (gamma 1, then 3), time and choose
    as before, and stay lossless; the main thread compiles nothing (`compile_only` filled
    the caches that the calls hit) beyond what the first auto run did (the prefill and
    gamma 1)."""
    _, _, vanilla = setup
    run("auto")
    _join_builds()
    monkeypatch.setattr(AutoController, "BACKGROUND", False)
    model, prompts, *_ = setup
    _MAIN_COMPILES.clear()
    _LISTEN.set()
    try:
        res = speculative_generate(model, prompts, NEW, SpecConfig(
            method="auto", gamma=AUTO_GAMMA, min_tokens=8), exec_config=XLA)
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
    monkeypatch.setattr(AutoController, "choose", lambda self: next(order))
    model, prompts, *_ = setup
    res = speculative_generate(model, prompts, NEW, SpecConfig(method="auto", gamma=AUTO_GAMMA,
                                                               min_tokens=8), exec_config=XLA)
    assert res.tokens == vanilla.tokens
    calls = res.stats["auto"]["calls"]
    assert calls["vanilla"] >= 2 and calls["gamma 1"] >= 2 and calls["gamma 3"] >= 2


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
    assert res.stats["acceptance_by_position"] == [1.0] * 4
    assert res.stats["acceptance_conditional"] == [1.0] * 4


@pytest.mark.slow
def test_auto_rounds_after_a_larger_gamma_see_their_own_positions(setup, monkeypatch):
    """Rounds alternate gamma 6 and 2 at sparsity 1 (the draft reads everything: every
    draft is accepted) only if each round's tail reaches its own positions; a gamma 2
    round's own tail (5 entries) ends before them after a gamma 6 round accepted 7."""
    model, prompts, vanilla = setup
    order = itertools.cycle([6, 2])
    monkeypatch.setattr(AutoController, "choose", lambda self: next(order))
    res = speculative_generate(model, prompts, NEW, SpecConfig(method=Auto(gammas=(2, 6)),
                                                               gamma=6, sparsity=1.0,
                                                               min_tokens=1))
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
    vocab = 100
    m = tiny_model(vocab=vocab, scale=0.5, seed=3)
    prompt = list(range(1, 41))
    n_rows = 3000
    # stream reads 16 sink + ceil(0.25 n) window entries: most of the prompt, not all
    res = speculative_generate(m, [prompt] * n_rows, 3,
                               SpecConfig(method="stream", gamma=gamma, sparsity=0.25,
                                          min_tokens=2), sp, seed=1)
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


# ---------------------------------------------------------------------------------------
# auto's controller (vegas_jax.auto), on fake clocks
# ---------------------------------------------------------------------------------------

def test_auto_candidates():
    assert Auto().candidates(6) == (4, 6, 8)
    assert Auto().candidates(1) == (1, 3)
    assert Auto(gammas=(2, 9)).candidates(4) == (2, 4, 9)
    ctl = AutoController(SpecConfig(method="auto", gamma=6))
    assert ctl.gammas == [4, 6, 8] and ctl.spec.method.gammas == (4, 6, 8)
    # every round's tail holds what the largest candidate's round may leave
    assert ctl.spec.method.tail_len(ctl.spec, 1024) == 2 * 8 + 1


def test_auto_cost_line_follows_the_active_count():
    """The batch's tail: gamma 4 / 6 / 8 timed with the whole batch (64 sequences), then
    gamma 8 alone with 10 left. Each configuration's median then says gamma 8 (10.5 ms,
    mostly tail calls) is cheaper than gamma 6 (12.3 ms, whole-batch calls); the line in
    the active count gives each gamma's time with 10 sequences, and gamma 6 wins there
    where gamma 8 wins with the whole batch."""
    cost = lambda g, n: 0.0025 + 0.0009 * g + 0.00006 * n  # noqa: E731  (s)
    ctl = AutoController(SpecConfig(method=Auto(gammas=(4, 6, 8)), gamma=6))
    ctl.queue = []
    for g in (4, 6, 8):
        ctl.times[g] = [cost(g, 64)] * 3
        ctl.times_n[g] = [64] * 3
    # acceptance 0.9 a position: tau(6) = 5.22, tau(8) = 6.13 (+17 %)
    ctl.trials[1:9] += 100
    ctl.hits[1:9] += 90
    ctl.n_active = 64
    assert ctl.round_time(6) == pytest.approx(cost(6, 64))  # no spread: the old line
    assert max(ctl.rates(), key=ctl.rates().get) == 8  # 6.13 / 13.5 ms vs 5.22 / 11.7
    ctl.times[8] += [cost(8, 10)] * 5
    ctl.times_n[8] += [10] * 5
    ctl.n_active = 10
    assert ctl.call_time(8) < ctl.call_time(6)  # the medians mislead
    assert ctl._active_line() == pytest.approx((0.0025, 0.0009, 0.00006), rel=1e-6)
    assert ctl.round_time(6) == pytest.approx(cost(6, 10))
    assert ctl.round_time(8) == pytest.approx(cost(8, 10))
    assert max(ctl.rates(), key=ctl.rates().get) == 6  # 5.22 / 8.5 ms vs 6.13 / 10.3
    assert ctl.stats()["active_line_ms"] == pytest.approx([2.5, 0.9, 0.06], rel=1e-6)
    # counts not known (calls timed before this version, or plain steps): the old line
    for g in (4, 6, 8):
        ctl.times_n[g] = [None] * len(ctl.times[g])
    assert ctl._active_line() is None


def test_auto_cost_model():
    """tau from conditional acceptance, time from a line through the measured rounds, and
    the choice of the configuration with the most tokens per second."""
    ctl = AutoController(SpecConfig(method=Auto(gammas=(2, 4, 6, 8)), gamma=4))
    ctl.queue = []
    for a in (4, 4, 2, 3):  # accepted counts of 4 sequence-rounds at gamma 4
        ctl.trials[1:5] += [1, 1, 1, a >= 3]
        ctl.hits[1:5] += [a >= 1, a >= 2, a >= 3, a >= 4]
    # alpha = 1, 1, 3/4, 2/3 -> tau(4) = 1 + 1 + 1 + .75 + .5 ; beyond: alpha 2/3 repeats
    assert ctl.tau(4) == pytest.approx(4.25)
    assert ctl.tau(5) == pytest.approx(4.25 + 0.5 * 2 / 3)
    ctl.times[4] = [0.010] * 3
    ctl.times[8] = [0.014] * 3
    assert ctl.round_time(6) == pytest.approx(0.012)
    ctl.times[0] = [0.001 * 8] * 3  # a plain step 1 ms: 1000 tokens/s
    rates = ctl.rates()
    assert rates[0] == pytest.approx(1000)
    assert rates[4] == pytest.approx(425)
    assert rates[2] == pytest.approx(3 / 0.008)  # t(2) = 6 ms + 2 x 1 ms
    assert ctl.choose() == 0
    ctl.times[0] = [0.004 * 8] * 3  # a plain step 4 ms: 250 tokens/s, rounds win
    ctl.calls[4] = 1  # not a re-probe call
    assert ctl.choose() == 4  # the most tokens per second: tau 4.25 in 10 ms
    ctl.calls[4] = ctl.REPROBE  # every REPROBE calls the runner-up (gamma 6, 400/s) once
    assert ctl.choose() == 6 and ctl.queue == []
    ctl.times[0] = [0.0023 * 8] * 3  # plain steps best (435/s), gamma 4 (425/s) runner-up:
    assert ctl.choose() == 4 and ctl.queue == [4]  # two rounds, the first one's is stale


def test_auto_drops_rounds_that_cannot_win():
    """Plain steps of 1 ms against a 10 ms round at gamma 4: even tau = 5 loses, so the
    rounds still queued for exploration are dropped."""
    ctl = AutoController(SpecConfig(method=Auto(gammas=(4,)), gamma=4))
    assert ctl.queue == [4, 4, 4, 4]  # one gamma: no second one to fit a line with
    ctl.queue = [4, 4]
    ctl.times[0] = [0.008] * 2
    ctl.times[4] = [0.010]
    assert ctl.choose() == 0 and ctl.queue == []


def _drive_auto(ctl, cost, n_acc, calls, now):
    """Drive `ctl` like `drive` (one call in flight) with a fake clock: a call of
    configuration c takes cost[c] of device time; every round accepts n_acc."""
    ctl.runners = {c: (lambda st, c=c: (st, c)) for c in cost}
    flight = []

    def dispatch():
        c = ctl.choose()
        ctl.run(c, None)
        flight.append(c)

    dispatch()
    for _ in range(calls):
        dispatch()
        c = flight.pop(0)
        now[0] += cost[c]
        ctl.read(None if c == 0 else np.array([min(n_acc, c)]), np.array([True]))


def _fake_clock(monkeypatch, now):
    from vegas_jax import auto as auto_mod

    monkeypatch.setattr(auto_mod.time, "perf_counter", lambda: now[0])


@pytest.mark.parametrize("plain_step,draft,n_acc,plain", [
    (0.005, 0.0011, 8, False),  # B 64-like: verify ~ a step, cheap drafts: never plain
    (0.0012, 0.0011, 1, True),  # B 1-like: launch-bound drafts, few accepted: plain wins
])
def test_auto_explores_rounds_first_and_plain_steps_only_where_they_can_win(
        monkeypatch, plain_step, draft, n_acc, plain):
    """auto starts with rounds of two gammas (the line's slope); plain steps (8 a call)
    are tried only when the rounds' intercept says they could win, and then chosen only if
    they do."""
    now = [0.0]
    _fake_clock(monkeypatch, now)
    ctl = AutoController(SpecConfig(method=Auto(gammas=(4, 6, 8)), gamma=6))
    assert ctl.queue == [6, 6, 6, 6, 4, 4, 4]
    verify = 1.3 * plain_step  # a verify reads what a step reads, and captures
    cost = {0: 8 * plain_step, **{g: verify + g * draft for g in (4, 6, 8)}}
    _drive_auto(ctl, cost, n_acc, 40, now)
    assert (ctl.calls[0] > 0) == plain
    if plain:
        assert ctl.choose() == 0
    else:  # every draft accepted: 5 / 10.9 ms, 7 / 13.1 ms, 9 / 15.3 ms: gamma 8 wins
        assert ctl.choose() == 8


def test_auto_does_not_time_first_dispatches(monkeypatch):
    """The interval in which an executable is dispatched for the first time (its kernels
    load on the host) is not counted: driven like `drive` (one call in flight) with a fake
    clock where a plain call takes 8 ms, a round 1.6-1.8 ms (nothing accepted: plain
    steps get probed) and a first dispatch 30 ms more, every interval the controller
    keeps is a call's own time."""
    now = [0.0]
    _fake_clock(monkeypatch, now)
    ctl = AutoController(SpecConfig(method=Auto(gammas=(2, 4)), gamma=4))
    cost = {0: 0.008, 2: 0.0016, 4: 0.0018}
    ctl.runners = {c: (lambda st, c=c: (st, c)) for c in cost}

    def dispatch():
        c = ctl.choose()
        if ctl.calls[c] == 0:
            now[0] += 0.030  # loading the executable's kernels
        ctl.run(c, None)
        return c

    flight = [dispatch()]
    for _ in range(30):
        flight.append(dispatch())
        now[0] += cost[flight.pop(0)]  # the earlier call's device time
        ctl.read(np.array([0]), np.array([True]))
    assert ctl.times[0] and ctl.times[2] and ctl.times[4]
    for c, ts in ctl.times.items():
        assert ts == pytest.approx([cost[c]] * len(ts)), (c, ts)


def test_auto_times_a_call_only_when_the_host_waited_at_both_ends():
    """A read that found its output ready (the host was late) may have let the next call
    start before it: the interval that read opens is not the call's device time, and is
    kept apart (used only while a configuration has no other)."""
    ctl = AutoController(SpecConfig(method=Auto(gammas=(4,)), gamma=4))
    ctl.runners = {c: (lambda st: (st, None)) for c in (0, 4)}
    reads = [(0, 0.0, 1e-3), (0, 0.008, 1e-3),  # waited: 8 ms, the device's time
             (0, 0.020, 0.0), (0, 0.024, 1e-3),  # ready on arrival: the next interval is short
             (4, 0.034, 0.0), (4, 0.040, 0.0)]  # host-bound rounds (the first one's
    # interval holds its first dispatch: not counted)
    for c, at, wait in reads:
        ctl.run(c, None)
        ctl.read(None if c == 0 else np.array([4]), np.array([True]), at, wait)
    assert ctl.times[0] == pytest.approx([0.008]) and ctl.loose[0] == pytest.approx([0.012, 0.004])
    assert ctl.call_time(0) == pytest.approx(0.008)
    assert not ctl.times[4] and ctl.call_time(4) == pytest.approx(0.006)
    assert ctl.stats()["timed_calls"] == {"vanilla": [1, 2], "gamma 4": [0, 1]}


def test_auto_ignores_acceptance_of_a_round_after_plain_steps():
    """The first round after plain steps drafts from a selection older than those steps;
    its acceptance (here none) must not drag the estimate of the rounds that follow (here
    all accepted): tau(4) stays 5 (the old code counted it: 3)."""
    ctl = AutoController(SpecConfig(method=Auto(gammas=(4,)), gamma=4))
    ctl.runners = {c: (lambda st: (st, None)) for c in (0, 4)}
    for c, n_acc in ((0, None), (4, np.array([0])), (4, np.array([4]))):
        ctl.run(c, None)
        ctl.read(n_acc, np.array([True]))
    assert ctl.tau(4) == pytest.approx(5.0)


def test_auto_builds_the_other_candidates_after_its_first_call():
    """`prepare` makes every runner and builds none; the first read starts a thread that
    compiles the others on the state the first call donated, the second gamma explored
    first and plain steps last; `choose` keeps the configured gamma until the build is
    over. Too few calls left at the first read: nothing built, the configured gamma
    throughout. A state with no donated buffer: no thread, each candidate is compiled by
    its first call."""
    spent = jnp.ones(2)
    jax.jit(lambda x: x, donate_argnums=0)(spent)  # spent now holds a donated buffer
    ctl = AutoController(SpecConfig(method=Auto(gammas=(2, 4, 6)), gamma=4))
    made, built = [], []
    ctl.prepare(lambda c: made.append(c) or (lambda st: (st, c)))
    assert made == [0, 2, 4, 6] and ctl.pending == [2, 6, 0] and ctl.build == "pending"
    assert ctl.choose() == 4 and ctl.queue[0] == 4  # the queue waits for the build
    gate = threading.Event()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(auto_mod, "compile_only", lambda run, spent: (
            gate.wait(60), built.append((run(None)[1], spent))))
        mp.setattr(AutoController, "BACKGROUND", True)
        ctl.run(ctl.choose(), spent)
        assert ctl.spent is spent and ctl.build == "pending"
        ctl.read(np.array([4]), np.array([True]))  # prompts waiting (remaining None)
        assert ctl.pending == [] and ctl.build == "running" and ctl.choose() == 4
        gate.set()
        _join_builds()
    assert built == [(2, spent), (6, spent), (0, spent)] and ctl.ready == {0, 2, 4, 6}
    assert ctl.build == "done" and ctl.built_at is not None and ctl.compile_s >= 0
    ctl.run(ctl.choose(), None)  # the first dispatch after the build: every buffer dropped
    assert ctl.warm == {4} and ctl.built_after_calls == 1
    # BACKGROUND None on a CPU device (these tests'): the first read waits for the build
    ctl = AutoController(SpecConfig(method=Auto(gammas=(2, 4)), gamma=4))
    ctl.prepare(lambda c: (lambda st: (st, c)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(auto_mod, "compile_only", lambda run, spent: built.append(run(None)[1]))
        ctl.run(ctl.choose(), spent)
        ctl.read(np.array([4]), np.array([True]))
    assert ctl.build == "done" and ctl.background is False and built[-2:] == [2, 0]
    # 20 tokens left at tau 5 (every draft accepted): 4 calls, fewer than BUILD_MIN_CALLS
    ctl = AutoController(SpecConfig(method=Auto(gammas=(2, 4)), gamma=4))
    ctl.prepare(lambda c: (lambda st: (st, c)))
    ctl.run(ctl.choose(), spent)
    ctl.read(np.array([4]), np.array([True]), remaining=np.array([20]))
    assert ctl.build == "skipped" and ctl.pending == [] and ctl.built_at is None
    assert ctl.choose() == 4
    # in the background: 1000 calls left (5000 tokens at tau 5) of 10 ms = 10 s do not
    # outlast two candidates built 6 s each (the first call's dispatch, its compile)
    for remaining, build in ((5000, "skipped"), (10000, "running")):
        ctl = AutoController(SpecConfig(method=Auto(gammas=(2, 4)), gamma=4))
        ctl.prepare(lambda c: (lambda st: (st, c)))
        with pytest.MonkeyPatch.context() as mp:
            gate = threading.Event()
            mp.setattr(auto_mod, "compile_only", lambda run, spent: gate.wait(60))
            mp.setattr(AutoController, "BACKGROUND", True)
            ctl.run(ctl.choose(), spent)
            ctl.in_flight[0] = (4, 6.0)
            ctl.read(np.array([4]), np.array([True]), wait_s=0.01,
                     remaining=np.array([remaining]))
            assert ctl.build == build and ctl.pending == []
            gate.set()
            _join_builds()
    # no donated buffer (a runner that does not donate): built by first calls instead
    ctl = AutoController(SpecConfig(method=Auto(gammas=(2, 4)), gamma=4))
    ctl.prepare(lambda c: (lambda st: (st, c)))
    ctl.run(ctl.choose(), jnp.ones(2))
    ctl.read(np.array([4]), np.array([True]))
    assert not any(t.name == "vegas_jax auto build" for t in threading.enumerate())
    assert ctl.build == "done" and ctl.built_at is not None and ctl.ready == {4}


def test_compile_only_compiles_what_a_later_call_runs(caplog):
    """`compile_only` on a donated state compiles the call and runs nothing; the later
    call of the same shapes compiles nothing."""
    from vegas_jax.auto import compile_only

    f = jax.jit(lambda s, k: s * k + 1, static_argnums=1, donate_argnums=0)
    spent = jnp.ones(4)
    live = f(spent, 2)  # spent: donated
    with jax.log_compiles(), caplog.at_level("WARNING"):
        compile_only(lambda s: f(s, 3), spent)
        compiled = [r for r in caplog.records if "Compiling" in r.getMessage()]
        caplog.clear()
        out = f(live, 3)
        assert not [r for r in caplog.records if "Compiling" in r.getMessage()]
    assert len(compiled) == 1
    np.testing.assert_array_equal(out, 3 * 3.0 + 1)


def test_auto_times_nothing_while_its_candidates_are_built(monkeypatch):
    """Driven like `drive` on a fake clock while the build runs (here until call 10):
    every call is the configured gamma and none is timed, though acceptance is counted;
    once built, each configuration's first dispatch (which stalls the host 30 ms: its
    command buffer recorded) is not timed either, every interval kept is a call's own
    time, and the exploration that follows finds the best gamma (every draft accepted:
    gamma 8)."""
    now = [0.0]
    _fake_clock(monkeypatch, now)
    ctl = AutoController(SpecConfig(method=Auto(gammas=(4, 6, 8)), gamma=6))
    cost = {0: 8 * 0.005, 4: 0.0065 + 4 * 0.0011, 6: 0.0065 + 6 * 0.0011,
            8: 0.0065 + 8 * 0.0011}
    ctl.runners = {c: (lambda st, c=c: (st, c)) for c in cost}
    ctl.ready = set(cost)
    ctl.built_at, ctl.build_seen = None, False  # a build under way
    flight = []

    def dispatch():
        c = ctl.choose()
        if c not in ctl.warm:
            now[0] += 0.030
        ctl.run(c, None)
        flight.append(c)

    dispatch()
    for i in range(40):
        if i == 10:
            ctl.built_at = now[0]
        dispatch()
        c = flight.pop(0)
        now[0] += cost[c]
        ctl.read(np.array([c]), np.array([True]))
        if i < 10:
            assert not ctl.times and not ctl.loose and set(ctl.calls) == {6}
    assert ctl.trials[1] >= 10 and ctl.built_after_calls == 11
    for c, ts in ctl.times.items():
        assert ts == pytest.approx([cost[c]] * len(ts)), (c, ts)
    assert ctl.times[6] and ctl.times[4] and ctl.choose() == 8


def test_auto_estimates_tau_from_the_sequences_still_decoding():
    """Two of four sequences accept everything, two nothing. While all four decode,
    tau(4) pools them (1 + 0.5 + 0.25 + ...); once the good two have finished, it is the
    remaining two's (1.0: a batch of fixed-length outputs waits on them). A slot that
    comes back (refilled with a new prompt) starts its counts over."""
    ctl = AutoController(SpecConfig(method=Auto(gammas=(4,)), gamma=4))
    ctl.runners = {c: (lambda st: (st, None)) for c in (0, 4)}
    both = np.array([4, 4, 0, 0])
    for active in ([True] * 4, [True] * 4, [False, False, True, True]):
        ctl.run(4, None)
        ctl.read(both, np.array(active))
        if all(active):
            pooled = ctl.tau(4)
    assert pooled == pytest.approx(1 + 0.5 * 4)  # alpha_1 = 1/2, then 1 given reached
    assert ctl.tau(4) == pytest.approx(1.0)
    ctl.run(4, None)
    ctl.read(np.array([4, 4, 0, 0]), np.array([True, False, True, False]))
    # slot 0 is back with a new prompt: its earlier four-of-four no longer counts
    assert ctl.slot_trials[0, 1] == 1 and ctl.slot_trials[2, 1] == 4


def test_auto_does_not_time_a_read_that_a_stalled_dispatch_delayed(monkeypatch):
    """On the H200 a warm candidate's first dispatch could still hold the host 15 ms
    (a command buffer recorded) while the call in flight ran 11 ms: the read after it
    found the device idle, yet waited ~0.8 ms for the copy of the output. Simulated like
    `drive` (dispatch k + 1, then read k): every interval the controller keeps as the
    device's time is a call's own time, and plain steps (3.6 ms a step, rounds' line
    through 4 ms) are never probed."""
    host = [0.0]
    _fake_clock(monkeypatch, host)
    ctl = AutoController(SpecConfig(method=Auto(gammas=(4, 6, 8)), gamma=6))
    cost = {0: 8 * 0.0036, 4: 0.0087, 6: 0.0112, 8: 0.0137}

    def runner(st, c):  # a configuration's first dispatch holds the host 15 ms, later ones 1
        host[0] += 0.015 if ctl.calls[c] == 1 else 0.001
        return st, c

    ctl.runners = {c: functools.partial(runner, c=c) for c in cost}
    ctl.ready = ctl.warm = set(cost)
    free = [0.0]  # when the device finishes the calls queued so far
    flight = []

    def dispatch():
        c = ctl.choose()
        ctl.run(c, None)
        free[0] = max(free[0], host[0]) + cost[c]
        flight.append((c, free[0]))

    dispatch()
    for _ in range(40):
        dispatch()
        c, end = flight.pop(0)
        wait = max(0.0, end - host[0]) + 0.0008  # the output's copy
        host[0] = max(host[0], end) + 0.0008
        ctl.read(None if c == 0 else np.array([c - 1]), np.array([True]), host[0], wait)
    for c, ts in ctl.times.items():
        assert ts == pytest.approx([cost[c]] * len(ts), abs=1e-9), (c, ts)
    assert ctl.calls[0] == 0


def test_auto_finish_tau_follows_the_slowest_sequence():
    """Two of four sequences accept every draft, two none. With no prompt waiting, the
    batch ends with the slow two: finish_tau(4) is theirs (1, up to the shrinkage toward
    the batch's acceptance), not the pooled 1 + 0.5 * 4; with prompts waiting
    (remaining None) it is the pooled mean; once the slow two are done, the fast two's."""
    ctl = AutoController(SpecConfig(method=Auto(gammas=(4,)), gamma=4))
    ctl.runners = {4: (lambda st: (st, None))}
    acc = np.array([4, 4, 0, 0])
    for _ in range(200):
        ctl.run(4, None)
        ctl.read(acc, np.ones(4, bool), remaining=np.array([100, 100, 100, 100]))
    assert ctl.tau(4) == pytest.approx(3.0)
    assert 1.0 < ctl.finish_tau(4) < 1.2  # 1 + 4 x 8 / 216: 16 pseudo-trials at 0.5
    ctl.run(4, None)
    ctl.read(acc, np.ones(4, bool), remaining=None)
    assert ctl.finish_tau(4) == pytest.approx(3.0, rel=1e-2)
    ctl.run(4, None)  # the slow two need 10x fewer tokens than the fast two: the fast
    # two finish last (250 tokens at tau 5 against 25 at tau ~1)
    ctl.read(acc, np.ones(4, bool), remaining=np.array([250, 250, 25, 25]))
    assert ctl.finish_tau(4) == pytest.approx(5.0, rel=4e-2)  # shrunk: 1 + 4 x 208 / 216
    ctl.run(4, None)
    ctl.read(acc, np.ones(4, bool), remaining=np.array([100, 100, 0, 0]))
    assert ctl.finish_tau(4) == pytest.approx(5.0, rel=4e-2)  # shrunk: 1 + 4 x 208 / 216

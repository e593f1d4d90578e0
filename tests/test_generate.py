"""Vanilla decoding: batching, EOS and limits, memory refusal, sampling reproducibility,
bad arguments, the execution config each choice derives from, the layer layouts, and the
prefill's plans (slices, groups, budget, progress, capture)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax import SamplingParams, generate
from vegas_jax import execution, prefill as pf, prompts as pr
from vegas_jax.attention import AttnPlan, Capture
from vegas_jax.cache import init_cache
from vegas_jax.execution import ExecConfig
from vegas_jax.model import forward
from tests.tiny import tiny_model

XLA = ExecConfig(backend="xla", layers="scan")


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(scale=0.3)


def _prompts(seed, lens, vocab=100):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lens]


# Prompts of two padded lengths (two prefill groups) and a limit they all share: the tests
# below reuse the programs the first one compiled (one cache length for every run).
PROMPTS = _prompts(0, (5, 70))
NEW = 12


@pytest.fixture(scope="module")
def batch(tiny):
    return generate(tiny, PROMPTS, NEW)


# ---------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_batch_equals_each_prompt_alone_real_weights():
    from vegas_jax.loading import load_model

    smollm2 = load_model(dtype=jnp.float32)
    prompts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci",
               "Once upon a time, in a village by the sea, there lived an old fisherman who"]
    batch = generate(smollm2, prompts, 16)
    for p, toks in zip(prompts, batch.tokens):
        assert generate(smollm2, [p], 16).tokens[0] == toks
    assert all(isinstance(t, str) and t for t in batch.text)
    st = batch.stats
    assert st["decode_tokens"] == sum(len(t) for t in batch.tokens) - len(prompts)
    assert st["decode_tokens_per_s"] > 0 and st["prefill_s"] > 0


def test_ragged_batch_equals_each_prompt_alone(tiny, batch):
    """Prompts of two padded lengths (two prefill groups) decoded together give what each
    gives alone; the stats count what was generated."""
    assert [len(t) for t in batch.tokens] == [NEW] * 2 and batch.text is None
    for p, toks in zip(PROMPTS, batch.tokens):
        assert generate(tiny, [p], NEW).tokens[0] == toks
    st = batch.stats
    assert st["decode_tokens"] == 2 * NEW - 2 and st["prompt_tokens"] == [5, 70]
    assert (st["method"], st["batch"], st["backend"]) == ("vanilla", 2, "xla")
    assert st["decode_tokens_per_s"] > 0 and st["prefill_s"] > 0


class _EosTokenizer:
    """A tokenizer that only names an EOS id (`prompts.eos_ids` reads it)."""

    def __init__(self, eos):
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_eos_and_limits(tiny, batch):
    """A sequence stops at its EOS (kept), and at its own limit; the others go on."""
    ref = batch.tokens
    limited = generate(tiny, PROMPTS, [4, 9])  # one limit per prompt
    assert limited.tokens == [ref[0][:4], ref[1][:9]]
    eos = ref[0][3]
    out = generate(tiny._replace(tokenizer=_EosTokenizer(eos)), PROMPTS, NEW)
    assert out.tokens[0] == ref[0][: ref[0].index(eos) + 1]
    for full, cut in zip(ref, out.tokens):
        assert full[: len(cut)] == cut
    assert out.text == [" ".join(map(str, t)) for t in out.tokens]


def test_sampling_is_seeded(tiny):
    sp = SamplingParams(0.9, 20, 0.9)
    a = generate(tiny, [[1, 2, 3]], 20, sp, seed=5).tokens
    assert a == generate(tiny, [[1, 2, 3]], 20, sp, seed=5).tokens
    assert a != generate(tiny, [[1, 2, 3]], 20, sp, seed=6).tokens


def test_refuses_what_does_not_fit(monkeypatch, tiny):
    monkeypatch.setattr(pr, "available_bytes", lambda: 1 << 20)
    with pytest.raises(MemoryError, match="KV cache"):
        generate(tiny, [[1, 2, 3]] * 8, 1000)


@pytest.mark.parametrize("kw, err, match", [
    (dict(steps_per_call=0), ValueError, "steps_per_call"),
    (dict(sampling={"temperature": 1.0}), TypeError, "SamplingParams"),
    (dict(exec_config="xla"), TypeError, "exec_config must be an ExecConfig"),
    (dict(max_batch=0), ValueError, "max_batch must be"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be whole numbers >= 1"),
    (dict(max_new_tokens=[3, 4]), ValueError, "one per prompt"),
    (dict(prompts=[1, 2, 3]), TypeError, "list of prompts"),
    (dict(prompts=[]), ValueError, "empty batch"),
    (dict(prompts=[[]]), ValueError, "prompt 0 is empty"),
    (dict(prompts=[[1, 100]]), ValueError, r"outside \[0, 100\)"),
    (dict(prompts=["hello"]), ValueError, "no tokenizer"),
    (dict(prompts=[[1] * 41000]), ValueError, "exceeds tiny-qwen3's context"),
])
def test_bad_arguments(kw, err, match, tiny):
    args = dict(prompts=[[1]], max_new_tokens=4) | kw
    with pytest.raises(err, match=match):
        generate(tiny, args.pop("prompts"), args.pop("max_new_tokens"), **args)


# ---------------------------------------------------------------------------------------
# The execution config: four choices, the rest derived
# ---------------------------------------------------------------------------------------

def test_exec_config_derives_every_other_choice(monkeypatch):
    from pallas_kernels import grouped_matmul

    assert [f.name for f in dataclasses.fields(ExecConfig)] == ["backend", "layers", "tp", "exact"]
    cpu = ExecConfig().resolve()
    assert (cpu.backend, cpu.layers) == ("xla", "scan")
    assert cpu.compiler_options() == {} and cpu.interpret
    assert not (cpu.pallas or cpu.cudnn_prefill or cpu.draft_mlp) and cpu.moe == "xla"
    # a Pallas backend on the CPU interprets the GPU's kernel choices (no cuDNN)
    pc = ExecConfig(backend="pallas").resolve()
    assert pc.pallas and pc.interpret and pc.draft_mlp and not pc.cudnn_prefill
    assert pc.moe == "xla" and not ExecConfig(backend="pallas", tp=2).draft_mlp

    monkeypatch.setattr(execution, "on_gpu", lambda: True)
    monkeypatch.setattr(grouped_matmul, "hopper", lambda: True)
    gpu = ExecConfig().resolve()
    assert (gpu.backend, gpu.layers) == ("pallas", "unrolled") and not gpu.interpret
    assert gpu.compiler_options() == {"xla_gpu_enable_triton_gemm": False,
                                      "xla_gpu_enable_dynamic_slice_fusion": True}
    assert gpu.cudnn_prefill and gpu.draft_mlp and gpu.moe == "pallas"
    assert ExecConfig(layers="scan").resolve().layers == "scan"
    tp2 = ExecConfig(tp=2).resolve()
    assert not tp2.draft_mlp and tp2.moe == "xla" and tp2.cudnn_prefill
    ref = ExecConfig(backend="xla").resolve()
    assert not (ref.draft_mlp or ref.cudnn_prefill) and ref.moe == "xla"
    monkeypatch.setattr(grouped_matmul, "hopper", lambda: False)
    assert gpu.moe == "xla"


@pytest.mark.parametrize("kw, match", [
    (dict(backend="cuda"), "backend must be one of"), (dict(layers="python"), "layers"),
    (dict(tp=0), "tp must be"), (dict(tp=1.5), "tp must be"),
    (dict(exact=True, tp=2), "exact=True runs on one device"),
])
def test_exec_config_refuses(kw, match):
    with pytest.raises(ValueError, match=match):
        ExecConfig(**kw)


def test_run_config_follows_the_params_layout(tiny):
    """The layer loop a run uses is the params' layout: a per-call config that names the
    other one is refused (the layout is set at load time); "auto" follows the params."""
    from vegas_jax.driver import exec_config
    from vegas_jax.params import layout_params

    assert exec_config(tiny).layers == "scan" and exec_config(tiny).backend == "xla"
    unrolled = tiny._replace(params=layout_params(tiny.params, ExecConfig(layers="unrolled")))
    assert exec_config(unrolled, ExecConfig()).layers == "unrolled"
    assert exec_config(unrolled, ExecConfig(layers="unrolled")).layers == "unrolled"
    with pytest.raises(ValueError, match="layers='scan' differs from the params' layout"):
        exec_config(unrolled, ExecConfig(layers="scan"))
    with pytest.raises(ValueError, match="layers='scan' differs"):
        generate(unrolled, PROMPTS, 2, exec_config=ExecConfig(layers="scan"))
    assert exec_config(tiny, ExecConfig(backend="pallas", exact=True)) == ExecConfig(
        backend="pallas", layers="scan", exact=True)


@pytest.fixture(scope="module")
def unrolled(tiny):
    from vegas_jax.params import layout_params, stack_layers

    m = tiny._replace(params=layout_params(tiny.params, ExecConfig(layers="unrolled")))
    assert isinstance(m.params.layers, tuple) and len(m.params.layers) == tiny.config.num_layers
    back = stack_layers(m.params)
    np.testing.assert_array_equal(np.asarray(back.layers.w_qkv),
                                  np.asarray(tiny.params.layers.w_qkv))
    return m


def test_unrolled_layers_equal_scan(unrolled, batch):
    """Per-layer weight buffers walked by a Python loop compute what the scan computes."""
    res = generate(unrolled, PROMPTS, NEW)
    assert res.tokens == batch.tokens


@pytest.mark.slow
def test_unrolled_layers_equal_scan_speculative(tiny, unrolled, batch):
    """... and so do a speculative round's drafts, verify, capture and selection: the
    same tokens (vanilla's) and the same acceptance."""
    from vegas_jax import SpecConfig, speculative_generate

    spec = SpecConfig(method="vegas", gamma=2, min_tokens=8)
    a = speculative_generate(tiny, PROMPTS, NEW, spec)
    b = speculative_generate(unrolled, PROMPTS, NEW, spec)
    assert a.tokens == b.tokens == batch.tokens
    assert a.stats["acceptance_cumulative"] == b.stats["acceptance_cumulative"]
    assert a.stats["rounds"] == b.stats["rounds"] > 0


# ---------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------

# Three prompts of one padded length (192) in a cache of 256: one prefill program each
# for the plain and the capturing whole-batch step, shared by the tests below.
LONG = (150, 170, 191)
WHOLE = (192, 3)  # (chunk, group) of one step: what `prefill_prompts` plans for them


def _cache(cfg, b=3):
    return init_cache(cfg, b, 256, jnp.float32)


@pytest.mark.parametrize("chunk,group", [
    (64, None), pytest.param(128, None, marks=pytest.mark.slow),
    pytest.param(None, 1, marks=pytest.mark.slow), (None, 2)])
def test_chunked_prefill_equals_whole(chunk, group, tiny):
    """Slices of the prompts (the whole batch a step) and groups of whole prompts (the
    last group overlapping the one before: 3 rows in groups of 2) leave what one step
    leaves."""
    cfg = tiny.config
    ids = _prompts(3, LONG)
    toks, lens = pf.pad_prompts(ids)
    assert pf.prefill_plan(cfg, *toks.shape, pf.available_bytes()) == WHOLE

    def run(c):
        return pf.prefill(tiny.params, cfg, XLA, toks, lens, _cache(cfg), Capture((0,)), *c)

    (lw, cw, sw), (lc, cc, sc) = run(WHOLE), run((chunk, group))
    np.testing.assert_allclose(np.asarray(lc), np.asarray(lw), atol=2e-5)
    np.testing.assert_allclose(np.asarray(sc), np.asarray(sw), atol=2e-5)
    for i, n in enumerate(lens.tolist()):  # the kept entries; padding slots may differ
        np.testing.assert_allclose(np.asarray(cc.k[:, i, :, :n]), np.asarray(cw.k[:, i, :, :n]),
                                   atol=2e-5)


def test_prefill_plans():
    assert (pf.prefill_chunk(2, 192), pf.prefill_rows(2, 192)) == (192, 2)
    # a large batch of whole prompts: groups of sequences, each step within the budget
    assert pf.prefill_chunk(1024, 8192) == 8192
    assert pf.prefill_rows(1024, 8192) * 8192 <= pf.PREFILL_TOKENS
    # one prompt over the budget: equal slices within it
    c = pf.prefill_chunk(1, 3 * pf.PREFILL_TOKENS + 5)
    assert c % pf.PROMPT_BUCKET == 0 and c <= pf.PREFILL_TOKENS
    assert pf.prefill_steps(3, 192, 192, 2) == 2 and pf.prefill_steps(1, 640, 128, 1) == 5


def test_prefill_capture_leaves_the_cache_as_plain_prefill(tiny):
    """The first selection's capture pass reads the cache without writing: verify-guided
    methods start from exactly the cache vanilla decoding starts from. The pass itself
    must return the cache it was given bit for bit (a rewrite of the last prompt token's
    K/V by a one-row matmul differs in its last bits: the fp32 bug of issue 10); the two
    prefills are different compiled programs, so they agree to rounding only."""
    m = tiny
    ids = _prompts(5, LONG)
    toks, lens = pf.pad_prompts(ids)

    def run(capture):
        return pf.prefill(m.params, m.config, XLA, toks, lens, _cache(m.config), capture, *WHOLE)

    (l0, c0, s0), (l1, c1, s1) = run(None), run(Capture((0,)))
    assert s0 is None and s1.shape == (m.config.num_layers, 3, 256)
    np.testing.assert_allclose(np.asarray(c1.k), np.asarray(c0.k), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(c1.v), np.asarray(c0.v), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=0, atol=1e-5)

    # the capture forward on its own: the cache comes back untouched, bit for bit
    last = jnp.take_along_axis(toks, (lens - 1)[:, None], axis=1)
    _, c2, s2 = forward(m.params, m.config, XLA, last, (lens - 1)[:, None], c0,
                        AttnPlan(capture=Capture((0,))), write=False)
    np.testing.assert_array_equal(np.asarray(c2.k), np.asarray(c0.k))
    np.testing.assert_array_equal(np.asarray(c2.v), np.asarray(c0.v))
    np.testing.assert_allclose(np.asarray(s2), np.asarray(s1), rtol=0, atol=1e-6)


def test_long_prefill_reports_every_step(monkeypatch, tiny):
    """Prompts over PROGRESS_TOKENS tick a progress bar of prompt tokens as each prefill
    step ends (here 3 prompts in groups of 2: two steps), and the bar is full when the
    prefill returns; the logits are those of a prefill without it."""
    import tqdm

    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n, self.seen, self.closed = total, 0, [], False
            bars.append(self)

        def update(self, k):
            self.n += k
            self.seen.append(self.n)

        def close(self):
            self.closed = True

    m = tiny
    ids = _prompts(5, LONG)
    cache = lambda: _cache(m.config)  # noqa: E731
    quiet, _, _ = pf.prefill_prompts(m.params, m.config, XLA, ids, cache(), None)
    monkeypatch.setattr(tqdm, "tqdm", Bar)
    monkeypatch.setattr(pf, "PROGRESS_TOKENS", 100)
    monkeypatch.setattr(pf, "PREFILL_TOKENS", 2 * 192)
    logits, _, _ = pf.prefill_prompts(m.params, m.config, XLA, ids, cache(), None)
    (bar,) = bars
    assert bar.total == sum(LONG) and bar.seen == [sum(LONG) // 2, sum(LONG)] and bar.closed
    np.testing.assert_allclose(np.asarray(logits), np.asarray(quiet), atol=2e-5)


def test_prefill_budget_shrinks_with_free_memory(monkeypatch, tiny):
    """Little free memory: fewer query tokens a prefill step (halving from PREFILL_TOKENS,
    never below one prompt bucket), and the prefill's logits stay those of one step."""
    cfg = tiny.config
    per_token = pf.act_bytes(cfg)
    assert pf.prefill_budget(cfg, None) == pf.PREFILL_TOKENS
    assert pf.prefill_budget(cfg, 3 * per_token * pf.PREFILL_TOKENS) == pf.PREFILL_TOKENS
    assert pf.prefill_budget(cfg, 3 * per_token * 300) == 256
    assert pf.prefill_budget(cfg, 0) == pf.PROMPT_BUCKET
    assert pf.prefill_plan(cfg, 3, 192, 3 * per_token * 400) == (192, 1)  # groups of one
    assert pf.prefill_plan(cfg, 1, 192, 3 * per_token * 100) == (64, 1)  # slices

    m = tiny
    ids = _prompts(6, LONG)
    cache = lambda: _cache(m.config)  # noqa: E731
    whole, _, _ = pf.prefill_prompts(m.params, m.config, XLA, ids, cache(), None)
    monkeypatch.setattr(pf, "available_bytes", lambda: 3 * per_token * 100)
    sliced, _, _ = pf.prefill_prompts(m.params, m.config, XLA, ids, cache(), None)
    np.testing.assert_allclose(np.asarray(sliced), np.asarray(whole), atol=2e-5)

"""Vanilla decoding: batching, EOS, memory refusal, sampling reproducibility."""

import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax import SamplingParams, generate
from vegas_jax import runtime as gen
from vegas_jax.attention import AttnPlan, Capture
from vegas_jax.execution import ExecConfig
from vegas_jax.loading import load_model
from vegas_jax.model import forward
from tests.tiny import tiny_model

XLA = ExecConfig(attn="xla", gemm="triton", layers="scan")



@pytest.fixture(scope="module")
def smollm2():
    return load_model(dtype=jnp.float32)


def test_batch_equals_each_prompt_alone_real_weights(smollm2):
    prompts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci",
               "Once upon a time, in a village by the sea, there lived an old fisherman who"]
    batch = generate(smollm2, prompts, 24)
    for p, toks in zip(prompts, batch.tokens):
        assert generate(smollm2, [p], 24).tokens[0] == toks
    assert all(isinstance(t, str) and t for t in batch.text)
    st = batch.stats
    assert st["decode_tokens"] == sum(len(t) for t in batch.tokens) - len(prompts)
    assert st["decode_tokens_per_s"] > 0 and st["prefill_s"] > 0


def test_eos_stops_and_is_kept():
    m = tiny_model(scale=0.3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 100, size=n).tolist() for n in (5, 40)]
    ref = generate(m, prompts, 30)
    eos = ref.tokens[0][3]
    out = generate(tiny_model(scale=0.3, eos=(eos,)), prompts, 30)
    assert out.tokens[0] == ref.tokens[0][: ref.tokens[0].index(eos) + 1]
    for full, cut in zip(ref.tokens, out.tokens):
        assert full[: len(cut)] == cut


def test_sampling_is_seeded():
    m = tiny_model(scale=0.3)
    sp = SamplingParams(0.9, 20, 0.9)
    a = generate(m, [[1, 2, 3]], 20, sp, seed=5).tokens
    assert a == generate(m, [[1, 2, 3]], 20, sp, seed=5).tokens
    assert a != generate(m, [[1, 2, 3]], 20, sp, seed=6).tokens


def test_refuses_what_does_not_fit(monkeypatch):
    m = tiny_model()
    monkeypatch.setattr(gen, "available_bytes", lambda: 1 << 20)
    with pytest.raises(MemoryError, match="KV cache"):
        generate(m, [[1, 2, 3]] * 8, 1000)


def test_bad_arguments():
    m = tiny_model()
    with pytest.raises(ValueError, match="steps_per_call"):
        generate(m, [[1]], 4, steps_per_call=0)
    with pytest.raises(TypeError, match="SamplingParams"):
        generate(m, [[1]], 4, sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="attn must be one of"):
        generate(m, [[1]], 4, attn_impl="cuda")


@pytest.mark.parametrize("chunk,group", [(64, None), (128, None), (None, 1), (None, 2)])
def test_chunked_prefill_equals_whole(chunk, group):
    """Slices of the prompts (the whole batch a step) and groups of whole prompts (the
    last group overlapping the one before: 3 rows in groups of 2) leave what one step
    leaves."""
    m = tiny_model(scale=0.3)
    cfg = m.config
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, 100, size=n).tolist() for n in (150, 170, 191)]  # one 192 bucket
    toks, lens = gen.pad_prompts(ids)

    def run(c):
        cache = gen.init_cache(cfg, len(ids), 384, jnp.float32)
        return gen.prefill(m.params, cfg, XLA, toks, lens, cache, Capture((0,)), *c)

    (lw, cw, sw), (lc, cc, sc) = run((None, None)), run((chunk, group))
    np.testing.assert_allclose(np.asarray(lc), np.asarray(lw), atol=2e-5)
    np.testing.assert_allclose(np.asarray(sc), np.asarray(sw), atol=2e-5)
    for i, n in enumerate(lens.tolist()):  # the kept entries; padding slots may differ
        np.testing.assert_allclose(np.asarray(cc.k[:, i, :, :n]), np.asarray(cw.k[:, i, :, :n]),
                                   atol=2e-5)
    assert (gen.prefill_chunk(2, 192), gen.prefill_rows(2, 192)) == (192, 2)
    # a large batch of whole prompts: groups of sequences, each step within the budget
    assert gen.prefill_chunk(1024, 8192) == 8192
    assert gen.prefill_rows(1024, 8192) * 8192 <= gen.PREFILL_TOKENS
    # one prompt over the budget: equal slices within it
    c = gen.prefill_chunk(1, 3 * gen.PREFILL_TOKENS + 5)
    assert c % gen.PROMPT_BUCKET == 0 and c <= gen.PREFILL_TOKENS


def test_exec_config_resolution():
    gpu = ExecConfig().resolve("gpu")
    assert (gpu.attn, gpu.gemm, gpu.layers) == ("pallas", "cublas", "unrolled")
    assert gpu.compiler_options() == {"xla_gpu_enable_triton_gemm": False,
                                      "xla_gpu_enable_dynamic_slice_fusion": True}
    cpu = ExecConfig().resolve("cpu")
    assert (cpu.attn, cpu.gemm, cpu.layers) == ("xla", "triton", "scan")
    assert cpu.compiler_options() == {}
    assert ExecConfig(gemm="triton").resolve("gpu").compiler_options() == {}
    assert ExecConfig(layers="scan").resolve("gpu").layers == "scan"
    # the draft MLP kernel: the GPU default on one device, never on the XLA path
    assert gpu.draft == "fused-mlp" and cpu.draft == "fused"
    assert ExecConfig(tp=2).resolve("gpu").draft == "fused"
    assert ExecConfig(attn="xla").resolve("gpu").draft == "fused"
    assert ExecConfig(draft="split").resolve("gpu").draft == "split"
    with pytest.raises(ValueError, match="layers"):
        ExecConfig(layers="python")


def test_unrolled_layers_equal_scan():
    """Per-layer weight buffers walked by a Python loop compute what the scan computes."""
    from vegas_jax import SpecConfig, speculative_generate
    from vegas_jax.model import layout_params, stack_layers

    m = tiny_model(scale=0.3)
    unrolled = m._replace(params=layout_params(m.params, ExecConfig(layers="unrolled")))
    assert isinstance(unrolled.params.layers, tuple)
    assert len(unrolled.params.layers) == m.config.num_layers
    back = stack_layers(unrolled.params)
    np.testing.assert_array_equal(np.asarray(back.layers.w_qkv), np.asarray(m.params.layers.w_qkv))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 100, size=n).tolist() for n in (40, 200)]
    spec = SpecConfig(gamma=3, min_tokens=8)
    a = speculative_generate(m, prompts, 24, spec)
    b = speculative_generate(unrolled, prompts, 24, spec)
    assert a.tokens == b.tokens
    assert generate(unrolled, prompts, 24).tokens == a.tokens


def test_prefill_capture_leaves_the_cache_as_plain_prefill():
    """The first selection's capture pass reads the cache without writing: verify-guided
    methods start from exactly the cache vanilla decoding starts from. The pass itself
    must return the cache it was given bit for bit (a rewrite of the last prompt token's
    K/V by a one-row matmul differs in its last bits: the fp32 bug of issue 10); the two
    prefills are different compiled programs, so they agree to rounding only."""
    m = tiny_model(scale=0.3)
    rng = np.random.default_rng(5)
    ids = [rng.integers(0, 100, size=n).tolist() for n in (70, 100)]
    toks, lens = gen.pad_prompts(ids)

    def run(capture):
        cache = gen.init_cache(m.config, 2, 256, jnp.float32)
        return gen.prefill(m.params, m.config, XLA, toks, lens, cache, capture, None)

    (l0, c0, s0), (l1, c1, s1) = run(None), run(Capture((0,)))
    assert s0 is None and s1.shape == (m.config.num_layers, 2, 256)
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


def test_long_prefill_reports_every_layer_of_every_step(monkeypatch):
    """Prompts over PROGRESS_TOKENS tick a progress bar once a layer of each prefill step
    (here 3 prompts in groups of 2: two steps), and the bar is full when the prefill
    returns; the logits are those of a prefill without it."""
    import tqdm

    ticks = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n = total, 0
            ticks.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            pass

    m = tiny_model(scale=0.3)
    rng = np.random.default_rng(5)
    ids = [rng.integers(0, 100, size=n).tolist() for n in (150, 170, 191)]
    cache = lambda: gen.init_cache(m.config, 3, 256, jnp.float32)  # noqa: E731
    quiet, _, _ = gen.prefill_prompts(m.params, m.config, XLA, ids, cache(), None)
    monkeypatch.setattr(tqdm, "tqdm", Bar)
    monkeypatch.setattr(gen, "PROGRESS_TOKENS", 100)
    monkeypatch.setattr(gen, "PREFILL_TOKENS", 2 * 192)
    logits, _, _ = gen.prefill_prompts(m.params, m.config, XLA, ids, cache(), None)
    assert len(ticks) == 1 and ticks[0].total == 2 * m.config.num_layers
    assert ticks[0].n == ticks[0].total
    np.testing.assert_allclose(np.asarray(logits), np.asarray(quiet), atol=2e-5)


def test_prefill_budget_shrinks_with_free_memory(monkeypatch):
    """Little free memory: fewer query tokens a prefill step (halving from PREFILL_TOKENS,
    never below one prompt bucket), and the prefill's logits stay those of one step."""
    cfg = tiny_model().config
    per_token = gen._act_bytes(cfg)
    assert gen.prefill_budget(cfg, None) == gen.PREFILL_TOKENS
    assert gen.prefill_budget(cfg, 3 * per_token * gen.PREFILL_TOKENS) == gen.PREFILL_TOKENS
    assert gen.prefill_budget(cfg, 3 * per_token * 300) == 256
    assert gen.prefill_budget(cfg, 0) == gen.PROMPT_BUCKET
    assert gen.prefill_plan(cfg, 3, 192, 3 * per_token * 400) == (192, 1)  # groups of one
    assert gen.prefill_plan(cfg, 1, 192, 3 * per_token * 100) == (64, 1)  # slices

    m = tiny_model(scale=0.3)
    rng = np.random.default_rng(6)
    ids = [rng.integers(0, 100, size=n).tolist() for n in (150, 170, 191)]
    cache = lambda: gen.init_cache(m.config, 3, 256, jnp.float32)  # noqa: E731
    whole, _, _ = gen.prefill_prompts(m.params, m.config, XLA, ids, cache(), None)
    monkeypatch.setattr(gen, "available_bytes", lambda: 3 * per_token * 100)
    sliced, _, _ = gen.prefill_prompts(m.params, m.config, XLA, ids, cache(), None)
    np.testing.assert_allclose(np.asarray(sliced), np.asarray(whole), atol=2e-5)

"""Row-invariant execution (`ExecConfig(exact=True)`): a row's result never depends on the
rows computed with it, so greedy speculative decoding equals plain decoding bit for bit in
bf16. Kernels in interpret mode on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import MatmulBlocks, matmul, matmul_reference
from pallas_kernels.rms_norm import rms_norm, rms_norm_reference
from pallas_kernels.verify_attention import INVARIANT, CaptureSpec, verify_attention
from tests import compiled
from tests.tiny import TinyModel, tiny_model
from vegas_jax import AutoPolicy, ExecConfig, SpecConfig, generate, speculative_generate
from vegas_jax.attention import AttnPlan
from vegas_jax.cache import init_cache
from vegas_jax.execution import model_jit
from vegas_jax.model import forward
from vegas_jax.params import layout_params

BF16 = jnp.bfloat16


@pytest.mark.parametrize("transpose_w,k", [(False, 200), (True, 200), (False, 4096)])
def test_matmul_matches_reference_and_rows_are_invariant(transpose_w, k):
    """k 200: 64-deep k blocks, the last one ragged; k 4096: 256-deep (`k_block`)."""
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (37, k), BF16)
    w = jax.random.normal(kw, (150, k) if transpose_w else (k, 150), BF16) * 0.1
    full = matmul(x, w, transpose_w=transpose_w, interpret=True)
    ref = matmul_reference(x, w, transpose_w=transpose_w)
    np.testing.assert_allclose(np.asarray(full, np.float32), np.asarray(ref, np.float32),
                               rtol=2e-2, atol=2e-2)
    one = matmul(x[5:6], w, transpose_w=transpose_w, interpret=True)  # a decode step's row
    seven = matmul(x[3:10], w, transpose_w=transpose_w, interpret=True)  # inside a verify
    padded = jnp.concatenate([x[5:6], jnp.zeros((4, k), BF16)])  # a batch of 5, padded
    five = matmul(padded, w, transpose_w=transpose_w, interpret=True)
    assert jnp.array_equal(full[5], one[0])
    assert jnp.array_equal(full[5], seven[2])
    assert jnp.array_equal(full[5], five[0])


@pytest.mark.parametrize("h", [576, 128, 40])
def test_rms_norm_matches_reference_and_rows_are_invariant(h):
    x = jax.random.normal(jax.random.PRNGKey(2), (37, h), BF16) * 3
    full = rms_norm(x, 1e-5, interpret=True)
    np.testing.assert_allclose(np.asarray(full, np.float32),
                               np.asarray(rms_norm_reference(x, 1e-5), np.float32),
                               rtol=1e-2, atol=1e-2)
    assert jnp.array_equal(rms_norm(x[5:6], 1e-5, interpret=True)[0], full[5])  # alone
    assert jnp.array_equal(rms_norm(x[3:10], 1e-5, interpret=True), full[3:10])  # 7 rows
    assert jnp.array_equal(rms_norm(x[1:], 1e-5, interpret=True), full[1:])  # shifted


def test_matmul_rejects_a_weight_of_the_wrong_shape():
    with pytest.raises(ValueError, match="w must be"):
        matmul(jnp.zeros((4, 8), BF16), jnp.zeros((9, 3), BF16), interpret=True)


def test_matmul_tiles_are_an_argument():
    x = jnp.ones((3, 40), BF16)
    w = jnp.ones((40, 24), BF16)
    small = MatmulBlocks(block_m=16, block_k=16, block_n=16)
    assert jnp.array_equal(matmul(x, w, blocks=small, interpret=True), matmul_reference(x, w))


def test_invariant_attention_rows_equal_decode_rows():
    L, b, kh, s, d, g = 2, 3, 2, 1024 + 128, 32, 3
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    kc = jax.random.normal(ks[0], (L, b, kh, s, d), BF16)
    vc = jax.random.normal(ks[1], (L, b, kh, s, d), BF16)
    n = jnp.array([1000, 30, 1100])
    q7 = jax.random.normal(ks[2], (b, 7, kh, g, d), BF16)
    pos7 = n[:, None] + jnp.arange(7)
    run = lambda q, k, v, p, **kw: verify_attention(q, k, v, 1, p, interpret=True,  # noqa: E731
                                                     blocks=INVARIANT, **kw)[0]
    o7 = run(q7, kc, vc, pos7)
    assert jnp.array_equal(o7[:, 0], run(q7[:, :1], kc, vc, pos7[:, :1])[:, 0])
    alone = run(q7[2:3, 3:4], kc[:, 2:3], vc[:, 2:3], pos7[2:3, 3:4])
    assert jnp.array_equal(o7[2, 3], alone[0, 0])
    # the capture side output changes nothing in the attention's output
    assert jnp.array_equal(o7, run(q7, kc, vc, pos7, capture=CaptureSpec((0, 6))))


def test_invariant_attention_rows_do_not_depend_on_the_cache_length():
    # a cache is as long as its batch's longest prompt: a row alone and the same row in a
    # batch read caches of other lengths, and must split their keys alike
    b, kh, d, g = 1, 2, 32, 3
    ks = jax.random.split(jax.random.PRNGKey(4), 3)
    kc = jax.random.normal(ks[0], (1, b, kh, 3328, d), BF16)
    vc = jax.random.normal(ks[1], (1, b, kh, 3328, d), BF16)
    q = jax.random.normal(ks[2], (b, 1, kh, g, d), BF16)
    run = lambda s, p: verify_attention(q, kc[:, :, :, :s], vc[:, :, :, :s], 0,  # noqa: E731
                                        jnp.array([[p]]), interpret=True, blocks=INVARIANT)[0]
    for p in (700, 1100):  # one split; two
        outs = [run(s, p) for s in (1152, 1792, 3328)]
        assert all(jnp.array_equal(outs[0], o) for o in outs[1:]), p


@pytest.mark.parametrize("g", [1, 3, 4, 8])
def test_invariant_plan_runs_decode_verify_and_prefill_in_one_program_shape(g):
    # on the GPU a 16-row program reduced a row's keys across warps in another order than
    # a 32-row one: decode rows parted from verify rows
    from pallas_kernels.verify_attention import _plan

    kw = dict(max_rows=INVARIANT.max_rows, row_block=INVARIANT.row_block, target_programs=528,
              block_k=64, min_split=512, split_keys=INVARIANT.split_keys)
    shapes = {_plan(b, 2, t, g, 8192, **kw)[0] for b in (1, 64) for t in (1, 7, 13, 500)}
    assert shapes == {INVARIANT.max_rows}


@pytest.fixture(scope="module")
def tiny_bf16():
    return tiny_model(scale=0.3, dtype=BF16)


def test_forward_rows_are_the_same_in_decode_steps_a_verify_and_a_padded_batch(tiny_bf16):
    m = tiny_bf16
    cfg = m.config
    xc = ExecConfig(backend="pallas", layers="scan", exact=True).resolve()
    params = layout_params(m.params, xc)

    @model_jit(static_argnames=("xc",))  # as the product compiles it (its XLA options)
    def fwd(params, xc, toks, pos, cache):
        logits, cache, _ = forward(params, cfg, xc, toks, pos, cache, AttnPlan())
        return logits, cache

    rng = np.random.default_rng(0)
    b, s, n = 5, 128, 40
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, n + 7)), jnp.int32)
    cache = init_cache(cfg, b, s, BF16)
    pos = jnp.broadcast_to(jnp.arange(n), (b, n))
    _, cache = fwd(params, xc, toks[:, :n], pos, cache)
    vpos = n + jnp.broadcast_to(jnp.arange(7), (b, 7))
    verify, _ = fwd(params, xc, toks[:, n:], vpos, cache)  # [b, 7, v] logits
    steps, c = [], cache
    for j in range(7):  # seven one-row decode steps, each writing its K/V
        logits, c = fwd(params, xc, toks[:, n + j:n + j + 1], vpos[:, j:j + 1], c)
        steps.append(logits[:, 0])
    assert jnp.array_equal(verify, jnp.stack(steps, axis=1))
    one = cache.replace(k=cache.k[:, 2:3], v=cache.v[:, 2:3], lengths=cache.lengths[2:3])
    alone, _ = fwd(params, xc, toks[2:3, n:n + 1], vpos[2:3, :1], one)
    assert jnp.array_equal(alone[0, 0], steps[0][2])


def test_exact_compiles_without_excess_precision():
    # XLA keeps fp32 between fused bf16 ops where fusion allows, and fusion follows shapes
    assert ExecConfig(exact=True).compiler_options()["xla_allow_excess_precision"] is False
    assert "xla_allow_excess_precision" not in ExecConfig().compiler_options()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 100, size=k).tolist() for k in (37, 150)]


@pytest.mark.slow
def test_exact_vanilla_alone_equals_the_batch_on_the_xla_path(tiny_bf16, prompts):
    """A prompt alone equals its row of the batch (on the kernels' path: the long prompts'
    test below, which also refills)."""
    xc = ExecConfig(backend="xla", exact=True)
    batch = generate(tiny_bf16, prompts, 16, exec_config=xc).tokens
    assert generate(tiny_bf16, prompts[1:], 16, exec_config=xc).tokens[0] == batch[1]


SLOW = pytest.mark.slow


# one method a capture mode (drafts only propose: the output rests on the verify rows):
# vegas (its pair of rows; vegas-paper's too), stream (none; quest's too) and auto (vegas's
# rounds at several gammas); `last` (every row) is the next test's
@pytest.mark.slow
@pytest.mark.parametrize("method", ["vegas", "stream", "auto"])
def test_exact_greedy_speculative_equals_vanilla_in_bf16(tiny_bf16, prompts, method):
    xc = ExecConfig(backend="pallas", exact=True)
    ref = generate(tiny_bf16, prompts, 12, exec_config=xc)
    out = speculative_generate(tiny_bf16, prompts, 12, SpecConfig(method=method, gamma=3,
                                                                  min_tokens=8), exec_config=xc,
                               auto_policy=AutoPolicy(min_gain=1.0))  # auto: rounds
    assert out.tokens == ref.tokens
    assert out.stats["rounds"] > 0


@pytest.mark.slow
def test_exact_last_captures_more_rows_than_one_query_block(tiny_bf16, prompts):
    """`last` captures every verify row: at gamma 16 and group 2 that is 34 rows, more than
    the invariant plan's 32-row program (the GPU's gamma 12 at group 3 once refused)."""
    xc = ExecConfig(backend="pallas", exact=True)
    ref = generate(tiny_bf16, prompts, 40, exec_config=xc)
    out = speculative_generate(tiny_bf16, prompts, 40, SpecConfig(method="last", gamma=16,
                                                                  min_tokens=8), exec_config=xc)
    assert out.tokens == ref.tokens
    assert out.stats["rounds"] > 0


def test_exact_refuses_what_it_cannot_make_invariant():
    with pytest.raises(ValueError, match="one device"):
        ExecConfig(exact=True, tp=2)


@pytest.mark.slow
def test_full_size_forward_verify_rows_equal_decode_steps():
    """SmolLM2's widths (fusion follows the shapes) in random weights, 4 of its 30 layers
    (one program the scan repeats): verify rows equal decode steps, a row alone the batch."""
    import dataclasses

    from benchmarks.row_invariance import whole_forward
    from vegas_jax.config import get_config
    from vegas_jax.params import init_params

    cfg = dataclasses.replace(get_config("smollm2-135m"), num_layers=4)
    model = TinyModel(cfg, init_params(cfg, jax.random.key(0), BF16))
    out = whole_forward(model, ExecConfig(exact=True).resolve(), 3, 256, 2, uncaptured=False)
    assert out["verify_vs_steps"][:2] == (9, 9)
    assert out["alone_vs_batch"][:2] == (3, 3)
    assert out["alone_short_cache_vs_batch"][:2] == (3, 3)


@pytest.mark.parametrize("g,windowed,unmasked", [(3, False, False),
                                                 pytest.param(3, False, True, marks=SLOW),
                                                 pytest.param(4, True, False, marks=SLOW)])
def test_invariant_prefill_rows_alone_batched_and_chunked(g, windowed, unmasked):
    """The prompt steps' plan (`INVARIANT_PREFILL`; and with its unmasked first loop): a
    prompt's rows alone equal the same rows in a batch whose longest prompt makes the
    cache longer, and prefilled in chunks that cut its query blocks (42 tokens a block at
    group 3); and match the reference."""
    import dataclasses

    from pallas_kernels.verify_attention import INVARIANT_PREFILL, verify_attention_reference

    blocks = dataclasses.replace(INVARIANT_PREFILL, unmasked=unmasked)

    kh, d, t, wide = 2, 32, 300, 420
    ks = jax.random.split(jax.random.PRNGKey(6), 3)
    kc = jax.random.normal(ks[0], (1, 3, kh, wide + 30, d), BF16)
    vc = jax.random.normal(ks[1], (1, 3, kh, wide + 30, d), BF16)
    q = jax.random.normal(ks[2], (3, wide, kh, g, d), BF16)
    pos = jnp.broadcast_to(jnp.arange(wide, dtype=jnp.int32), (3, wide))
    extra = dict(window=jnp.int32(70), sinks=jnp.ones((kh, g))) if windowed else {}

    def run(q, kc, vc, pos):
        return compiled.call(verify_attention, q, kc, vc, jnp.int32(0), pos,
                             blocks=blocks, interpret=True, **extra)[0]

    batch = run(q, kc, vc, pos)[1, :t]
    q1, kc1, vc1, p1 = q[1:2, :t], kc[:, 1:2, :, :t + 8], vc[:, 1:2, :, :t + 8], pos[1:2, :t]
    alone = run(q1, kc1, vc1, p1)[0]
    assert jnp.array_equal(alone, batch)
    cuts = (0, 100, 250, t)  # 100 and 150 tokens: blocks of 42 tokens cut mid-block
    chunked = jnp.concatenate([run(q1[:, a:b], kc1, vc1, p1[:, a:b])[0]
                               for a, b in zip(cuts, cuts[1:])])
    assert jnp.array_equal(alone, chunked)
    ref = compiled.call(verify_attention_reference, q1, kc1, vc1, jnp.int32(0), p1, **extra)[0]
    np.testing.assert_allclose(np.asarray(alone, np.float32), np.asarray(ref[0], np.float32),
                               rtol=2e-2, atol=2e-2)


def test_prefill_matmul_tile_rows_are_invariant():
    """The prompt steps' tile (`PREFILL_BLOCKS`, its programs on one grouped axis): a
    row alone, at another offset in its tile, or in a larger batch is bit for bit itself."""
    from pallas_kernels.matmul import PREFILL_BLOCKS

    kx, kw = jax.random.split(jax.random.PRNGKey(7))
    x = jax.random.normal(kx, (300, 200), BF16)
    w = jax.random.normal(kw, (200, 300), BF16) * 0.1
    full = matmul(x, w, blocks=PREFILL_BLOCKS, interpret=True)
    np.testing.assert_allclose(np.asarray(full, np.float32),
                               np.asarray(matmul_reference(x, w), np.float32), rtol=2e-2,
                               atol=2e-2)
    assert jnp.array_equal(full[130:131], matmul(x[130:131], w, blocks=PREFILL_BLOCKS,
                                                 interpret=True))
    assert jnp.array_equal(full[5:260], matmul(x[5:260], w, blocks=PREFILL_BLOCKS,
                                               interpret=True))


@pytest.mark.parametrize("transpose_w", [False, True])
def test_prefill_matmul_tile_lowers_for_cuda(transpose_w):
    from pallas_kernels.matmul import PREFILL_BLOCKS
    from tests.cuda import lower_cuda

    sd = jax.ShapeDtypeStruct
    w = sd((6144, 4096) if transpose_w else (4096, 6144), BF16)
    txt = lower_cuda(lambda x, w: matmul(x, w, blocks=PREFILL_BLOCKS, transpose_w=transpose_w),
                     sd((8192, 4096), BF16), w)
    assert "xla.gpu.triton" in txt


def _long_prompts(lengths, seed=5):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100, size=k).tolist() for k in lengths]


@pytest.mark.slow
def test_exact_prefill_in_chunks_equals_one_call(tiny_bf16, monkeypatch):
    """Prompt steps of 64 tokens (a budget of 64 query tokens a step) and one call give
    the same tokens: a prompt row does not depend on the chunking."""
    import vegas_jax.prefill as pf

    xc = ExecConfig(backend="pallas", exact=True)
    prompts = _long_prompts((150, 140))
    whole = generate(tiny_bf16, prompts, 4, exec_config=xc).tokens
    monkeypatch.setattr(pf, "PREFILL_TOKENS", 64)
    assert generate(tiny_bf16, prompts, 4, exec_config=xc).tokens == whole


@pytest.mark.slow
def test_exact_long_prompts_alone_batched_chunked_refilled_and_speculative(tiny_bf16,
                                                                         monkeypatch):
    """Prompts past two of decode's key splits (1024 keys): exact vanilla alone equals the
    batch (two prompts of one padded width, another of its own), prefilled in chunks,
    refilled into a freed slot, and exact speculative decoding. Alone: the short prompt,
    whose cache is then a seventh as long (its keys split otherwise, its rows must not)."""
    import vegas_jax.prefill as pf

    xc = ExecConfig(backend="pallas", exact=True)
    prompts = _long_prompts((2100, 2090, 300))
    batch = generate(tiny_bf16, prompts, 8, exec_config=xc).tokens
    assert generate(tiny_bf16, prompts[2:], 8, exec_config=xc).tokens[0] == batch[2]
    assert generate(tiny_bf16, prompts, 8, exec_config=xc, max_batch=2).tokens == batch
    spec = speculative_generate(tiny_bf16, prompts, 8, SpecConfig(method="vegas", gamma=3,
                                                                  min_tokens=8), exec_config=xc)
    assert spec.tokens == batch and spec.stats["rounds"] > 0
    monkeypatch.setattr(pf, "PREFILL_TOKENS", 512)  # the two long prompts: 5 chunks of 448
    assert generate(tiny_bf16, prompts, 8, exec_config=xc).tokens == batch

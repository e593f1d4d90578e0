"""Pallas sparse draft attention (interpret mode) vs the jnp reference, plus CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention import (
    SparseBlocks, SparseIndex, StepBlocks, StepSpec, sparse_attention,
    sparse_attention_reference,
)
from tests.cuda import lower_cuda
from tests import compiled, rand


def attend(fn, q, kc, vc, layer, idx, count, tail_start, q_pos, idx_layer=None, **kw):
    """`fn` (the kernel or its reference) on flat index arrays, a `SparseIndex` of them."""
    return fn(q, kc, vc, layer, SparseIndex(idx, count, tail_start, q_pos, idx_layer), **kw)


def step(fn, qkv, q_norm, k_norm, rope, kc, vc, layer, idx, count, tail_start, q_pos, *,
         tail_len, num_heads, qk_norm=False, eps=1e-6, idx_layer=None, **kw):
    """`fn` (`sparse_step` or its reference) on flat index arrays and flat settings."""
    return fn(qkv, q_norm, k_norm, rope, kc, vc, layer,
              SparseIndex(idx, count, tail_start, q_pos, idx_layer),
              spec=StepSpec(tail_len=tail_len, num_heads=num_heads, qk_norm=qk_norm, eps=eps),
              **kw)


def _fast_first(cases, fast, prefix="c"):
    """pytest params of `cases`, those not indexed in `fast` in the slow tier."""
    return [pytest.param(c, id=f"{prefix}{i}", marks=() if i in fast else pytest.mark.slow)
            for i, c in enumerate(cases)]


# (L, b, kh, g, d, s, K, tail_len, per_head, dtype, layer axis on idx)
CASES = [
    (2, 2, 2, 4, 64, 300, 37, 9, False, jnp.float32, False),
    (2, 2, 2, 4, 64, 300, 37, 9, True, jnp.float32, True),
    (1, 3, 1, 8, 128, 257, 64, 0, False, jnp.bfloat16, False),
    (2, 2, 4, 1, 64, 129, 20, 16, True, jnp.bfloat16, False),
    (1, 1, 2, 4, 128, 99, 50, 7, False, jnp.float32, True),
    # a long tail (Stream's window) split across several programs, a tiny index list
    (2, 2, 2, 4, 64, 300, 3, 90, False, jnp.float32, True),
]


@pytest.mark.parametrize("case", _fast_first(CASES, (1, 5)))
def test_sparse_matches_reference(case):
    L, b, kh, g, d, s, K, W, per_head, dtype, stacked = case
    ks = jax.random.split(jax.random.PRNGKey(s + K), 6)
    kc = rand.normal(ks[0], (L, b, kh, s, d), jnp.float32).astype(dtype)
    vc = rand.normal(ks[1], (L, b, kh, s, d), jnp.float32).astype(dtype)
    q = (2.0 * rand.normal(ks[2], (b, 1, kh, g, d), jnp.float32)).astype(dtype)
    q_pos = rand.randint(ks[3], (b,), s // 2, s)  # ragged
    tail_start = jnp.maximum(q_pos - max(W - 3, 0), 0)
    if W > 50:  # the window reaches back W - 3 positions: several chunks of it are real
        assert int(jnp.min(q_pos - tail_start)) > 2 * 16
    ish = (b, kh, K) if per_head else (b, K)
    idx = rand.randint(ks[4], ish, 0, s // 2)
    count = rand.randint(ks[5], ish[:-1], 1, K + 1).at[(0,) * (len(ish) - 1)].set(K)
    # padding entries hold a valid sentinel
    idx = jnp.where(jnp.arange(K) < count[..., None], idx, 0)
    layer = jnp.int32(L - 1)
    ref = compiled.call(attend, sparse_attention_reference, q, kc, vc, layer, idx, count,
                        tail_start, q_pos, tail_len=W)
    kw = {}
    if stacked:  # every layer's lists in one buffer: the kernel indexes entry 1
        junk = rand.randint(ks[5], idx.shape, 0, s)
        idx = jnp.stack([junk, idx, junk])
        count = jnp.stack([jnp.ones_like(count), count, jnp.ones_like(count)])
        kw["idx_layer"] = jnp.int32(1)
        ref2 = compiled.call(attend, sparse_attention_reference, q, kc, vc, layer, idx, count,
                             tail_start, q_pos, tail_len=W, **kw)
        np.testing.assert_array_equal(np.asarray(ref2), np.asarray(ref))
    out = compiled.call(attend, sparse_attention, q, kc, vc, layer, idx, count, tail_start,
                        q_pos, tail_len=W, interpret=True, **kw,
                        blocks=SparseBlocks(block_k=16, target_programs=3 * b * kh))
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()  # interpret mode starts outputs as NaN
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("per_head,g,none_selected",
                         [(False, 3, False), pytest.param(True, 1, True, marks=pytest.mark.slow)])
def test_sinks_match_reference(per_head, g, none_selected):
    """gpt-oss's sinks (one logit per query head in the denominator) enter at the combine;
    a sliding layer's draft selects nothing and reads its window as the tail."""
    L, b, kh, d, s, K, W = 2, 2, 2, 64, 200, 24, 40
    ks = jax.random.split(jax.random.PRNGKey(g), 6)
    kc = rand.normal(ks[0], (L, b, kh, s, d), jnp.float32)
    vc = rand.normal(ks[1], (L, b, kh, s, d), jnp.float32)
    q = 2.0 * rand.normal(ks[2], (b, 1, kh, g, d), jnp.float32)
    q_pos = jnp.array([120, 190], jnp.int32)
    tail_start = q_pos - W + 1
    ish = (b, kh, K) if per_head else (b, K)
    idx = rand.randint(ks[4], ish, 0, 80)
    count = jnp.full(ish[:-1], 0 if none_selected else K, jnp.int32)
    sinks = 5.0 + 2.0 * rand.normal(ks[5], (kh, g), jnp.float32)  # near the LSE
    layer = jnp.int32(1)
    args = (q, kc, vc, layer, idx, count, tail_start, q_pos)
    ref = compiled.call(attend, sparse_attention_reference, *args, tail_len=W, sinks=sinks)
    out = compiled.call(attend, sparse_attention, *args, tail_len=W, sinks=sinks,
                        interpret=True, blocks=SparseBlocks(block_k=16, target_programs=3 * b * kh))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-4, rtol=1e-4)
    plain = compiled.call(attend, sparse_attention_reference, *args, tail_len=W)
    assert np.abs(np.asarray(plain) - np.asarray(ref)).max() > 0.05


@pytest.mark.parametrize("per_head", [False, True])
def test_lowers_for_cuda(per_head):
    L, b, kh, g, d, s, K = 2, 2, 8, 4, 128, 4096, 300
    sd = jax.ShapeDtypeStruct
    ish = (b, kh, K) if per_head else (b, K)
    txt = lower_cuda(
        lambda *a: attend(sparse_attention, *a, tail_len=16),
        sd((b, 1, kh, g, d), jnp.bfloat16), sd((L, b, kh, s, d), jnp.bfloat16),
        sd((L, b, kh, s, d), jnp.bfloat16), sd((), jnp.int32), sd(ish, jnp.int32),
        sd(ish[:-1], jnp.int32), sd((b,), jnp.int32), sd((b,), jnp.int32))
    assert "xla.gpu.triton" in txt
    txt = lower_cuda(  # with gpt-oss's sinks at the combine
        lambda *a: attend(sparse_attention, *a[:-1], tail_len=128, sinks=a[-1]),
        sd((b, 1, kh, g, d), jnp.bfloat16), sd((L, b, kh, s, d), jnp.bfloat16),
        sd((L, b, kh, s, d), jnp.bfloat16), sd((), jnp.int32), sd(ish, jnp.int32),
        sd(ish[:-1], jnp.int32), sd((b,), jnp.int32), sd((b,), jnp.int32),
        sd((kh, g), jnp.float32))
    assert "xla.gpu.triton" in txt

# (b, kh, g, d, s, K, tail_len, qk_norm, dtype, unsplit): the whole draft attention block
STEP_CASES = [
    (2, 2, 3, 64, 300, 37, 9, False, jnp.float32, False),
    (2, 2, 3, 64, 300, 37, 9, True, jnp.float32, True),
    (3, 1, 8, 32, 257, 20, 16, True, jnp.bfloat16, True),
    (2, 2, 2, 64, 300, 3, 90, False, jnp.float32, False),  # long tail over several programs
    (2, 2, 2, 64, 300, 3, 90, False, jnp.float32, True),  # ... over several blocks
]


# (case, with_x): with x on the split path, the chunks are combined by the Pallas kernel
STEP_PARAMS = [pytest.param(c, x, id=f"c{i}-{'x' if x else 'qkv'}",
                            marks=() if (i, x) in ((0, True), (1, False)) else pytest.mark.slow)
               for i, c in enumerate(STEP_CASES) for x in (False, True)]


@pytest.mark.parametrize("case,with_x", STEP_PARAMS)
def test_sparse_step_matches_reference(case, with_x):
    """With x, qkv is the projection before the input norm's row scale, which the kernel
    applies from x (rows of different scales; a hidden size that is not a power of two)."""
    from pallas_kernels.sparse_attention import rope_halves, sparse_step, sparse_step_reference

    b, kh, g, d, s, K, W, qk_norm, dtype, unsplit = case
    L, n = 2, kh * g
    ks = jax.random.split(jax.random.PRNGKey(s + K + W), 8)
    kc = rand.normal(ks[0], (L, b, kh, s, d), jnp.float32).astype(dtype)
    vc = rand.normal(ks[1], (L, b, kh, s, d), jnp.float32).astype(dtype)
    qkv = (2.0 * rand.normal(ks[2], (b, 1, (n + 2 * kh) * d))).astype(dtype)
    norms = (1.0 + 0.3 * rand.normal(ks[6], (2, d))).astype(dtype)
    q_pos = rand.randint(ks[3], (b,), s // 2, s).at[0].set(s - 1)  # ragged; one at the end
    tail_start = jnp.maximum(q_pos - max(W - 3, 0), 0)
    idx = rand.randint(ks[4], (L, b, K), 0, s // 2)
    # a selected entry at the query's own position must read the new K/V, not the stale row
    idx = idx.at[1, 1, 0].set(q_pos[1])
    count = rand.randint(ks[5], (L, b), 1, K + 1).at[1].set(K)
    pos = q_pos.astype(jnp.float32)[:, None, None]
    freqs = pos * (10000.0 ** (-jnp.arange(0, d, 2) / d))[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    args = (qkv, norms[0], norms[1], rope_halves(cos, sin), kc, vc, jnp.int32(1), idx, count,
            tail_start, q_pos)
    kw = dict(tail_len=W, num_heads=n, qk_norm=qk_norm, eps=1e-6, idx_layer=jnp.int32(1))
    if with_x:
        x = rand.normal(ks[7], (b, 3 * d // 2)) * jnp.linspace(0.2, 5.0, b)[:, None]
        kw["x"] = x.astype(dtype)
    ref, rk, rv = compiled.call(step, sparse_step_reference, *args, **kw)
    # unsplit: a tail shorter than the list's blocks walks its own, smaller blocks
    sb = SparseBlocks(block_k=32 if unsplit else 16, target_programs=3 * b * kh)
    # split: the chunks combined by the Pallas kernel (with x) or by XLA (without)
    blocks = StepBlocks(split=sb, whole=sb, whole_from=1 if unsplit else 10**6,
                        combine_from=1 if with_x else 10**6)
    out, ok_, ov = compiled.call(step, sparse_step, *args, **kw, interpret=True,
                                 blocks=blocks)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=tol, rtol=tol)
    # the cache: the new rows written at q_pos of layer 1, nothing else touched
    np.testing.assert_array_equal(np.asarray(ov), np.asarray(rv))
    np.testing.assert_allclose(np.asarray(ok_, np.float32), np.asarray(rk, np.float32),
                               atol=tol, rtol=tol)
    assert not np.array_equal(np.asarray(rk), np.asarray(kc))


@pytest.mark.parametrize("unsplit", [pytest.param(False, marks=pytest.mark.slow), True])
def test_sparse_step_padding_rows_output_zeros_and_touch_no_cache(unsplit):
    """qkv and x with rows past the cache's batch (the model's padded residual stream):
    the real rows are those of the unpadded call, the padding rows zeros, and the cache
    is written for the real sequences only."""
    from pallas_kernels.sparse_attention import rope_halves, sparse_step, sparse_step_reference

    L, b, bq, kh, g, d, s, K, W = 2, 3, 8, 2, 2, 32, 200, 24, 9
    n = kh * g
    ks = jax.random.split(jax.random.PRNGKey(5), 7)
    kc = rand.normal(ks[0], (L, b, kh, s, d))
    vc = rand.normal(ks[1], (L, b, kh, s, d))
    qkv = rand.normal(ks[2], (bq, 1, (n + 2 * kh) * d))
    x = rand.normal(ks[3], (bq, 48))
    q_pos = jnp.array([150, 199, 120])
    idx = rand.randint(ks[4], (L, b, K), 0, 100)
    count = jnp.full((L, b), K)
    ang = q_pos[:, None, None] * jnp.ones((1, 1, d)) * 0.01
    rope = rope_halves(jnp.cos(ang), jnp.sin(ang))
    args = (jnp.ones((d,)), jnp.ones((d,)), rope, kc, vc, jnp.int32(1), idx, count,
            q_pos - 5, q_pos)
    kw = dict(tail_len=W, num_heads=n, qk_norm=True, idx_layer=jnp.int32(1))
    sb = SparseBlocks(block_k=16, target_programs=2 * b * kh)
    blocks = StepBlocks(split=sb, whole=sb, whole_from=1 if unsplit else 10**6, combine_from=1)
    out, ok_, ov = compiled.call(step, sparse_step, qkv, *args, **kw, x=x, interpret=True,
                                 blocks=blocks)
    one, k1, v1 = compiled.call(step, sparse_step, qkv[:b], *args, **kw, x=x[:b],
                                interpret=True, blocks=blocks)
    ref, rk, rv = compiled.call(step, sparse_step_reference, qkv, *args, **kw, x=x)
    assert out.shape == ref.shape == (bq, 1, kh, g, d)
    np.testing.assert_allclose(np.asarray(out[:b]), np.asarray(one), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-4)
    assert not np.asarray(out[b:]).any()
    # (interpret mode on the CPU rounds the padded shapes' arithmetic a little differently)
    np.testing.assert_allclose(np.asarray(ok_), np.asarray(k1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ov), np.asarray(rv), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(ok_)[:, :, :, 121:150], np.asarray(kc)[:, :, :, 121:150])


def test_sparse_step_lowers_for_cuda():
    from pallas_kernels.sparse_attention import sparse_step

    L, b, kh, g, d, s, K = 2, 64, 3, 3, 64, 4096, 300
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    for blocks in (StepBlocks(whole_from=1), StepBlocks(whole_from=10**6)):
        fn = functools.partial(step, sparse_step, tail_len=13, num_heads=kh * g,
                               qk_norm=True, blocks=blocks)
        txt = lower_cuda(
            fn, sd((b, 1, (kh * g + 2 * kh) * d), bf), sd((d,), bf), sd((d,), bf),
            sd((b, 2, d // 2), jnp.float32), sd((L, b, kh, s, d), bf), sd((L, b, kh, s, d), bf),
            sd((), jnp.int32), sd((b, K), jnp.int32), sd((b,), jnp.int32),
            sd((b,), jnp.int32), sd((b,), jnp.int32))
        assert "xla.gpu.triton" in txt


# (bq, kh, J, g, d, out dtype): the split step's combine kernel. SmolLM2 B 1 and Qwen3-8B
# B 4 shapes; J and g not powers of two; J 17, g 8, d 128 splits d into two blocks
COMBINE_CASES = [
    (1, 3, 9, 3, 64, jnp.float32),
    (2, 8, 17, 4, 128, jnp.bfloat16),
    (2, 2, 17, 8, 128, jnp.float32),
    (2, 2, 1, 1, 64, jnp.float32),
    (1, 2, 3, 8, 128, jnp.bfloat16),
    (3, 2, 9, 1, 128, jnp.float32),
    (2, 3, 3, 4, 64, jnp.bfloat16),
    (1, 4, 1, 3, 128, jnp.bfloat16),
]


@pytest.mark.parametrize("case", _fast_first(COMBINE_CASES, (1, 3)))
def test_combine_step_splits_matches_combine_splits(case):
    """Empty chunks (m = NEG, l = 0, o = 0) among real ones; sequence 0's head 0 saw
    nothing in any chunk: its rows are zeros."""
    from pallas_kernels.common import NEG, combine_splits, pow2_at_least
    from pallas_kernels.sparse_attention import combine_step_splits

    bq, kh, J, g, d, dtype = case
    rows = pow2_at_least(g)
    ks = jax.random.split(jax.random.PRNGKey(J * 10 + g), 4)
    o = rand.normal(ks[0], (bq, kh, J, rows, d))  # [b, k, J, R, d]
    m = 3.0 * rand.normal(ks[1], (bq, kh, J, rows))  # [b, k, J, R]
    l = rand.uniform(ks[2], (bq, kh, J, rows), minval=0.5, maxval=8.0)
    empty = rand.bernoulli(ks[3], 0.3, (bq, kh, J)).at[0, 0].set(True)  # [b, k, J]
    m = jnp.where(empty[..., None], NEG, m)
    l = jnp.where(empty[..., None], 0.0, l)
    o = jnp.where(empty[..., None, None], 0.0, o)
    ref = np.asarray(compiled.call(combine_splits, o, m, l)[0][:, :, :g].astype(dtype), np.float32)
    out = compiled.call(combine_step_splits, o, m, l, g, dtype, interpret=True)
    assert out.shape == (bq, kh, g, d) and out.dtype == dtype
    out = np.asarray(out, np.float32)
    assert not out[0, 0].any()
    assert np.abs(out).max() > 0
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


def test_combine_step_splits_lowers_for_cuda():
    from pallas_kernels.sparse_attention import combine_step_splits

    sd = jax.ShapeDtypeStruct
    for bq, kh, J, g, d in [(8, 8, 17, 4, 128), (1, 3, 9, 3, 64), (2, 2, 17, 8, 128),
                            (2, 2, 1, 1, 64)]:
        rows = max(16, g)
        fn = functools.partial(combine_step_splits, g=g, out_dtype=jnp.bfloat16)
        txt = lower_cuda(fn, sd((bq, kh, J, rows, d), jnp.float32),
                         sd((bq, kh, J, rows), jnp.float32), sd((bq, kh, J, rows), jnp.float32))
        assert "xla.gpu.triton" in txt

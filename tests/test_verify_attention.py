"""Pallas verify attention (interpret mode) vs the jnp reference, plus CUDA lowering."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.verify_attention import (
    CaptureSpec, VerifyBlocks, verify_attention, verify_attention_reference)
from tests.cuda import lower_cuda
from tests import compiled, rand


def _inputs(seed, L, b, kh, g, d, s, t, dtype, base):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    kc = rand.normal(ks[0], (L, b, kh, s, d), jnp.float32).astype(dtype)
    vc = rand.normal(ks[1], (L, b, kh, s, d), jnp.float32).astype(dtype)
    q = (2.0 * rand.normal(ks[2], (b, t, kh, g, d), jnp.float32)).astype(dtype)
    q_pos = jnp.asarray(base, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return q, kc, vc, q_pos


def _check(out, ref, dtype, rtol_score=None):
    o, sc = out
    ro, rsc = ref
    assert o.shape == ro.shape and o.dtype == ro.dtype
    o = np.asarray(o, np.float32)
    ro = np.asarray(ro, np.float32)
    assert np.isfinite(o).all()
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(o, ro, atol=tol, rtol=tol)
    if rsc is None:
        assert sc is None
        return
    sc = np.asarray(sc)
    rsc = np.asarray(rsc)
    assert sc.shape == rsc.shape and sc.dtype == np.float32
    assert np.isfinite(sc).all()
    # captured logits travel as fp16: ~1e-3 relative on the logit
    scale = np.abs(rsc).max()
    np.testing.assert_allclose(sc, rsc, atol=2e-3 * scale, rtol=1e-2)


def _spec(capture, rows, score="weight"):
    """The capture of the old (mode, rows, score) triples: "none" is no capture."""
    return None if capture == "none" else CaptureSpec(tuple(rows), capture, score)


def _fast_first(cases, fast, prefix):
    """pytest params of `cases`, those not indexed in `fast` in the slow tier."""
    return [pytest.param(c, id=f"{prefix}{i}", marks=() if i in fast else pytest.mark.slow)
            for i, c in enumerate(cases)]


# (L, b, kh, g, d, s, gamma, dtype, base positions, capture, rows, score)
CASES = [
    (2, 2, 2, 4, 64, 97, 1, jnp.float32, (40, 90), "mean", (0, 1), "weight"),
    (2, 2, 2, 4, 128, 131, 4, jnp.bfloat16, (3, 120), "mean", (0, 4), "weight"),
    (2, 3, 1, 8, 64, 77, 6, jnp.float32, (0, 33, 70), "rows", (0, 6), "weight"),
    (1, 2, 4, 1, 64, 65, 8, jnp.float32, (10, 56), "mean", (0, 8), "logit"),
    (2, 2, 2, 4, 64, 200, 7, jnp.bfloat16, (150, 17), "rows", tuple(range(8)), "logit"),
    (2, 1, 2, 8, 128, 61, 2, jnp.float32, (58,), "none", (0,), "weight"),
    (2, 2, 2, 1, 128, 150, 5, jnp.float32, (100, 144), "rows", (5, 0), "weight"),
    (1, 2, 2, 4, 64, 45, 0, jnp.float32, (44, 7), "mean", (0, 0), "weight"),  # decode
    (1, 2, 2, 8, 64, 70, 0, jnp.bfloat16, (69, 20), "none", (0,), "weight"),  # decode
    # in-kernel logit reduction with a duplicated capture row (weights 1/3, 2/3)
    (2, 2, 2, 4, 64, 90, 3, jnp.float32, (5, 80), "mean", (0, 3, 3), "logit"),
]


@pytest.mark.parametrize("case", _fast_first(CASES, (0, 4, 7), "c"))
def test_verify_matches_reference(case):
    L, b, kh, g, d, s, gamma, dtype, base, capture, rows, score = case
    q, kc, vc, q_pos = _inputs(len(base) + s, L, b, kh, g, d, s, gamma + 1, dtype, base)
    layer = jnp.int32(L - 1)
    kw = dict(capture=_spec(capture, rows, score))
    # small blocks/splits so several key splits and blocks (and a ragged last one) run
    blocks = VerifyBlocks(block_k=16, min_split=32, target_programs=4 * b * kh)
    out = compiled.call(verify_attention, q, kc, vc, layer, q_pos, interpret=True,
                        blocks=blocks, **kw)
    ref = compiled.call(verify_attention_reference, q, kc, vc, layer, q_pos, **kw)
    _check(out, ref, dtype)


# gpt-oss: a sliding window (narrower than the cache, so whole key blocks and splits fall
# before it) and sinks, with every capture reduction and both scores; decode, verify and
# a prefill of many query blocks.
WINDOW_CASES = [  # (b, kh, g, s, t, base, window, capture, rows, score, dtype)
    (2, 2, 4, 97, 1, (40, 90), 20, "none", (0,), "weight", jnp.float32),
    (2, 2, 4, 131, 4, (3, 120), 24, "mean", (0, 3), "weight", jnp.float32),
    (3, 1, 8, 77, 7, (0, 33, 70), 9, "rows", (0, 6), "weight", jnp.float32),
    (2, 2, 4, 90, 4, (5, 80), 30, "mean", (0, 3, 3), "logit", jnp.float32),
    (2, 3, 3, 120, 5, (30, 100), 17, "mean", (0, 4), "weight", jnp.bfloat16),
    (2, 2, 4, 200, 4, (150, 17), 0, "rows", (0, 3), "logit", jnp.float32),  # 0: a full layer
    (2, 2, 4, 90, 37, (0, 50), 12, "mean", (36, 0), "weight", jnp.float32),  # prefill
]


@pytest.mark.parametrize("case", _fast_first(WINDOW_CASES, (2, 3, 6), "w"))
def test_window_and_sinks_match_reference(case):
    b, kh, g, s, t, base, window, capture, rows, score, dtype = case
    q, kc, vc, q_pos = _inputs(s + t, 2, b, kh, g, 64, s, t, dtype, base)
    sinks = 2.0 * rand.normal(jax.random.PRNGKey(t), (kh, g), jnp.float32)
    kw = dict(capture=_spec(capture, rows, score), sinks=sinks, window=jnp.int32(window))
    blocks = VerifyBlocks(block_k=16, min_split=32, target_programs=4 * b * kh, max_rows=16,
                          row_block=32)
    layer = jnp.int32(1)
    out = compiled.call(verify_attention, q, kc, vc, layer, q_pos, interpret=True,
                        blocks=blocks, **kw)
    ref = compiled.call(verify_attention_reference, q, kc, vc, layer, q_pos, **kw)
    _check(out, ref, dtype)
    # the sinks and the window are both felt: without them the output differs
    plain = compiled.call(verify_attention_reference, q, kc, vc, layer, q_pos,
                          capture=_spec(capture, rows, score))
    assert np.abs(np.asarray(plain[0], np.float32) - np.asarray(ref[0], np.float32)).max() > 0.05


@pytest.mark.parametrize("capture,score", [pytest.param("none", "weight", marks=pytest.mark.slow),
                                           ("mean", "weight"),
                                           pytest.param("rows", "logit", marks=pytest.mark.slow)])
def test_prefill_query_blocks(capture, score):
    """t * g > max_rows: many query blocks, causal block skipping, single split."""
    L, b, kh, g, d, s, t = 1, 2, 2, 4, 64, 90, 37
    q, kc, vc, q_pos = _inputs(3, L, b, kh, g, d, s, t, jnp.float32, (0, 50))
    kw = dict(capture=_spec(capture, (t - 1, 0), score))
    blocks = VerifyBlocks(max_rows=16, row_block=32, block_k=16)
    out = compiled.call(verify_attention, q, kc, vc, jnp.int32(0), q_pos, interpret=True,
                        blocks=blocks, **kw)
    ref = compiled.call(verify_attention_reference, q, kc, vc, jnp.int32(0), q_pos, **kw)
    _check(out, ref, jnp.float32)


@pytest.mark.parametrize("capture,score", [("rows", "weight"), ("mean", "weight"),
                                           pytest.param("rows", "logit", marks=pytest.mark.slow)])
def test_capture_rows_span_query_blocks(capture, score):
    """More capture rows than a query block holds (`last` at gamma 12 under the 32-row
    invariant plan: 13 tokens x group 3 in blocks of 10 tokens), several key splits."""
    from pallas_kernels.verify_attention import INVARIANT

    L, b, kh, g, d, s, t = 1, 2, 2, 3, 64, 200, 13
    q, kc, vc, q_pos = _inputs(4, L, b, kh, g, d, s, t, jnp.float32, (60, 170))
    kw = dict(capture=_spec(capture, tuple(range(t)), score))
    blocks = dataclasses.replace(INVARIANT, block_k=16, split_keys=64)
    out = compiled.call(verify_attention, q, kc, vc, jnp.int32(0), q_pos, interpret=True,
                        blocks=blocks, **kw)
    ref = compiled.call(verify_attention_reference, q, kc, vc, jnp.int32(0), q_pos, **kw)
    _check(out, ref, jnp.float32)


@pytest.mark.slow
def test_layer_traced_in_scan():
    """`layer` is a traced scalar inside a lax.scan over layers (as in the model)."""
    L, b, kh, g, d, s, t = 3, 2, 2, 4, 64, 50, 3
    q, kc, vc, q_pos = _inputs(5, L, b, kh, g, d, s, t, jnp.float32, (20, 46))

    def run(fn):
        def body(c, li):
            o, sc = fn(q, kc, vc, li, q_pos, capture=CaptureSpec((0, t - 1)))
            return c, (o, sc)
        return jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(L, dtype=jnp.int32))[1])()

    o1, s1 = run(functools.partial(verify_attention, interpret=True,
                                   blocks=VerifyBlocks(block_k=16)))
    o2, s2 = run(verify_attention_reference)
    _check((o1, s1), (o2, s2), jnp.float32)


@pytest.mark.parametrize("mode", ["main", "sum"])
def test_every_output_written(mode):
    """Interpret mode fills pallas outputs with NaN first: every element the combine and
    the capture's reduction read must have been overwritten by the kernel."""
    L, b, kh, g, d, s, t = 1, 2, 2, 4, 64, 70, 3
    q, kc, vc, q_pos = _inputs(7, L, b, kh, g, d, s, t, jnp.float32, (60, 30))
    rows, nu, crow = 16, 2, 16
    n_cap = nu * g
    qr = jnp.pad(q.transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, d),
                 ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))  # [b, k, rows, d]
    rp = jnp.pad(jnp.repeat(q_pos, g, axis=1), ((0, 0), (0, rows - t * g)), constant_values=-1)
    from pallas_kernels.verify_attention import (
        StoreLogits, SumLogits, _KernelConfig, _Operands, _verify_call)

    qc = rpc = None
    if mode == "main":
        cap = StoreLogits(n_cap, spare=rows)
    else:
        qc = jnp.pad(qr[:, :, :n_cap], ((0, 0), (0, 0), (0, crow - n_cap), (0, 0)))
        rpc = jnp.pad(rp[:, :n_cap], ((0, 0), (0, crow - n_cap)), constant_values=-1)
        cap = SumLogits(n_cap, crow, (tuple([0.5] * n_cap + [0.0] * (crow - n_cap)),))
    cfg = _KernelConfig(block_k=16, split_len=32, n_splits=3, s_len=s, rows=rows,
                        real_rows=t * g, kh=kh, normalize=False, capture=cap)
    ops = _Operands(layer=jnp.zeros((1,), jnp.int32), window=None, q=qr, rowpos=rp,
                    k_cache=kc, v_cache=vc, qc=qc, rpc=rpc)
    o, m, l, buf = _verify_call(ops, cfg, VerifyBlocks(block_k=16, num_warps=4, num_stages=2),
                                interpret=True)
    for x in (o, m, l):
        assert np.isfinite(np.asarray(x)).all()
    buf = np.asarray(buf, np.float32)
    if mode == "main":
        buf = buf[: b * kh * n_cap].reshape(b, kh, nu, g, -1)
        for bi in range(b):
            for u in range(nu):  # capture tokens = the first nu tokens here
                assert np.isfinite(buf[bi, :, u, :, : int(q_pos[bi, u]) + 1]).all()
    else:
        buf = buf.reshape(b, kh, -1)
        for bi in range(b):
            assert np.isfinite(buf[bi, :, : int(q_pos[bi, :nu].max()) + 1]).all()


@pytest.mark.parametrize("t,capture", [(1, "none"), (7, "mean"), (9, "rows"), (300, "mean")])
def test_lowers_for_cuda(t, capture):
    L, b, kh, g, d, s = 2, 2, 8, 4, 128, 4096
    sd = jax.ShapeDtypeStruct
    txt = lower_cuda(
        functools.partial(verify_attention, capture=_spec(capture, (0, t - 1))),
        sd((b, t, kh, g, d), jnp.bfloat16), sd((L, b, kh, s, d), jnp.bfloat16),
        sd((L, b, kh, s, d), jnp.bfloat16), sd((), jnp.int32), sd((b, t), jnp.int32))
    assert "xla.gpu.triton" in txt


@pytest.mark.parametrize("t,capture,score", [(1, "none", "weight"), (7, "mean", "weight"),
                                             (7, "rows", "logit"), (300, "mean", "weight")])
def test_window_and_sinks_lower_for_cuda(t, capture, score):
    """gpt-oss's window (a traced scalar) and sinks through the Triton lowering."""
    L, b, kh, g, d, s = 2, 2, 8, 8, 64, 4096
    sd = jax.ShapeDtypeStruct
    txt = lower_cuda(
        lambda q, kc, vc, layer, pos, w, sk: verify_attention(
            q, kc, vc, layer, pos, capture=_spec(capture, (0, t - 1), score), window=w,
            sinks=sk),
        sd((b, t, kh, g, d), jnp.bfloat16), sd((L, b, kh, s, d), jnp.bfloat16),
        sd((L, b, kh, s, d), jnp.bfloat16), sd((), jnp.int32), sd((b, t), jnp.int32),
        sd((), jnp.int32), sd((kh, g), jnp.float32))
    assert "xla.gpu.triton" in txt


def test_wave_splits_fill_the_last_wave():
    """SmolLM2 B 64 verify on an H200: 192 programs a split, 264 resident. Three splits
    (576 programs) leave the third wave 18 % full; four (768) fill three waves."""
    from pallas_kernels.common import wave_splits

    assert wave_splits(192, 7936, 128, 3, 16, 264) == 4
    assert wave_splits(384, 7936, 128, 2, 16, 264) == 2  # 768 already fills its waves
    assert wave_splits(192, 7936, 128, 3, 3, 264) == 3  # never past j_max
    assert 17 <= wave_splits(32, 32896, 128, 17, 64, 132) <= 26  # at most 1.5x the target


@pytest.mark.parametrize("capture,rows,windowed", [("mean", (0, 3), False),
                                                   ("rows", (0, 3, 3), True)])
def test_capture_scores_kernel_matches_reference(capture, rows, windowed):
    """The capture's reduction kernel (interpret mode) against its jnp reference: stale
    logits past each row's position (and before its window) and garbage in unwritten
    rows must not leak in."""
    from pallas_kernels.verify_attention import (
        CaptureBlocks, _capture_weights, _CaptureRows, capture_scores, capture_scores_reference)

    b, kh, g, s = 3, 2, 3, 300
    crows = _CaptureRows.of(CaptureSpec(rows, capture), 1000)
    uniq = crows.uniq
    n_cap = len(uniq) * g
    r = kh * n_cap
    ks = jax.random.split(jax.random.PRNGKey(4), 3)
    cbuf = (4 * rand.normal(ks[0], (b * r + 8, 384))).astype(jnp.float16)
    cbuf = cbuf.at[-8:].set(jnp.inf)  # spare rows: never read
    lse = 3.0 + rand.normal(ks[1], (b, r))
    pos = jnp.array([[250, 253], [10, 13], [-1, -1]])[:, :len(uniq)]  # last: finished
    rowpos = jnp.tile(jnp.repeat(pos, g, axis=1), (1, kh))
    rowlo = (rowpos - 100) if windowed else None
    w = _capture_weights(crows, capture, kh, g)
    ref = compiled.call(capture_scores_reference, cbuf, lse, rowpos, w, s, rowlo)
    blocks = CaptureBlocks(block_s=128)  # 3 programs a sequence, the last one ragged
    got = compiled.call(capture_scores, cbuf, lse, rowpos, w, s, rowlo, blocks=blocks,
                        interpret=True)
    assert got.shape == ref.shape == (b, w.shape[0], s)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)
    if windowed:  # keys before the window
        assert np.abs(np.asarray(ref[0, :, :150])).max() == 0
    assert np.abs(np.asarray(ref[1, :, 14:])).max() == 0  # past the rows' positions
    assert np.abs(np.asarray(ref[2])).max() == 0
    assert np.abs(np.asarray(ref[0])).max() > 0


def test_capture_into_a_stacked_buffer():
    """capture_into: every layer's capture logits go into one buffer (aliased through the
    calls), and the offsets turn them into the very scores capture="mean" returns, over
    the ranked range (keys up to capture row 0's position); the output is unchanged."""
    from pallas_kernels.capture_select import _scores_reference
    from pallas_kernels.verify_attention import capture_buffer

    L, b, kh, g, d, s, gamma = 3, 2, 2, 4, 64, 150, 4
    q, kc, vc, q_pos = _inputs(5, L, b, kh, g, d, s, gamma + 1, jnp.float32, (100, 37))
    blocks = VerifyBlocks(block_k=16, min_split=32, target_programs=4 * b * kh)
    kw = dict(capture=CaptureSpec((0, gamma)), interpret=True, blocks=blocks)
    buf = capture_buffer(L, b, kh, 2 * g, s)
    assert np.isnan(np.asarray(buf, np.float32)).all()  # off the GPU: NaN until written
    offsets = []
    for layer in range(L):
        ql = q * (1.0 + 0.1 * layer)  # layers differ
        out, (buf, off) = compiled.call(verify_attention, ql, kc, vc, jnp.int32(layer), q_pos,
                                           capture_into=buf, **kw)
        ref_out, ref_sc = compiled.call(verify_attention, ql, kc, vc, jnp.int32(layer), q_pos, **kw)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
        offsets.append(off)
    offsets = jnp.stack(offsets)  # [L, b, kh * 2g]
    score = compiled.call(_scores_reference, buf, offsets, q_pos[:, 0], s, None, 0.0)  # [L, b, s]
    for layer in range(L):
        ql = q * (1.0 + 0.1 * layer)
        _, ref_sc = compiled.call(verify_attention, ql, kc, vc, jnp.int32(layer), q_pos, **kw)
        ranked = np.arange(s)[None, :] <= np.asarray(q_pos[:, :1])
        want = np.where(ranked, np.asarray(ref_sc), -np.inf)
        np.testing.assert_allclose(np.asarray(score[layer]), want, rtol=1e-5, atol=1e-7)


def test_capture_into_refuses_what_it_cannot_hold():
    from pallas_kernels.verify_attention import capture_buffer

    q, kc, vc, q_pos = _inputs(5, 1, 1, 2, 4, 64, 64, 3, jnp.float32, (40,))
    buf = capture_buffer(1, 1, 2, 8, 64)
    for kw in (dict(capture=CaptureSpec((0, 2), "rows")),
               dict(capture=CaptureSpec((0, 2), "mean", "logit")),
               dict(capture=CaptureSpec((0, 2)), window=jnp.int32(8)), dict(capture=None)):
        with pytest.raises(ValueError, match="capture_into"):
            verify_attention(q, kc, vc, jnp.int32(0), q_pos, capture_into=buf, interpret=True,
                             **kw)


def test_capture_spec_refuses_unknown_names():
    with pytest.raises(ValueError, match="reduce"):
        CaptureSpec((0,), "sum")
    with pytest.raises(ValueError, match="score"):
        CaptureSpec((0,), "mean", "prob")


@pytest.mark.parametrize("capture,windowed,unmasked", [
    (None, False, False), (CaptureSpec((0, 299)), False, True), (None, True, False)])
def test_invariant_prefill_lowers_for_cuda(capture, windowed, unmasked):
    """The prompt steps' exact plan (one split finished in the kernel; unmasked: two key
    loops with traced bounds) through the Triton lowering."""
    from pallas_kernels.verify_attention import INVARIANT_PREFILL

    blocks = dataclasses.replace(INVARIANT_PREFILL, unmasked=unmasked)

    L, b, kh, g, d, s, t = 2, 2, 8, 4, 128, 4096, 300
    sd = jax.ShapeDtypeStruct
    extra = (sd((), jnp.int32), sd((kh, g), jnp.float32)) if windowed else ()
    txt = lower_cuda(
        lambda q, kc, vc, layer, pos, *wk: verify_attention(
            q, kc, vc, layer, pos, capture=capture, blocks=blocks,
            **(dict(window=wk[0], sinks=wk[1]) if wk else {})),
        sd((b, t, kh, g, d), jnp.bfloat16), sd((L, b, kh, s, d), jnp.bfloat16),
        sd((L, b, kh, s, d), jnp.bfloat16), sd((), jnp.int32), sd((b, t), jnp.int32), *extra)
    assert "xla.gpu.triton" in txt

"""The fused selection from captured logits (interpret mode) against its XLA reference,
and its CUDA lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.capture_select import (
    _scores_reference, select_from_capture, select_from_capture_reference,
)
from tests.cuda import lower_cuda
from tests import compiled, rand


def _inputs(L, b, r, s, spare=16, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    cbuf = (3.0 * rand.normal(ks[0], (L * b * r + spare, s))).astype(jnp.float16)
    offset = 4.0 + rand.normal(ks[1], (L, b, r))
    end = jnp.asarray([s - 1, s // 3, 40, -1][:b], jnp.int32)  # ragged; the last finished
    old = jnp.where(jnp.arange(s)[None, None, :] <= end[None, :, None],
                    rand.uniform(ks[2], (L, b, s)) * 0.2, -jnp.inf)
    return cbuf, offset, end, old


def _check(idx, score, want):
    """Each row's first want[b] slots hold distinct positions whose scores are the
    row's want[b] largest (exact up to ties), the slots after them position 0."""
    idx, score = np.asarray(idx), np.asarray(score)
    L, b, kmax = idx.shape
    for l in range(L):
        for bi in range(b):
            w = int(want[bi])
            got = idx[l, bi, :w]
            assert len(set(got.tolist())) == w
            np.testing.assert_array_equal(np.sort(score[l, bi, got]),
                                          np.sort(score[l, bi])[::-1][:w][::-1])
            assert (idx[l, bi, w:] == 0).all()
            assert (np.diff(got) > 0).all()  # in position order


@pytest.mark.parametrize("L,b,r,s,decay", [pytest.param(2, 4, 6, 700, 0.5, marks=pytest.mark.slow),
                                           pytest.param(3, 4, 18, 1024, 0.0,
                                                        marks=pytest.mark.slow),
                                           (1, 2, 8, 300, 0.5),  # with the carry
                                           (1, 4, 6, 256, 0.0)])  # without; one finished
def test_kernel_matches_reference(L, b, r, s, decay):
    cbuf, offset, end, old = _inputs(L, b, r, s)
    want = jnp.clip(jnp.asarray([37, 60, 41, 5][:b], jnp.int32), 1, jnp.maximum(end + 1, 1))
    kmax = 64
    o = old if decay else None
    idx, acc = compiled.call(select_from_capture, cbuf, offset, end, want, kmax, s, o, decay,
                             interpret=True)
    ridx, racc = compiled.call(select_from_capture_reference, cbuf, offset, end, want, kmax,
                               s, o, decay)
    score = compiled.call(_scores_reference, cbuf, offset, end, s, o, decay)
    _check(idx, score, np.asarray(want))
    _check(ridx, score, np.asarray(want))
    if decay:
        np.testing.assert_allclose(np.asarray(acc), np.asarray(racc), rtol=1e-5)
        for bi in range(b):  # -inf past each ranked range; everywhere for the finished one
            assert np.isneginf(np.asarray(acc)[:, bi, int(end[bi]) + 1:]).all()
            assert np.isfinite(np.asarray(acc)[:, bi, :int(end[bi]) + 1]).all()
    else:
        assert acc is None


def test_the_scores_are_weighted_softmax_weights():
    """offset = LSE - log2(w) makes each row's exp2(logit - offset) its softmax weight times
    w: a row whose weights sum to one adds w in total (a wrong sign or a natural-log
    exponent would not)."""
    L, b, r, s = 1, 1, 2, 128
    logits = rand.normal(jax.random.PRNGKey(3), (r, s)) * 2.0
    lse = jax.nn.logsumexp(logits * np.log(2.0), axis=-1) / np.log(2.0)  # log2 units
    w = jnp.asarray([0.25, 0.75])
    offset = (lse - jnp.log2(w)).reshape(L, b, r)
    cbuf = jnp.pad(logits, ((0, 4), (0, 0))).astype(jnp.float32)
    score = _scores_reference(cbuf, offset, jnp.asarray([s - 1]), s, None, 0.0)
    np.testing.assert_allclose(float(score.sum()), 1.0, rtol=1e-5)


def test_select_from_capture_lowers_for_cuda():
    L, b, r, s = 30, 4, 18, 7936
    text = lower_cuda(
        lambda c, o, e, w, old: select_from_capture(c, o, e, w, 556, s, old, 0.5),
        jax.ShapeDtypeStruct((L * b * r + 64, s), jnp.float16),
        jax.ShapeDtypeStruct((L, b, r), jnp.float32),
        jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((L, b, s), jnp.float32))
    assert "vegas_select_from_capture" in text

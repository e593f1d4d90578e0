"""The top-k select: XLA's count passes and the fused Pallas kernel (interpret mode)
against `lax.top_k`, plus the kernel's CUDA lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topk import kth_largest_key, select_topk_fast, sortable_keys
from tests import compiled, rand


def _check_topk(x, idx, k):
    """idx holds k distinct positions whose values are the k largest (multiset equality
    with lax.top_k's values: exact up to ties)."""
    x = np.asarray(x).reshape(-1, x.shape[-1])
    idx = np.asarray(idx).reshape(-1, k)
    ref = np.asarray(jax.lax.top_k(jnp.asarray(x), k)[0])
    for r in range(x.shape[0]):
        assert len(set(idx[r].tolist())) == k
        assert ((0 <= idx[r]) & (idx[r] < x.shape[1])).all()
        np.testing.assert_array_equal(np.sort(x[r, idx[r]]), np.sort(ref[r]))


def test_sortable_keys_order():
    v = jnp.array([-jnp.inf, -3.0, -1e-30, -0.0, 0.0, 1e-30, 2.0, jnp.inf], jnp.float32)
    k = np.asarray(sortable_keys(v)).astype(np.int64)
    assert (np.diff(k) > 0).all()


@pytest.mark.parametrize("radix_bits", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_select_topk_fast_random(radix_bits):
    x = rand.normal(jax.random.PRNGKey(1), (3, 2, 700))  # [L, b, s], one call
    k = 49
    idx = jax.jit(lambda x: select_topk_fast(x, k, radix_bits=radix_bits))(x)
    assert idx.shape == (3, 2, k) and idx.dtype == jnp.int32
    _check_topk(x, idx, k)
    # distinct values: the index set equals lax.top_k's exactly
    ri = np.asarray(jax.lax.top_k(x, k)[1])
    for a, b in zip(np.asarray(idx).reshape(-1, k), ri.reshape(-1, k)):
        assert set(a.tolist()) == set(b.tolist())


def test_kth_largest_key_is_the_sorted_rows_kth():
    """The XLA count passes against a sort, with -inf, ties and -0.0 in the rows and a k
    per row."""
    x = rand.normal(jax.random.PRNGKey(5), (4, 300))
    x = x.at[0, :20].set(-jnp.inf).at[1, 10:20].set(x[1, 5]).at[2, 3].set(-0.0)
    k = jnp.array([[1], [15], [300], [7]])
    got = jax.jit(lambda x, k: kth_largest_key(sortable_keys(x), k))(x, k)
    want = np.sort(np.asarray(sortable_keys(x)), axis=1)[:, ::-1]
    want = want[np.arange(4), np.asarray(k[:, 0]) - 1]
    np.testing.assert_array_equal(np.asarray(got), want)


def _masked_ties(s):
    """[6, s] scores with heavy ties, -inf (masked) tails leaving rows of s, 200, 25, 0 and
    1 finite entries, a -0.0, and a last row all equal (zeros)."""
    x = jnp.round(rand.uniform(jax.random.PRNGKey(2), (6, s)) * 8) / 8  # ties
    ranked = jnp.array([s, 200, 25, 0, 1, s])  # row r keeps positions < ranked[r]
    x = jnp.where(jnp.arange(s)[None, :] < ranked[:, None], x, -jnp.inf)
    return x.at[4, 7].set(-0.0).at[5].set(0.0)


@pytest.mark.parametrize("k", [40, pytest.param(1, marks=pytest.mark.slow),
                               pytest.param(333, marks=pytest.mark.slow)])
def test_select_topk_fast_masked_ties_and_short_rows(k):
    """-inf (masked) positions, rows with fewer finite entries than k, heavy ties, k = s
    and k = 1, a length that is no multiple of the 128-block."""
    x = _masked_ties(333)
    idx = jax.jit(lambda x: select_topk_fast(x, k))(x)
    _check_topk(x, idx, k)
    if k >= 25:  # all finite entries of a short row
        assert set(range(25)) <= set(np.asarray(idx)[2].tolist())
    # all equal: the first k positions
    assert sorted(np.asarray(idx)[5].tolist()) == list(range(k))


def test_select_topk_fast_lowers_for_cuda():
    sd = jax.ShapeDtypeStruct
    jax.jit(lambda x: select_topk_fast(x, 574)).trace(sd((3, 4, 8192), jnp.float32)).lower(
        lowering_platforms=("cuda",))


def test_select_topk_fast_counts_per_row():
    """counts[r] < k: row r's first counts[r] slots are its counts[r] largest, by position,
    and the slots after them hold position 0."""
    x = rand.normal(jax.random.PRNGKey(3), (2, 3, 500))
    counts = jnp.array([[60, 1, 33], [64, 17, 64]])
    idx = np.asarray(jax.jit(lambda x, c: select_topk_fast(x, 64, counts=c))(x, counts))
    for r in range(2):
        for c in range(3):
            n = int(counts[r, c])
            got = idx[r, c, :n]
            assert (np.diff(got) > 0).all()  # position order
            want = np.asarray(jax.lax.top_k(x[r, c], n)[1])
            assert set(got.tolist()) == set(want.tolist())
            assert (idx[r, c, n:] == 0).all()


def test_long_rows_take_the_xla_threshold():
    """Rows longer than one register-resident chunk take XLA's passes even when the fused
    kernel is asked for (on the CPU a Pallas call without interpret mode would raise)."""
    from pallas_kernels.topk import PALLAS_MAX_KEYS

    x = rand.normal(jax.random.PRNGKey(3), (1, PALLAS_MAX_KEYS + 5))
    _check_topk(x, jax.jit(lambda x: select_topk_fast(x, 40, threshold="fused"))(x), 40)
    with pytest.raises(ValueError, match="interpret"):
        select_topk_fast(x[:, :100], 40, threshold="fused")


@pytest.mark.parametrize("r,s,kk", [(5, 700, 60), pytest.param(9, 300, 17, marks=pytest.mark.slow),
                                    pytest.param(3, 33, 33, marks=pytest.mark.slow)])
def test_fused_select_kernel_matches_the_xla_compaction(r, s, kk):
    """Threshold and compaction in one kernel (interpret mode): the same index lists as
    the XLA compaction, per-row counts, -inf, ties and -0.0 included, zeros after each
    row's count."""
    x = rand.normal(jax.random.PRNGKey(s), (r, s))
    x = x.at[0, :20].set(-jnp.inf).at[1, 10:40].set(x[1, 5]).at[2, 3].set(-0.0)
    counts = (jnp.arange(r) * 7) % kk + 1
    got = compiled.call(select_topk_fast, x, kk, counts=counts, threshold="fused",
                        interpret=True)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(compiled.call(select_topk_fast, x, kk,
                                                           counts=counts)))


def test_fused_select_kernel_lowers_for_cuda():
    from tests.cuda import lower_cuda

    sd = jax.ShapeDtypeStruct
    text = lower_cuda(lambda x, c: select_topk_fast(x, 556, counts=c, threshold="fused"),
                      sd((30, 64, 7936), jnp.float32), sd((30, 64), jnp.int32))
    assert "vegas_select" in text

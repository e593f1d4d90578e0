import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topk import blockwise_topk
from tests import rand


@pytest.mark.parametrize("b,s,k,block", [(2, 5000, 350, 512), (3, 4096, 287, 1024),
                                         (1, 777, 60, 128)])
def test_blockwise_topk_exact(b, s, k, block):
    x = rand.normal(jax.random.PRNGKey(s), (b, s))
    v, i = blockwise_topk(x, k, block=block)
    rv, ri = jax.lax.top_k(x, k)
    for r in range(b):
        assert set(np.asarray(i[r]).tolist()) == set(np.asarray(ri[r]).tolist())
    np.testing.assert_array_equal(np.sort(np.asarray(v), 1), np.sort(np.asarray(rv), 1))


def test_blockwise_topk_fallback():
    """All winners crowd one block: the check must fall back to the exact top-k."""
    x = rand.uniform(jax.random.PRNGKey(0), (2, 4096))
    x = x.at[:, :300].add(10.0)
    _, i = blockwise_topk(x, 280, block=512)
    assert set(np.asarray(i[0]).tolist()) == set(np.asarray(jax.lax.top_k(x, 280)[1][0]).tolist())


from pallas_kernels.topk import select_topk_fast, sortable_keys  # noqa: E402


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


@pytest.mark.parametrize("how,radix_bits", [("sep", 2), ("sep", 4), ("minor", 4),
                                            ("major", 8)])
def test_select_topk_fast_random(how, radix_bits):
    x = rand.normal(jax.random.PRNGKey(1), (3, 2, 700))  # [L, b, s], one call
    k = 49
    idx = select_topk_fast(x, k, radix_bits=radix_bits, count_impl=how)
    assert idx.shape == (3, 2, k) and idx.dtype == jnp.int32
    _check_topk(x, idx, k)
    # distinct values: the index set equals lax.top_k's exactly
    ri = np.asarray(jax.lax.top_k(x, k)[1])
    for a, b in zip(np.asarray(idx).reshape(-1, k), ri.reshape(-1, k)):
        assert set(a.tolist()) == set(b.tolist())


def test_select_topk_fast_masked_ties_and_short_rows():
    """-inf (masked) positions, rows with fewer finite entries than k, heavy ties, k = s
    and k = 1, a length that is no multiple of the 128-block."""
    s, k = 333, 40
    x = jnp.round(rand.uniform(jax.random.PRNGKey(2), (5, s)) * 8) / 8  # ties
    ranked = jnp.array([s, 200, 25, 0, 1])  # row r keeps positions < ranked[r]
    x = jnp.where(jnp.arange(s)[None, :] < ranked[:, None], x, -jnp.inf)
    x = x.at[4, 7].set(-0.0)
    idx = jax.jit(lambda x: select_topk_fast(x, k))(x)
    _check_topk(x, idx, k)
    got = np.asarray(idx)
    assert set(range(25)) <= set(got[2].tolist())  # all finite entries of a short row
    for kk in (1, s):
        _check_topk(x, select_topk_fast(x, kk), kk)
    # all equal: the first k positions
    z = jnp.zeros((2, 300))
    assert sorted(np.asarray(select_topk_fast(z, 17))[0].tolist()) == list(range(17))


def test_select_topk_fast_lowers_for_cuda():
    sd = jax.ShapeDtypeStruct
    jax.jit(lambda x: select_topk_fast(x, 574)).trace(sd((3, 4, 8192), jnp.float32)).lower(
        lowering_platforms=("cuda",))


def test_select_topk_fast_counts_per_row():
    """counts[r] < k: row r's first counts[r] slots are its counts[r] largest, by position,
    and the slots after them hold position 0."""
    x = rand.normal(jax.random.PRNGKey(3), (2, 3, 500))
    counts = jnp.array([[60, 1, 33], [64, 17, 64]])
    idx = np.asarray(select_topk_fast(x, 64, counts=counts))
    for r in range(2):
        for c in range(3):
            n = int(counts[r, c])
            got = idx[r, c, :n]
            assert (np.diff(got) > 0).all()  # position order
            want = np.asarray(jax.lax.top_k(x[r, c], n)[1])
            assert set(got.tolist()) == set(want.tolist())
            assert (idx[r, c, n:] == 0).all()


@pytest.mark.parametrize("r,s,tile", [(5, 700, 8192), (3, 3000, 1024), (6, 33, 64)])
def test_kth_largest_key_kernel_matches_the_count_passes(r, s, tile):
    """The Pallas threshold (interpret mode; one resident chunk, and rows re-read in
    chunks) equals the XLA count passes, with -inf, ties and -0.0 in the rows; through
    select_topk_fast the index sets are identical."""
    from pallas_kernels.topk import kth_largest_key, kth_largest_key_pallas

    x = rand.normal(jax.random.PRNGKey(r), (r, s))
    x = x.at[0, :20].set(-jnp.inf).at[1, 10:20].set(x[1, 5]).at[2, 3].set(-0.0)
    k = jnp.array([1, s, 7, 12, 2, 3])[:r] % s + 1
    got = kth_largest_key_pallas(x, k, tile=tile, interpret=True)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(kth_largest_key(sortable_keys(x), k[:, None])))
    kk = min(9, s)
    np.testing.assert_array_equal(
        np.asarray(select_topk_fast(x, kk, counts=jnp.minimum(k, kk), threshold="pallas",
                                    interpret=True)),
        np.asarray(select_topk_fast(x, kk, counts=jnp.minimum(k, kk))))


def test_long_rows_keep_the_xla_threshold():
    """Rows longer than one register-resident chunk take XLA's passes even when the
    kernel is asked for (on the CPU a Pallas call without interpret mode would raise)."""
    from pallas_kernels.topk import PALLAS_MAX_KEYS

    x = rand.normal(jax.random.PRNGKey(3), (2, PALLAS_MAX_KEYS + 5))
    _check_topk(x, select_topk_fast(x, 40, threshold="pallas"), 40)
    with pytest.raises(ValueError, match="interpret"):
        select_topk_fast(x[:, :100], 40, threshold="pallas")


@pytest.mark.parametrize("r,s,kk", [(5, 700, 60), (9, 300, 17), (3, 33, 33)])
def test_fused_select_kernel_matches_the_xla_compaction(r, s, kk):
    """Threshold and compaction in one kernel (interpret mode): the same index lists as
    the XLA compaction, per-row counts, -inf, ties and -0.0 included, zeros after each
    row's count."""
    x = rand.normal(jax.random.PRNGKey(s), (r, s))
    x = x.at[0, :20].set(-jnp.inf).at[1, 10:40].set(x[1, 5]).at[2, 3].set(-0.0)
    counts = (jnp.arange(r) * 7) % kk + 1
    got = select_topk_fast(x, kk, counts=counts, threshold="fused", interpret=True)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(select_topk_fast(x, kk, counts=counts)))


def test_fused_select_kernel_lowers_for_cuda():
    from tests.cuda import lower_cuda

    sd = jax.ShapeDtypeStruct
    text = lower_cuda(lambda x, c: select_topk_fast(x, 556, counts=c, threshold="fused"),
                      sd((30, 64, 7936), jnp.float32), sd((30, 64), jnp.int32))
    assert "vegas_select" in text

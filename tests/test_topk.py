import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topk import blockwise_topk


@pytest.mark.parametrize("b,s,k,block", [(2, 5000, 350, 512), (3, 4096, 287, 1024),
                                         (1, 777, 60, 128)])
def test_blockwise_topk_exact(b, s, k, block):
    x = jax.random.normal(jax.random.PRNGKey(s), (b, s))
    v, i = blockwise_topk(x, k, block=block)
    rv, ri = jax.lax.top_k(x, k)
    for r in range(b):
        assert set(np.asarray(i[r]).tolist()) == set(np.asarray(ri[r]).tolist())
    np.testing.assert_array_equal(np.sort(np.asarray(v), 1), np.sort(np.asarray(rv), 1))


def test_blockwise_topk_fallback():
    """All winners crowd one block: the check must fall back to the exact top-k."""
    x = jax.random.uniform(jax.random.PRNGKey(0), (2, 4096))
    x = x.at[:, :300].add(10.0)
    _, i = blockwise_topk(x, 280, block=512)
    assert set(np.asarray(i[0]).tolist()) == set(np.asarray(jax.lax.top_k(x, 280)[1][0]).tolist())

"""tests/rand.py draws exactly what jax.random draws, for the shapes and dtypes the tests
use (N-d, sizes off the power-of-two buckets, bf16, bounds, a scalar)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import rand

KEY = jax.random.PRNGKey(11)


@pytest.mark.parametrize("name,args,kw", [
    ("normal", ((2, 3, 5),), {}),
    ("normal", ((3, 7),), dict(dtype=jnp.bfloat16)),
    ("uniform", ((2, 9),), dict(minval=0.5, maxval=8.0)),
    ("randint", ((4, 5), 3, 40), {}),
    ("bernoulli", (0.3, (2, 3, 4)), {}),
    ("normal", ((),), {}),
])
def test_draws_equal_jax_random(name, args, kw):
    want = getattr(jax.random, name)(KEY, *args, **kw)
    got = getattr(rand, name)(KEY, *args, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bounds_are_not_baked_in():
    """The bounds travel as arguments (one compile serves them all): other bounds, other
    values, each equal to jax.random's."""
    for lo, hi in ((0, 150), (75, 300)):
        np.testing.assert_array_equal(np.asarray(rand.randint(KEY, (3, 11), lo, hi)),
                                      np.asarray(jax.random.randint(KEY, (3, 11), lo, hi)))
        np.testing.assert_array_equal(
            np.asarray(rand.uniform(KEY, (3, 11), minval=lo / 7, maxval=hi / 7)),
            np.asarray(jax.random.uniform(KEY, (3, 11), minval=lo / 7, maxval=hi / 7)))

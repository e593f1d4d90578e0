"""jax.random draws for test inputs, bit for bit those of `jax.random.<name>(key, shape,
...)`, in a fraction of the compile time.

XLA:CPU compiles a draw over an N-d shape slowly (jax.random.normal over [2, 2, 2, 97, 64]:
~2.5 s on the 2-core CI machine; a flat draw of as many values: ~0.4 s), and every new
shape compiles again: the kernel tests spent more time compiling their random inputs than
their kernels. With partitionable threefry (JAX's default) the value at each element is a
function of the key and the element's flat index only, so a flat draw of the next power of
two holds the draw of `shape` as its first prod(shape) values: one compile per size
bucket serves every shape in it. Where that does not hold (partitionable threefry off, or a
traced key), these call jax.random directly.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


def _flat_ok(key) -> bool:
    return bool(jax.config.jax_threefry_partitionable) and not isinstance(key, jax.core.Tracer)


def _bucket(n: int) -> int:
    return max(1 << max(n - 1, 0).bit_length(), 64)


def _take(flat, shape):
    n = math.prod(shape)
    return jnp.asarray(np.asarray(flat)[:n].reshape(shape))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, n, dtype):
    return jax.random.normal(key, (n,), dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _uniform(key, n, dtype, minval, maxval):  # the bounds traced: one compile for all
    return jax.random.uniform(key, (n,), dtype, minval, maxval)


@functools.partial(jax.jit, static_argnums=(1, 4))
def _randint(key, n, minval, maxval, dtype):
    return jax.random.randint(key, (n,), minval, maxval, dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _bernoulli(key, p, n):
    return jax.random.bernoulli(key, p, (n,))


def normal(key, shape, dtype=jnp.float32):
    shape = tuple(shape)
    if not _flat_ok(key):
        return jax.random.normal(key, shape, dtype)
    return _take(_normal(key, _bucket(math.prod(shape)), jnp.dtype(dtype)), shape)


def uniform(key, shape=(), dtype=jnp.float32, minval=0.0, maxval=1.0):
    shape = tuple(shape)
    if not _flat_ok(key):
        return jax.random.uniform(key, shape, dtype, minval, maxval)
    return _take(_uniform(key, _bucket(math.prod(shape)), jnp.dtype(dtype), float(minval),
                          float(maxval)), shape)


def randint(key, shape, minval: int, maxval: int, dtype=jnp.int32):
    shape = tuple(shape)
    if not _flat_ok(key):
        return jax.random.randint(key, shape, minval, maxval, dtype)
    return _take(_randint(key, _bucket(math.prod(shape)), int(minval), int(maxval),
                          jnp.dtype(dtype)), shape)


def bernoulli(key, p, shape):
    shape = tuple(shape)
    if not _flat_ok(key):
        return jax.random.bernoulli(key, p, shape)
    return _take(_bernoulli(key, float(p), _bucket(math.prod(shape))), shape)

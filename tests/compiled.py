"""`call(fn, *args, **kw)`: fn(*args, **kw) run as one jitted program, as the model runs the
kernels and their wrappers (inside its jit), instead of op by op.

Called eagerly, a kernel's wrapper and a jnp reference dispatch dozens of small ops, and on
the CPU each new (op, shape) is compiled on its own: the kernel tests spent most of their
time compiling broadcasts and multiplies one at a time (a sparse-attention case: 3-4 s for
its reference op by op, 0.5-0.9 s as one program). Arrays (jax or numpy) are the traced
arguments; everything else (ints, strings, tuples, dtypes, block configs, None) is static,
bound as it would be in the eager call. Programs are cached on the static values, so a call
repeated with the same shapes compiles once.
"""

from __future__ import annotations

import functools

import jax
import numpy as np


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def call(fn, *args, **kw):
    vals = list(args) + list(kw.values())
    mask = tuple(_is_array(x) for x in vals)
    static = tuple(None if m else x for m, x in zip(mask, vals))
    arrays = [x for m, x in zip(mask, vals) if m]
    # the values' types too: 1, 1.0 and True are equal keys, yet not the same call
    key = (fn, len(args), tuple(kw), mask, static, tuple(type(x) for x in static))
    try:
        hash(key)
    except TypeError:  # an unhashable static value: compile this call on its own
        return _build(*key)(*arrays)
    return _cached(*key)(*arrays)


def _build(fn, n_args, names, mask, static, _types=None):
    def run(*arrays):
        it = iter(arrays)
        vals = [next(it) if m else s for m, s in zip(mask, static)]
        return fn(*vals[:n_args], **dict(zip(names, vals[n_args:])))

    return jax.jit(run)


_cached = functools.lru_cache(maxsize=None)(_build)

"""Top-k selection of key positions from the captured scores: [b, s] -> indices [b, k].

`lax.top_k` over 128K positions with k = 7 % sorts whole rows and is slow on the GPU
(DESIGN.md §3). `blockwise_topk` is exact up to ties: a per-block top-kb (small batched
sorts) followed by a top-k over the candidates, with a check that no block could have held
more than kb winners; if one could, it falls back to `lax.top_k` for the batch (lax.cond).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def blockwise_topk(x, k, *, block=4096, oversample=2.0, fallback=True):
    """x [b, s] float -> (values [b, k], indices [b, k] int32); exact up to ties."""
    b, s = x.shape
    if s <= block or k >= s // 2:
        return lax.top_k(x, k)
    nb = -(-s // block)
    pad = nb * block - s
    xp = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x
    kb = min(block, int(math.ceil(k / nb * oversample)) + 16)
    if kb * nb < k:
        kb = -(-k // nb)
    v1, i1 = lax.top_k(xp.reshape(b, nb, block), kb)  # [b, nb, kb]
    i1 = i1 + (jnp.arange(nb, dtype=i1.dtype) * block)[None, :, None]
    v2, j2 = lax.top_k(v1.reshape(b, nb * kb), k)
    idx = jnp.take_along_axis(i1.reshape(b, nb * kb), j2, axis=1)
    if not fallback:
        return v2, idx
    # exact unless some block's smallest candidate beats the k-th value (then that block
    # may hold more winners than kb); equal values are ties and acceptable.
    missed = jnp.any(v1[:, :, -1] > v2[:, -1:])
    return lax.cond(missed, lambda: tuple(lax.top_k(x, k)), lambda: (v2, idx.astype(jnp.int32)))


def topk_indices(x, k, method="blockwise", **kw):
    if method == "exact":
        return lax.top_k(x, k)[1]
    if method == "approx":
        return lax.approx_max_k(x, k, recall_target=kw.get("recall_target", 0.95))[1]
    if method == "blockwise":
        return blockwise_topk(x, k, **kw)[1]
    raise ValueError(method)

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


def sort_topk(x, k):
    """Exact: one two-operand sort (values descending, iota) and a slice."""
    b, s = x.shape
    iota = lax.broadcasted_iota(jnp.int32, (b, s), 1)
    v, i = lax.sort((-x, iota), dimension=1, num_keys=1)
    return -v[:, :k], i[:, :k]


def packed_topk(x, k):
    """Approximate (ranks by the top 15 bits of the score, ties -> lower index): one
    single-operand uint32 sort. Needs s <= 2**17."""
    b, s = x.shape
    assert s <= 1 << 17
    u = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    mono = jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))  # order-preserving
    key = ~((mono >> 17) << 17 | lax.broadcasted_iota(jnp.uint32, (b, s), 1))
    srt = lax.sort(key, dimension=1)
    return (~srt[:, :k]) & jnp.uint32((1 << 17) - 1)

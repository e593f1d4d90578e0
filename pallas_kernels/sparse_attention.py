"""Sparse draft attention: one query token per sequence over a selected index set plus
the contiguous recent tail.

Reads only the selected K/V rows: bytes proportional to the budget, never a masked
full-length attention.

Shapes: q [b, 1, k, g, d]; cache k/v [L, b, k, s, d] with a layer index;
idx [b, K] (shared by the layer's KV heads) or [b, k, K] (per KV head), padded with a valid
sentinel position; count [b] or [b, k] = how many leading entries of idx are real;
tail_start [b]: the tail covers positions tail_start .. q_pos (at most `tail_len` of them);
q_pos [b]: the query's position (its own K/V is already in the cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_rows(cache, layer, idx):
    """cache [L, b, k, s, d] -> rows [b, k, K, d] at positions idx [b, K] or [b, k, K]."""
    _, b, kh, s, _ = cache.shape
    if idx.ndim == 2:
        rows = cache[layer, jnp.arange(b)[:, None], :, idx]  # [b, K, k, d]
        return rows.transpose(0, 2, 1, 3)
    return cache[layer, jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None], idx]


def sparse_attention_reference(q, k_cache, v_cache, layer, idx, count, tail_start, q_pos,
                               *, tail_len):
    """Gather-then-attend in plain XLA. Returns out [b, 1, k, g, d]."""
    b, _, kh, g, d = q.shape
    s = k_cache.shape[3]
    kk = idx.shape[-1]
    tail = tail_start[:, None] + jnp.arange(tail_len)[None, :]  # [b, W]
    tail_ok = tail <= q_pos[:, None]
    tail = jnp.minimum(tail, s - 1)
    sel_ok = jnp.arange(kk) < count[..., None]  # [b, K] or [b, k, K]
    if idx.ndim == 2:
        sel_ok = jnp.broadcast_to(sel_ok[:, None, :], (b, kh, kk))
    keys = jnp.concatenate([gather_rows(k_cache, layer, idx), gather_rows(k_cache, layer, tail)], 2)
    vals = jnp.concatenate([gather_rows(v_cache, layer, idx), gather_rows(v_cache, layer, tail)], 2)
    ok = jnp.concatenate([sel_ok, jnp.broadcast_to(tail_ok[:, None, :], (b, kh, tail_len))], 2)
    # keys/vals [b, k, K + W, d]; ok [b, k, K + W]
    logits = jnp.einsum("bkgd,bksd->bkgs", q[:, 0].astype(jnp.float32), keys.astype(jnp.float32))
    logits = jnp.where(ok[:, :, None, :], logits * d**-0.5, -jnp.inf)
    w = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgs,bksd->bkgd", w, vals.astype(jnp.float32))
    return out[:, None].astype(q.dtype)

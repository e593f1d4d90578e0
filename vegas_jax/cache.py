"""KV cache pytree: `[layers, batch, kv_heads, max_len, head_dim]` plus per-sequence lengths.

The (batch, head) slab of one layer is contiguous, which is what the attention kernels
read; transposing the cache per call would cost several times the attention itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from vegas_jax.config import ModelConfig


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, b, k, s, d]
    v: jax.Array  # [L, b, k, s, d]
    lengths: jax.Array  # [b] int32: positions 0 .. lengths-1 hold valid entries

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache, in one compiled call (op by op, each zeros is a compile of its own)."""
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype) -> int:
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * cfg.num_layers * batch * cfg.num_kv_heads * max_len * cfg.head_dim * itemsize


def write_kv(k_cache, v_cache, layer, k, v, positions):
    """Scatter new entries k, v [b, t, k, d] of one layer at `positions` [b, t].

    Works on the full stacked cache so that, inside the layer loop, XLA updates the
    carried buffer in place. Positions past the end are dropped (padding tokens). A
    sequence's positions are distinct, so the writes are declared unique: XLA then writes
    them in parallel instead of guarding against two updates of one entry.
    """
    b = positions.shape[0]
    bidx = jnp.broadcast_to(jnp.arange(b)[:, None], positions.shape)  # [b, t]
    kw = dict(mode="drop", unique_indices=True)
    k_cache = k_cache.at[layer, bidx, :, positions].set(k.astype(k_cache.dtype), **kw)
    v_cache = v_cache.at[layer, bidx, :, positions].set(v.astype(v_cache.dtype), **kw)
    return k_cache, v_cache

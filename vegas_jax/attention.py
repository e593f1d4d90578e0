"""Attention dispatch: one function for every mode, swappable backends (pallas | xla).

Modes:
  "causal": each query row attends to cache keys at positions <= its own (prefill, decode,
            verify). Optionally captures the selector's scores from chosen rows.
  "sparse": one query per sequence attends to a selected index set plus the recent tail
            (the Vegas draft and the stream / last / vegas-all drafts).
  "quest":  the MagicDec-Quest draft: per KV head, rank pages by the query against their
            element-wise key min/max, then a per-head sparse attention over the top pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from pallas_kernels.sparse_attention import sparse_attention_reference
from pallas_kernels.verify_attention import verify_attention_reference

IMPLS = ("xla", "pallas")


@struct.dataclass
class AttnSpec:
    mode: str = struct.field(pytree_node=False, default="causal")
    impl: str = struct.field(pytree_node=False, default="xla")
    capture: str = struct.field(pytree_node=False, default="none")  # none | mean | rows
    capture_rows: tuple = struct.field(pytree_node=False, default=(0,))
    score: str = struct.field(pytree_node=False, default="weight")  # weight | logit
    tail_len: int = struct.field(pytree_node=False, default=0)
    page_size: int = struct.field(pytree_node=False, default=16)
    max_pages: int = struct.field(pytree_node=False, default=0)
    # sparse mode, one entry per layer:
    idx: jax.Array | None = None  # [L, b, K] or [L, b, k, K]
    count: jax.Array | None = None  # [L, b] or [L, b, k]
    tail_start: jax.Array | None = None  # [b]
    # quest mode: per-layer page key bounds, and pages to keep per sequence
    page_min: jax.Array | None = None  # [L, b, k, P, d]
    page_max: jax.Array | None = None  # [L, b, k, P, d]
    page_budget: jax.Array | None = None  # [b]


def default_impl() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def per_layer_inputs(spec: AttnSpec):
    """What the layer scan slices per layer."""
    return (spec.idx, spec.count, spec.page_min, spec.page_max)


def quest_pages(q, page_min, page_max, ready_pages, page_budget, page_size, max_pages):
    """Quest's page choice for one layer.

    q [b, 1, k, g, d]; page_min/max [b, k, P, d]; ready_pages [b] = pages whose keys are
    all committed. Page score = sum over the KV head's query heads of
    sum_d max(q_d * kmin_d, q_d * kmax_d), an upper bound of q.k inside the page.
    Returns idx [b, k, max_pages * page_size] and count [b, k].
    """
    qf = q[:, 0].astype(jnp.float32)[:, :, :, None, :]  # [b, k, g, 1, d]
    lo = page_min.astype(jnp.float32)[:, :, None]  # [b, k, 1, P, d]
    hi = page_max.astype(jnp.float32)[:, :, None]
    score = jnp.maximum(qf * lo, qf * hi).sum(axis=(2, 4))  # [b, k, P]
    npages = page_min.shape[2]
    ready = jnp.arange(npages)[None, None, :] < ready_pages[:, None, None]
    score = jnp.where(ready, score, -jnp.inf)
    _, pages = lax.top_k(score, max_pages)  # [b, k, max_pages]
    idx = pages[..., None] * page_size + jnp.arange(page_size)
    b, kh = pages.shape[:2]
    count = jnp.minimum(page_budget, ready_pages)[:, None] * page_size
    return idx.reshape(b, kh, -1).astype(jnp.int32), jnp.broadcast_to(count, (b, kh))


def attention(spec: AttnSpec, q, k_cache, v_cache, layer, positions, layer_inputs):
    """q [b, t, k, g, d]; cache [L, b, k, s, d]; positions [b, t]. Returns (out, scores)."""
    if spec.impl not in IMPLS:
        raise ValueError(f"attn impl must be one of {IMPLS}, got {spec.impl!r}")
    if spec.mode == "causal":
        if spec.impl == "pallas":
            from pallas_kernels.verify_attention import verify_attention

            return verify_attention(q, k_cache, v_cache, layer, positions, capture=spec.capture,
                                    capture_rows=spec.capture_rows, score=spec.score)
        return verify_attention_reference(q, k_cache, v_cache, layer, positions,
                                          capture=spec.capture, capture_rows=spec.capture_rows,
                                          score=spec.score)
    if spec.mode in ("sparse", "quest"):
        idx, count, page_min, page_max = layer_inputs
        q_pos = positions[:, 0]
        if spec.mode == "quest":
            idx, count = quest_pages(q, page_min, page_max, spec.tail_start // spec.page_size,
                                     spec.page_budget, spec.page_size, spec.max_pages)
        if spec.impl == "pallas":
            from pallas_kernels.sparse_attention import sparse_attention

            out = sparse_attention(q, k_cache, v_cache, layer, idx, count, spec.tail_start,
                                   q_pos, tail_len=spec.tail_len)
        else:
            out = sparse_attention_reference(q, k_cache, v_cache, layer, idx, count,
                                             spec.tail_start, q_pos, tail_len=spec.tail_len)
        return out, None
    raise ValueError(f"unknown attention mode {spec.mode!r}")

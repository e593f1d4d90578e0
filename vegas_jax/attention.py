"""Attention dispatch: one function for every mode, swappable backends (pallas | xla).

Modes:
  "causal": each query row attends to cache keys at positions <= its own (prefill, decode,
            verify). Optionally captures the selector's scores from chosen rows.
  "sparse": one query per sequence attends to a selected index set plus the recent tail
            (the Vegas draft and the baselines' drafts).
"""

from __future__ import annotations

import jax
from flax import struct

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
    # sparse mode, one entry per layer:
    idx: jax.Array | None = None  # [L, b, K] or [L, b, k, K]
    count: jax.Array | None = None  # [L, b] or [L, b, k]
    tail_start: jax.Array | None = None  # [b]


def default_impl() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def per_layer_inputs(spec: AttnSpec):
    """What the layer scan slices per layer."""
    return (spec.idx, spec.count)


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
    if spec.mode == "sparse":
        idx, count = layer_inputs
        q_pos = positions[:, 0]
        if spec.impl == "pallas":
            from pallas_kernels.sparse_attention import sparse_attention

            out = sparse_attention(q, k_cache, v_cache, layer, idx, count, spec.tail_start,
                                   q_pos, tail_len=spec.tail_len)
        else:
            out = sparse_attention_reference(q, k_cache, v_cache, layer, idx, count,
                                             spec.tail_start, q_pos, tail_len=spec.tail_len)
        return out, None
    raise ValueError(f"unknown attention mode {spec.mode!r}")

"""Causal attention of a few query tokens over the KV cache, with score capture.

Serves decode (t = 1), verification (t = gamma + 1) and, in query chunks, prefill. The
side output is the per-position criticality score that Vegas's selector ranks: from the
chosen query rows only, averaged over all query heads of the layer.

Shapes: q [b, t, k, g, d]; cache k/v [L, b, k, s, d] (the full stacked cache plus a layer
index, so no per-layer slab is copied); q_pos [b, t] (row t sees keys s <= q_pos[b, t]).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

CAPTURE_MODES = ("none", "mean", "rows")
SCORE_KINDS = ("weight", "logit")


def _scores_from_logits(logits, lse, valid, rows, score, capture):
    """logits [b, k, g, t, s] fp32 masked with -inf, lse [b, k, g, t]."""
    sel = logits[:, :, :, list(rows), :]  # [b, k, g, r, s]
    vis = valid[:, :, :, list(rows), :]
    if score == "weight":
        per = jnp.exp(sel - lse[:, :, :, list(rows), None])
    else:
        per = jnp.where(vis, sel, 0.0)
    per = per.mean(axis=(1, 2))  # [b, r, s]
    return per.mean(axis=1) if capture == "mean" else per


def verify_attention_reference(
    q, k_cache, v_cache, layer, q_pos, *, capture="none", capture_rows=(0,),
    score="weight", query_chunk=512,
):
    """Plain-XLA reference. Returns (out [b, t, k, g, d], scores or None).

    scores: [b, s] fp32 for capture="mean" (mean over heads and rows), [b, r, s] for
    capture="rows" (mean over heads, one row each).
    """
    if capture not in CAPTURE_MODES:
        raise ValueError(f"capture must be one of {CAPTURE_MODES}, got {capture!r}")
    if score not in SCORE_KINDS:
        raise ValueError(f"score must be one of {SCORE_KINDS}, got {score!r}")
    b, t, kh, g, d = q.shape
    k = k_cache[layer]  # [b, k, s, d]
    v = v_cache[layer]
    s = k.shape[2]
    scale = d**-0.5

    def attend(qc, pc):
        # qc [b, c, k, g, d], pc [b, c]
        logits = jnp.einsum("bckgd,bksd->bkgcs", qc.astype(jnp.float32), k.astype(jnp.float32))
        logits = logits * scale
        valid = jnp.arange(s)[None, None, None, None, :] <= pc[:, None, None, :, None]
        logits = jnp.where(valid, logits, -jnp.inf)
        lse = jax.nn.logsumexp(logits, axis=-1)  # [b, k, g, c]
        w = jnp.exp(logits - lse[..., None])
        out = jnp.einsum("bkgcs,bksd->bckgd", w, v.astype(jnp.float32))
        return out.astype(q.dtype), logits, lse, valid

    if capture == "none" and query_chunk and t > query_chunk:
        # Prefill: bound the [.., chunk, s] logits instead of materialising t x s.
        pad = (-t) % query_chunk
        qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        pp = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)
        n = (t + pad) // query_chunk
        qs = qp.reshape(b, n, query_chunk, kh, g, d).swapaxes(0, 1)
        ps = pp.reshape(b, n, query_chunk).swapaxes(0, 1)
        outs = lax.map(lambda a: attend(*a)[0], (qs, ps))  # [n, b, c, k, g, d]
        out = outs.swapaxes(0, 1).reshape(b, n * query_chunk, kh, g, d)[:, :t]
        return out, None

    out, logits, lse, valid = attend(q, q_pos)
    if capture == "none":
        return out, None
    return out, _scores_from_logits(logits, lse, valid, capture_rows, score, capture)


@functools.partial(jax.jit, static_argnames=("capture", "capture_rows", "score"))
def verify_attention_reference_jit(q, k_cache, v_cache, layer, q_pos, *, capture="none",
                                   capture_rows=(0,), score="weight"):
    return verify_attention_reference(q, k_cache, v_cache, layer, q_pos, capture=capture,
                                      capture_rows=capture_rows, score=score)

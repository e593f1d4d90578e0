"""Attention dispatch: one function for every mode, swappable backends (pallas | xla).

An `AttnPlan` says what one forward's attention does, for every layer:
  "causal": each query row attends to cache keys at positions <= its own (prefill, decode,
            verify), optionally capturing the selector's scores from chosen rows.
  "sparse": one query per sequence attends to a selected index set plus the recent tail
            (every method's draft). The index set is either given per layer (`idx`,
            `count`) or chosen per layer from the query itself by a `picker` (Quest).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_kernels.topk import PALLAS_MAX_KEYS
from pallas_kernels.sparse_attention import (
    SparseIndex, StepSpec, sparse_attention, sparse_attention_reference, sparse_step,
)
from pallas_kernels.verify_attention import (
    INVARIANT, capture_buffer, verify_attention, verify_attention_reference,
)
from vegas_jax.sharding import AXIS, mesh

SCORES = ("weight", "logit")


@dataclasses.dataclass(frozen=True)
class Capture:
    """Which verify rows' attention becomes the next selection's scores.

    rows: query rows (token indices of the forward) whose attention is captured.
    reduce: "mean" averages them into one score vector per (layer, sequence); "rows" keeps
      one per row (the row to use is known only after acceptance).
    score: "weight" = softmax weights averaged over all query heads; "logit" = raw logits.
    raw: the verify hands over the capture rows' logits, every layer's in one stacked
      buffer, with their offsets (`RawCapture`) instead of scores, and the selection
      reduces them itself in one kernel (`raw_capture` says where the kernels allow it).
    """

    rows: tuple[int, ...]
    reduce: str = "mean"
    score: str = "weight"
    raw: bool = False

    def __post_init__(self):
        if self.reduce not in ("mean", "rows"):
            raise ValueError(f"reduce must be 'mean' or 'rows', got {self.reduce!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")

    def scores_shape(self, b: int, kh: int, s: int, g: int = 1) -> tuple[int, ...]:
        """One layer's captured scores (fp32) for b sequences, kh KV heads of g query heads,
        s positions (raw: the offsets of its kh * n_cap rows a sequence)."""
        if self.raw:
            return (b, kh * self.rows_per_head(g))
        return (b, s) if self.reduce == "mean" else (b, len(self.rows), s)

    def rows_per_head(self, g: int) -> int:
        """Captured query rows a KV head: the distinct capture tokens x its g query heads."""
        return len(set(self.rows)) * g


jax.tree_util.register_static(Capture)


@struct.dataclass
class RawCapture:
    """A verify's capture before any reduction (`Capture.raw`): logits [L * b * R + spare,
    s_pad] fp16, the capture rows' log2-unit logits of every layer (`verify_attention.
    capture_buffer`'s layout), offset [L, b, R] fp32 each row's LSE - log2 of its weight,
    valid [b] False for sequences whose rows were not computed (finished ones)."""

    logits: jax.Array
    offset: jax.Array
    valid: jax.Array


def raw_capture(cap: Capture | None, cfg, xc, max_len: int) -> Capture | None:
    """`cap` as a raw capture where the kernels can hand one over and select from it (the
    mean of softmax weights on the Pallas path, one device, no sliding windows, rows that
    one selection program holds), else `cap`."""
    ok = (cap is not None and cap.reduce == "mean" and cap.score == "weight" and xc.pallas
          and xc.tp == 1 and not cfg.sliding_layers and max_len <= PALLAS_MAX_KEYS)
    return dataclasses.replace(cap, raw=True) if ok else cap


def capture_start(plan: "AttnPlan", cfg, b: int, max_len: int):
    """The empty stacked buffer a raw capture's forward fills layer by layer, else None."""
    cap = plan.capture
    if plan.mode != "causal" or cap is None or not cap.raw:
        return None
    return capture_buffer(cfg.num_layers, b, cfg.num_kv_heads,
                          cap.rows_per_head(cfg.group_size), max_len)


@struct.dataclass
class AttnPlan:
    mode: str = struct.field(pytree_node=False, default="causal")
    capture: Capture | None = struct.field(pytree_node=False, default=None)
    tail_len: int = struct.field(pytree_node=False, default=0)  # sparse: static tail length
    layered: bool = struct.field(pytree_node=False, default=True)  # idx differs per layer
    picker: Any = struct.field(pytree_node=False, default=None)  # has .pick(q, inputs, layer, tail_start)
    idx: jax.Array | None = None  # [L|1, b, K] or [L|1, b, k, K]: positions, best first
    count: jax.Array | None = None  # [L|1, b] or [L|1, b, k]: leading idx entries that are real
    tail_start: jax.Array | None = None  # [b]: the tail is tail_start .. the query's position
    picker_inputs: Any = None  # arrays the picker reads (leading layer axis)
    # [b] bool: False for finished sequences, whose attention reads nothing on the Pallas
    # path (their output is never used; the batch waits for its slowest sequence, and a
    # finished one then costs no cache reads). None: every sequence attends.
    active: jax.Array | None = None
    # causal: every row's queries sit at positions 0..t-1 (a whole prompt from its first
    # token), so a backend that needs that (cuDNN's causal mask) may run it
    fresh: bool = struct.field(pytree_node=False, default=False)


CAUSAL = AttnPlan()
PROMPT = AttnPlan(fresh=True)


# Tensor parallel: a Pallas kernel runs on each device's KV heads inside `shard_map` (XLA
# cannot partition a custom call); these specs split the KV-head axis of each argument.
HEADS5 = P(None, None, AXIS, None, None)  # q [b, t, k, g, d], caches [L, b, k, s, d]
REP = P()


def index_specs(idx):
    """Tensor-parallel specs of a sparse draft's (index lists, counts): per-KV-head lists
    ([Li, b, k, K]) split with the heads, shared ones ([Li, b, K]) replicated."""
    if idx.ndim == 4:
        return P(None, None, AXIS, None), P(None, None, AXIS)
    return REP, REP


def per_device(fn, xc, in_specs, out_specs):
    """`fn` on each device's shard (tp > 1, Pallas path), else `fn` itself."""
    if xc.tp == 1 or not xc.pallas:
        return fn
    return jax.shard_map(fn, mesh=mesh(xc.tp), in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def attention(plan: AttnPlan, xc, q, k_cache, v_cache, layer, positions, *, window=None,
              sinks=None, slot=None, capture_into=None):
    """q [b, t, k, g, d]; cache [L, b, k, s, d]; positions [b, t]. `layer` indexes the
    cache. Returns (out [b, t, k, g, d], scores | None); a raw capture (`capture_into`,
    the stacked buffer: Pallas, one device) returns (buffer, offset [b, R]) as scores.

    gpt-oss layers differ beyond their weights: window (int32 scalar, traced) is the
    number of positions a query sees, its own included (0: all before it); sinks [k, g]
    one logit per query head in the softmax's denominator; slot (int32 scalar) the row
    of the plan's per-layer selection this layer reads (None: `layer`, every layer has
    one). In a sparse draft a windowed layer reads its window as the tail and nothing
    selected: the window is already at most `window` reads (the caller makes the plan's
    tail that long, `model.forward`)."""
    if plan.mode == "causal":
        if skips(plan, xc):  # rows at position -1 see no key: nothing is read
            positions = jnp.where(plan.active[:, None], positions, -1)
        cap = plan.capture
        kw = {} if cap is None else dict(capture=cap.reduce, capture_rows=cap.rows,
                                         score=cap.score)
        kernel = xc.pallas or xc.exact  # exact: the row-invariant plan on either backend
        if kernel:
            kw["interpret"] = xc.interpret
        if xc.exact:
            kw["blocks"] = INVARIANT
        if capture_into is not None:
            return verify_attention(q, k_cache, v_cache, layer, positions, **kw,
                                    capture_into=capture_into, sinks=sinks)
        fn = verify_attention if kernel else verify_attention_reference
        # cuDNN's flash attention has no fp32, windows or sinks (nor a row-invariant plan)
        if plan.fresh and xc.cudnn_prefill and not xc.exact and cap is None \
                and window is None and sinks is None and q.dtype != jnp.float32:
            kw["prefill_impl"] = "cudnn"

        names, extra, especs = _extras(window=window, sinks=sinks)

        def local(q, k_cache, v_cache, layer, positions, *extra):
            out, scores = fn(q, k_cache, v_cache, layer, positions, **kw,
                             **dict(zip(names, extra)))
            if scores is not None and xc.tp > 1 and xc.pallas:
                scores = lax.pmean(scores, AXIS)  # every device holds as many heads
            return out, scores

        sspec = None if cap is None else REP
        return per_device(local, xc, (HEADS5, HEADS5, HEADS5, REP, REP, *especs),
                          (HEADS5, sspec))(q, k_cache, v_cache, layer, positions, *extra)
    if plan.mode == "sparse":
        at = (layer if slot is None else slot) if plan.layered else 0
        idx, count, tail_start = plan.idx, plan.count, plan.tail_start
        if plan.picker is not None:
            idx, count = plan.picker.pick(q, plan.picker_inputs, layer, tail_start)
            idx, count, at = idx[None], count[None], 0
        if window is not None:
            # a sliding layer: nothing selected, its window as the tail (a full layer's
            # window is 0 and keeps the plan's)
            slide = window > 0
            count = jnp.where(slide, 0, count)
            tail_start = jnp.where(slide, jnp.maximum(positions[:, 0] - window + 1, 0),
                                   tail_start)
        count, tail_start = skipped(plan, xc, count, tail_start, positions)
        fn = (functools.partial(sparse_attention, interpret=xc.interpret) if xc.pallas
              else sparse_attention_reference)
        ispec, cspec = index_specs(idx)

        names, extra, especs = _extras(sinks=sinks)

        def local(q, k_cache, v_cache, layer, idx, count, tail_start, q_pos, at, *extra):
            return fn(q, k_cache, v_cache, layer, SparseIndex(idx, count, tail_start, q_pos, at),
                      tail_len=plan.tail_len, **dict(zip(names, extra)))

        out = per_device(local, xc, (HEADS5, HEADS5, HEADS5, REP, ispec, cspec, REP, REP, REP,
                                     *especs), HEADS5)(
            q, k_cache, v_cache, layer, idx, count, tail_start, positions[:, 0], at, *extra)
        return out, None
    raise ValueError(f"unknown attention mode {plan.mode!r}")


def _extras(**kw):
    """The per-layer extras given (None dropped: models without them call the kernels as
    before) as (names, values, tensor-parallel specs): positional arguments through
    `per_device`, keywords again inside (`dict(zip(names, values))`)."""
    specs = {"window": REP, "sinks": P(AXIS, None)}  # sinks [k, g]: split with the KV heads
    names = tuple(k for k, v in kw.items() if v is not None)
    return names, [kw[k] for k in names], tuple(specs[k] for k in names)


def skips(plan: AttnPlan, xc) -> bool:
    """Whether finished sequences skip their attention (the Pallas path; the XLA path is
    the reference and computes every row)."""
    return plan.active is not None and xc.pallas


def skipped(plan: AttnPlan, xc, count, tail_start, positions):
    """A sparse draft's (count, tail_start) with finished sequences reading nothing: no
    selected entry, and a tail that starts after the query."""
    if not skips(plan, xc):
        return count, tail_start
    act = plan.active.reshape((1, -1) + (1,) * (count.ndim - 2))  # against [Li, b, (k)]
    return (jnp.where(act, count, 0),
            jnp.where(plan.active, tail_start, positions[:, 0] + 1))


def fused_draft(plan: AttnPlan, xc, cfg) -> bool:
    """Whether this forward's attention block runs as `sparse_step` (one kernel a layer):
    sparse drafts with given index lists on the Pallas path (Quest's picker needs the
    rotated query outside the kernel), for models without gpt-oss's attention extras
    (projection biases do not commute with the input norm's row scale the kernel applies,
    and its in-kernel normalisation has no sink term)."""
    return (plan.mode == "sparse" and plan.picker is None and xc.pallas
            and not (cfg.attn_bias or cfg.attn_sinks or cfg.sliding_layers))


def sparse_block(plan: AttnPlan, xc, cfg, qkv, q_norm, k_norm, rope, k_cache, v_cache, layer,
                 positions, x=None):
    """The fused draft attention block: qkv [b, 1, (n + 2k) * d] raw projection (per shard
    [q_i | k_i | v_i]; on one device possibly followed by columns the kernel ignores),
    q_norm / k_norm [d], rope [b, 2, d/2] (`rope_halves`); x [b, h] or None: the layer
    input, when qkv projects it before the input norm's row scale (the kernel applies it).
    Returns (out [b, 1, k, g, d], k_cache, v_cache)."""

    def local(qkv, q_norm, k_norm, rope, k_cache, v_cache, layer, idx, count, tail_start,
              q_pos, at, *x):
        spec = StepSpec(tail_len=plan.tail_len, num_heads=cfg.num_heads // xc.tp,
                        qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps)
        return sparse_step(qkv, q_norm, k_norm, rope, k_cache, v_cache, layer,
                           SparseIndex(idx, count, tail_start, q_pos, at), spec=spec,
                           x=x[0] if x else None, interpret=xc.interpret)

    cols = P(None, None, AXIS)
    ispec, cspec = index_specs(plan.idx)
    count, tail_start = skipped(plan, xc, plan.count, plan.tail_start, positions)
    xs = () if x is None else (x,)
    return per_device(local, xc, (cols, REP, REP, REP, HEADS5, HEADS5, REP, ispec, cspec, REP,
                                  REP, REP) + (REP,) * len(xs), (HEADS5, HEADS5, HEADS5))(
        qkv, q_norm, k_norm, rope, k_cache, v_cache, layer, plan.idx, count, tail_start,
        positions[:, 0], layer if plan.layered else 0, *xs)

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

from pallas_kernels.topk import PALLAS_MAX_KEYS
from pallas_kernels.sparse_attention import (
    SparseIndex, StepSpec, sparse_attention, sparse_attention_reference, sparse_step,
)
from pallas_kernels.verify_attention import (
    INVARIANT, INVARIANT_PREFILL, CaptureSpec, VerifyBlocks, capture_buffer, cudnn_attention,
    verify_attention, verify_attention_reference,
)
from vegas_jax.sharding import AXIS, TP_RULES, mesh


@dataclasses.dataclass(frozen=True)
class Capture(CaptureSpec):
    """Which verify rows' attention becomes the next selection's scores: the kernel's
    `CaptureSpec` (rows: the forward's query rows; reduce "mean" averages them into one
    score vector per (layer, sequence), "rows" keeps one per row, the row to use known
    only after acceptance; score "weight" or "logit") plus

    raw: the verify hands over the capture rows' logits, every layer's in one stacked
      buffer, with their offsets (`RawCapture`) instead of scores, and the selection
      reduces them itself in one kernel (`raw_capture` says where the kernels allow it).
    """

    raw: bool = False

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
    # causal: a prompt step (prefill, whole or a chunk): under `exact` the row-invariant
    # kernels run their prefill plans (a prompt row equals itself in any batch or
    # chunking, never has to equal a decode row)
    prefill: bool = struct.field(pytree_node=False, default=False)


CAUSAL = AttnPlan()
PROMPT = AttnPlan(fresh=True, prefill=True)  # a step of whole prompts
PROMPT_CHUNK = AttnPlan(prefill=True)  # a later slice of the prompts


# Tensor parallel: a Pallas kernel runs on each device's KV heads inside `shard_map` (XLA
# cannot partition a custom call). Its arguments go by name with their logical axes
# (`sharding.ShardingRules`), never as positional spec tuples.
Q_AXES = ("batch", "seq", "kv_heads", "group", "head_dim")  # q, out [b, t, k, g, d]
CACHE_AXES = ("layers", "batch", "kv_heads", "keys", "head_dim")  # [L, b, k, s, d]
SINK_AXES = ("kv_heads", "group")  # sinks [k, g]


def index_axes(idx) -> dict:
    """Logical axes of a sparse draft's index lists and counts: per KV head ([Li, b, k, K],
    [Li, b, k]) or shared by the layer's heads ([Li, b, K], [Li, b])."""
    if idx.ndim == 4:
        return dict(idx=("layers", "batch", "kv_heads", "selected"),
                    count=("layers", "batch", "kv_heads"))
    return dict(idx=("layers", "batch", "selected"), count=("layers", "batch"))


def _index_axes(idx) -> SparseIndex:
    """Logical axes of a sparse draft's `SparseIndex`, field by field."""
    return SparseIndex(**index_axes(idx), tail_start=("batch",), q_pos=("batch",),
                       idx_layer=())


def per_device(fn, xc, args: dict, axes: dict, out_axes):
    """fn(**args) on each device's shard (tp > 1, Pallas path), else fn(**args). args:
    the arrays by name (None ones left out: fn's defaults); axes: each one's logical axes
    by the same name; out_axes: the outputs' (a tuple of them; None for a None output)."""
    args = {k: v for k, v in args.items() if v is not None}
    if xc.tp == 1 or not xc.pallas:
        return fn(**args)
    out_specs = jax.tree.map(lambda a: None if a is None else TP_RULES.spec(a), out_axes,
                             is_leaf=lambda a: a is None or _is_axes(a))
    return jax.shard_map(lambda a: fn(**a), mesh=mesh(xc.tp),
                         in_specs=({k: jax.tree.map(TP_RULES.spec, axes[k], is_leaf=_is_axes)
                                    for k in args},),
                         out_specs=out_specs, check_vma=False)(args)


def _is_axes(a) -> bool:
    return isinstance(a, tuple) and all(isinstance(n, str) for n in a)


def _cudnn(q, k_cache, v_cache, layer, q_pos, *, capture=None):
    """`cudnn_attention` in the kernels' call shape (its rows sit at 0..t-1 whatever
    q_pos says; it captures nothing)."""
    del q_pos, capture
    return cudnn_attention(q, k_cache, v_cache, layer), None


def causal_impl(plan: AttnPlan, xc, q, window=None, sinks=None):
    """The one place that decides how a causal plan's attention runs: a function (q,
    k_cache, v_cache, layer, q_pos, *, capture, window, sinks, ...) -> (out, scores).

    The XLA reference on the XLA backend; else the Pallas kernel (under `exact` on either
    backend, with the row-invariant plan: a prompt step's, `INVARIANT_PREFILL`, or decode
    and verify's, `INVARIANT`) or, for a fresh prompt on a GPU, cuDNN's flash attention,
    where it computes the same: no capture, window or sinks (it has none), no fp32 (nor
    that), not exact (no row-invariant plan), and more rows than one decode-like program
    holds."""
    if not (xc.pallas or xc.exact):
        return verify_attention_reference
    blocks = VerifyBlocks()
    if xc.exact:
        blocks = INVARIANT_PREFILL if plan.prefill else INVARIANT
    b, t, kh, g, d = q.shape
    if (plan.fresh and xc.cudnn_prefill and not xc.exact and plan.capture is None
            and window is None and sinks is None and q.dtype != jnp.float32
            and t * g > blocks.max_rows):
        return _cudnn
    return functools.partial(verify_attention, blocks=blocks, interpret=xc.interpret)


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
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, layer=layer, sinks=sinks)
    if plan.mode == "causal":
        return _causal(plan, xc, args, positions, window, capture_into)
    if plan.mode == "sparse":
        return _sparse(plan, xc, args, positions, window, slot), None
    raise ValueError(f"unknown attention mode {plan.mode!r}")


def _causal(plan: AttnPlan, xc, args: dict, positions, window, capture_into):
    """`attention` of a causal plan; args: q, caches, layer and sinks by name."""
    if skips(plan, xc):  # rows at position -1 see no key: nothing is read
        positions = jnp.where(plan.active[:, None], positions, -1)
    cap = plan.capture
    fn = functools.partial(causal_impl(plan, xc, args["q"], window, args["sinks"]),
                           capture=cap)
    if capture_into is not None:  # a raw capture (Pallas, one device, no window)
        return fn(**{k: v for k, v in args.items() if v is not None}, q_pos=positions,
                  capture_into=capture_into)

    def local(**kw):
        out, scores = fn(**kw)
        if scores is not None and xc.tp > 1 and xc.pallas:
            scores = lax.pmean(scores, AXIS)  # every device holds as many heads
        return out, scores

    axes = dict(q=Q_AXES, k_cache=CACHE_AXES, v_cache=CACHE_AXES, layer=(),
                q_pos=("batch", "seq"), window=(), sinks=SINK_AXES)
    return per_device(local, xc, dict(args, q_pos=positions, window=window), axes,
                      (Q_AXES, None if cap is None else ()))


def _sparse(plan: AttnPlan, xc, args: dict, positions, window, slot):
    """`attention` of a sparse draft plan; args: q, caches, layer and sinks by name."""
    layer = args["layer"]
    at = (layer if slot is None else slot) if plan.layered else 0
    idx, count, tail_start = plan.idx, plan.count, plan.tail_start
    if plan.picker is not None:
        idx, count = plan.picker.pick(args["q"], plan.picker_inputs, layer, tail_start)
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
    axes = dict(q=Q_AXES, k_cache=CACHE_AXES, v_cache=CACHE_AXES, layer=(),
                index=_index_axes(idx), sinks=SINK_AXES)
    index = SparseIndex(idx, count, tail_start, positions[:, 0], at)
    return per_device(functools.partial(fn, tail_len=plan.tail_len), xc,
                      dict(args, index=index), axes, Q_AXES)


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

    spec = StepSpec(tail_len=plan.tail_len, num_heads=cfg.num_heads // xc.tp,
                    qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps)
    fn = functools.partial(sparse_step, spec=spec, interpret=xc.interpret)
    count, tail_start = skipped(plan, xc, plan.count, plan.tail_start, positions)
    index = SparseIndex(plan.idx, count, tail_start, positions[:, 0],
                        layer if plan.layered else 0)
    args = dict(qkv=qkv, q_norm=q_norm, k_norm=k_norm, rope=rope, k_cache=k_cache,
                v_cache=v_cache, layer=layer, index=index, x=x)
    axes = dict(qkv=("batch", "seq", "qkv"), q_norm=("head_dim",), k_norm=("head_dim",),
                rope=("batch", "rope", "rope"), k_cache=CACHE_AXES, v_cache=CACHE_AXES,
                layer=(), index=_index_axes(plan.idx), x=("batch", "hidden"))
    return per_device(fn, xc, args, axes, (Q_AXES, CACHE_AXES, CACHE_AXES))

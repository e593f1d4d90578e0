"""Sparse draft attention: one query token per sequence over a selected index set plus
the contiguous recent tail.

Reads only the selected K/V rows: bytes proportional to the budget, never a masked
full-length attention.

Shapes: q [b, 1, k, g, d]; cache k/v [L, b, k, s, d] with a layer index; the index
inputs a `SparseIndex`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import NEG, combine_splits, dot, pow2_at_least, whole, with_sinks


class SparseIndex(NamedTuple):
    """A sparse draft's index inputs (a pytree). idx [b, K] (shared by the layer's KV
    heads) or [b, k, K] (per KV head), best entries first, padded with a valid sentinel
    position; count [b] or [b, k]: how many leading entries of idx are real; tail_start
    [b]: the tail covers positions tail_start .. q_pos (at most `tail_len` of them); q_pos
    [b]: the query's position (its own K/V is already in the cache). With idx_layer (an
    int, traced or not), idx and count carry a leading layer axis ([Li, b, K], [Li, b])
    and idx_layer picks the entry: every layer's index lists stay one buffer, nothing is
    sliced per layer."""

    idx: jax.Array
    count: jax.Array
    tail_start: jax.Array
    q_pos: jax.Array
    idx_layer: object = None


def gather_rows(cache, layer, idx):
    """cache [L, b, k, s, d] -> rows [b, k, K, d] at positions idx [b, K] or [b, k, K]."""
    _, b, kh, s, _ = cache.shape
    if idx.ndim == 2:
        rows = cache[layer, jnp.arange(b)[:, None], :, idx]  # [b, K, k, d]
        return rows.transpose(0, 2, 1, 3)
    return cache[layer, jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None], idx]


def _at_layer(idx, count, idx_layer):
    if idx_layer is None:
        return idx, count
    return idx[idx_layer], count[idx_layer]


def sparse_attention_reference(q, k_cache, v_cache, layer, index: SparseIndex, *, tail_len,
                               sinks=None):
    """Gather-then-attend in plain XLA. sinks [k, g] or None: one more logit per query
    head in the softmax's denominator, with no value (gpt-oss). Returns out
    [b, 1, k, g, d]."""
    idx, count = _at_layer(index.idx, index.count, index.idx_layer)
    tail_start, q_pos = index.tail_start, index.q_pos
    b, _, kh, g, d = q.shape
    s = k_cache.shape[3]
    kk = idx.shape[-1]
    tail = tail_start[:, None] + jnp.arange(tail_len)[None, :]  # [b, W]
    tail_ok = tail <= q_pos[:, None]
    tail = jnp.minimum(tail, s - 1)
    sel_ok = jnp.arange(kk) < count[..., None]  # [b, K] or [b, k, K]
    if idx.ndim == 2:
        sel_ok = jnp.broadcast_to(sel_ok[:, None, :], (b, kh, kk))
    keys = jnp.concatenate([gather_rows(k_cache, layer, idx),
                            gather_rows(k_cache, layer, tail)], 2)  # [b, k, K + W, d]
    vals = jnp.concatenate([gather_rows(v_cache, layer, idx),
                            gather_rows(v_cache, layer, tail)], 2)
    ok = jnp.concatenate([sel_ok, jnp.broadcast_to(tail_ok[:, None, :], (b, kh, tail_len))], 2)
    logits = jnp.einsum("bkgd,bksd->bkgs", q[:, 0].astype(jnp.float32), keys.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST)
    logits = jnp.where(ok[:, :, None, :], logits * d**-0.5, -jnp.inf)  # [b, k, g, K + W]
    if sinks is None:
        w = jax.nn.softmax(logits, axis=-1)
    else:
        lse = jnp.logaddexp(jax.nn.logsumexp(logits, axis=-1), sinks.astype(jnp.float32))
        w = jnp.exp(logits - lse[..., None])  # [b, k, g, K + W]
    out = jnp.einsum("bkgs,bksd->bkgd", w, vals.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
    return out[:, None].astype(q.dtype)


# ---------------------------------------------------------------------------------------
# Pallas (Triton backend) kernel
# ---------------------------------------------------------------------------------------
#
# One program = (sequence b, KV head h, chunk j). The selected index list and the recent
# tail are cut into chunks of the same length: chunks 0..J_sel-1 cover the list, chunks
# J_sel.. the tail, so a long tail (Stream's window) is split across programs just like a
# long list (Vegas's selection), and small batches still fill the GPU. Each program gathers
# its K/V rows inside the kernel (`ref[layer, b, h, pos_vector, :]`, unmasked: positions are
# clamped to valid ones and invalid entries are masked in the scores), loops only over the
# entries that are real (< count, <= the query's position), and writes the unnormalised
# output with the running max / sum; XLA combines the chunks. Bytes read ~ (count + tail) rows.


@dataclasses.dataclass(frozen=True)
class SparseBlocks:
    """Launch knobs: block_k gathered rows per loop step; num_warps / num_stages: Triton;
    target_programs: the grid aimed at when cutting the entries into chunks."""

    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int = 528


@dataclasses.dataclass(frozen=True)
class StepBlocks:
    """`sparse_step`'s launch: from `whole_from` (sequence, KV head) pairs on, one program
    a pair walks its whole list and tail and normalises in the kernel (`whole` tiles, no
    combine pass); below it the entries are split across programs (`split` tiles), their
    chunks combined by one Pallas kernel from `combine_from` pairs on, else by XLA. The
    `_wide` tiles serve head dims above 64. Each default is the fastest that
    `benchmarks/tune_sparse_step.py` found (RESULTS.md "Kernels (latest rooflines)", draft
    attention; variants dropped: "Levers measured and not kept")."""

    split: SparseBlocks = SparseBlocks()
    whole: SparseBlocks = SparseBlocks(block_k=64, num_warps=2, num_stages=3)
    whole_from: int = 128
    combine_from: int = 16
    whole_wide: SparseBlocks = SparseBlocks()
    split_wide: SparseBlocks = SparseBlocks(block_k=32, num_warps=4, num_stages=3)


@dataclasses.dataclass(frozen=True)
class _ChunkPlan:
    """How a call's entries are cut (`_chunking`): block_k gathered rows a loop step;
    chunk entries a program; n_sel programs (per sequence and KV head) over the selected
    list, n_prog in all (the tail's after them); n_idx list length; tail_len; s_len the
    cache length; scale the logits' scale."""

    block_k: int
    chunk: int
    n_sel: int
    n_prog: int
    n_idx: int
    tail_len: int
    s_len: int
    scale: float


class _Program(NamedTuple):
    """What a program's walk reads: the caches and index refs (k_ref, v_ref [L, b, k, s,
    d]; idx_ref [Li, b, k|1, K], cnt_ref [Li, b, k|1], ts_ref [b]), its cache layer and
    index layer, sequence bi, KV head h (hi: its index head, 0 when shared), chunk j, the
    query's position, and `live` (traced bool or None: False walks no entry, a padding
    row's program)."""

    k_ref: object
    v_ref: object
    idx_ref: object
    cnt_ref: object
    ts_ref: object
    layer: object
    il: object
    bi: object
    h: object
    hi: object
    j: object
    qpos: object
    live: object = None


def _update(q_parts, pr: _Program, plan: _ChunkPlan, skip_qpos, pos, ok, rows_kv, carry):
    """One block's online-softmax update of carry (o, m, l, hits)."""
    o, m, l, hits = carry
    ks, v = rows_kv
    if skip_qpos:
        here = ok & (pos == pr.qpos)
        hits = hits + jnp.sum(here.astype(jnp.int32))
        ok = ok & (pos != pr.qpos)
    qk = None
    for (qp, _), k in zip(q_parts, ks):
        part = dot(qp, k, trans_b=True)  # [rows, block_k]
        qk = part if qk is None else qk + part
    qk = jnp.where(ok[None, :], qk * plan.scale, NEG)
    m_new = jnp.maximum(m, qk.max(axis=-1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(qk - m_new[:, None])
    l = l * corr + p.sum(axis=-1)
    o = o * corr[:, None] + dot(p.astype(v.dtype), v)
    return o, m_new, l, hits


def _chunk_attention(q_parts, pr: _Program, plan: _ChunkPlan, *, skip_qpos,
                     one_program=False):
    """Online softmax of program pr.j's chunk (selected entries or tail) for one
    (sequence, KV head). q_parts: ((q [rows, w], last-axis slice of the cache rows it
    multiplies), ...): the logits are the sum of their dots (RoPE's two halves, or the
    whole row). With `skip_qpos`, entries at the query's own position are left out and
    counted: its K/V is written by this very call, so the caller adds it from registers.
    `one_program`: this program covers the whole list and then the whole tail.
    Returns (o [rows, d], m [rows], l [rows], hits)."""
    rows = q_parts[0][0].shape[0]
    d = pr.v_ref.shape[-1]
    block_k, chunk, tail_len = plan.block_k, plan.chunk, plan.tail_len
    kr = jnp.arange(block_k, dtype=jnp.int32)
    # the tail's own block: vegas's tail is 2 gamma + 1 entries, and a 64-row block for 13
    # of them would gather 51 rows for nothing (a power of two dividing `chunk`)
    tail_bk = min(block_k, pow2_at_least(tail_len))
    tr = jnp.arange(tail_bk, dtype=jnp.int32)

    def gather(pos):  # [block_k] positions -> (K parts [block_k, w] each, V [block_k, d])
        pos = jnp.clip(pos, 0, plan.s_len - 1)
        return ([pr.k_ref[pr.layer, pr.bi, pr.h, pos, sl] for _, sl in q_parts],
                pr.v_ref[pr.layer, pr.bi, pr.h, pos, :])

    def walk(nblk, pos_of, ok_of, carry):
        """Blocks 0..nblk-1 with positions pos_of(i) and validity ok_of(i). Positions are
        loaded one block ahead: their latency overlaps this block's gathers."""
        if pr.live is not None:
            nblk = jnp.where(pr.live, nblk, 0)

        def body(i, c):
            *c, pos = c
            nxt = pos_of(i + 1)
            return (*_update(q_parts, pr, plan, skip_qpos, pos, ok_of(i), gather(pos), c),
                    nxt)

        *carry, _ = lax.fori_loop(0, nblk, body, (*carry, pos_of(0)))
        return tuple(carry)

    carry0 = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
              jnp.zeros((rows,), jnp.float32), jnp.int32(0))

    def selected(carry):
        cnt = jnp.minimum(pr.cnt_ref[pr.il, pr.bi, pr.hi], plan.n_idx)
        e0 = pr.j * chunk
        nblk = pl.cdiv(jnp.maximum(jnp.minimum(e0 + chunk, cnt) - e0, 0), block_k)

        def positions(i):
            e = e0 + i * block_k + kr
            return pltr.load(pr.idx_ref.at[pr.il, pr.bi, pr.hi,
                                           pl.ds(e0 + i * block_k, block_k)],
                             mask=e < plan.n_idx, other=0)

        return walk(nblk, positions, lambda i: e0 + i * block_k + kr < cnt, carry)

    def tail(carry):
        t0 = pr.ts_ref[pr.bi]
        n_valid = jnp.clip(pr.qpos - t0 + 1, 0, tail_len)  # entries tail_start .. q_pos
        e0 = 0 if one_program else (pr.j - plan.n_sel) * chunk
        nblk = pl.cdiv(jnp.maximum(jnp.minimum(e0 + chunk, n_valid) - e0, 0), tail_bk)
        # positions past the query's are clamped to it: the block's spare rows load the
        # same (cached) row instead of rows no one asked for
        return walk(nblk, lambda i: jnp.minimum(t0 + e0 + i * tail_bk + tr, pr.qpos),
                    lambda i: e0 + i * tail_bk + tr < n_valid, carry)

    if one_program:
        return tail(selected(carry0)) if tail_len > 0 else selected(carry0)
    if tail_len > 0:
        return lax.cond(pr.j < plan.n_sel, selected, tail, carry0)
    return selected(carry0)


def _sparse_kernel(layer_ref, il, *refs, per_head, plan):
    # layer_ref [1] (cache layer); il the index layer (`_layer_inputs`); then q_ref
    # [rows, d]; idx_ref [Li, b, k|1, K]; cnt_ref [Li, b, k|1]; ts_ref, qp_ref [b]; k_ref,
    # v_ref [L, b, k, s, d]; o_ref [rows, d], m_ref, l_ref [rows]
    q_ref, idx_ref, cnt_ref, ts_ref, qp_ref, k_ref, v_ref, o_ref, m_ref, l_ref = refs
    bi, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hi = h if per_head else jnp.int32(0)
    q = q_ref[...]  # [rows, d]
    pr = _Program(k_ref, v_ref, idx_ref, cnt_ref, ts_ref, layer_ref[0], il, bi, h, hi, j,
                  qp_ref[bi])
    o, m, l, _ = _chunk_attention(((q, slice(None)),), pr, plan, skip_qpos=False)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _chunking(b, kh, n_idx, tail_len, blocks, *, s_len, d, split=True) -> _ChunkPlan:
    """The entries cut into chunks of equal length, enough programs per (sequence, KV
    head) to reach `blocks.target_programs` (one if not split)."""
    bk = max(16, min(blocks.block_k, pow2_at_least(max(n_idx, tail_len, 1))))
    entries = n_idx + tail_len
    plan = functools.partial(_ChunkPlan, block_k=bk, n_idx=n_idx, tail_len=tail_len,
                             s_len=s_len, scale=d**-0.5)
    if not split:  # one program walks the whole list, then the whole tail
        return plan(chunk=pl.cdiv(max(n_idx, tail_len, 1), bk) * bk, n_sel=1, n_prog=1)
    per_bh = max(1, min(pl.cdiv(entries, bk), pl.cdiv(blocks.target_programs, b * kh)))
    chunk = pl.cdiv(pl.cdiv(entries, per_bh), bk) * bk
    n_sel = max(1, pl.cdiv(n_idx, chunk))
    n_prog = n_sel + (pl.cdiv(tail_len, chunk) if tail_len > 0 else 0)
    return plan(chunk=chunk, n_sel=n_sel, n_prog=n_prog)


def _layer_inputs(kernel, layer, idx_layer):
    """The layer scalars as kernel inputs: (kernel taking (layer_ref, il, ...), operands).
    The index layer is a constant or the cache layer itself in every model call; then only
    the cache layer travels, as one [1] array (a bitcast of the scalar: stacking the two
    scalars, or handing one buffer twice, costs a kernel or a copy every layer)."""
    if idx_layer is layer or isinstance(idx_layer, int):
        def same(layer_ref, *refs, **kw):
            il = layer_ref[0] if idx_layer is layer else jnp.int32(idx_layer)
            return kernel(layer_ref, il, *refs, **kw)
        return same, [scalar(layer)]

    def two(layer_ref, il_ref, *refs, **kw):
        return kernel(layer_ref, il_ref[0], *refs, **kw)
    return two, [scalar(layer), scalar(idx_layer)]


def _index_inputs(b, index: SparseIndex):
    """(idx4 [Li, b, k|1, K], cnt3 [Li, b, k|1], the index layer, per KV head or not)."""
    idx, count, idx_layer = index.idx, index.count, index.idx_layer
    if idx_layer is None:
        idx, count, idx_layer = idx[None], count[None], 0
    per_head = idx.ndim == 4
    idx4 = (idx if per_head else idx[:, :, None, :]).astype(jnp.int32)  # [Li, b, k|1, K]
    cnt3 = jnp.broadcast_to(count.reshape(count.shape[0], b, -1),
                            idx4.shape[:3]).astype(jnp.int32)
    return idx4, cnt3, idx_layer, per_head


def sparse_attention(q, k_cache, v_cache, layer, index: SparseIndex, *, tail_len, sinks=None,
                     interpret=False, blocks: SparseBlocks = SparseBlocks()):
    """Pallas (Triton) op with exactly `sparse_attention_reference`'s semantics (sinks
    enter in the combine, `with_sinks`).

    Returns out [b, 1, k, g, d] in q.dtype.
    """
    b, _, kh, g, d = q.shape
    s = k_cache.shape[3]
    idx4, cnt3, idx_layer, per_head = _index_inputs(b, index)
    plan = _chunking(b, kh, idx4.shape[-1], tail_len, blocks, s_len=s, d=d)
    rows = pow2_at_least(g)
    qr = jnp.pad(q[:, 0], ((0, 0), (0, 0), (0, rows - g), (0, 0)))  # [b, kh, rows, d]

    kernel, scalars = _layer_inputs(functools.partial(
        _sparse_kernel, per_head=per_head, plan=plan), layer, idx_layer)
    spec_o = pl.BlockSpec((None, None, None, rows, d), lambda bi, h, c: (bi, h, c, 0, 0))
    spec_v = pl.BlockSpec((None, None, None, rows), lambda bi, h, c: (bi, h, c, 0))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, kh, plan.n_prog),
        in_specs=[
            *[whole((1,))] * len(scalars),
            pl.BlockSpec((None, None, rows, d), lambda bi, h, c: (bi, h, 0, 0)),
            whole(idx4.shape),
            whole(cnt3.shape),
            whole((b,)),
            whole((b,)),
            whole(k_cache.shape),
            whole(v_cache.shape),
        ],
        out_specs=[spec_o, spec_v, spec_v],
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, plan.n_prog, rows, d), jnp.float32),  # [b, k, J, rows, d]
            jax.ShapeDtypeStruct((b, kh, plan.n_prog, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, plan.n_prog, rows), jnp.float32),
        ],
        compiler_params=pltr.CompilerParams(num_warps=blocks.num_warps,
                                            num_stages=blocks.num_stages),
        interpret=interpret,
        name="vegas_sparse_attention",
    )(*scalars, qr, idx4, cnt3, index.tail_start.astype(jnp.int32),
      index.q_pos.astype(jnp.int32), k_cache, v_cache)
    out, lse = combine_splits(o, m, l)  # [b, kh, rows, d], [b, kh, rows]
    if sinks is not None:  # padded rows get the last head's sink: never read
        out, _ = with_sinks(out, lse, jnp.pad(sinks, ((0, 0), (0, rows - g)), mode="edge"))
    return out[:, None, :, :g].astype(q.dtype)


# ---------------------------------------------------------------------------------------
# The draft step's whole attention block in one kernel
# ---------------------------------------------------------------------------------------
#
# A draft step runs one token through every layer; at small models its time goes to the
# number of kernels, not their bytes. `sparse_step` takes the layer's raw Q/K/V projection
# and does, per (sequence, KV head): the Q/K RMS norm (Qwen3), RoPE (rotate-half, as the
# two halves of the head dim), the new token's K/V write into the cache (in place, through
# input/output aliasing), and the sparse attention above. The new token's own entry is
# taken from registers, never read back from the cache: other programs of the same call
# may not see the write yet. With one program per (sequence, KV head) the kernel also
# normalises and writes the output rows itself, so no combine pass follows.


def _rms(parts, w_ref, eps, d):
    """RMS-normalise the row(s) held as halves `parts` ([r, d/2] each), times the weight
    w_ref [d] in the input dtype, as the model's `rms_norm` does."""
    dt = parts[0].dtype
    fs = [x.astype(jnp.float32) for x in parts]
    inv = lax.rsqrt(sum(jnp.sum(f * f, axis=-1) for f in fs) / d + eps)  # [r]
    half = d // 2
    return [w_ref[pl.ds(i * half, half)][None, :] * (f * inv[:, None]).astype(dt)
            for i, f in enumerate(fs)]


def _rope(x1, x2, cos, sin):
    """Rotate-half RoPE on the halves x1, x2 [r, d/2] with cos, sin [1, d/2] fp32."""
    dt = x1.dtype
    f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    return (f1 * cos - f2 * sin).astype(dt), (f2 * cos + f1 * sin).astype(dt)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """A draft step's attention settings (static): tail_len, the tail's most entries;
    num_heads, query heads (of this device); qk_norm, Qwen3's Q/K RMS norms (weights
    read); eps, the RMS norms' epsilon."""

    tail_len: int
    num_heads: int
    qk_norm: bool = False
    eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class _StepConfig:
    """`_step_kernel`'s static settings: per_head index lists; g query heads per KV head of
    kh; qk_norm, eps; normalize (one program a pair, normalised in the kernel); hidden, the
    width of x (0: no x)."""

    per_head: bool
    g: int
    kh: int
    qk_norm: bool
    eps: float
    normalize: bool
    hidden: int


def _step_qkv(qkv_ref, x_ref, qn_ref, kn_ref, rope_ref, pid, bi, h, rid, cfg: _StepConfig):
    """The program's query rows q, its KV head's k (each as two [r, d/2] halves) and v
    [1, d]: the input norm's row scale (with x), the Q/K norms, RoPE at the query's
    position."""
    g, kh, hidden, eps = cfg.g, cfg.kh, cfg.hidden, cfg.eps
    d = qkv_ref.shape[-1]
    half = d // 2
    lo, up = pl.ds(0, half), pl.ds(half, half)
    cos = rope_ref[bi, 0, :][None, :]  # [1, d/2]
    sin = rope_ref[bi, 1, :][None, :]

    q = [qkv_ref[pid, rid, lo], qkv_ref[pid, rid, up]]  # gather [rows, d/2] x 2
    k = [qkv_ref[pid, pl.ds(kh * g + h, 1), lo], qkv_ref[pid, pl.ds(kh * g + h, 1), up]]
    v = qkv_ref[pid, pl.ds(kh * g + kh + h, 1), :]  # [1, d]
    if hidden:  # the input norm's scale of this sequence's row: (r x) @ W = r (x @ W)
        hp = pow2_at_least(hidden)
        xr = pltr.load(x_ref.at[pid, pl.ds(0, hp)], mask=jnp.arange(hp) < hidden,
                       other=0).astype(jnp.float32)  # [hp]
        r = lax.rsqrt(jnp.sum(xr * xr) / hidden + eps)
        q, k = ([(a.astype(jnp.float32) * r).astype(a.dtype) for a in part] for part in (q, k))
        v = (v.astype(jnp.float32) * r).astype(v.dtype)
    if cfg.qk_norm:
        q, k = _rms(q, qn_ref, eps, d), _rms(k, kn_ref, eps, d)
    return _rope(*q, cos, sin), _rope(*k, cos, sin), v


def _with_own_entry(q, k, v, attn, scale):
    """attn (o, m, l, hits) with the new token's own entry added as often as the chunk
    listed its position (its K/V from registers: the cache row is this call's write)."""
    o, m, l, hits = attn
    s_new = sum(jnp.sum(qp.astype(jnp.float32) * kp.astype(jnp.float32), axis=-1)
                for qp, kp in zip(q, k)) * scale  # [rows]
    seen = hits > 0
    m_new = jnp.where(seen, jnp.maximum(m, s_new), m)
    corr = jnp.exp(m - m_new)
    p = jnp.where(seen, jnp.exp(s_new - m_new) * hits.astype(jnp.float32), 0.0)
    l = l * corr + p
    o = o * corr[:, None] + p[:, None] * v.astype(jnp.float32)
    return o, m_new, l


def _step_kernel(layer_ref, il, qkv_ref, *refs, cfg: _StepConfig, plan: _ChunkPlan):
    # layer_ref [1]; il the index layer; qkv_ref [b, n + 2k, d] (raw projection: q heads |
    # k heads | v heads); x_ref [b, hidden] (the layer's input, when `hidden`: qkv is then
    # its projection before the RMS norm's row scale, applied here);
    # qn_ref, kn_ref [d] (q, k norm weights; absent without qk_norm);
    # rope_ref [b, 2, d/2] (cos, sin of the query's
    # position); idx_ref, cnt_ref, ts_ref, qp_ref as in `_sparse_kernel`;
    # k_ref, v_ref [L, b, k, s, d] (read); outs: o_ref [b, n, d] when normalize, else
    # o_ref [rows, d], m_ref, l_ref [rows]; then ko_ref, vo_ref (= k_ref, v_ref, aliased)
    x_ref, refs = (refs[0], refs[1:]) if cfg.hidden else (None, refs)
    qn_ref, kn_ref = refs[:2] if cfg.qk_norm else (None, None)
    rope_ref, idx_ref, cnt_ref, ts_ref, qp_ref, k_ref, v_ref, *outs = refs[2 * cfg.qk_norm:]
    if cfg.normalize:
        o_ref, ko_ref, vo_ref = outs
    else:
        o_ref, m_ref, l_ref, ko_ref, vo_ref = outs
    # rows of qkv past the cache's batch pad the residual stream (`sparse_step`): their
    # programs read the last sequence's scalars, walk nothing, write no cache and output 0
    pid, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b = qp_ref.shape[0]
    live = pid < b
    bi = jnp.minimum(pid, b - 1)
    hi = h if cfg.per_head else jnp.int32(0)
    layer = layer_ref[0]
    qpos = qp_ref[bi]
    half = qkv_ref.shape[-1] // 2
    lo, up = pl.ds(0, half), pl.ds(half, half)
    rows = pow2_at_least(cfg.g)
    # padded rows repeat the head's last query row: they compute (and write) the same values
    rid = h * cfg.g + jnp.minimum(jnp.arange(rows, dtype=jnp.int32), cfg.g - 1)  # [rows]
    q, k, v = _step_qkv(qkv_ref, x_ref, qn_ref, kn_ref, rope_ref, pid, bi, h, rid, cfg)

    # the new token's K/V into the cache; the walk never reads that row (its own entry
    # comes from registers)
    @pl.when((j == 0) & (qpos < plan.s_len) & live)
    def _write():
        ko_ref[layer, bi, h, pl.ds(qpos, 1), lo] = k[0]  # [1, d/2]
        ko_ref[layer, bi, h, pl.ds(qpos, 1), up] = k[1]
        vo_ref[layer, bi, h, pl.ds(qpos, 1), :] = v  # [1, d]

    # keys gathered as two half rows, each dotted with its RoPE half of the query (whole-row
    # key loads: RESULTS.md "Levers measured and not kept")
    pr = _Program(k_ref, v_ref, idx_ref, cnt_ref, ts_ref, layer, il, bi, h, hi, j, qpos, live)
    attn = _chunk_attention(((q[0], lo), (q[1], up)), pr, plan, skip_qpos=True,
                            one_program=cfg.normalize)
    o, m, l = _with_own_entry(q, k, v, attn, plan.scale)
    if cfg.normalize:
        o = o / jnp.where(l == 0.0, 1.0, l)[:, None]
        o_ref[pid, rid, :] = o.astype(o_ref.dtype)
    else:
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l


def rope_halves(cos, sin):
    """cos, sin [b, 1, d] (the two halves equal, as `rope_tables` makes them) -> the
    [b, 2, d/2] fp32 table `sparse_step` reads. Made once per forward, not per layer."""
    half = cos.shape[-1] // 2
    return jnp.stack([cos[:, 0, :half], sin[:, 0, :half]], axis=1).astype(jnp.float32)


def scalar(x):
    """An int32 scalar as the [1] array a kernel reads (a bitcast, no kernel of its own)."""
    return jnp.asarray(x, jnp.int32).reshape(1)


# The split path's combine as one kernel (XLA's `combine_splits` + slice + cast are three):
# a program per (sequence, KV head, d-block) loads all J chunks at once, not one by one.

_COMBINE_ELEMS = 16384  # Jp * gp * db fp32 values of o held by one program


def _combine_blocks(n_chunks, g, d):
    """(Jp, gp, db): chunks and rows padded to powers of two, and the largest d-block (a
    power of two dividing d, at least 16 or d) that keeps Jp * gp * db <= _COMBINE_ELEMS."""
    jp, gp = pow2_at_least(n_chunks, 1), pow2_at_least(g, 1)
    db = d & -d  # the largest power of two dividing d
    while db > 16 and jp * gp * db > _COMBINE_ELEMS:
        db //= 2
    return jp, gp, db


def _combine_kernel(o_ref, m_ref, l_ref, out_ref, *, n_chunks, g, jp, gp, db):
    # o_ref [bq, k, J, rows, d], m_ref, l_ref [bq, k, J, rows] (whole); out_ref [bq, k, g, d]
    bi, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ok = (jnp.arange(jp)[:, None] < n_chunks) & (jnp.arange(gp)[None, :] < g)  # [Jp, gp]
    ml = (bi, h, pl.ds(0, jp), pl.ds(0, gp))
    m = pltr.load(m_ref.at[ml], mask=ok, other=NEG)  # [Jp, gp]
    l = pltr.load(l_ref.at[ml], mask=ok, other=0.0)
    cols = pl.ds(c * db, db)
    o = pltr.load(o_ref.at[(*ml, cols)], mask=jnp.broadcast_to(ok[:, :, None], (jp, gp, db)),
                  other=0.0)  # [Jp, gp, db]
    mx = m.max(axis=0)  # [gp]
    w = jnp.exp(m - mx[None, :])  # [Jp, gp]
    lsum = (l * w).sum(axis=0)
    lsafe = jnp.where(lsum == 0.0, 1.0, lsum)  # a row no chunk saw outputs 0
    out = (o * w[:, :, None]).sum(axis=0) / lsafe[:, None]  # [gp, db]
    pltr.store(out_ref.at[bi, h, pl.ds(0, gp), cols], out.astype(out_ref.dtype),
               mask=jnp.broadcast_to((jnp.arange(gp) < g)[:, None], (gp, db)))


def combine_step_splits(o, m, l, g, out_dtype, *, interpret=False):
    """`combine_splits(o, m, l)[0][:, :, :g].astype(out_dtype)` in one Pallas (Triton)
    kernel. o [bq, k, J, rows, d] fp32 unnormalised, m, l [bq, k, J, rows] (empty chunks:
    m = NEG, l = 0); rows >= g. Returns [bq, k, g, d] in out_dtype."""
    bq, kh, n_chunks, rows, d = o.shape
    jp, gp, db = _combine_blocks(n_chunks, g, d)
    assert g <= gp <= rows, (g, rows)  # rows = pow2_at_least(g) >= 16: the gp rows exist
    kernel = functools.partial(_combine_kernel, n_chunks=n_chunks, g=g, jp=jp, gp=gp, db=db)
    return pl.pallas_call(
        kernel,
        grid=(bq, kh, d // db),
        in_specs=[whole(o.shape), whole(m.shape), whole(l.shape)],
        out_specs=whole((bq, kh, g, d)),
        out_shape=jax.ShapeDtypeStruct((bq, kh, g, d), out_dtype),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="vegas_step_combine",
    )(o, m, l)


def _step_outputs(bq, kh, rows, plan: _ChunkPlan, spec: StepSpec, qkv_dtype, k_cache,
                  normalize):
    """`sparse_step`'s (out_specs, out_shape): the attention output (normalised rows, or
    each chunk's o, m, l), then the two caches."""
    d = k_cache.shape[-1]
    cache_shape = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    caches = [whole(k_cache.shape), whole(k_cache.shape)]
    if normalize:
        return ([whole((bq, spec.num_heads, d)), *caches],
                [jax.ShapeDtypeStruct((bq, spec.num_heads, d), qkv_dtype), cache_shape,
                 cache_shape])
    spec_o = pl.BlockSpec((None, None, None, rows, d), lambda bi, h, c: (bi, h, c, 0, 0))
    spec_v = pl.BlockSpec((None, None, None, rows), lambda bi, h, c: (bi, h, c, 0))
    return ([spec_o, spec_v, spec_v, *caches], [
        jax.ShapeDtypeStruct((bq, kh, plan.n_prog, rows, d), jnp.float32),  # [bq, k, J, rows, d]
        jax.ShapeDtypeStruct((bq, kh, plan.n_prog, rows), jnp.float32),
        jax.ShapeDtypeStruct((bq, kh, plan.n_prog, rows), jnp.float32),
        cache_shape, cache_shape])


def _check_step(qkv, k_cache, spec: StepSpec):
    bq = qkv.shape[0]
    _, b, kh, _, d = k_cache.shape
    if bq < b:
        raise ValueError(f"qkv has {bq} rows for a cache of {b} sequences")
    heads = spec.num_heads + 2 * kh
    if qkv.shape[-1] % d or qkv.shape[-1] < heads * d:
        raise ValueError(f"qkv's last axis ({qkv.shape[-1]}) must hold the {heads} q/k/v "
                         f"heads of width {d}, and whole heads after them")


def sparse_step(qkv, q_norm, k_norm, rope, k_cache, v_cache, layer, index: SparseIndex, *,
                spec: StepSpec, x=None, interpret=False, blocks: StepBlocks = StepBlocks()):
    """One draft token's attention block for one layer, in one Pallas (Triton) call:
    `sparse_step_reference`'s semantics.

    qkv [b, 1, (n + 2k) * d + extra]: the layer's raw Q/K/V projection, possibly followed
    by columns the kernel never reads; x [b, h] or None: the
    layer's input, when qkv is its projection before the input RMS norm (whose weight is
    folded into the projection): the kernel scales each sequence's q, k, v by the norm's
    rsqrt(mean(x**2) + eps), one kernel launch a layer fewer; q_norm, k_norm [d]: the Q
    and K RMS-norm weights (read when spec.qk_norm); rope [b, 2, d/2]: `rope_halves` of
    the RoPE tables at q_pos; caches [L, b, k, s, d], written at q_pos (layer `layer`)
    and returned; index as in `sparse_attention`. Every input but qkv and the norms is
    the same for all layers of a step: built once, outside the layer loop (a per-layer
    stack or concatenation costs a kernel launch a layer).
    qkv (and x) may carry rows past the cache's b sequences (bq >= b: the model pads a
    draft's rows to `model.ROW_PAD`): their outputs are zeros and they touch no cache.
    Returns (out [bq, 1, k, g, d] in qkv.dtype, k_cache, v_cache).
    """
    _check_step(qkv, k_cache, spec)
    bq = qkv.shape[0]
    _, b, kh, s, d = k_cache.shape
    g = spec.num_heads // kh
    n_rows = qkv.shape[-1] // d  # the kernel reads rows 0 .. num_heads + 2 kh - 1 only
    idx4, cnt3, idx_layer, per_head = _index_inputs(b, index)
    normalize = b * kh >= blocks.whole_from
    if normalize:
        tiles = blocks.whole if d <= 64 else blocks.whole_wide
    else:
        tiles = blocks.split if d <= 64 else blocks.split_wide
    plan = _chunking(b, kh, idx4.shape[-1], spec.tail_len, tiles, s_len=s, d=d,
                     split=not normalize)
    rows = pow2_at_least(g)
    cfg = _StepConfig(per_head=per_head, g=g, kh=kh, qk_norm=spec.qk_norm, eps=spec.eps,
                      normalize=normalize, hidden=0 if x is None else x.shape[-1])
    kernel, scalars = _layer_inputs(functools.partial(_step_kernel, cfg=cfg, plan=plan),
                                    layer, idx_layer)
    norms = [q_norm.astype(qkv.dtype), k_norm.astype(qkv.dtype)] if spec.qk_norm else []
    xs = [] if x is None else [x]
    n_in = len(scalars) + 1 + len(xs) + len(norms) + 5  # index of k_cache: the caches come last
    out_specs, out_shape = _step_outputs(bq, kh, rows, plan, spec, qkv.dtype, k_cache,
                                         normalize)
    n_out = len(out_shape)
    res = pl.pallas_call(
        kernel,
        grid=(bq, kh, plan.n_prog),
        in_specs=[*[whole((1,))] * len(scalars), whole((bq, n_rows, d)),
                  *[whole(a.shape) for a in xs],
                  *[whole((d,))] * len(norms), whole((b, 2, d // 2)), whole(idx4.shape),
                  whole(cnt3.shape), whole((b,)), whole((b,)), whole(k_cache.shape),
                  whole(v_cache.shape)],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={n_in: n_out - 2, n_in + 1: n_out - 1},
        compiler_params=pltr.CompilerParams(num_warps=tiles.num_warps,
                                            num_stages=tiles.num_stages),
        interpret=interpret,
        name="vegas_sparse_step",
    )(*scalars, qkv.reshape(bq, n_rows, d), *xs, *norms, rope.astype(jnp.float32),
      idx4, cnt3, index.tail_start.astype(jnp.int32), index.q_pos.astype(jnp.int32),
      k_cache, v_cache)
    k_cache, v_cache = res[-2:]
    if normalize:
        out = res[0].reshape(bq, kh, g, d)
    elif b * kh >= blocks.combine_from:
        out = combine_step_splits(*res[:3], g, qkv.dtype, interpret=interpret)
    else:
        out, _ = combine_splits(*res[:3])  # [bq, kh, rows, d]
        out = out[:, :, :g].astype(qkv.dtype)  # [bq, kh, g, d]
    return out[:, None], k_cache, v_cache


def sparse_step_reference(qkv, q_norm, k_norm, rope, k_cache, v_cache, layer,
                          index: SparseIndex, *, spec: StepSpec, x=None):
    """Input-norm scale (with x), split, norm, RoPE, cache write and
    `sparse_attention_reference`, in plain XLA."""
    bq = qkv.shape[0]
    _, b, kh, s, d = k_cache.shape
    num_heads, eps, q_pos = spec.num_heads, spec.eps, index.q_pos
    qkv = qkv[:b]  # padding rows (`sparse_step`) output zeros
    if x is not None:
        x = x[:b]
        xf = x.astype(jnp.float32)
        r = lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)  # [b]
        qkv = (qkv.astype(jnp.float32) * r[:, None, None]).astype(qkv.dtype)
    y = qkv.reshape(b, 1, -1, d)  # columns past the q/k/v heads are ignored
    q, k = y[:, :, :num_heads], y[:, :, num_heads:num_heads + kh]
    v = y[:, :, num_heads + kh:num_heads + 2 * kh]
    cos = jnp.concatenate([rope[:, 0], rope[:, 0]], -1)[:, None]  # [b, 1, d]
    sin = jnp.concatenate([rope[:, 1], rope[:, 1]], -1)[:, None]

    def rms(y, w):
        yf = y.astype(jnp.float32)
        yf = yf * lax.rsqrt(jnp.mean(yf * yf, axis=-1, keepdims=True) + eps)
        return w.astype(y.dtype) * yf.astype(y.dtype)

    def rope(y):
        yf = y.astype(jnp.float32)
        rot = jnp.concatenate([-yf[..., d // 2:], yf[..., :d // 2]], axis=-1)
        return (yf * cos[:, :, None] + rot * sin[:, :, None]).astype(y.dtype)

    if spec.qk_norm:
        q, k = rms(q, q_norm), rms(k, k_norm)
    q, k = rope(q), rope(k)
    ok = q_pos < s
    at = jnp.minimum(q_pos, s - 1)
    bi = jnp.arange(b)
    k_cache = k_cache.at[layer, bi, :, at].set(
        jnp.where(ok[:, None, None], k[:, 0], k_cache[layer, bi, :, at]))
    v_cache = v_cache.at[layer, bi, :, at].set(
        jnp.where(ok[:, None, None], v[:, 0], v_cache[layer, bi, :, at]))
    out = sparse_attention_reference(q.reshape(b, 1, kh, num_heads // kh, d), k_cache, v_cache,
                                     layer, index, tail_len=spec.tail_len)
    return jnp.pad(out, ((0, bq - b),) + ((0, 0),) * 4), k_cache, v_cache

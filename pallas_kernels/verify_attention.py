"""Causal attention of a few query tokens over the KV cache, with score capture.

Serves decode (t = 1), verification (t = gamma + 1) and, in query chunks, prefill. The
side output is the per-position criticality score that Vegas's selector ranks: from the
chosen query rows only, averaged over all query heads of the layer.

Shapes: q [b, t, k, g, d]; cache k/v [L, b, k, s, d] (the full stacked cache plus a layer
index, so no per-layer slab is copied); q_pos [b, t] (row t sees keys s <= q_pos[b, t]).
Scores (`CaptureSpec`): [b, s] fp32 for reduce="mean" (mean over heads and capture rows),
[b, r, s] for reduce="rows" (mean over heads, one per capture row).

Layout (as jax's Pallas GPU ops): the kernel (`_verify_kernel`, its refs named as
`_Operands`), its `pallas_call` wrapper (`_verify_call`), the public op
(`verify_attention`), the reference (`verify_attention_reference`); `cudnn_attention` is
cuDNN's flash attention for a fresh prompt, which the caller chooses
(`vegas_jax.attention.causal_impl`).

gpt-oss extras: window (an int32 scalar, may be traced; 0 = none): row t sees only keys
q_pos - window < s <= q_pos; sinks [k, g] fp32: one more logit per query head in the
softmax's denominator, with no value (the weights of the keys sum to less than one; the
captured weights are those).
"""


from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import (
    NEG, SMEM_BYTES, combine_splits, dot, empty, key_splits, pow2_at_least, sm_count,
    wave_splits, whole, with_sinks,
)

# The score names, defined here once (vegas_jax imports them): "weight" = softmax weights,
# "logit" = raw logits, each averaged over the layer's query heads.
SCORES = ("weight", "logit")
REDUCTIONS = ("mean", "rows")


@dataclasses.dataclass(frozen=True)
class CaptureSpec:
    """Which query rows' attention becomes the side output, and how.

    rows: query rows (token indices of the call; negative ones count from the end).
    reduce: "mean" averages them into one score vector a sequence [b, s]; "rows" keeps
      one per entry of `rows` [b, r, s].
    score: "weight" (softmax weights) or "logit" (raw logits), over all query heads."""

    rows: tuple[int, ...]
    reduce: str = "mean"
    score: str = "weight"

    def __post_init__(self):
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be 'mean' or 'rows', got {self.reduce!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")


@dataclasses.dataclass(frozen=True)
class _CaptureRows:
    """A capture's rows within a call of t tokens: `listed` (each entry of the spec's
    rows, mod t), `uniq` (the distinct ones, sorted) and `mult` (each one's share)."""

    listed: tuple[int, ...]
    uniq: tuple[int, ...]
    mult: tuple[float, ...]

    @classmethod
    def of(cls, capture: CaptureSpec | None, t: int) -> "_CaptureRows":
        listed = tuple(int(r) % t for r in capture.rows) if capture is not None else ()
        uniq = tuple(sorted(set(listed)))
        return cls(listed, uniq, tuple(listed.count(u) / len(listed) for u in uniq))


# ---------------------------------------------------------------------------------------
# Pallas (Triton backend) kernel
# ---------------------------------------------------------------------------------------
#
# One program = (sequence b, KV head h, query block qb, key split j). Its rows are the
# query tokens of block qb times the GQA group (row = token * g + head), padded to a power
# of two >= 16. It loops over key blocks of split j up to the largest position its rows can
# see, reading K/V straight out of the full stacked cache at `layer` (no per-layer copy), and
# writes the unnormalised split output plus the running max / sum; XLA combines the splits.
# Logits, max and LSE are in log2 units (the scale carries log2 e): exp2 is cheaper than
# exp, and the XLA side converts.
#
# Score capture: the capture tokens are permuted to the front, so their rows are the first
# `n_cap` rows overall. score="weight" (`StoreLogits`): the kernel stores their raw scaled
# logits (fp16 by default) from the main product's tile with a masked store into a side
# buffer, and `capture_scores` turns them into weights with the combined LSE (no second
# pass over K). score="logit" (`SumLogits`, linear in the logits): the kernel sums the
# capture rows' logits itself.
#
# Verify / decode (t * g <= max_rows): one query block, split-K over the cache.
# Prefill (t * g > max_rows): many query blocks of `row_block` rows, causal block skipping,
# split-K only when the grid would otherwise be too small. Never materialises s x s.

_LOGIT_CLIP = 60000.0  # keeps the fp16 capture cast finite (fp16 max 65504)
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class VerifyBlocks:
    """Launch knobs; None picks per shape in `verify_attention`. The defaults are the
    fastest plans `benchmarks/tune_verify.py` and `benchmarks/kernels.py` found (64-key
    blocks at Qwen3-8B's 128K: RESULTS.md "Kernels (latest rooflines)").

    block_k: keys per loop step (None: 128 for verify / decode, 64 for prefill and for
    wide heads over fewer than 128 (sequence, KV head) pairs); num_warps (None: 4 up to
    64 rows a program, else 8); num_stages (None: 3 for verify / decode, else 2); max_rows:
    largest t * g run as one query block; row_block: rows a program in prefill;
    target_programs: the grid aimed at when choosing key splits; min_split: shortest key
    split; cap_dtype: dtype of the captured logits; waves: choose the split count by
    `wave_splits` (more splits, up to 1.5x, where they fill the grid's last wave).
    split_keys: a row-invariant plan (`INVARIANT`): keys cut into splits of this length
    whatever the batch and rows, fixed tiles, the splits combined in order.
    unmasked: each program first walks the key blocks that all its real rows see without
    the causal mask, then the rest with it (less work a block; off for windows). The mask
    keeps every logit of those blocks, yet a compiler may fuse the unmasked loop's
    multiply and subtract where the select kept them apart: whether a row's bits then
    depend on which loop reads a block is for the GPU to show
    (`benchmarks/exact_prefill.py --quick`), hence off in the row-invariant plans."""

    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    max_rows: int = 64
    row_block: int = 128
    target_programs: int = 528
    min_split: int = 512
    cap_dtype: Any = jnp.float16
    waves: bool = True
    split_keys: int | None = None
    unmasked: bool = False


# A row's output depends only on its query, position and the cache: decode rows and verify
# rows agree bit for bit (every program max_rows rows, one tile for every call).
INVARIANT = VerifyBlocks(block_k=64, num_warps=4, num_stages=2, max_rows=32, row_block=32,
                         waves=False, split_keys=1024)
# The row-invariant plan of prompt steps (`exact` prefill): every call runs query blocks of
# row_block rows (max_rows 0) and one key split (target_programs 1), whose key blocks sit at
# 0, block_k, 2 block_k, ... and are walked in order, the softmax finished in the kernel. A
# row's result does not depend on the rows beside it, the batch, the cache's length or the
# chunking: a block wholly past a row's position leaves its accumulators bit for bit as
# they were (the first block always holds key 0). A prompt row never has to equal a decode
# row (`INVARIANT`), only itself prefilled in any batch or chunks; no buffer of partial
# results per key split (at 128K those were 64 GiB).
INVARIANT_PREFILL = VerifyBlocks(block_k=64, num_warps=8, num_stages=2, max_rows=0,
                                 row_block=128, target_programs=1, waves=False)


@dataclasses.dataclass(frozen=True)
class StoreLogits:
    """Capture by storing the main product's [rows, block_k] tiles of raw scaled logits
    into a buffer [b * kh * n_cap + spare, s_pad], at row (b * kh + h) * n_cap + r for the
    capture rows r < n_cap (which may span query blocks); `spare` rows after the last keep
    the last program's masked store window inside. stacked: the buffer holds every layer's
    rows, this layer's from row layer * b * kh * n_cap on (`capture_buffer`), and comes in
    as an input aliased to the output."""

    n_cap: int
    spare: int
    stacked: bool = False


@dataclasses.dataclass(frozen=True)
class SumLogits:
    """Capture by a small [crow, d] x [d, block_k] dot of the capture rows alone (query
    block 0's programs), their raw logits masked to each row's causal range and reduced
    into len(weights) vectors, vector i weighting capture row r by weights[i][r]: buffer
    [b * kh * len(weights), s_pad]."""

    n_cap: int
    crow: int
    weights: tuple[tuple[float, ...], ...]


@dataclasses.dataclass(frozen=True)
class _KernelConfig:
    """What one launch of `_verify_kernel` computes (static): key blocks of block_k, splits
    of split_len keys over a cache of s_len, `rows` rows a program of which `real_rows` are
    not padding, kh KV heads; normalize: finish the single split in the kernel (m then
    holds the LSE)."""

    block_k: int
    split_len: int
    n_splits: int
    s_len: int
    rows: int
    real_rows: int
    kh: int
    normalize: bool
    capture: StoreLogits | SumLogits | None = None
    unmasked: bool = False


class _Operands(NamedTuple):
    """The kernel's inputs, in its argument order (None: absent, no ref)."""

    layer: jax.Array  # [1] int32
    window: jax.Array | None  # [1] int32 (0: none)
    q: jax.Array  # [b, kh, nqb * rows, d]
    rowpos: jax.Array  # [b, nqb * rows] (-1: padding row)
    k_cache: jax.Array  # [L, b, kh, s, d]
    v_cache: jax.Array  # [L, b, kh, s, d]
    qc: jax.Array | None = None  # SumLogits: the capture rows [b, kh, crow, d]
    rpc: jax.Array | None = None  # SumLogits: their positions [b, crow] (-1: padding)
    cap_into: jax.Array | None = None  # StoreLogits.stacked: the buffer, aliased


def _key_range(cfg: _KernelConfig, rp, win_ref, j):
    """Split j's first key, its key blocks, the window (None without win_ref; 0: all) and
    each row's last unseen key lo (row r sees keys lo[r] < s <= rp[r]; None without a
    window). rp [rows]."""
    start = j * cfg.split_len
    # causal block skipping: no row of this program sees past max(rp)
    end = jnp.minimum(jnp.minimum(start + cfg.split_len, jnp.max(rp) + 1), cfg.s_len)
    win = lo = None
    if win_ref is not None:
        win = win_ref[0]
        lo = jnp.where(win > 0, rp - win, -1)  # [rows]
        # ... nor before the first of its rows' windows (block-aligned: the capture stores
        # whole key blocks)
        first = jnp.min(jnp.where(rp >= 0, lo + 1, cfg.s_len))
        start = jnp.maximum(start, first // cfg.block_k * cfg.block_k)
    return start, pl.cdiv(jnp.maximum(end - start, 0), cfg.block_k), win, lo


def _capture_row0(cfg: _KernelConfig, bi, h, layer):
    """StoreLogits: the first buffer row of program (bi, h)'s capture rows."""
    cap = cfg.capture
    row0 = (bi * cfg.kh + h) * cap.n_cap
    if cap.stacked:
        row0 += layer * pl.num_programs(0) * cfg.kh * cap.n_cap
    return row0


def _logit_store(cfg: _KernelConfig, cap_ref, row0, qb):
    """StoreLogits: fn(qk [rows, block_k], k0) storing the capture rows' tile."""
    cap = cfg.capture
    rr = jnp.arange(cfg.rows, dtype=jnp.int32)
    first = qb * cfg.real_rows  # this query block's first row among all real rows

    def store(qk, k0):
        val = jnp.clip(qk, -_LOGIT_CLIP, _LOGIT_CLIP).astype(cap_ref.dtype)
        pltr.store(cap_ref.at[pl.ds(row0 + first, cfg.rows), pl.ds(k0, cfg.block_k)],
                   val, mask=((rr < cfg.real_rows) & (first + rr < cap.n_cap))[:, None])

    return lambda qk, k0: pl.when(first < cap.n_cap)(lambda: store(qk, k0))


def _logit_sum(cfg: _KernelConfig, qc_ref, rpc_ref, cap_ref, win, bi, h, scale):
    """SumLogits: fn(k [block_k, d], k0, kidx [block_k]) reducing the capture rows'
    logits of one key block into the buffer."""
    cap = cfg.capture
    qc = qc_ref[...]  # [crow, d]
    rpc = rpc_ref[...]  # [crow]
    rc = jnp.arange(cap.crow, dtype=jnp.int32)

    def reduce(k, k0, kidx):
        qk = dot(qc, k, trans_b=True) * scale  # [crow, block_k] fp32
        seen = kidx[None, :] <= rpc[:, None]
        if win is not None:
            seen &= kidx[None, :] > jnp.where(win > 0, rpc - win, -1)[:, None]
        qk = jnp.where(seen, qk, 0.0)
        for i, wts in enumerate(cap.weights):
            w = jnp.zeros((cap.crow,), jnp.float32)  # [crow]
            for r, wr in enumerate(wts):
                if wr:
                    w = jnp.where(rc == r, jnp.float32(wr), w)
            vec = jnp.sum(qk * w[:, None], axis=0)  # [block_k]
            pltr.store(cap_ref.at[(bi * cfg.kh + h) * len(cap.weights) + i,
                                  pl.ds(k0, cfg.block_k)], vec)

    return reduce


def _verify_kernel(layer_ref, win_ref, q_ref, rowpos_ref, k_ref, v_ref, qc_ref, rpc_ref,
                   cap_in_ref, o_ref, m_ref, l_ref, cap_ref, *, cfg: _KernelConfig):
    """Flash-decoding over one key split (refs as `_Operands`, then o, m, l [rows(, d)]
    and the capture buffer; None where absent)."""
    del cap_in_ref  # the stacked buffer, aliased to cap_ref: written through that
    bi, h, qb, j = (pl.program_id(a) for a in range(4))
    layer = layer_ref[0]
    stored = isinstance(cfg.capture, StoreLogits)
    row0 = _capture_row0(cfg, bi, h, layer) if stored else None
    q = q_ref[...]  # [rows, d]
    rp = rowpos_ref[...]  # [rows]
    d = q.shape[-1]
    scale = d**-0.5 * _LOG2E  # log2 units
    start, nblk, win, lo = _key_range(cfg, rp, win_ref, j)
    kr = jnp.arange(cfg.block_k, dtype=jnp.int32)
    store = sum_rows = None
    if stored:
        store = _logit_store(cfg, cap_ref, row0, qb)
    elif isinstance(cfg.capture, SumLogits):
        sum_rows = _logit_sum(cfg, qc_ref, rpc_ref, cap_ref, win, bi, h, scale)

    def body(i, carry, masked=True):
        o, m, l = carry
        k0 = start + i * cfg.block_k
        kidx = k0 + kr  # [block_k]
        inb = kidx < cfg.s_len  # the last block may run past the cache
        k = pltr.load(k_ref.at[layer, bi, h, pl.ds(k0, cfg.block_k), :], mask=inb[:, None],
                      other=0.0)  # [block_k, d]
        if sum_rows is not None:  # the capture rows: query block 0 only
            pl.when(qb == 0)(lambda: sum_rows(k, k0, kidx))
        qk = dot(q, k, trans_b=True) * scale  # [rows, block_k] fp32, log2 units
        if store is not None:
            store(qk, k0)
        if masked:
            vis = kidx[None, :] <= rp[:, None]
            if lo is not None:
                vis &= kidx[None, :] > lo[:, None]
            qk = jnp.where(vis, qk, NEG)
        m_new = jnp.maximum(m, qk.max(axis=-1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(qk - m_new[:, None])  # [rows, block_k]
        l = l * corr + p.sum(axis=-1)
        v = pltr.load(v_ref.at[layer, bi, h, pl.ds(k0, cfg.block_k), :], mask=inb[:, None],
                      other=0.0)  # [block_k, d]
        o = o * corr[:, None] + dot(p.astype(v.dtype), v)
        return o, m_new, l

    o0 = jnp.zeros((cfg.rows, d), jnp.float32)  # [rows, d]
    m0 = jnp.full((cfg.rows,), NEG, jnp.float32)  # [rows]
    l0 = jnp.zeros((cfg.rows,), jnp.float32)  # [rows]
    carry = (o0, m0, l0)
    if cfg.unmasked and lo is None:  # the blocks every real row sees in full, unmasked
        low = jnp.min(jnp.where(rp >= 0, rp, cfg.s_len))  # the lowest real row's position
        n_full = jnp.clip((low + 1 - start) // cfg.block_k, 0, nblk)
        carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
        carry = lax.fori_loop(n_full, nblk, body, carry)
    else:
        carry = lax.fori_loop(0, nblk, body, carry)
    o, m, l = carry
    if cfg.normalize:  # single split: finish here (prefill), m_ref receives the LSE
        o = o / jnp.where(l == 0.0, 1.0, l)[:, None]
        m = m + jnp.log2(jnp.where(l == 0.0, 1.0, l))
    o_ref[...] = o.astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


# spare rows after a stacked buffer's last: the last program's (masked) store window of
# up to `rows` rows stays inside it
CAPTURE_SPARE = 128


def _capture_output(cfg: _KernelConfig, ops: _Operands, b: int, cap_dtype):
    """The capture buffer's (shape, dtype), or None without a capture."""
    cap = cfg.capture
    s_pad = pl.cdiv(cfg.s_len, cfg.block_k) * cfg.block_k  # the kernel stores whole blocks
    if ops.cap_into is not None:
        if not isinstance(cap, StoreLogits) or ops.cap_into.shape[1] < s_pad \
                or cap.spare > CAPTURE_SPARE:
            raise ValueError(f"a stacked capture buffer takes logits of {s_pad} keys from "
                             f"at most {CAPTURE_SPARE} rows a program, got "
                             f"{ops.cap_into.shape} for capture {cap}")
        return jax.ShapeDtypeStruct(ops.cap_into.shape, ops.cap_into.dtype)
    if isinstance(cap, StoreLogits):
        return jax.ShapeDtypeStruct((b * cfg.kh * cap.n_cap + cap.spare, s_pad), cap_dtype)
    if isinstance(cap, SumLogits):
        return jax.ShapeDtypeStruct((b * cfg.kh * len(cap.weights), s_pad), jnp.float32)
    return None


def _verify_call(ops: _Operands, cfg: _KernelConfig, blocks: VerifyBlocks, interpret: bool):
    """The `pallas_call` over grid (b, kh, query blocks, splits). blocks: resolved
    (num_warps, num_stages set). Returns o [b, kh, J, R, d] (q's dtype when normalized,
    else fp32), m, l [b, kh, J, R] (log2 units), the capture buffer | None."""
    b, kh, rtot, d = ops.q.shape
    rows, nsp = cfg.rows, cfg.n_splits
    cap_shape = _capture_output(cfg, ops, b, blocks.cap_dtype)
    out_shape = (  # o [b, kh, J, R, d], m, l [b, kh, J, R], capture buffer
        jax.ShapeDtypeStruct((b, kh, nsp, rtot, d),
                             ops.q.dtype if cfg.normalize else jnp.float32),
        jax.ShapeDtypeStruct((b, kh, nsp, rtot), jnp.float32),
        jax.ShapeDtypeStruct((b, kh, nsp, rtot), jnp.float32),
        cap_shape,
    )
    out_specs = (
        pl.BlockSpec((None, None, None, rows, d), lambda bi, h, qb, j: (bi, h, j, qb, 0)),
        pl.BlockSpec((None, None, None, rows), lambda bi, h, qb, j: (bi, h, j, qb)),
        pl.BlockSpec((None, None, None, rows), lambda bi, h, qb, j: (bi, h, j, qb)),
        None if cap_shape is None else whole(cap_shape.shape),
    )
    in_specs = _Operands(
        layer=whole((1,)),
        window=None if ops.window is None else whole((1,)),
        q=pl.BlockSpec((None, None, rows, d), lambda bi, h, qb, j: (bi, h, qb, 0)),
        rowpos=pl.BlockSpec((None, rows), lambda bi, h, qb, j: (bi, qb)),
        k_cache=whole(ops.k_cache.shape),  # indexed at `layer` in the kernel
        v_cache=whole(ops.v_cache.shape),
        qc=None if ops.qc is None else pl.BlockSpec(
            (None, None, ops.qc.shape[2], d), lambda bi, h, qb, j: (bi, h, 0, 0)),
        rpc=None if ops.rpc is None else pl.BlockSpec(
            (None, ops.rpc.shape[1]), lambda bi, h, qb, j: (bi, 0)),
        cap_into=None if ops.cap_into is None else whole(ops.cap_into.shape),
    )
    # the stacked buffer, the last input leaf, is the capture output (index 3)
    aliases = {} if ops.cap_into is None else {len(jax.tree.leaves(ops)) - 1: 3}
    return pl.pallas_call(
        functools.partial(_verify_kernel, cfg=cfg),
        grid=(b, kh, rtot // rows, nsp),
        in_specs=tuple(in_specs),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=blocks.num_warps,
                                            num_stages=blocks.num_stages),
        input_output_aliases=aliases,
        interpret=interpret,
        name="vegas_verify_attention",
    )(*ops)


def capture_buffer(layers, b, kh, n_cap, s, dtype=jnp.float16):
    """The stacked buffer `verify_attention(..., capture_into=)` fills, layer by layer:
    [layers * b * kh * n_cap + CAPTURE_SPARE, s rounded up to 128] (n_cap = capture rows a
    KV head: unique capture tokens x group size), contents undefined until written."""
    return empty((layers * b * kh * n_cap + CAPTURE_SPARE, pl.cdiv(s, 128) * 128), dtype)


def capture_scores_reference(cbuf, lse, rowpos, w, s, rowlo=None):
    """cbuf [b * R + spare, s_pad] captured log2-unit logits (rows of sequence b at b * R ..),
    lse [b, R] their rows' log2 LSE, rowpos [b, R] their positions (-1: none), w [n_out, R];
    rowlo [b, R] or None: each row sees only keys after it (a sliding window).
    Returns [b, n_out, s] fp32: sum_r w[o, r] * exp2(logit - lse) over keys <= the row's
    position (keys past it hold stale or never written logits, as keys before a window)."""
    b, r = lse.shape
    logits = cbuf[: b * r, :s].reshape(b, r, s).astype(jnp.float32)
    valid = jnp.arange(s)[None, None, :] <= rowpos[:, :, None]
    if rowlo is not None:
        valid &= jnp.arange(s)[None, None, :] > rowlo[:, :, None]
    p = jnp.where(valid, jnp.exp2(logits - lse[:, :, None]), 0.0)  # [b, R, s]
    return jnp.einsum("or,brs->bos", jnp.asarray(w), p, precision=lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True)
class CaptureBlocks:
    """`capture_scores`' launch: block_s key columns a program (cut so that its
    [rows, block_s] fp32 tile stays within `tile` elements, which bounds its shared
    memory), num_warps. Defaults: 256 columns, fewer above 64 rows (16384 fp32 elements:
    64 KiB a tile)."""

    block_s: int = 256
    tile: int = 16384
    num_warps: int = 4


def _capture_scores_kernel(cbuf_ref, lse_ref, rp_ref, w_ref, *refs, r, n_out, block_s,
                           s_len, windowed=False):
    # cbuf_ref [b * r + spare, s_pad]; lse_ref, rp_ref [b, RP]; w_ref [NO, RP];
    # (rl_ref [b, RP] when windowed: each row sees keys > rl); o_ref [pow2(n_out), block_s]
    rl_ref, o_ref = refs if windowed else (None, refs[0])
    bi, sj = pl.program_id(0), pl.program_id(1)
    rp_n = lse_ref.shape[1]
    rows = jnp.arange(rp_n, dtype=jnp.int32)
    lse = lse_ref[bi, :]  # [RP]
    rp = rp_ref[bi, :]
    c0 = sj * block_s
    cols = c0 + jnp.arange(block_s, dtype=jnp.int32)  # [block_s]
    ok = (rows < r)[:, None] & (cols < s_len)[None, :]
    logits = pltr.load(cbuf_ref.at[pl.ds(bi * r, rp_n), pl.ds(c0, block_s)],
                       mask=ok, other=0.0).astype(jnp.float32)  # [RP, block_s]
    vis = ok & (cols[None, :] <= rp[:, None])
    if windowed:
        vis &= cols[None, :] > rl_ref[bi, :][:, None]
    p = jnp.where(vis, jnp.exp2(logits - lse[:, None]), 0.0)
    for i in range(n_out):  # a masked sum per output vector; rows past n_out are never read
        o_ref[i, pl.ds(0, block_s)] = jnp.sum(p * w_ref[i, :][:, None], axis=0)


def capture_scores(cbuf, lse, rowpos, w, s, rowlo=None, *,
                   blocks: CaptureBlocks = CaptureBlocks(), interpret=False):
    """`capture_scores_reference` as one Pallas (Triton) kernel a layer: programs over
    (sequence, key range), each reads its rows' logits once."""
    b, r = lse.shape
    n_out = w.shape[0]
    rp_n, no = pow2_at_least(r), pow2_at_least(n_out)
    block_s = min(blocks.block_s, max(16, blocks.tile // rp_n), pow2_at_least(s))
    nsb = pl.cdiv(s, block_s)
    rows_out = pow2_at_least(n_out, lo=1)
    lse_p = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, rp_n - r)))
    rp_p = jnp.pad(rowpos.astype(jnp.int32), ((0, 0), (0, rp_n - r)), constant_values=-1)
    w_p = jnp.pad(jnp.asarray(w, jnp.float32), ((0, no - n_out), (0, rp_n - r)))
    extra = [] if rowlo is None else [
        jnp.pad(rowlo.astype(jnp.int32), ((0, 0), (0, rp_n - r)), constant_values=-1)]
    out = pl.pallas_call(
        functools.partial(_capture_scores_kernel, r=r, n_out=n_out, block_s=block_s,
                          s_len=s, windowed=rowlo is not None),
        grid=(b, nsb),
        in_specs=[whole(cbuf.shape), whole((b, rp_n)), whole((b, rp_n)), whole((no, rp_n)),
                  *[whole((b, rp_n))] * len(extra)],
        out_specs=pl.BlockSpec((None, rows_out, block_s), lambda bi, sj: (bi, 0, sj)),
        out_shape=jax.ShapeDtypeStruct((b, rows_out, nsb * block_s), jnp.float32),
        compiler_params=pltr.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="vegas_capture_scores",
    )(cbuf, lse_p, rp_p, w_p, *extra)
    return out[:, :n_out, :s]


def _plan(b, kh, t, g, s, *, max_rows, row_block, target_programs, block_k, min_split,
          resident=None, split_keys=None):
    """Static launch plan: (rows per program, tokens per query block, query blocks, splits,
    split length). resident: programs the GPU runs at once; given, the split count is
    chosen to fill the last wave (`wave_splits`). split_keys: splits of that many keys,
    whatever the batch and rows."""
    if t * g <= max_rows:
        rows = pow2_at_least(t * g)
        tq = t
    else:
        tq = max(1, row_block // g)
        rows = pow2_at_least(tq * g)
    nqb = -(-t // tq)
    if split_keys is not None:
        # one program shape for decode and verify alike: the warps' split of a row's key
        # reductions follows the tile's rows
        rows = max(rows, pow2_at_least(max_rows))
        # keys cut at fixed multiples whatever the cache's length (which follows the
        # batch's longest prompt): a row's splits are the same in every cache
        split_len = -(-split_keys // block_k) * block_k
        return rows, tq, nqb, -(-s // split_len), split_len
    per = b * kh * nqb
    max_splits = max(1, -(-s // max(min_split, block_k)))
    j = max(1, min(max_splits, -(-target_programs // per)))
    if resident:
        j = wave_splits(per, s, block_k, j, max_splits, resident)
    split_len, j = key_splits(s, j, block_k)
    return rows, tq, nqb, j, split_len



# ---------------------------------------------------------------------------------------
# Public op
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Launch:
    """A call's launch: blocks resolved (block_k, num_warps, num_stages set), rows a
    program, tq tokens a query block, nqb query blocks, n_splits key splits of split_len."""

    blocks: VerifyBlocks
    rows: int
    tq: int
    nqb: int
    n_splits: int
    split_len: int


def _launch(q_shape, k_cache, blocks: VerifyBlocks) -> _Launch:
    """The launch for q [b, t, k, g, d] over the cache: `blocks`' None fields picked."""
    b, t, kh, g, d = q_shape
    s = k_cache.shape[3]
    decode_like = t * g <= blocks.max_rows
    # 64-key blocks for prefill, and for wide heads over few (sequence, KV head) pairs:
    # two programs an SM instead of one fill the GPU
    few_wide = d > 64 and b * kh < 128
    bk = blocks.block_k or (128 if decode_like and not few_wide else 64)
    bk = min(bk, pow2_at_least(s))
    stages = blocks.num_stages or (3 if decode_like else 2)
    # programs resident per SM, as shared memory allows: the K and V tiles of each stage
    per_sm = max(1, SMEM_BYTES // (stages * 2 * bk * d * k_cache.dtype.itemsize))
    rows, tq, nqb, n_splits, split_len = _plan(
        b, kh, t, g, s, max_rows=blocks.max_rows, row_block=blocks.row_block,
        target_programs=blocks.target_programs, block_k=bk, min_split=blocks.min_split,
        # wave filling pays where two or more programs share an SM; at one it is slower
        # (`benchmarks/tune_verify.py --head-dim 128`, its "no waves" plan)
        resident=sm_count() * per_sm if blocks.waves and decode_like and per_sm > 1 else None,
        split_keys=blocks.split_keys)
    resolved = dataclasses.replace(
        blocks, block_k=bk, num_warps=blocks.num_warps or (4 if rows <= 64 else 8),
        num_stages=stages)
    return _Launch(resolved, rows, tq, nqb, n_splits, split_len)


def _pack_rows(q, q_pos, perm, la: _Launch):
    """q [b, t, k, g, d] and q_pos [b, t] in the kernel's rows, tokens in `perm`'s order
    (the capture tokens first): (qr [b, k, nqb * rows, d], rp [b, nqb * rows], -1 for
    padding rows)."""
    b, t, kh, g, d = q.shape
    ident = perm == tuple(range(t))
    qp = q if ident else q[:, jnp.array(perm)]
    pp = q_pos if ident else q_pos[:, jnp.array(perm)]
    tpad = la.nqb * la.tq
    qp = jnp.pad(qp, ((0, 0), (0, tpad - t), (0, 0), (0, 0), (0, 0)))  # [b, tpad, k, g, d]
    pp = jnp.pad(pp.astype(jnp.int32), ((0, 0), (0, tpad - t)), constant_values=-1)
    qr = qp.transpose(0, 2, 1, 3, 4).reshape(b, kh, la.nqb, la.tq * g, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, 0), (0, la.rows - la.tq * g), (0, 0)))
    qr = qr.reshape(b, kh, la.nqb * la.rows, d)  # [b, k, nqb * rows, d]
    rp = jnp.repeat(pp.reshape(b, la.nqb, la.tq), g, axis=2)
    rp = jnp.pad(rp, ((0, 0), (0, 0), (0, la.rows - la.tq * g)), constant_values=-1)
    return qr, rp.reshape(b, la.nqb * la.rows)  # [b, nqb * rows]


def _unpack_rows(out, la: _Launch, t: int, g: int, perm):
    """`_pack_rows` undone: out [b, k, nqb * rows, d] -> [b, t, k, g, d]."""
    b, kh, _, d = out.shape
    out = out.reshape(b, kh, la.nqb, la.rows, d)[:, :, :, : la.tq * g]
    out = out.reshape(b, kh, la.nqb * la.tq, g, d)[:, :, :t].transpose(0, 2, 1, 3, 4)
    if perm != tuple(range(t)):
        out = out[:, jnp.array([perm.index(i) for i in range(t)])]
    return out  # [b, t, k, g, d]


def _real(a, la: _Launch, g: int, n_cap: int):
    """[b, k, nqb * rows, ...] -> the first n_cap rows that are not padding."""
    a = a.reshape(a.shape[:2] + (la.nqb, la.rows) + a.shape[3:])[:, :, :, :la.tq * g]
    return a.reshape(a.shape[:2] + (la.nqb * la.tq * g,) + a.shape[4:])[:, :, :n_cap]


def _capture_layout(capture, crows: _CaptureRows, qr, rp, la: _Launch, g: int, stacked: bool):
    """The kernel's capture (StoreLogits | SumLogits | None) and SumLogits' inputs (qc
    [b, k, crow, d], rpc [b, crow], else None)."""
    n_cap = len(crows.uniq) * g  # the first n_cap real rows, in one query block or several
    if not n_cap:
        return None, None, None
    if capture.score == "weight":  # needs the final LSE: store logits, finish after
        return StoreLogits(n_cap, la.rows, stacked), None, None
    # linear in the logits: reduce over heads (and rows) in the kernel
    crow = pow2_at_least(n_cap)  # a power-of-two row count for the capture dot
    qc = jnp.pad(_real(qr, la, g, n_cap), ((0, 0), (0, 0), (0, crow - n_cap), (0, 0)))
    rpc = jnp.pad(_real(rp[:, None], la, g, n_cap)[:, 0], ((0, 0), (0, crow - n_cap)),
                  constant_values=-1)
    if capture.reduce == "mean":
        weights = (tuple(crows.mult[r // g] if r < n_cap else 0.0 for r in range(crow)),)
    else:
        weights = tuple(tuple(1.0 if r // g == i and r < n_cap else 0.0 for r in range(crow))
                        for i in range(len(crows.uniq)))
    return SumLogits(n_cap, crow, weights), qc, rpc.astype(jnp.int32)


def _combine(o, m, l, la: _Launch, g: int, sinks, dtype, normalized: bool):
    """The kernel's outputs as (out [b, k, R, d] in dtype, lse [b, k, R] log2 units): the
    splits combined unless the kernel normalised its one split (then m holds the LSE),
    the sinks joined."""
    if normalized:
        out = o[:, :, 0]  # [b, k, R, d]
        lse = m[:, :, 0]  # [b, k, R], log2 units
    else:
        out, lse = combine_splits(o, m, l, base2=True, ordered=la.blocks.split_keys is not None)
        out = out.astype(dtype)
    if sinks is not None:  # each row's head's sink (row = token * g + head in a block)
        per_block = jnp.pad(jnp.tile(sinks, (1, la.tq)), ((0, 0), (0, la.rows - la.tq * g)))
        out, lse = with_sinks(out, lse, jnp.tile(per_block, (1, la.nqb))[None], base2=True)
        out = out.astype(dtype)
    return out, lse


def _capture_weights(crows: _CaptureRows, reduce: str, kh: int, g: int):
    """[n_out, kh * n_cap] fp32: how each captured row (KV head k, unique capture row u,
    query head of the group; row (k * nu + u) * g + head) enters each output score vector:
    "mean" one vector (every row), "rows" one per entry of crows.listed."""
    nu = len(crows.uniq)
    u = (np.arange(kh * nu * g) // g) % nu
    if reduce == "mean":
        w = np.asarray(crows.mult)[u][None, :] / (kh * g)
    else:
        w = (u[None, :] == np.array([crows.uniq.index(c) for c in crows.listed])[:, None]
             ) / (kh * g)
    return w.astype(np.float32)


def _stored_scores(reduce, crows, cbuf, lse_c, pos_c, lo_c, g, s, interpret):
    """StoreLogits' scores: weights exp2(logit - lse) of the capture rows (lse_c [b, kh *
    n_cap]; pos_c, lo_c [b, nu] their positions and windows), reduced."""
    kh = lse_c.shape[1] // (len(crows.uniq) * g)
    w = _capture_weights(crows, reduce, kh, g)
    rowpos = jnp.tile(jnp.repeat(pos_c, g, axis=1), (1, kh))  # [b, kh * n_cap]
    rowlo = None if lo_c is None else jnp.tile(jnp.repeat(lo_c, g, axis=1), (1, kh))
    sc = capture_scores(cbuf, lse_c, rowpos, w, s, rowlo,
                        interpret=interpret)  # [b, n_out, s]
    return sc[:, 0] if reduce == "mean" else sc


def _summed_scores(reduce, crows, cbuf, pos_c, lo_c, kh, g, s):
    """SumLogits' scores from the kernel's sums cbuf [b * kh * n_out, s_pad]."""
    ar = jnp.arange(s, dtype=jnp.int32)
    b = pos_c.shape[0]
    n_out = 1 if reduce == "mean" else len(crows.uniq)
    # keys past every capture row's position (or before every row's window) were never
    # written: [b, s]
    written = ar[None, :] <= pos_c.max(axis=1)[:, None]
    if lo_c is not None:
        written &= ar[None, :] > lo_c.min(axis=1)[:, None]
    # the kernel summed log2-unit logits: _LN2 converts back to natural-log logits
    tot = cbuf.reshape(b, kh, n_out, -1)[..., :s].sum(axis=1) * (_LN2 / (kh * g))
    if reduce == "mean":
        return jnp.where(written, tot[:, 0], 0.0)
    seen = ar[None, None, :] <= pos_c[:, :, None]  # [b, nu, s]
    if lo_c is not None:
        seen &= ar[None, None, :] > lo_c[:, :, None]
    tot = jnp.where(seen, tot, 0.0)  # [b, nu, s]
    return tot[:, jnp.array([crows.uniq.index(r) for r in crows.listed])]


def verify_attention(q, k_cache, v_cache, layer, q_pos, *, capture: CaptureSpec | None = None,
                     window=None, sinks=None, capture_into=None,
                     blocks: VerifyBlocks = VerifyBlocks(), interpret=False):
    """Pallas (Triton) op with exactly `verify_attention_reference`'s semantics.

    Returns (out [b, t, k, g, d] in q.dtype, scores | None). window: the kernel skips the
    key blocks before its rows' windows and masks inside them; sinks join the LSE after
    the combine (`with_sinks`), before the captured weights are taken from it.
    capture_into: a stacked buffer (`capture_buffer`; a capture "mean" of softmax
    weights, no window): the kernel stores the capture rows' logits into it at `layer`
    and the call returns (out, (buffer, offset [b, kh * n_cap])) instead of scores,
    offset = each row's LSE - log2(its weight in the mean), for
    `capture_select.select_from_capture`."""
    if capture_into is not None and (capture is None or capture.reduce != "mean"
                                     or capture.score != "weight" or window is not None):
        raise ValueError("capture_into takes the mean of softmax weights, without a window "
                         f"(capture {capture!r}, window {window})")
    b, t, kh, g, d = q.shape
    s = k_cache.shape[3]
    la = _launch(q.shape, k_cache, blocks)
    crows = _CaptureRows.of(capture, t)
    # capture tokens first, so their rows are the first n_cap real rows (block 0 on)
    perm = crows.uniq + tuple(i for i in range(t) if i not in crows.uniq)
    qr, rp = _pack_rows(q, q_pos, perm, la)
    cap, qc, rpc = _capture_layout(capture, crows, qr, rp, la, g, capture_into is not None)
    # one split: the kernel normalises, m holds the LSE; a row-invariant plan always
    # combines its splits (one split or many, the same sums)
    cfg = _KernelConfig(block_k=la.blocks.block_k, split_len=la.split_len,
                        n_splits=la.n_splits, s_len=s, rows=la.rows, real_rows=la.tq * g,
                        kh=kh, normalize=la.n_splits == 1 and blocks.split_keys is None,
                        capture=cap, unmasked=blocks.unmasked)
    ops = _Operands(
        layer=jnp.reshape(layer, (1,)).astype(jnp.int32),
        window=None if window is None else jnp.reshape(window, (1,)).astype(jnp.int32),
        q=qr, rowpos=rp, k_cache=k_cache, v_cache=v_cache, qc=qc, rpc=rpc,
        cap_into=capture_into)
    o, m, l, cbuf = _verify_call(ops, cfg, la.blocks, interpret)
    out, lse = _combine(o, m, l, la, g, sinks, q.dtype, cfg.normalize)
    out = _unpack_rows(out, la, t, g, perm)
    if capture is None:
        return out, None
    pos_c = q_pos[:, jnp.array(crows.uniq)].astype(jnp.int32)  # [b, nu]
    # each capture row sees keys after lo_c: keys before the window were masked or, in
    # blocks before every row's window, never written
    lo_c = None if window is None else jnp.where(window > 0, pos_c - window, -1)  # [b, nu]
    n_cap = len(crows.uniq) * g
    if capture_into is not None:
        w = _capture_weights(crows, capture.reduce, kh, g)[0]  # [kh * n_cap]
        lse_c = _real(lse, la, g, n_cap).reshape(b, kh * n_cap)  # the capture rows' LSE
        return out, (cbuf, lse_c - jnp.log2(jnp.asarray(w)))
    if isinstance(cap, StoreLogits):
        lse_c = _real(lse, la, g, n_cap).reshape(b, kh * n_cap)
        return out, _stored_scores(capture.reduce, crows, cbuf, lse_c, pos_c, lo_c, g, s,
                                   interpret)
    return out, _summed_scores(capture.reduce, crows, cbuf, pos_c, lo_c, kh, g, s)


def cudnn_attention(q, k_cache, v_cache, layer):
    """cuDNN flash attention for a prompt at positions 0..t-1 (GPU only; no capture,
    window or sinks). q [b, t, k, g, d] -> out [b, t, k, g, d]."""
    b, t, kh, g, d = q.shape
    k = lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False)[:, :, :t]  # [b, k, t, d]
    v = lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False)[:, :, :t]
    out = jax.nn.dot_product_attention(
        q.reshape(b, t, kh * g, d), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
        is_causal=True, implementation="cudnn")
    return out.reshape(b, t, kh, g, d)


# ---------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------


def _scores_from_logits(logits, lse, valid, capture: CaptureSpec):
    """logits [b, k, g, t, s] fp32 masked with -inf, lse [b, k, g, t] -> the scores."""
    rows = list(capture.rows)
    sel = logits[:, :, :, rows, :]  # [b, k, g, r, s]
    vis = valid[:, :, :, rows, :]
    if capture.score == "weight":
        per = jnp.exp(sel - lse[:, :, :, rows, None])
    else:
        per = jnp.where(vis, sel, 0.0)
    per = per.mean(axis=(1, 2))  # [b, r, s]
    return per.mean(axis=1) if capture.reduce == "mean" else per


def _attend_reference(q, k, v, q_pos, window, sinks):
    """q [b, c, k, g, d], k / v [b, k, s, d], q_pos [b, c] -> (out [b, c, k, g, d] in q's
    dtype, logits [b, k, g, c, s] masked with -inf, lse [b, k, g, c], valid)."""
    s, d = k.shape[2], q.shape[-1]
    logits = jnp.einsum("bckgd,bksd->bkgcs", q.astype(jnp.float32), k.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST)
    logits = logits * d**-0.5  # [b, k, g, c, s]
    pos = q_pos[:, None, None, :, None]
    keys = jnp.arange(s)[None, None, None, None, :]
    valid = keys <= pos
    if window is not None:
        valid &= (window <= 0) | (keys > pos - window)
    logits = jnp.where(valid, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [b, k, g, c]
    if sinks is not None:  # the sink joins the denominator only
        lse = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, :, None])
    w = jnp.exp(logits - lse[..., None])
    out = jnp.einsum("bkgcs,bksd->bckgd", w, v.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
    return out.astype(q.dtype), logits, lse, valid


def verify_attention_reference(q, k_cache, v_cache, layer, q_pos, *,
                               capture: CaptureSpec | None = None, window=None, sinks=None,
                               query_chunk=512):
    """Plain-XLA reference. Returns (out [b, t, k, g, d], scores or None)."""
    b, t, kh, g, d = q.shape
    k = k_cache[layer]  # [b, k, s, d]
    v = v_cache[layer]
    attend = functools.partial(_attend_reference, k=k, v=v, window=window, sinks=sinks)
    if capture is None and query_chunk and t > query_chunk:
        # Prefill: bound the [.., chunk, s] logits instead of materialising t x s.
        pad = (-t) % query_chunk
        qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        pp = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)
        n = (t + pad) // query_chunk
        qs = qp.reshape(b, n, query_chunk, kh, g, d).swapaxes(0, 1)
        ps = pp.reshape(b, n, query_chunk).swapaxes(0, 1)
        outs = lax.map(lambda a: attend(a[0], q_pos=a[1])[0], (qs, ps))  # [n, b, c, k, g, d]
        return outs.swapaxes(0, 1).reshape(b, n * query_chunk, kh, g, d)[:, :t], None
    out, logits, lse, valid = attend(q, q_pos=q_pos)
    if capture is None:
        return out, None
    return out, _scores_from_logits(logits, lse, valid, capture)

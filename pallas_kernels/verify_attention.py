"""Causal attention of a few query tokens over the KV cache, with score capture.

Serves decode (t = 1), verification (t = gamma + 1) and, in query chunks, prefill. The
side output is the per-position criticality score that Vegas's selector ranks: from the
chosen query rows only, averaged over all query heads of the layer.

Shapes: q [b, t, k, g, d]; cache k/v [L, b, k, s, d] (the full stacked cache plus a layer
index, so no per-layer slab is copied); q_pos [b, t] (row t sees keys s <= q_pos[b, t]).
Scores: [b, s] fp32 for capture="mean" (mean over heads and capture rows), [b, r, s] for
capture="rows" (mean over heads, one per capture row).

gpt-oss extras: window (an int32 scalar, may be traced; 0 = none): row t sees only keys
q_pos - window < s <= q_pos; sinks [k, g] fp32: one more logit per query head in the
softmax's denominator, with no value (the weights of the keys sum to less than one; the
captured weights are those).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

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

CAPTURE_MODES = ("none", "mean", "rows")
SCORE_KINDS = ("weight", "logit")


def _check_modes(capture, score):
    if capture not in CAPTURE_MODES:
        raise ValueError(f"capture must be one of {CAPTURE_MODES}, got {capture!r}")
    if score not in SCORE_KINDS:
        raise ValueError(f"score must be one of {SCORE_KINDS}, got {score!r}")


def _scores_from_logits(logits, lse, valid, rows, score, capture):
    """logits [b, k, g, t, s] fp32 masked with -inf, lse [b, k, g, t] -> the scores."""
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
    score="weight", query_chunk=512, window=None, sinks=None,
):
    """Plain-XLA reference. Returns (out [b, t, k, g, d], scores or None)."""
    _check_modes(capture, score)
    b, t, kh, g, d = q.shape
    k = k_cache[layer]  # [b, k, s, d]
    v = v_cache[layer]
    s = k.shape[2]
    scale = d**-0.5

    def attend(qc, pc):
        # qc [b, c, k, g, d], pc [b, c]
        logits = jnp.einsum("bckgd,bksd->bkgcs", qc.astype(jnp.float32), k.astype(jnp.float32),
                            precision=lax.Precision.HIGHEST)
        logits = logits * scale  # [b, k, g, c, s]
        pos = pc[:, None, None, :, None]
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
# `n_cap` rows overall. score="weight": the kernel stores their raw scaled logits (fp16 by
# default) from the main product's tile with a masked store into a side buffer, and
# `capture_scores` turns them into weights with the combined LSE (no second pass over K).
# score="logit" (linear in the logits): the kernel sums the capture rows' logits itself.
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
    fastest of the plans measured.

    block_k: keys per loop step (None: 128 for verify / decode, 64 for prefill and for
    wide heads over fewer than 128 (sequence, KV head) pairs); num_warps (None: 4 up to
    64 rows a program, else 8); num_stages (None: 3 for verify / decode, else 2); max_rows:
    largest t * g run as one query block; row_block: rows a program in prefill;
    target_programs: the grid aimed at when choosing key splits; min_split: shortest key
    split; cap_dtype: dtype of the captured logits; waves: choose the split count by
    `wave_splits` (more splits, up to 1.5x, where they fill the grid's last wave).
    split_keys: a row-invariant plan (`INVARIANT`): keys cut into splits of this length
    whatever the batch and rows, fixed tiles, the splits combined in order."""

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


# A row's output depends only on its query, position and the cache: decode rows and verify
# rows agree bit for bit (every program max_rows rows, one tile for every call).
INVARIANT = VerifyBlocks(block_k=64, num_warps=4, num_stages=2, max_rows=32, row_block=32,
                         waves=False, split_keys=1024)


def _verify_kernel(layer_ref, *refs, block_k, split_len, s_len, scale, rows, kh, normalize,
                   cap, real_rows, windowed=False, stacked=False):
    """Flash-decoding over one key split.

    windowed (static): a [1] window input follows layer_ref; each row then sees keys
    rp - window < s <= rp (window 0: all), and the program starts at the first key block
    any of its rows sees.

    cap (static) describes the score capture or is None:
      ("main", n_cap, rows): store the main product's [rows, block_k] tile of raw scaled
        logits into a [b * kh * n_cap + rows, s_pad] buffer at rows (b * kh + h) * n_cap +
        r for the capture rows r < n_cap, which may span query blocks of `real_rows` rows
        (`rows` spare rows keep the last window inside);
      ("sum", n_cap, crow, weights): a small [crow, d] x [d, block_k] dot of the capture
        rows alone, their raw logits masked to each row's causal range and reduced into
        len(weights) vectors a program, vector i weighting capture row r by weights[i][r];
        buffer [b * kh * n_out, s_pad].
    stacked (static; "main"): the buffer holds every layer's rows, this layer's from row
    layer * b * kh * n_cap on (`capture_buffer`), and comes in as an input aliased to the
    output (its ref, before o_ref, is not used)."""
    # layer_ref [1]; (win_ref [1]); q_ref [rows, d]; rowpos_ref [rows] (-1 = padding row);
    # k_ref, v_ref [L, b, k, s, d]; with "sum": qc_ref [crow, d], rpc_ref [crow];
    # o_ref [rows, d], m_ref, l_ref [rows]; cap_ref [b * k * n_cap + rows, s_pad] ("main")
    # or [b * k * n_out, s_pad] ("sum")
    win_ref, refs = (refs[0], refs[1:]) if windowed else (None, refs)
    q_ref, rowpos_ref, k_ref, v_ref, *refs = refs
    if stacked:
        refs = refs[:-5] + refs[-4:]  # the aliased buffer's input ref (before o, m, l, cap)
    if cap is not None and cap[0] == "main":
        o_ref, m_ref, l_ref, cap_ref = refs
    elif cap is not None:
        qc_ref, rpc_ref, o_ref, m_ref, l_ref, cap_ref = refs
    else:
        o_ref, m_ref, l_ref = refs
    bi = pl.program_id(0)
    h = pl.program_id(1)
    qb = pl.program_id(2)
    j = pl.program_id(3)
    layer = layer_ref[0]
    if cap is not None:  # the first buffer row of this program's capture rows
        cap_row0 = (bi * kh + h) * cap[1]
        if stacked:
            cap_row0 += layer * pl.num_programs(0) * kh * cap[1]
    q = q_ref[...]  # [rows, d]
    rp = rowpos_ref[...]  # [rows]
    d = q.shape[-1]

    start = j * split_len
    # causal block skipping: no row of this program sees past max(rp)
    end = jnp.minimum(jnp.minimum(start + split_len, jnp.max(rp) + 1), s_len)
    if windowed:
        win = win_ref[0]
        lo = jnp.where(win > 0, rp - win, -1)  # [rows]: row r sees keys lo[r] < s <= rp[r]
        # ... nor before the first of its rows' windows (block-aligned: the capture stores
        # whole key blocks)
        first = jnp.min(jnp.where(rp >= 0, lo + 1, s_len))
        start = jnp.maximum(start, first // block_k * block_k)
    nblk = pl.cdiv(jnp.maximum(end - start, 0), block_k)
    kr = jnp.arange(block_k, dtype=jnp.int32)
    if cap is not None and cap[0] == "main":
        n_cap = cap[1]
        rr = jnp.arange(rows, dtype=jnp.int32)

        first = qb * real_rows  # this query block's first row among all real rows

        def capture_main(qk, k0):  # qk [rows, block_k]
            val = jnp.clip(qk, -_LOGIT_CLIP, _LOGIT_CLIP).astype(cap_ref.dtype)
            pltr.store(cap_ref.at[pl.ds(cap_row0 + first, rows), pl.ds(k0, block_k)],
                       val, mask=((rr < real_rows) & (first + rr < n_cap))[:, None])
    elif cap is not None:
        qc = qc_ref[...]  # [crow, d]
        rpc = rpc_ref[...]  # [crow]
        n_cap, crow = cap[1], cap[2]
        rc = jnp.arange(crow, dtype=jnp.int32)

    def capture_sum(k, k0, kidx):  # k [block_k, d], kidx [block_k]
        qk = dot(qc, k, trans_b=True) * scale  # [crow, block_k] fp32
        seen = kidx[None, :] <= rpc[:, None]
        if windowed:
            seen &= kidx[None, :] > jnp.where(win > 0, rpc - win, -1)[:, None]
        qk = jnp.where(seen, qk, 0.0)
        weights = cap[3]
        for i, wts in enumerate(weights):
            w = jnp.zeros((crow,), jnp.float32)  # [crow]
            for r, wr in enumerate(wts):
                if wr:
                    w = jnp.where(rc == r, jnp.float32(wr), w)
            vec = jnp.sum(qk * w[:, None], axis=0)  # [block_k]
            pltr.store(cap_ref.at[(bi * kh + h) * len(weights) + i, pl.ds(k0, block_k)],
                       vec)

    def body(i, carry):
        o, m, l = carry
        k0 = start + i * block_k
        kidx = k0 + kr  # [block_k]
        inb = kidx < s_len  # the last block may run past the cache
        k = pltr.load(k_ref.at[layer, bi, h, pl.ds(k0, block_k), :], mask=inb[:, None],
                      other=0.0)  # [block_k, d]
        if cap is not None and cap[0] == "sum":  # the capture rows: query block 0 only
            pl.when(qb == 0)(lambda: capture_sum(k, k0, kidx))
        qk = dot(q, k, trans_b=True) * scale  # [rows, block_k] fp32, log2 units
        if cap is not None and cap[0] == "main":
            pl.when(first < n_cap)(lambda: capture_main(qk, k0))
        vis = kidx[None, :] <= rp[:, None]
        if windowed:
            vis &= kidx[None, :] > lo[:, None]
        qk = jnp.where(vis, qk, NEG)
        m_new = jnp.maximum(m, qk.max(axis=-1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(qk - m_new[:, None])  # [rows, block_k]
        l = l * corr + p.sum(axis=-1)
        v = pltr.load(v_ref.at[layer, bi, h, pl.ds(k0, block_k), :], mask=inb[:, None],
                      other=0.0)  # [block_k, d]
        o = o * corr[:, None] + dot(p.astype(v.dtype), v)
        return o, m_new, l

    o0 = jnp.zeros((rows, d), jnp.float32)  # [rows, d]
    m0 = jnp.full((rows,), NEG, jnp.float32)  # [rows]
    l0 = jnp.zeros((rows,), jnp.float32)  # [rows]
    o, m, l = lax.fori_loop(0, nblk, body, (o0, m0, l0))
    if normalize:  # single split: finish here (prefill), m_ref receives the LSE
        o = o / jnp.where(l == 0.0, 1.0, l)[:, None]
        m = m + jnp.log2(jnp.where(l == 0.0, 1.0, l))
    o_ref[...] = o.astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


def _verify_call(layer, qr, rowpos, k_cache, v_cache, *, rows, real_rows, n_splits, split_len,
                 blocks, interpret, out_dtype, normalize, cap=None, qc=None, rpc=None,
                 window=None, cap_into=None):
    """qr [b, kh, nqb*rows, d]; rowpos [b, nqb*rows]; with a "sum" cap (`_verify_kernel`)
    also qc [b, kh, crow, d] (the capture rows) and rpc [b, crow] (their positions, -1 =
    pad); real_rows: rows of a query block that are not padding;
    window: an int32 scalar (0: none) or None (no window input). cap_into: a stacked
    capture buffer (`capture_buffer`) the logits go into at `layer`, returned updated.
    blocks: resolved (block_k, num_warps, num_stages set); normalize: finish one split in
    the kernel (m then holds the LSE). Returns o [b, kh, J, R, d],
    m, l [b, kh, J, R] (log2 units), cap buffer | None."""
    b, kh, rtot, d = qr.shape
    block_k = blocks.block_k
    s_len = k_cache.shape[3]
    s_pad = pl.cdiv(s_len, block_k) * block_k  # capture stores whole key blocks
    nqb = rtot // rows
    kernel = functools.partial(
        _verify_kernel, block_k=block_k, split_len=split_len, s_len=s_len,
        scale=d**-0.5 * _LOG2E, rows=rows, kh=kh, normalize=normalize, cap=cap,
        real_rows=real_rows, windowed=window is not None,
        stacked=cap_into is not None)
    out_shape = [  # o [b, kh, J, R, d], m, l [b, kh, J, R]
        jax.ShapeDtypeStruct((b, kh, n_splits, rtot, d), out_dtype if normalize else jnp.float32),
        jax.ShapeDtypeStruct((b, kh, n_splits, rtot), jnp.float32),
        jax.ShapeDtypeStruct((b, kh, n_splits, rtot), jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, rows, d), lambda bi, h, qb, j: (bi, h, j, qb, 0)),
        pl.BlockSpec((None, None, None, rows), lambda bi, h, qb, j: (bi, h, j, qb)),
        pl.BlockSpec((None, None, None, rows), lambda bi, h, qb, j: (bi, h, j, qb)),
    ]
    scalars = [jnp.reshape(layer, (1,)).astype(jnp.int32)]
    if window is not None:
        scalars.append(jnp.reshape(window, (1,)).astype(jnp.int32))
    in_specs = [
        *[whole((1,))] * len(scalars),
        pl.BlockSpec((None, None, rows, d), lambda bi, h, qb, j: (bi, h, qb, 0)),
        pl.BlockSpec((None, rows), lambda bi, h, qb, j: (bi, qb)),
        whole(k_cache.shape),  # indexed at `layer` in the kernel
        whole(v_cache.shape),
    ]
    args = [*scalars, qr, rowpos, k_cache, v_cache]
    if cap is not None and cap[0] == "main":
        shape = (b * kh * cap[1] + cap[2], s_pad)  # `rows` spare rows (`_verify_kernel`)
        out_shape.append(jax.ShapeDtypeStruct(shape, blocks.cap_dtype))
        out_specs.append(whole(shape))
    elif cap is not None:
        crow = cap[2]
        in_specs += [pl.BlockSpec((None, None, crow, d), lambda bi, h, qb, j: (bi, h, 0, 0)),
                     pl.BlockSpec((None, crow), lambda bi, h, qb, j: (bi, 0))]
        args += [qc, rpc.astype(jnp.int32)]
        shape = (b * kh * len(cap[3]), s_pad)
        out_shape.append(jax.ShapeDtypeStruct(shape, jnp.float32))
        out_specs.append(whole(shape))
    aliases = {}
    if cap_into is not None:
        if cap[0] == "sum" or cap_into.shape[1] < s_pad or cap[2] > CAPTURE_SPARE:
            raise ValueError(f"a stacked capture buffer takes logits of {s_pad} keys from "
                             f"at most {CAPTURE_SPARE} rows a program, got {cap_into.shape} "
                             f"for capture {cap[:3]}")
        out_shape[-1] = jax.ShapeDtypeStruct(cap_into.shape, cap_into.dtype)
        out_specs[-1] = whole(cap_into.shape)
        in_specs.append(whole(cap_into.shape))
        args.append(cap_into)
        aliases = {len(args) - 1: 3}
    res = pl.pallas_call(
        kernel,
        grid=(b, kh, nqb, n_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=blocks.num_warps,
                                            num_stages=blocks.num_stages),
        input_output_aliases=aliases,
        interpret=interpret,
        name="vegas_verify_attention",
    )(*args)
    if cap is not None:
        return res
    return (*res, None)


def _capture_weights(capture, kh, g, uniq, cap_list, mult):
    """[n_out, kh * n_cap] fp32: how each captured row (KV head k, unique capture row u,
    query head of the group; row (k * nu + u) * g + head) enters each output score vector:
    "mean" one vector (every row), "rows" one per entry of cap_list."""
    nu = len(uniq)
    u = (np.arange(kh * nu * g) // g) % nu
    if capture == "mean":
        w = np.asarray(mult)[u][None, :] / (kh * g)
    else:
        w = (u[None, :] == np.array([uniq.index(c) for c in cap_list])[:, None]) / (kh * g)
    return w.astype(np.float32)


# spare rows after a stacked buffer's last: the last program's (masked) store window of
# up to `rows` rows stays inside it
CAPTURE_SPARE = 128


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
    memory), num_warps. The fastest of the plans measured."""

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


def _prefill_cudnn(q, k_cache, v_cache, layer):
    """cuDNN flash attention for a prompt at positions 0..t-1 (GPU only)."""
    b, t, kh, g, d = q.shape
    k = lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False)[:, :, :t]  # [b, k, t, d]
    v = lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False)[:, :, :t]
    out = jax.nn.dot_product_attention(
        q.reshape(b, t, kh * g, d), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
        is_causal=True, implementation="cudnn")
    return out.reshape(b, t, kh, g, d)


def verify_attention(
    q, k_cache, v_cache, layer, q_pos, *, capture="none", capture_rows=(0,), score="weight",
    interpret=False, blocks: VerifyBlocks = VerifyBlocks(), prefill_impl="pallas",
    window=None, sinks=None, capture_into=None,
):
    """Pallas (Triton) op with exactly `verify_attention_reference`'s semantics.

    Returns (out [b, t, k, g, d] in q.dtype, scores | None). prefill_impl: "pallas" |
    "cudnn", the latter only for prompts that start at position 0 (q_pos[b, i] == i).
    window: the kernel skips the key blocks before its rows' windows and masks inside
    them; sinks join the LSE after the combine (`with_sinks`), before the captured
    weights are taken from it.
    capture_into: a stacked buffer (`capture_buffer`; capture "mean" of softmax weights,
    no window): the kernel stores the capture rows' logits into it at `layer` and the
    call returns (out, (buffer, offset [b, kh * n_cap])) instead of scores, offset = each
    row's LSE - log2(its weight in the mean), for `capture_select.select_from_capture`.
    """
    _check_modes(capture, score)
    if capture_into is not None and (capture != "mean" or score != "weight"
                                     or window is not None):
        raise ValueError("capture_into takes the mean of softmax weights, without a window "
                         f"(capture {capture!r}, score {score!r}, window {window})")
    b, t, kh, g, d = q.shape
    s = k_cache.shape[3]
    cap_list = [int(r) % t for r in capture_rows] if capture != "none" else []
    uniq = sorted(set(cap_list))
    mult = [cap_list.count(u) / len(cap_list) for u in uniq]  # each unique row's share

    if prefill_impl == "cudnn" and t * g > blocks.max_rows:
        if window is not None or sinks is not None:
            raise NotImplementedError("the cuDNN prefill has no sliding window or sinks here: "
                                      "use prefill_impl='pallas'")
        out = _prefill_cudnn(q, k_cache, v_cache, layer)
        if capture == "none":
            return out, None
        # scores from the capture rows only, through the split-K kernel
        _, sc = verify_attention(
            q[:, uniq], k_cache, v_cache, layer, q_pos[:, uniq], capture=capture,
            capture_rows=tuple(uniq.index(r) for r in cap_list), score=score,
            interpret=interpret, blocks=blocks)
        return out, sc

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
        # wave filling pays where two or more programs share an SM; at one it was slower
        resident=sm_count() * per_sm if blocks.waves and decode_like and per_sm > 1 else None,
        split_keys=blocks.split_keys)
    resolved = dataclasses.replace(
        blocks, block_k=bk, num_warps=blocks.num_warps or (4 if rows <= 64 else 8),
        num_stages=stages)

    # capture tokens first, so their rows are the first n_cap real rows (block 0 on)
    perm = uniq + [i for i in range(t) if i not in uniq]
    inv = [perm.index(i) for i in range(t)]
    qp = q if perm == list(range(t)) else q[:, jnp.array(perm)]
    pp = q_pos if perm == list(range(t)) else q_pos[:, jnp.array(perm)]
    tpad = nqb * tq
    qp = jnp.pad(qp, ((0, 0), (0, tpad - t), (0, 0), (0, 0), (0, 0)))  # [b, tpad, k, g, d]
    pp = jnp.pad(pp.astype(jnp.int32), ((0, 0), (0, tpad - t)), constant_values=-1)
    qr = qp.transpose(0, 2, 1, 3, 4).reshape(b, kh, nqb, tq * g, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, 0), (0, rows - tq * g), (0, 0)))
    qr = qr.reshape(b, kh, nqb * rows, d)  # [b, k, nqb * rows, d]
    rp = jnp.repeat(pp.reshape(b, nqb, tq), g, axis=2)
    rp = jnp.pad(rp, ((0, 0), (0, 0), (0, rows - tq * g)), constant_values=-1)
    rp = rp.reshape(b, nqb * rows)  # [b, nqb * rows]
    n_cap = len(uniq) * g  # the first n_cap real rows, in one query block or several

    def real(a):  # [b, k, nqb * rows, ...] -> the first n_cap rows that are not padding
        a = a.reshape(a.shape[:2] + (nqb, rows) + a.shape[3:])[:, :, :, :tq * g]
        return a.reshape(a.shape[:2] + (nqb * tq * g,) + a.shape[4:])[:, :, :n_cap]
    nu = len(uniq)
    cap = qc = rpc = None
    if n_cap and score == "weight":  # needs the final LSE: store logits, finish after
        cap = ("main", n_cap, rows)  # the main tile's rows: no capture inputs
    elif n_cap:  # linear in the logits: reduce over heads (and rows) in the kernel
        crow = pow2_at_least(n_cap)  # a power-of-two row count for the capture dot
        # qc [b, k, crow, d], rpc [b, crow]
        qc = jnp.pad(real(qr), ((0, 0), (0, 0), (0, crow - n_cap), (0, 0)))
        rpc = jnp.pad(real(rp[:, None])[:, 0], ((0, 0), (0, crow - n_cap)), constant_values=-1)
        if capture == "mean":
            weights = (tuple(mult[r // g] if r < n_cap else 0.0 for r in range(crow)),)
        else:
            weights = tuple(tuple(1.0 if r // g == i and r < n_cap else 0.0
                                  for r in range(crow)) for i in range(nu))
        cap = ("sum", n_cap, crow, weights)

    # one split: the kernel normalises, m holds the LSE; a row-invariant plan always
    # combines its splits (one split or many, the same sums)
    normalize = n_splits == 1 and blocks.split_keys is None
    o, m, l, cbuf = _verify_call(
        layer, qr, rp, k_cache, v_cache, rows=rows, n_splits=n_splits, split_len=split_len,
        blocks=resolved, interpret=interpret, out_dtype=q.dtype, normalize=normalize,
        cap=cap, qc=qc, rpc=rpc, window=window, cap_into=capture_into, real_rows=tq * g)

    if normalize:
        out = o[:, :, 0]  # [b, k, R, d]
        lse = m[:, :, 0]  # [b, k, R], log2 units
    else:
        out, lse = combine_splits(o, m, l, base2=True, ordered=blocks.split_keys is not None)
        out = out.astype(q.dtype)
    if sinks is not None:  # each row's head's sink (row = token * g + head in a block)
        per_block = jnp.pad(jnp.tile(sinks, (1, tq)), ((0, 0), (0, rows - tq * g)))
        out, lse = with_sinks(out, lse, jnp.tile(per_block, (1, nqb))[None], base2=True)
        out = out.astype(q.dtype)
    out = out.reshape(b, kh, nqb, rows, d)[:, :, :, : tq * g]
    out = out.reshape(b, kh, tpad, g, d)[:, :, :t].transpose(0, 2, 1, 3, 4)  # [b, t, k, g, d]
    if perm != list(range(t)):
        out = out[:, jnp.array(inv)]
    if capture == "none":
        return out, None

    pos_c = q_pos[:, jnp.array(uniq)].astype(jnp.int32)  # [b, nu]
    ar = jnp.arange(s, dtype=jnp.int32)
    # each capture row sees keys after lo_c: keys before the window were masked or, in
    # blocks before every row's window, never written
    lo_c = None if window is None else jnp.where(window > 0, pos_c - window, -1)  # [b, nu]
    if capture_into is not None:
        w = _capture_weights(capture, kh, g, uniq, cap_list, mult)[0]  # [kh * n_cap]
        offset = real(lse).reshape(b, kh * n_cap) - jnp.log2(jnp.asarray(w))
        return out, (cbuf, offset)
    if cap[0] == "main":
        # weights exp2(logit - lse) of the capture rows, reduced to the scores
        w = _capture_weights(capture, kh, g, uniq, cap_list, mult)
        lse_c = real(lse).reshape(b, kh * n_cap)
        rowpos = jnp.tile(jnp.repeat(pos_c, g, axis=1), (1, kh))  # [b, kh * n_cap]
        rowlo = None if lo_c is None else jnp.tile(jnp.repeat(lo_c, g, axis=1), (1, kh))
        sc = capture_scores(cbuf, lse_c, rowpos, w, s, rowlo,
                            interpret=interpret)  # [b, n_out, s]
        return out, sc[:, 0] if capture == "mean" else sc
    n_out = len(cap[3])  # tot below: [b, n_out, s]
    # keys past every capture row's position (or before every row's window) were never
    # written: [b, s]
    written = ar[None, :] <= pos_c.max(axis=1)[:, None]
    if lo_c is not None:
        written &= ar[None, :] > lo_c.min(axis=1)[:, None]
    # the kernel summed log2-unit logits: _LN2 converts back to natural-log logits
    tot = cbuf.reshape(b, kh, n_out, -1)[..., :s].sum(axis=1) * (_LN2 / (kh * g))
    if capture == "mean":
        return out, jnp.where(written, tot[:, 0], 0.0)
    seen = ar[None, None, :] <= pos_c[:, :, None]  # [b, nu, s]
    if lo_c is not None:
        seen &= ar[None, None, :] > lo_c[:, :, None]
    tot = jnp.where(seen, tot, 0.0)  # [b, nu, s]
    return out, tot[:, jnp.array([uniq.index(r) for r in cap_list])]

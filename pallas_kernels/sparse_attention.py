"""Sparse draft attention: one query token per sequence over a selected index set plus
the contiguous recent tail.

Reads only the selected K/V rows: bytes proportional to the budget, never a masked
full-length attention.

Shapes: q [b, 1, k, g, d]; cache k/v [L, b, k, s, d] with a layer index; idx [b, K]
(shared by the layer's KV heads) or [b, k, K] (per KV head), best entries first, padded
with a valid sentinel position; count [b] or [b, k] = how many leading entries of idx are
real; tail_start [b]: the tail covers positions tail_start .. q_pos (at most `tail_len` of
them); q_pos [b]: the query's position (its own K/V is already in the cache). With
`idx_layer`, idx and count carry a leading layer axis ([Li, b, K], [Li, b]) and
`idx_layer` picks the entry: every layer's index lists stay one buffer, nothing is sliced
per layer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import NEG, combine_splits, dot, pow2_at_least, whole


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


def sparse_attention_reference(q, k_cache, v_cache, layer, idx, count, tail_start, q_pos,
                               *, tail_len, idx_layer=None):
    """Gather-then-attend in plain XLA. Returns out [b, 1, k, g, d]."""
    idx, count = _at_layer(idx, count, idx_layer)
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
    logits = jnp.einsum("bkgd,bksd->bkgs", q[:, 0].astype(jnp.float32), keys.astype(jnp.float32))
    logits = jnp.where(ok[:, :, None, :], logits * d**-0.5, -jnp.inf)  # [b, k, g, K + W]
    w = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgs,bksd->bkgd", w, vals.astype(jnp.float32))
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
    """Tuning knobs. block_k: gathered rows per loop step; num_warps / num_stages: Triton;
    target_programs: grid size aimed at when cutting the entries into chunks."""

    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int = 528


def _sparse_kernel(layers_ref, q_ref, idx_ref, cnt_ref, ts_ref, qp_ref, k_ref, v_ref,
                   o_ref, m_ref, l_ref, *, block_k, chunk, n_sel, n_idx, tail_len, s_len,
                   scale, per_head):
    # layers_ref [2] (cache layer, index layer); q_ref [rows, d]; idx_ref [Li, b, k|1, K];
    # cnt_ref [Li, b, k|1]; ts_ref, qp_ref [b]; k_ref, v_ref [L, b, k, s, d];
    # o_ref [rows, d], m_ref, l_ref [rows]
    bi = pl.program_id(0)
    h = pl.program_id(1)
    j = pl.program_id(2)
    hi = h if per_head else jnp.int32(0)
    layer = layers_ref[0]
    il = layers_ref[1]
    q = q_ref[...]  # [rows, d]
    rows, d = q.shape
    kr = jnp.arange(block_k, dtype=jnp.int32)
    qpos = qp_ref[bi]

    def attend(pos, ok, carry):
        o, m, l = carry
        pos = jnp.clip(pos, 0, s_len - 1)
        k = k_ref[layer, bi, h, pos, :]  # gather [block_k, d]
        qk = dot(q, k, trans_b=True) * scale  # [rows, block_k]
        qk = jnp.where(ok[None, :], qk, NEG)
        m_new = jnp.maximum(m, qk.max(axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(qk - m_new[:, None])
        l = l * corr + p.sum(axis=-1)
        v = v_ref[layer, bi, h, pos, :]
        o = o * corr[:, None] + dot(p.astype(v.dtype), v)
        return o, m_new, l

    carry0 = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
              jnp.zeros((rows,), jnp.float32))

    def selected(carry):
        cnt = jnp.minimum(cnt_ref[il, bi, hi], n_idx)
        e0 = j * chunk
        nblk = pl.cdiv(jnp.maximum(jnp.minimum(e0 + chunk, cnt) - e0, 0), block_k)

        def body(i, c):
            e = e0 + i * block_k + kr
            pos = pltr.load(idx_ref.at[il, bi, hi, pl.ds(e0 + i * block_k, block_k)],
                            mask=e < n_idx, other=0)
            return attend(pos, e < cnt, c)

        return lax.fori_loop(0, nblk, body, carry)

    def tail(carry):
        t0 = ts_ref[bi]
        n_valid = jnp.clip(qpos - t0 + 1, 0, tail_len)  # entries tail_start .. q_pos
        e0 = (j - n_sel) * chunk
        nblk = pl.cdiv(jnp.maximum(jnp.minimum(e0 + chunk, n_valid) - e0, 0), block_k)

        def body(i, c):
            e = e0 + i * block_k + kr
            return attend(t0 + e, e < n_valid, c)

        return lax.fori_loop(0, nblk, body, carry)

    if tail_len > 0:
        o, m, l = lax.cond(j < n_sel, selected, tail, carry0)
    else:
        o, m, l = selected(carry0)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def sparse_attention(q, k_cache, v_cache, layer, idx, count, tail_start, q_pos, *, tail_len,
                     idx_layer=None, interpret=False, blocks: SparseBlocks = SparseBlocks()):
    """Pallas (Triton) op with exactly `sparse_attention_reference`'s semantics.

    Returns out [b, 1, k, g, d] in q.dtype.
    """
    b, _, kh, g, d = q.shape
    s = k_cache.shape[3]
    if idx_layer is None:
        idx, count, idx_layer = idx[None], count[None], 0
    per_head = idx.ndim == 4
    idx4 = (idx if per_head else idx[:, :, None, :]).astype(jnp.int32)  # [Li, b, k|1, K]
    cnt3 = jnp.broadcast_to(count.reshape(count.shape[0], b, -1),
                            idx4.shape[:3]).astype(jnp.int32)
    n_idx = idx4.shape[-1]
    bk = max(16, min(blocks.block_k, pow2_at_least(max(n_idx, tail_len, 1))))
    entries = n_idx + tail_len
    per_bh = max(1, min(pl.cdiv(entries, bk), pl.cdiv(blocks.target_programs, b * kh)))
    chunk = pl.cdiv(pl.cdiv(entries, per_bh), bk) * bk
    n_sel = max(1, pl.cdiv(n_idx, chunk))
    n_prog = n_sel + (pl.cdiv(tail_len, chunk) if tail_len > 0 else 0)
    rows = pow2_at_least(g)
    qr = jnp.pad(q[:, 0], ((0, 0), (0, 0), (0, rows - g), (0, 0)))  # [b, kh, rows, d]
    layers = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(idx_layer, jnp.int32)])

    kernel = functools.partial(
        _sparse_kernel, block_k=bk, chunk=chunk, n_sel=n_sel, n_idx=n_idx, tail_len=tail_len,
        s_len=s, scale=d**-0.5, per_head=per_head)
    spec_o = pl.BlockSpec((None, None, None, rows, d), lambda bi, h, c: (bi, h, c, 0, 0))
    spec_v = pl.BlockSpec((None, None, None, rows), lambda bi, h, c: (bi, h, c, 0))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, kh, n_prog),
        in_specs=[
            whole((2,)),
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
            jax.ShapeDtypeStruct((b, kh, n_prog, rows, d), jnp.float32),  # [b, k, J, rows, d]
            jax.ShapeDtypeStruct((b, kh, n_prog, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, n_prog, rows), jnp.float32),
        ],
        compiler_params=pltr.CompilerParams(num_warps=blocks.num_warps,
                                            num_stages=blocks.num_stages),
        interpret=interpret,
        name="vegas_sparse_attention",
    )(layers, qr, idx4, cnt3, tail_start.astype(jnp.int32), q_pos.astype(jnp.int32),
      k_cache, v_cache)
    out, _ = combine_splits(o, m, l)  # [b, kh, rows, d]
    return out[:, None, :, :g].astype(q.dtype)

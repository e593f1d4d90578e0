"""Sparse draft attention: one query token per sequence over a selected index set plus
the contiguous recent tail.

Reads only the selected K/V rows: bytes proportional to the budget, never a masked
full-length attention.

Shapes: q [b, 1, k, g, d]; cache k/v [L, b, k, s, d] with a layer index;
idx [b, K] (shared by the layer's KV heads) or [b, k, K] (per KV head), padded with a valid
sentinel position; count [b] or [b, k] = how many leading entries of idx are real;
tail_start [b]: the tail covers positions tail_start .. q_pos (at most `tail_len` of them);
q_pos [b]: the query's position (its own K/V is already in the cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_rows(cache, layer, idx):
    """cache [L, b, k, s, d] -> rows [b, k, K, d] at positions idx [b, K] or [b, k, K]."""
    _, b, kh, s, _ = cache.shape
    if idx.ndim == 2:
        rows = cache[layer, jnp.arange(b)[:, None], :, idx]  # [b, K, k, d]
        return rows.transpose(0, 2, 1, 3)
    return cache[layer, jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None], idx]


def sparse_attention_reference(q, k_cache, v_cache, layer, idx, count, tail_start, q_pos,
                               *, tail_len):
    """Gather-then-attend in plain XLA. Returns out [b, 1, k, g, d]."""
    b, _, kh, g, d = q.shape
    s = k_cache.shape[3]
    kk = idx.shape[-1]
    tail = tail_start[:, None] + jnp.arange(tail_len)[None, :]  # [b, W]
    tail_ok = tail <= q_pos[:, None]
    tail = jnp.minimum(tail, s - 1)
    sel_ok = jnp.arange(kk) < count[..., None]  # [b, K] or [b, k, K]
    if idx.ndim == 2:
        sel_ok = jnp.broadcast_to(sel_ok[:, None, :], (b, kh, kk))
    keys = jnp.concatenate([gather_rows(k_cache, layer, idx), gather_rows(k_cache, layer, tail)], 2)
    vals = jnp.concatenate([gather_rows(v_cache, layer, idx), gather_rows(v_cache, layer, tail)], 2)
    ok = jnp.concatenate([sel_ok, jnp.broadcast_to(tail_ok[:, None, :], (b, kh, tail_len))], 2)
    # keys/vals [b, k, K + W, d]; ok [b, k, K + W]
    logits = jnp.einsum("bkgd,bksd->bkgs", q[:, 0].astype(jnp.float32), keys.astype(jnp.float32))
    logits = jnp.where(ok[:, :, None, :], logits * d**-0.5, -jnp.inf)
    w = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgs,bksd->bkgd", w, vals.astype(jnp.float32))
    return out[:, None].astype(q.dtype)


# ---------------------------------------------------------------------------------------
# Pallas (Triton backend) kernel
# ---------------------------------------------------------------------------------------
#
# One program = (sequence b, KV head h, chunk j). Chunks 0..J-1 split the selected index
# list (so small batches still fill the GPU); chunk J is the recent tail. Each program
# gathers its K/V rows inside the kernel (`ref[layer, b, h, pos_vector, :]`, unmasked: the
# positions are clamped to valid ones and invalid entries are masked in the scores), loops
# only over the entries that are real (< count), and writes the unnormalised output with the
# running max / sum; XLA combines the J + 1 partial results. Bytes read ~ (count + tail) rows.

import functools  # noqa: E402

from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltr  # noqa: E402

_dot = getattr(pltr, "dot", None) or pl.dot  # moved to pallas.triton in newer jax
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def _pow2_at_least(n, lo=16):
    p = lo
    while p < n:
        p *= 2
    return p


def _whole(shape):
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def _sparse_kernel(layer_ref, q_ref, idx_ref, cnt_ref, ts_ref, qp_ref, k_ref, v_ref,
                   o_ref, m_ref, l_ref, *, block_k, chunk, n_chunks, n_idx, tail_len, s_len,
                   scale, per_head):
    bi = pl.program_id(0)
    h = pl.program_id(1)
    j = pl.program_id(2)
    hi = h if per_head else jnp.int32(0)
    layer = layer_ref[0]
    q = q_ref[...]  # [rows, d]
    rows, d = q.shape
    kr = jnp.arange(block_k, dtype=jnp.int32)
    qpos = qp_ref[bi]

    def attend(pos, ok, carry):
        o, m, l = carry
        pos = jnp.clip(pos, 0, s_len - 1)
        k = k_ref[layer, bi, h, pos, :]  # gather [block_k, d]
        qk = _dot(q, k, trans_b=True) * scale
        qk = jnp.where(ok[None, :], qk, NEG)
        m_new = jnp.maximum(m, qk.max(axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(qk - m_new[:, None])
        l = l * corr + p.sum(axis=-1)
        v = v_ref[layer, bi, h, pos, :]
        o = o * corr[:, None] + _dot(p.astype(v.dtype), v)
        return o, m_new, l

    carry0 = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
              jnp.zeros((rows,), jnp.float32))

    def selected(carry):
        cnt = jnp.minimum(cnt_ref[bi, hi], n_idx)
        e0 = j * chunk
        nblk = pl.cdiv(jnp.maximum(jnp.minimum(e0 + chunk, cnt) - e0, 0), block_k)

        def body(i, c):
            e = e0 + i * block_k + kr
            pos = pltr.load(idx_ref.at[bi, hi, pl.ds(e0 + i * block_k, block_k)],
                            mask=e < n_idx, other=0)
            return attend(pos, e < cnt, c)

        return lax.fori_loop(0, nblk, body, carry)

    def tail(carry):
        t0 = ts_ref[bi]

        def body(i, c):
            e = i * block_k + kr
            pos = t0 + e
            return attend(pos, (e < tail_len) & (pos <= qpos), c)

        return lax.fori_loop(0, pl.cdiv(tail_len, block_k), body, carry)

    if tail_len > 0:
        o, m, l = lax.cond(j < n_chunks, selected, tail, carry0)
    else:
        o, m, l = selected(carry0)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def sparse_attention(q, k_cache, v_cache, layer, idx, count, tail_start, q_pos, *, tail_len,
                     interpret=False, block_k=None, num_warps=4, num_stages=2,
                     target_programs=528):
    """Pallas (Triton) op with exactly `sparse_attention_reference`'s semantics.

    Returns out [b, 1, k, g, d] in q.dtype. Tuning: block_k (gathered rows per step),
    num_warps / num_stages (Triton), target_programs (grid size aimed at when splitting the
    index list).
    """
    b, _, kh, g, d = q.shape
    s = k_cache.shape[3]
    per_head = idx.ndim == 3
    idx3 = (idx if per_head else idx[:, None, :]).astype(jnp.int32)  # [b, kh|1, K]
    cnt2 = jnp.broadcast_to(count.reshape(b, -1), (b, idx3.shape[1])).astype(jnp.int32)
    n_idx = idx3.shape[-1]
    bk = block_k or 64
    bk = max(16, min(bk, _pow2_at_least(max(n_idx, tail_len, 1))))
    j = max(1, min(-(-n_idx // bk), -(-target_programs // (b * kh))))
    chunk = pl.cdiv(pl.cdiv(n_idx, j), bk) * bk
    j = max(1, -(-n_idx // chunk))
    n_prog = j + (1 if tail_len > 0 else 0)
    rows = _pow2_at_least(g)
    qr = jnp.pad(q[:, 0], ((0, 0), (0, 0), (0, rows - g), (0, 0)))  # [b, kh, rows, d]

    kernel = functools.partial(
        _sparse_kernel, block_k=bk, chunk=chunk, n_chunks=j, n_idx=n_idx, tail_len=tail_len,
        s_len=s, scale=d**-0.5, per_head=per_head)
    spec_o = pl.BlockSpec((None, None, None, rows, d), lambda bi, h, c: (bi, h, c, 0, 0))
    spec_v = pl.BlockSpec((None, None, None, rows), lambda bi, h, c: (bi, h, c, 0))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, kh, n_prog),
        in_specs=[
            _whole((1,)),
            pl.BlockSpec((None, None, rows, d), lambda bi, h, c: (bi, h, 0, 0)),
            _whole(idx3.shape),
            _whole(cnt2.shape),
            _whole((b,)),
            _whole((b,)),
            _whole(k_cache.shape),
            _whole(v_cache.shape),
        ],
        out_specs=[spec_o, spec_v, spec_v],
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, n_prog, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, n_prog, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, n_prog, rows), jnp.float32),
        ],
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="vegas_sparse_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), qr, idx3, cnt2,
      tail_start.astype(jnp.int32), q_pos.astype(jnp.int32), k_cache, v_cache)
    mx = lax.optimization_barrier(m.max(axis=2))
    w = jnp.exp(m - mx[:, :, None])
    lsum = (l * w).sum(axis=2)
    out = (o * w[..., None]).sum(axis=2) / jnp.where(lsum == 0.0, 1.0, lsum)[..., None]
    return out[:, None, :, :g].astype(q.dtype)

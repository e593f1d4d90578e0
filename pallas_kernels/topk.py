"""Top-k selection of key positions from the captured scores: [b, s] -> indices [b, k].

`lax.top_k` over 128K positions with k = 7 % sorts whole rows and is slow on the GPU
(BENCHMARKS.md, "Selection"). `blockwise_topk` is exact up to ties: a per-block top-kb (small batched
sorts) followed by a top-k over the candidates, with a check that no block could have held
more than kb winners; if one could, it falls back to `lax.top_k` for the batch (lax.cond).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def blockwise_topk(x, k, *, block=4096, oversample=2.0, fallback=True):
    """x [b, s] float -> (values [b, k], indices [b, k] int32); exact up to ties."""
    b, s = x.shape
    if s <= block or k >= s // 2:
        return lax.top_k(x, k)
    nb = -(-s // block)
    pad = nb * block - s
    xp = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x
    kb = min(block, int(math.ceil(k / nb * oversample)) + 16)
    if kb * nb < k:
        kb = -(-k // nb)
    v1, i1 = lax.top_k(xp.reshape(b, nb, block), kb)  # [b, nb, kb]
    i1 = i1 + (jnp.arange(nb, dtype=i1.dtype) * block)[None, :, None]
    v2, j2 = lax.top_k(v1.reshape(b, nb * kb), k)
    idx = jnp.take_along_axis(i1.reshape(b, nb * kb), j2, axis=1)
    if not fallback:
        return v2, idx
    # exact unless some block's smallest candidate beats the k-th value (then that block
    # may hold more winners than kb); equal values are ties and acceptable.
    missed = jnp.any(v1[:, :, -1] > v2[:, -1:])
    return lax.cond(missed, lambda: tuple(lax.top_k(x, k)), lambda: (v2, idx.astype(jnp.int32)))


# ---------------------------------------------------------------------------------------
# Threshold (radix) select: exact top-k up to ties, no sort
# ---------------------------------------------------------------------------------------
#
# 1. keys: the order-preserving uint32 image of the fp32 scores (total order, -inf and
#    masked positions included).
# 2. the k-th largest key t per row, digit by digit from the top (radix_bits per pass):
#    every pass counts, for all rows at once, how many keys are >= each of the
#    2**radix_bits - 1 candidate thresholds of the next digit -- 32 / radix_bits fused
#    count passes over the scores, each reading them once.
# 3. compaction: keep key > t plus the first (k - count(key > t)) keys == t by position.
#    Output slots come from prefix counts: in blocks of 128 through one bf16 matmul with a
#    triangular matrix (exact: 0/1 inputs, fp32 accumulation), block offsets through a small
#    cumsum; then one scatter. Exactly k distinct positions per row, order by position.


def sortable_keys(x):
    """fp32 -> uint32 with the same order (total order: -0 < +0, NaN above +inf)."""
    u = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where((u >> 31) == 1, ~u, u | jnp.uint32(0x80000000))


def _count_ge(key, thr, how):
    """key [R, s] u32, thr [R, T] u32 -> [R, T] int32 counts of key >= thr."""
    if how == "sep":  # T sibling reductions over the same input (one multi-output fusion)
        return jnp.stack([jnp.sum(key >= thr[:, i:i + 1], axis=1, dtype=jnp.int32)
                          for i in range(thr.shape[1])], axis=1)
    if how == "minor":  # [R, T, s] reduced over the minor axis
        return jnp.sum(key[:, None, :] >= thr[:, :, None], axis=2, dtype=jnp.int32)
    if how == "major":  # [R, s, T] reduced over the middle axis
        return jnp.sum(key[:, :, None] >= thr[:, None, :], axis=1, dtype=jnp.int32)
    raise ValueError(how)


def kth_largest_key(key, k, *, radix_bits=2, count_impl="sep"):
    """key [R, s] uint32 -> [R] uint32, the k-th largest key of each row (1 <= k <= s; an
    int, or [R, 1] per row)."""
    if 32 % radix_bits:
        raise ValueError("radix_bits must divide 32")
    ncand = (1 << radix_bits) - 1
    js = jnp.arange(1, ncand + 1, dtype=jnp.uint32)
    prefix = jnp.zeros(key.shape[:1], jnp.uint32)
    for p in range(32 // radix_bits):
        shift = 32 - radix_bits * (p + 1)
        thr = prefix[:, None] + (js[None, :] << jnp.uint32(shift))  # [R, ncand]
        cnt = _count_ge(key, thr, count_impl)
        nj = jnp.sum(cnt >= k, axis=1, dtype=jnp.int32)  # counts fall as j grows
        prefix = prefix + (nj.astype(jnp.uint32) << jnp.uint32(shift))
    return prefix


def _block_prefix(v, block):
    """Inclusive prefix sums of small non-negative integers v [R, s] (float, exact in bf16,
    block-sum < 2**24) along the rows, blocks of `block` through a triangular matmul."""
    r, s = v.shape
    nb = s // block
    tri = (jnp.arange(block)[:, None] <= jnp.arange(block)[None, :]).astype(jnp.bfloat16)
    p = jnp.dot(v.reshape(r * nb, block).astype(jnp.bfloat16), tri,
                preferred_element_type=jnp.float32).reshape(r, nb, block)
    return p


def select_topk_fast(scores, k, *, counts=None, radix_bits=2, count_impl="sep", block=128):
    """Indices of the k largest scores along the last axis: scores [..., s] (fp32; -inf for
    masked positions) -> int32 [..., k], exact up to ties (ties broken by lower position,
    like `lax.top_k`); the order inside the set is by position, not by score. Rows with
    fewer than k finite entries are filled with -inf positions (as `lax.top_k` does).
    counts [...] (1 <= counts <= k), optional: row r selects only its counts[r] largest,
    in its first counts[r] slots; the slots after them hold position 0 (a valid sentinel
    for a reader that stops at the count).
    One call serves all layers and sequences at once: scores [L, b, s] -> [L, b, k].
    Defaults from the H200 run 3 (BENCHMARKS.md): radix_bits=2 (16 count passes of 3
    thresholds) with sibling reductions beat 4 bits and the broadcast forms."""
    *lead, s = scores.shape
    k = int(k)
    if not 1 <= k <= s:
        raise ValueError(f"need 1 <= k <= s, got k={k}, s={s}")
    x = scores.reshape(-1, s)
    r = x.shape[0]
    want = (jnp.full((r,), k, jnp.int32) if counts is None
            else jnp.broadcast_to(counts, tuple(lead)).reshape(r).astype(jnp.int32))
    key = sortable_keys(x)
    t = kth_largest_key(key, want[:, None], radix_bits=radix_bits, count_impl=count_impl)
    t = t[:, None]
    gt = key > t
    eq = key == t
    need = want - jnp.sum(gt, axis=1, dtype=jnp.int32)  # >= 1 ties to take, by position
    pad = (-s) % block
    # one matmul for both prefixes: gt + 256 * eq (in-block counts <= 128 < 256)
    v = gt.astype(jnp.float32) + 256.0 * eq.astype(jnp.float32)
    v = jnp.pad(v, ((0, 0), (0, pad)))
    p = _block_prefix(v, block)  # [r, nb, block] inclusive, in-block
    p_eq = jnp.floor(p * (1.0 / 256.0))
    p_gt = p - 256.0 * p_eq
    tot = p[:, :, -1]
    tot_eq = jnp.floor(tot * (1.0 / 256.0))
    off_gt = jnp.cumsum((tot - 256.0 * tot_eq).astype(jnp.int32), axis=1)
    off_eq = jnp.cumsum(tot_eq.astype(jnp.int32), axis=1)
    off_gt = (off_gt - (tot - 256.0 * tot_eq).astype(jnp.int32))[:, :, None]  # exclusive
    off_eq = (off_eq - tot_eq.astype(jnp.int32))[:, :, None]
    g_gt = (p_gt.astype(jnp.int32) + off_gt).reshape(r, -1)[:, :s]
    g_eq = (p_eq.astype(jnp.int32) + off_eq).reshape(r, -1)[:, :s]
    sel = gt | (eq & (g_eq <= need[:, None]))
    slot = jnp.where(sel, g_gt + jnp.minimum(g_eq, need[:, None]) - 1, k)  # k: dropped
    rows = jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32)[:, None], (r, s))
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (r, s))
    out = jnp.zeros((r, k), jnp.int32).at[rows, slot].set(pos, mode="drop")
    return out.reshape(*lead, k)

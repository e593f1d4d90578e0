"""Top-k selection of key positions from the captured scores: [..., s] -> indices [..., k].

A sort (`lax.top_k`) of whole rows is slow on the GPU; this is a threshold (radix) select:
exact up to ties, no sort, one call for all layers and sequences.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import pow2_at_least, whole


# ---------------------------------------------------------------------------------------
# Threshold (radix) select
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


def kth_largest_key(key, k, *, radix_bits=2):
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
        # ncand sibling reductions over the same input (one multi-output fusion)
        cnt = jnp.stack([jnp.sum(key >= thr[:, i:i + 1], axis=1, dtype=jnp.int32)
                         for i in range(ncand)], axis=1)  # [R, ncand]
        nj = jnp.sum(cnt >= k, axis=1, dtype=jnp.int32)  # counts fall as j grows
        prefix = prefix + (nj.astype(jnp.uint32) << jnp.uint32(shift))
    return prefix


# The select as one Pallas (Triton) kernel: a program holds its rows in registers, so all
# count passes and the compaction read the scores once.
# Triton compares signed: keys are the int32 image of the order (`_signed_keys`), and a
# threshold built as unsigned bits u compares as u ^ INT_MIN.

_INT_MIN = -(2**31)
# Longest row the kernel serves: one register-resident chunk. Longer rows take XLA's
# passes, which spread each pass over the whole GPU.
PALLAS_MAX_KEYS = 16384


def _wrap32(v: int) -> int:
    return ((v + 2**31) % 2**32) - 2**31


def _signed_keys(x):
    """fp32 -> int32 in the float order under a signed compare (bits of `sortable_keys`
    with the top bit flipped)."""
    i = lax.bitcast_convert_type(x, jnp.int32)
    return i ^ ((i >> 31) & jnp.int32(0x7FFFFFFF))


def _row_keys(x_ref, r0, rb, chunk, n_rows, s_len):
    """The [rb, chunk] signed keys of rows r0.. (one chunk a row); padding and absent rows
    at the bottom of the order (INT_MIN)."""
    rows = r0 + jnp.arange(rb, dtype=jnp.int32)
    cols = jnp.arange(chunk, dtype=jnp.int32)
    ok = (rows < n_rows)[:, None] & (cols < s_len)[None, :]
    x = pltr.load(x_ref.at[pl.ds(r0, rb), pl.ds(0, chunk)], mask=ok, other=0.0)
    return jnp.where(ok, _signed_keys(x), jnp.int32(_INT_MIN))  # [rb, chunk]


def _kth_resident(key, want, radix_bits):
    """The k-th largest key of each row held in registers (key [rb, chunk] signed, want
    [rb]) by all 32 / radix_bits count passes; returns unsigned bits in int32 [rb]."""
    ncand = (1 << radix_bits) - 1
    prefix = jnp.zeros(want.shape, jnp.int32)
    for p in range(32 // radix_bits):
        shift = 32 - radix_bits * (p + 1)
        thr = [(prefix + jnp.int32(_wrap32(j << shift))) ^ jnp.int32(_INT_MIN)
               for j in range(1, ncand + 1)]  # [rb] each, signed-compare form
        cnt = [jnp.sum((key >= t[:, None]).astype(jnp.int32), axis=1) for t in thr]
        nj = sum((c >= want).astype(jnp.int32) for c in cnt)  # counts fall as j grows
        prefix = prefix + lax.shift_left(nj, jnp.int32(shift))
    return prefix


def _kth_resident_early(key, want, radix_bits):
    """`_kth_resident`, stopping as soon as every row's prefix holds exactly `want` keys
    at or above it (the k-th and the next key then differ in the digits seen, which usually
    happens well before the last pass); then the k-th largest is the smallest key at or
    above the prefix, one min-reduction. key [rb, chunk] signed, want [rb]; returns the
    signed key."""
    ncand = (1 << radix_bits) - 1
    npass = 32 // radix_bits
    rb, chunk = key.shape

    def cond(st):
        p, _, cnt = st
        # (no reduce_or in Triton's lowering: a sum)
        return (p < npass) & (jnp.sum((cnt != want).astype(jnp.int32)) > 0)

    def body(st):
        p, prefix, cnt = st
        shift = jnp.int32(32) - jnp.int32(radix_bits) * (p + 1)
        cs = [jnp.sum((key >= ((prefix + lax.shift_left(jnp.int32(j), shift))
                               ^ jnp.int32(_INT_MIN))[:, None]).astype(jnp.int32), axis=1)
              for j in range(1, ncand + 1)]  # [rb] each: keys >= each candidate
        nj = sum((c >= want).astype(jnp.int32) for c in cs)  # counts fall as j grows
        new_cnt = cnt
        for j, c in enumerate(cs, start=1):  # keys >= the new prefix
            new_cnt = jnp.where(nj == j, c, new_cnt)
        return p + 1, prefix + lax.shift_left(nj, shift), new_cnt

    start = (jnp.int32(0), jnp.zeros((rb,), jnp.int32), jnp.full((rb,), chunk, jnp.int32))
    _, prefix, _ = lax.while_loop(cond, body, start)
    above = key >= (prefix ^ jnp.int32(_INT_MIN))[:, None]
    return jnp.min(jnp.where(above, key, jnp.int32(2**31 - 1)), axis=1)


def select_resident(key, want, rows, n_rows, kmax, o_ref, radix_bits, early=False):
    """Threshold and compaction of rows held in registers: key [rb, chunk] signed keys
    (`_signed_keys`; INT_MIN for padding), want [rb] (1 <= want <= kmax), rows [rb] their
    global row numbers (>= n_rows: absent). Row r's want[r] largest positions (ties by
    lower position) are scattered to o_ref slots r * kmax + 0 .., by position; o_ref
    [n_rows * kmax + rb * chunk] int32 (whole), the slots after them, and the spare ones,
    left unwritten. early: the radix passes stop once every row's threshold is pinned
    (`_kth_resident_early`; the same result)."""
    rb, chunk = key.shape
    if early:
        t = _kth_resident_early(key, want, radix_bits)
    else:
        t = _kth_resident(key, want, radix_bits) ^ jnp.int32(_INT_MIN)  # signed form
    gt = key > t[:, None]
    eq = key == t[:, None]
    # ties at the threshold: the first `need` of them by position
    need = want - jnp.sum(gt.astype(jnp.int32), axis=1)  # [rb], >= 1
    # both inclusive prefix counts in one scan: gt in the low 16 bits, eq above them
    # (a row holds at most PALLAS_MAX_KEYS < 2**16 keys)
    both = jnp.cumsum(gt.astype(jnp.int32) + lax.shift_left(eq.astype(jnp.int32),
                                                            jnp.int32(16)), axis=1)
    c_gt = both & jnp.int32(0xFFFF)  # [rb, chunk]
    c_eq = lax.shift_right_logical(both, jnp.int32(16))
    sel = gt | (eq & (c_eq <= need[:, None]))
    slot = c_gt + jnp.minimum(c_eq, need[:, None]) - 1  # [rb, chunk], distinct where sel
    pos = jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32)[None, :], (rb, chunk))
    keep = sel & (rows < n_rows)[:, None]
    # entries not kept aim at a spare slot of their own past the rows (never written on
    # the GPU, where the mask holds; interpret mode writes masked lanes' old values back)
    spare = n_rows * kmax + jnp.arange(rb, dtype=jnp.int32)[:, None] * chunk + pos
    pltr.store(o_ref.at[jnp.where(keep, rows[:, None] * kmax + slot, spare)], pos, mask=keep)


def _select_kernel(x_ref, k_ref, o_ref, *, n_rows, s_len, rb, chunk, radix_bits, kmax):
    """Threshold and compaction of rows held in registers (one chunk a row): the scores
    are read once, and the selected positions scattered to their slots.
    x_ref [R, s] fp32 (whole); k_ref [rb] int32 (1 <= want <= kmax); o_ref [R * kmax +
    rb * chunk] int32 (whole), as `select_resident`."""
    r0 = pl.program_id(0) * rb
    key = _row_keys(x_ref, r0, rb, chunk, n_rows, s_len)  # [rb, chunk]
    select_resident(key, k_ref[...], r0 + jnp.arange(rb, dtype=jnp.int32), n_rows, kmax,
                    o_ref, radix_bits)


def select_topk_pallas(x, k, kmax, *, radix_bits=2, tile=8192, num_warps=8, interpret=False):
    """Threshold and compaction in one kernel: x [R, s] fp32 scores (s <= one resident
    chunk, `PALLAS_MAX_KEYS`), k [R] int32 (1 <= k <= kmax) -> [R, kmax] int32: row r's
    k[r] largest positions by position (ties by lower position), position 0 after them."""
    r, s = x.shape
    if s > PALLAS_MAX_KEYS:
        raise ValueError(f"rows of at most {PALLAS_MAX_KEYS} keys, got {s}")
    chunk = pow2_at_least(s)
    rb = min(max(1, max(tile, chunk) // chunk), pow2_at_least(r, lo=1))
    nprog = -(-r // rb)
    want = jnp.pad(jnp.broadcast_to(k, (r,)).astype(jnp.int32), (0, nprog * rb - r),
                   constant_values=1)
    out = pl.pallas_call(
        functools.partial(_select_kernel, n_rows=r, s_len=s, rb=rb, chunk=chunk,
                          radix_bits=radix_bits, kmax=kmax),
        grid=(nprog,),
        in_specs=[whole(x.shape), pl.BlockSpec((rb,), lambda i: (i,))],
        out_specs=whole((r * kmax + rb * chunk,)),
        out_shape=jax.ShapeDtypeStruct((r * kmax + rb * chunk,), jnp.int32),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="vegas_select",
    )(x.astype(jnp.float32), want)
    # slots past each row's count were never written
    out = out[: r * kmax].reshape(r, kmax)
    return jnp.where(jnp.arange(kmax)[None, :] < want[:r, None], out, 0)


def _block_prefix(v, block):
    """Inclusive prefix sums of small non-negative integers v [R, s] (float, exact in bf16,
    block-sum < 2**24) along the rows, blocks of `block` through a triangular matmul."""
    r, s = v.shape
    nb = s // block
    tri = (jnp.arange(block)[:, None] <= jnp.arange(block)[None, :]).astype(jnp.bfloat16)
    p = jnp.dot(v.reshape(r * nb, block).astype(jnp.bfloat16), tri,
                preferred_element_type=jnp.float32).reshape(r, nb, block)
    return p


_BLOCK = 128  # the compaction's prefix block (in-block counts < 256: see below)


def select_topk_fast(scores, k, *, counts=None, radix_bits=2, threshold="xla",
                     interpret=False):
    """Indices of the k largest scores along the last axis: scores [..., s] (fp32; -inf for
    masked positions) -> int32 [..., k], exact up to ties (ties broken by lower position,
    like `lax.top_k`); the order inside the set is by position, not by score. Rows with
    fewer than k finite entries are filled with -inf positions (as `lax.top_k` does).
    counts [...] (1 <= counts <= k), optional: row r selects only its counts[r] largest,
    in its first counts[r] slots; the slots after them hold position 0 (a valid sentinel
    for a reader that stops at the count).
    One call serves all layers and sequences at once: scores [L, b, s] -> [L, b, k].
    radix_bits: bits a count pass settles (2: 16 passes of 3 thresholds each; more bits
    trade passes for 2**radix_bits - 1 thresholds a pass).
    threshold: "xla" (count passes and compaction in XLA) or "fused" (threshold and
    compaction in one Pallas kernel, `select_topk_pallas`, for rows of at most
    PALLAS_MAX_KEYS; longer rows take the XLA path)."""
    *lead, s = scores.shape
    k = int(k)
    if not 1 <= k <= s:
        raise ValueError(f"need 1 <= k <= s, got k={k}, s={s}")
    x = scores.reshape(-1, s)
    r = x.shape[0]
    want = (jnp.full((r,), k, jnp.int32) if counts is None
            else jnp.broadcast_to(counts, tuple(lead)).reshape(r).astype(jnp.int32))
    if threshold not in ("xla", "fused"):
        raise ValueError(f"threshold must be 'xla' or 'fused', got {threshold!r}")
    if threshold == "fused" and s <= PALLAS_MAX_KEYS:
        return select_topk_pallas(x, want, k, radix_bits=radix_bits, interpret=interpret,
                                  tile=max(8192, pow2_at_least(s))).reshape(*lead, k)
    key = sortable_keys(x)  # [r, s]
    t = kth_largest_key(key, want[:, None], radix_bits=radix_bits)
    t = t[:, None]
    gt = key > t
    eq = key == t
    need = want - jnp.sum(gt, axis=1, dtype=jnp.int32)  # >= 1 ties to take, by position
    block = _BLOCK
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

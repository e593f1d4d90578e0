"""The next selection straight from a verify's captured logits: scores, carry and top-k in
one kernel for all layers.

The verify kernel stores the capture rows' raw logits (fp16, log2 units) of every layer
into one stacked buffer (`verify_attention(..., capture_into=...)`); their softmax weights
need each row's final LSE, known only after the split-K combine. One program per (layer,
sequence) reads its rows' logits once, sums their weights in registers, carries the old
scores (`max(new, decay * old)`), and selects and compacts the row it holds
(`topk.select_resident`, its radix passes stopping once the threshold is pinned): the
scores never reach HBM but as the carried copy.

Shapes (R = capture rows a sequence: KV heads x capture tokens x group):
  cbuf   [L * b * R + spare, s_pad] fp16, row (l * b + bi) * R + r
  offset [L, b, R] fp32: per row LSE - log2(row weight) (log2 units), so that
         score[j] = sum_r exp2(cbuf[.., r, j] - offset[r]), the weighted mean of the rows'
         softmax weights
  end    [b] int32: the ranked range is 0..end (-1: nothing, a finished sequence)
  want   [b] int32: entries to select (1 <= want <= kmax)
  old    [L, b, s] fp32 carried scores (decay > 0), -inf past the ranked range
Returns idx [L, b, kmax] int32 (the want largest by position, position 0 after them) and
the new carried scores [L, b, s] (decay > 0; else None).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import pow2_at_least, whole
from pallas_kernels.topk import (
    PALLAS_MAX_KEYS, _INT_MIN, _signed_keys, select_resident, select_topk_fast,
)


def _scores_reference(cbuf, offset, end, s, old, decay):
    """[L, b, s] fp32: the rows' weights summed, carried, -inf past each ranked range."""
    L, b, r = offset.shape
    logits = cbuf[: L * b * r, :s].reshape(L, b, r, s).astype(jnp.float32)
    score = jnp.exp2(logits - offset[..., None]).sum(axis=2)  # [L, b, s]
    ranked = jnp.arange(s)[None, None, :] <= end[None, :, None]
    if decay:
        score = jnp.maximum(score, decay * old)
    return jnp.where(ranked, score, -jnp.inf)


def select_from_capture_reference(cbuf, offset, end, want, kmax, s, old=None, decay=0.0):
    """Plain-XLA reference of `select_from_capture` (the scores, then `select_topk_fast`'s
    XLA threshold)."""
    score = _scores_reference(cbuf, offset, end, s, old, decay)
    counts = jnp.broadcast_to(want[None, :], score.shape[:2])
    idx = select_topk_fast(score, kmax, counts=counts, threshold="xla")
    return idx, (score if decay else None)


def _kernel(off_ref, end_ref, want_ref, cbuf_ref, *refs, b, r, n_rows, s_len, chunk, kmax,
            decay):
    # off_ref [L * b * r] fp32; end_ref, want_ref [b] int32; cbuf_ref [L * b * r + spare,
    # s_pad] (whole); refs: (old_ref [L * b, s] when decay,) o_ref [L * b * kmax + chunk]
    # int32 (whole), (acc_ref [L * b, s] when decay)
    if decay:
        old_ref, o_ref, acc_ref = refs
    else:
        (o_ref,) = refs
    l, bi = pl.program_id(0), pl.program_id(1)
    row = l * b + bi
    # [1, chunk] tiles throughout, as `select_resident` takes the row
    cols = jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [1, chunk]
    ranked = cols <= end_ref[bi]
    score = jnp.zeros((1, chunk), jnp.float32)
    for i in range(r):  # each capture row once: [1, chunk] fp16, contiguous
        x = pltr.load(cbuf_ref.at[pl.ds(row * r + i, 1), pl.ds(0, chunk)], mask=ranked,
                      other=0.0)
        score = score + jnp.exp2(x.astype(jnp.float32) - off_ref[row * r + i])
    if decay:
        old = pltr.load(old_ref.at[pl.ds(row, 1), pl.ds(0, chunk)], mask=ranked, other=0.0)
        score = jnp.maximum(score, decay * old)
    score = jnp.where(ranked, score, -jnp.inf)
    if decay:
        pltr.store(acc_ref.at[pl.ds(row, 1), pl.ds(0, chunk)], score, mask=cols < s_len)
    key = jnp.where(cols < s_len, _signed_keys(score), jnp.int32(_INT_MIN))  # [1, chunk]
    want = want_ref[pl.ds(bi, 1)]  # [1]
    select_resident(key, want, jnp.full((1,), row, jnp.int32), n_rows, kmax, o_ref,
                    radix_bits=2, early=True)


def select_from_capture(cbuf, offset, end, want, kmax, s, old=None, decay=0.0, *,
                        interpret=False):
    """See the module docstring. s: positions a row ranks (the cache length, at most
    `topk.PALLAS_MAX_KEYS`)."""
    L, b, r = offset.shape
    if s > PALLAS_MAX_KEYS:
        raise ValueError(f"rows of at most {PALLAS_MAX_KEYS} positions, got {s}")
    if (old is None) != (not decay):
        raise ValueError("old scores go with decay > 0, and only with it")
    chunk = pow2_at_least(s)
    rows = L * b
    args = [offset.reshape(-1).astype(jnp.float32), end.astype(jnp.int32),
            want.astype(jnp.int32), cbuf]
    in_specs = [whole((L * b * r,)), whole((b,)), whole((b,)), whole(cbuf.shape)]
    out_shape = [jax.ShapeDtypeStruct((rows * kmax + chunk,), jnp.int32)]
    out_specs = [whole((rows * kmax + chunk,))]
    if decay:
        args.append(old.reshape(rows, s).astype(jnp.float32))
        in_specs.append(whole((rows, s)))
        out_shape.append(jax.ShapeDtypeStruct((rows, s), jnp.float32))
        out_specs.append(whole((rows, s)))
    res = pl.pallas_call(
        functools.partial(_kernel, b=b, r=r, n_rows=rows, s_len=s, chunk=chunk, kmax=kmax,
                          decay=float(decay)),
        grid=(L, b),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        # one program a (layer, sequence) row: a row of 8K+ positions spreads each count
        # pass over 16 warps' threads
        compiler_params=pltr.CompilerParams(num_warps=16 if chunk >= 8192 else 4,
                                            num_stages=1),
        interpret=interpret,
        name="vegas_select_from_capture",
    )(*args)
    # slots past each row's count were never written
    idx = res[0][: rows * kmax].reshape(L, b, kmax)
    idx = jnp.where(jnp.arange(kmax)[None, None, :] < want[None, :, None], idx, 0)
    return idx, (res[1].reshape(L, b, s) if decay else None)

"""Weight-only quantized matmul for drafts: x [m, k] @ dequantize(q, scale) with the packed
weights read once and dequantized in registers, fp32 accumulation.

A draft only proposes (the verify decides with the model's own weights), so its matmuls
may read quantized weights: int8 halves and int4 quarters the bytes a bandwidth-bound draft
step reads. XLA dequantizes to memory before its dot, so it reads more, not fewer, bytes.

Formats (symmetric, no zero point):
- "int8": q int8 [..., k, n] = round(w / s), s = max|w| / 127 per output column, scale
  fp32 [..., n].
- "int4": q in [-7, 7] (the symmetric range: -8 would need its own scale and biases
  rounding), s = max|w| / 7 per group of G = `group_size(k)` rows along k and column,
  scale bf16 [..., k // G, n]. Two values a byte, stored with an offset of 8 (nibble =
  q + 8): within each group, byte j of q uint8 [..., k // 2, n] holds row j in its low
  nibble and row j + G/2 in its high nibble, so a group's bytes unpack into two contiguous
  halves of rows, each multiplied with its own contiguous half of x.
Zero columns or groups get scale 0 and q 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import dot, pow2_at_least, sm_count, whole

FORMATS = ("int8", "int4")
_QMAX = {"int8": 127.0, "int4": 7.0}


def group_size(k: int) -> int:
    """int4's group along k: 128 where it divides k, else 64 (SmolLM2's 576)."""
    for g in (128, 64):
        if k % g == 0:
            return g
    raise ValueError(f"k must be a multiple of 64 for int4 groups, got {k}")


def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def quantize(w, fmt: str):
    """w [..., k, n] -> (q, scale) in `fmt` (module docstring). Runs under jit."""
    _check_fmt(fmt)
    *lead, k, n = w.shape
    wf = w.astype(jnp.float32)
    if fmt == "int8":
        s = jnp.max(jnp.abs(wf), axis=-2) / _QMAX[fmt]  # [..., n]
        safe = jnp.where(s == 0.0, 1.0, s)
        q = jnp.clip(jnp.round(wf / safe[..., None, :]), -127, 127).astype(jnp.int8)
        return q, s
    g = group_size(k)
    wg = wf.reshape(*lead, k // g, g, n)
    # quantize against the stored (bf16) scale, so that dequantize inverts it
    s = (jnp.max(jnp.abs(wg), axis=-2) / _QMAX[fmt]).astype(jnp.bfloat16)  # [..., k/g, n]
    sf = s.astype(jnp.float32)
    safe = jnp.where(sf == 0.0, 1.0, sf)
    q = jnp.clip(jnp.round(wg / safe[..., None, :]), -7, 7).astype(jnp.int32) + 8
    lo, hi = q[..., : g // 2, :], q[..., g // 2:, :]  # [..., k/g, g/2, n]
    packed = (lo | (hi << 4)).astype(jnp.uint8)
    return packed.reshape(*lead, k // 2, n), s


def dequantize(q, scale, fmt: str):
    """(q, scale) -> w [..., k, n] fp32: `quantize`'s inverse up to its rounding."""
    _check_fmt(fmt)
    if fmt == "int8":
        return q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None, :]
    *lead, k2, n = q.shape
    ng = scale.shape[-2]
    g = 2 * k2 // ng
    b = q.astype(jnp.int32).reshape(*lead, ng, g // 2, n)
    vals = jnp.concatenate([(b & 15) - 8, (b >> 4) - 8], axis=-2)  # [..., ng, g, n]
    w = vals.astype(jnp.float32) * scale.astype(jnp.float32)[..., None, :]
    return w.reshape(*lead, 2 * k2, n)


def quant_matmul_reference(x, q, scale, fmt: str):
    """x [..., k] @ dequantize(q, scale) in fp32 (HIGHEST precision), rounded to x's dtype:
    the exact product the kernel approximates only in its summation order."""
    w = dequantize(q, scale, fmt)
    out = jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    return out.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class QuantBlocks:
    """A call's tiling: rows, columns and k rows of a program's block (int4: a multiple of
    the group), k splits (each program walks k / split_k; partial sums meet in XLA), and
    Triton's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def default_blocks(m: int, k: int, n: int, fmt: str) -> QuantBlocks:
    """The tiling for an (m, k, n) call: rows padded to 16 (a Triton dot's least) up to
    64; 128 columns; 256 k rows (int4: two groups); k split until the grid fills about two
    waves of the SMs (a GEMV's few column tiles alone leave most SMs idle)."""
    _check_fmt(fmt)
    bm = min(pow2_at_least(m), 64)
    bn = 128 if n >= 1024 else 64
    bk = 256
    while bk > 16 and k % bk:
        bk //= 2
    if fmt == "int4":
        bk = max(bk, group_size(k))
    tiles = pl.cdiv(m, bm) * pl.cdiv(n, bn)
    steps = k // bk
    split = 1
    while tiles * split < 2 * sm_count() and split * 2 <= steps and steps % (split * 2) == 0:
        split *= 2
    return QuantBlocks(block_m=bm, block_n=bn, block_k=bk, split_k=split,
                       num_warps=4, num_stages=4)


def _kernel(layer_ref, x_ref, q_ref, s_ref, o_ref, *, fmt, m, n, g, block_m, block_n,
            block_k, steps):
    # layer_ref [1] int32; x_ref [m, k]; q_ref [L, k, n] int8 or [L, k/2, n] uint8;
    # s_ref [L, 1, n] fp32 or [L, k/g, n] bf16; o_ref [split * m, n] (each k split's
    # partial product, scaled)
    i, j, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    li = layer_ref[0]
    rows, cols = pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)
    # masks only where a block passes the array's end (static)
    row_ok = (i * block_m + jnp.arange(block_m) < m)[:, None] if m % block_m else None
    col_ok = (j * block_n + jnp.arange(block_n) < n)[None, :] if n % block_n else None
    cdt = x_ref.dtype  # the dot's operand type: weights' integers are exact in bf16

    def load(ref, mask):  # `other` only beside a mask (Triton's lowering insists)
        return pltr.load(ref, mask=mask, other=None if mask is None else 0)

    def load_x(k0, width):
        return load(x_ref.at[rows, pl.ds(k0, width)], row_ok)

    def step_int8(t, acc):
        k0 = (sp * steps + t) * block_k
        wb = load(q_ref.at[li, pl.ds(k0, block_k), cols], col_ok)  # [bk, bn]
        return acc + dot(load_x(k0, block_k), wb.astype(cdt))

    def step_int4(t, acc):
        for gi in range(block_k // g):  # each group: its own scale row
            k0 = (sp * steps + t) * block_k + gi * g
            b = load(q_ref.at[li, pl.ds(k0 // 2, g // 2), cols], col_ok)
            b = b.astype(jnp.int32)  # [g/2, bn]
            lo, hi = ((b & 15) - 8).astype(cdt), ((b >> 4) - 8).astype(cdt)
            sc = load(s_ref.at[li, pl.ds(k0 // g, 1), cols], col_ok)
            part = dot(load_x(k0, g // 2), lo) + dot(load_x(k0 + g // 2, g // 2), hi)
            acc = acc + part * sc.astype(jnp.float32)  # [bm, bn]
        return acc

    acc = lax.fori_loop(0, steps, step_int8 if fmt == "int8" else step_int4,
                        jnp.zeros((block_m, block_n), jnp.float32))
    if fmt == "int8":
        acc = acc * load(s_ref.at[li, pl.ds(0, 1), cols], col_ok)
    out_rows = pl.ds(sp * m + i * block_m, block_m)
    mask = None
    if row_ok is not None or col_ok is not None:
        mask = jnp.broadcast_to(
            (True if row_ok is None else row_ok) & (True if col_ok is None else col_ok),
            (block_m, block_n))
    pltr.store(o_ref.at[out_rows, cols], acc.astype(o_ref.dtype), mask=mask)


def _check_shapes(k: int, q, scale, fmt: str, stacked: bool) -> None:
    _check_fmt(fmt)
    n = q.shape[-1]
    lead = q.shape[:1] if stacked else ()
    if fmt == "int8":
        want_q, want_s, qdt = (*lead, k, n), (*lead, n), jnp.int8
    else:
        want_q, want_s, qdt = (*lead, k // 2, n), (*lead, k // group_size(k), n), jnp.uint8
    if q.shape != want_q or q.dtype != qdt:
        raise ValueError(f"q must be {jnp.dtype(qdt).name} {list(want_q)} for {fmt} with "
                         f"k {k}, got {q.dtype} {list(q.shape)}")
    if scale.shape != want_s:
        raise ValueError(f"scale must be {list(want_s)} for {fmt}, got {list(scale.shape)}")


def _blocks(m: int, k: int, n: int, fmt: str, given: dict) -> QuantBlocks:
    """`default_blocks` with the caller's settings (those not None) put in, checked."""
    b = dataclasses.replace(default_blocks(m, k, n, fmt),
                            **{f: v for f, v in given.items() if v is not None})
    g = group_size(k) if fmt == "int4" else 1
    if b.block_k < 16 or k % b.block_k or b.block_k % g:
        raise ValueError(f"block_k {b.block_k} must be >= 16 and divide k {k}"
                         + (f", a multiple of the group {g}" if g > 1 else ""))
    if b.split_k < 1 or (k // b.block_k) % b.split_k:
        raise ValueError(f"split_k {b.split_k} must divide k / block_k = {k // b.block_k}")
    for name in ("block_m", "block_n"):
        v = getattr(b, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    return b


def quant_matmul(x, q, scale, *, fmt: str, layer=None, block_m: int | None = None,
                 block_n: int | None = None, block_k: int | None = None,
                 split_k: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, interpret: bool = False):
    """`quant_matmul_reference` as one Pallas (Triton) kernel (plus an XLA sum of the k
    splits' partials where split_k > 1). x [..., k] bf16 or fp32; q, scale from `quantize`
    of a [k, n] weight, or with layer (an int, traced or not) of stacked [L, k, n] weights,
    whose layer `layer` the kernel reads in place (no slice copied). Block settings left
    None come from `default_blocks`. Returns [..., n] in x's dtype."""
    *lead, k = x.shape
    _check_shapes(k, q, scale, fmt, stacked=layer is not None)
    if layer is None:
        q, scale, layer = q[None], scale[None], 0
    n = q.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    b = _blocks(m, k, n, fmt, dict(block_m=block_m, block_n=block_n, block_k=block_k,
                                   split_k=split_k, num_warps=num_warps,
                                   num_stages=num_stages))
    s3 = scale.reshape(scale.shape[0], 1, n) if fmt == "int8" else scale
    li = jnp.asarray(layer, jnp.int32).reshape(1)
    out_dtype = x.dtype if b.split_k == 1 else jnp.float32
    out = pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, m=m, n=n,
                          g=group_size(k) if fmt == "int4" else 1, block_m=b.block_m,
                          block_n=b.block_n, block_k=b.block_k,
                          steps=k // b.block_k // b.split_k),
        grid=(pl.cdiv(m, b.block_m), pl.cdiv(n, b.block_n), b.split_k),
        in_specs=[whole((1,)), whole(x2.shape), whole(q.shape), whole(s3.shape)],
        out_specs=whole((b.split_k * m, n)),
        out_shape=jax.ShapeDtypeStruct((b.split_k * m, n), out_dtype),
        compiler_params=pltr.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages),
        interpret=interpret,
        name=f"vegas_quant_matmul_{fmt}",
    )(li, x2, q, s3)
    if b.split_k > 1:  # a fixed-order sum over the splits: deterministic
        out = out.reshape(b.split_k, m, n).sum(axis=0).astype(x.dtype)
    return out.reshape(*lead, n)

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
    """A call's tiling. block_m: rows of a program (>= 16: tensor-core dots, rows padded to
    block_m; 1, 2, 4 or 8: a CUDA-core GEMV, each row's products summed elementwise into a
    register tile, reduced once at the end); block_n columns; block_k rows of k a loop
    step (int4: a multiple of the group); split_k: programs along k (partial sums meet in
    a fixed-order XLA sum); Triton's warps and stages; unpack: "asm" (inline PTX
    converting 4 packed values at once without an int-to-float instruction) or "jnp"
    (the same conversion from jnp ops; interpret mode always uses it)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    unpack: str = "jnp"


UNPACKS = ("jnp", "asm")
GEMV_ROWS = (1, 2, 4, 8)


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
    # the fewest k splits (a divisor of the steps) that make two waves, else all of them
    split = next((d for d in range(1, steps + 1)
                  if steps % d == 0 and tiles * d >= 2 * sm_count()), steps)
    return QuantBlocks(block_m=bm, block_n=bn, block_k=bk, split_k=split,
                       num_warps=4, num_stages=4)


# Inline PTX, 4 packed values a call (Triton packs them into one 32-bit register; each
# bf16 output pair is one register, element 0 in the low half). A nibble u becomes the
# bf16 with bits 0x4300 | u = 128 + u, and one bf16x2 fma takes 136 off: u - 8, exact.
_ASM_INT4 = """{{
.reg .b32 t, c, one, off;
{nibbles}
mov.b32 c, 0x43434343;
mov.b32 one, 0x3F803F80;
mov.b32 off, 0xC308C308;
prmt.b32 $0, t, c, 0x4140;
prmt.b32 $1, t, c, 0x4342;
fma.rn.bf16x2 $0, $0, one, off;
fma.rn.bf16x2 $1, $1, one, off;
}}"""
_ASM_LO = _ASM_INT4.format(nibbles="and.b32 t, $2, 0x0F0F0F0F;")
_ASM_HI = _ASM_INT4.format(nibbles="shr.u32 t, $2, 4;\nand.b32 t, t, 0x0F0F0F0F;")
# int8: v + 128 into the low byte of fp32 2^23 (bits 0x4B0000uu), minus 2^23 + 128: v,
# exact; its bf16 is the fp32's high half (exact for |v| <= 128).
_ASM_INT8 = """{
.reg .b32 t, c, f0, f1, f2, f3, off;
xor.b32 t, $2, 0x80808080;
mov.b32 c, 0x4B000000;
mov.b32 off, 0x4B000080;
prmt.b32 f0, t, c, 0x7440;
prmt.b32 f1, t, c, 0x7441;
prmt.b32 f2, t, c, 0x7442;
prmt.b32 f3, t, c, 0x7443;
sub.f32 f0, f0, off;
sub.f32 f1, f1, off;
sub.f32 f2, f2, off;
sub.f32 f3, f3, off;
prmt.b32 $0, f0, f1, 0x7632;
prmt.b32 $1, f2, f3, 0x7632;
}"""


def _asm(code: str, b):
    return pltr.elementwise_inline_asm(
        code, args=[b], constraints="=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(b.shape, jnp.bfloat16)])[0]


def unpack_int4(b, dtype, asm: bool):
    """Packed bytes b uint8 [r, c] -> (low, high) nibbles as signed values [r, c] in dtype
    (bf16 or fp32): the group's first and second halves of rows."""
    if asm:
        lo, hi = _asm(_ASM_LO, b), _asm(_ASM_HI, b)
    else:  # the same bits from jnp ops
        b16 = b.astype(jnp.uint16)
        lo = lax.bitcast_convert_type((b16 & 15) | 0x4300, jnp.bfloat16) - 136
        hi = lax.bitcast_convert_type((b16 >> 4) | 0x4300, jnp.bfloat16) - 136
    return lo.astype(dtype), hi.astype(dtype)


def unpack_int8(b, dtype, asm: bool):
    """int8 values b [r, c] as dtype (bf16 or fp32), exact."""
    if asm:
        return _asm(_ASM_INT8, b).astype(dtype)
    return b.astype(dtype)


@dataclasses.dataclass(frozen=True)
class _Prog:
    """One program's view: its block indices, its columns and their mask (None where the
    block ends inside n), and closures that load the weights (`weights`: a chunk of k
    rows at k0 as (k offset, values [rows, bn]) parts and the chunk's scale row or None)
    and int8's column scales (`col_scale`, [1, bn])."""

    i: object
    sp: object
    cols: object
    col_ok: object
    weights: object
    col_scale: object


def _kernel(layer_ref, x_ref, q_ref, s_ref, o_ref, *, fmt, m, n, g, block_m, block_n,
            block_k, steps, asm):
    # layer_ref [1] int32; x_ref [m, k]; q_ref [L, k, n] int8 or [L, k/2, n] uint8;
    # s_ref [L, 1, n] fp32 or [L, k/g, n] bf16; o_ref [split * m, n] (each k split's
    # partial product, scaled)
    li = layer_ref[0]
    j = pl.program_id(1)
    cols = pl.ds(j * block_n, block_n)
    # masks only where a block passes the array's end (static)
    col_ok = (j * block_n + jnp.arange(block_n) < n)[None, :] if n % block_n else None
    cdt = x_ref.dtype  # the dots' operand type: the weights' integers are exact in bf16
    chunk = g if fmt == "int4" else min(block_k, 64)  # as `_chunk`

    def weights(k0):
        if fmt == "int8":
            wb = _load(q_ref.at[li, pl.ds(k0, chunk), cols], col_ok)  # [c, bn]
            return [(0, unpack_int8(wb, cdt, asm))], None
        b = _load(q_ref.at[li, pl.ds(k0 // 2, g // 2), cols], col_ok)  # [g/2, bn]
        lo, hi = unpack_int4(b, cdt, asm)
        sc = _load(s_ref.at[li, pl.ds(k0 // g, 1), cols], col_ok)  # [1, bn]
        return [(0, lo), (g // 2, hi)], sc.astype(jnp.float32)

    def col_scale():
        return _load(s_ref.at[li, pl.ds(0, 1), cols], col_ok)  # [1, bn]

    prog = _Prog(i=pl.program_id(0), sp=pl.program_id(2), cols=cols, col_ok=col_ok,
                 weights=weights, col_scale=col_scale if fmt == "int8" else None)
    body = _dot_body if block_m >= 16 else _gemv_body
    body(x_ref, o_ref, prog, m=m, block_m=block_m, block_n=block_n, block_k=block_k,
         chunk=chunk, steps=steps)


def _load(ref, mask):  # `other` only beside a mask (Triton's lowering insists)
    return pltr.load(ref, mask=mask, other=None if mask is None else 0)


def _dot_body(x_ref, o_ref, p: _Prog, *, m, block_m, block_n, block_k, chunk, steps):
    """Tensor-core path: acc [bm, bn] += x [bm, rows] @ part, for each part of each chunk;
    int4's group scale multiplies its chunk's product, int8's column scale the total."""
    rows = pl.ds(p.i * block_m, block_m)
    row_ok = (p.i * block_m + jnp.arange(block_m) < m)[:, None] if m % block_m else None

    def step(t, acc):
        for c in range(block_k // chunk):
            k0 = (p.sp * steps + t) * block_k + c * chunk
            parts, sc = p.weights(k0)
            prod = None
            for off, w in parts:
                xb = _load(x_ref.at[rows, pl.ds(k0 + off, w.shape[0])], row_ok)
                d = dot(xb, w)
                prod = d if prod is None else prod + d
            acc = acc + (prod if sc is None else prod * sc)
        return acc

    acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    if p.col_scale is not None:
        acc = acc * p.col_scale()
    mask = None
    if row_ok is not None or p.col_ok is not None:
        mask = jnp.broadcast_to((True if row_ok is None else row_ok)
                                & (True if p.col_ok is None else p.col_ok), acc.shape)
    pltr.store(o_ref.at[pl.ds(p.sp * m + p.i * block_m, block_m), p.cols],
               acc.astype(o_ref.dtype), mask=mask)


def _gemv_body(x_ref, o_ref, p: _Prog, *, m, block_m, block_n, block_k, chunk, steps):
    """CUDA-core path for a few rows: per row, acc [rows, bn] += x[k0 + r] * w[r, :] for
    the chunk's rows r (no cross-thread reduction inside the loop), summed once at the
    end."""
    def row_ok(r):  # row r of this block exists: True (static) where every row does
        return True if m % block_m == 0 else p.i * block_m + r < m

    def step(t, accs):
        accs = list(accs)
        for c in range(block_k // chunk):
            k0 = (p.sp * steps + t) * block_k + c * chunk
            parts, sc = p.weights(k0)
            for r in range(block_m):
                prod = None
                for off, w in parts:
                    ok, width = row_ok(r), w.shape[0]
                    xr = _load(x_ref.at[p.i * block_m + r, pl.ds(k0 + off, width)],
                               None if ok is True else jnp.broadcast_to(ok, (width,)))
                    d = xr.astype(jnp.float32)[:, None] * w.astype(jnp.float32)
                    prod = d if prod is None else prod + d
                accs[r] = accs[r] + (prod if sc is None else prod * sc)
        return tuple(accs)

    part_rows = chunk if p.col_scale is not None else chunk // 2  # int8: whole; int4: halves
    zero = jnp.zeros((part_rows, block_n), jnp.float32)
    accs = lax.fori_loop(0, steps, step, (zero,) * block_m)
    scale = None if p.col_scale is None else p.col_scale().reshape(block_n)
    col_ok = None if p.col_ok is None else p.col_ok.reshape(block_n)
    for r in range(block_m):
        out = jnp.sum(accs[r], axis=0)  # [bn]
        if scale is not None:
            out = out * scale
        ok, mask = row_ok(r), col_ok
        if ok is not True:
            mask = jnp.broadcast_to(ok, out.shape) if mask is None else mask & ok
        pltr.store(o_ref.at[p.sp * m + p.i * block_m + r, p.cols], out.astype(o_ref.dtype),
                   mask=mask)


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


def _chunk(k: int, fmt: str, block_k: int) -> int:
    """k rows a kernel step loads at once: int4's group, else up to 64."""
    return group_size(k) if fmt == "int4" else min(block_k, 64)


def _blocks(m: int, k: int, n: int, fmt: str, given: dict) -> QuantBlocks:
    """`default_blocks` with the caller's settings (those not None) put in, checked."""
    unknown = set(given) - {f.name for f in dataclasses.fields(QuantBlocks)}
    if unknown:
        raise ValueError(f"unknown block settings {sorted(unknown)}; QuantBlocks has "
                         f"{[f.name for f in dataclasses.fields(QuantBlocks)]}")
    b = dataclasses.replace(default_blocks(m, k, n, fmt),
                            **{f: v for f, v in given.items() if v is not None})
    c = _chunk(k, fmt, b.block_k)
    if b.block_k < 16 or k % b.block_k or b.block_k % c or c & (c - 1):
        raise ValueError(f"block_k {b.block_k} must divide k {k} and be a multiple of "
                         f"{'the group ' if fmt == 'int4' else 'a power of two '}{c}")
    if b.split_k < 1 or (k // b.block_k) % b.split_k:
        raise ValueError(f"split_k {b.split_k} must divide k / block_k = {k // b.block_k}")
    if b.block_n < 16 or b.block_n & (b.block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {b.block_n}")
    if b.block_m not in GEMV_ROWS and (b.block_m < 16 or b.block_m & (b.block_m - 1)):
        raise ValueError(f"block_m must be one of {GEMV_ROWS} or a power of two >= 16, "
                         f"got {b.block_m}")
    if b.unpack not in UNPACKS:
        raise ValueError(f"unpack must be one of {UNPACKS}, got {b.unpack!r}")
    return b


def quant_matmul(x, q, scale, *, fmt: str, layer=None, interpret: bool = False,
                 **blocks):
    """`quant_matmul_reference` as one Pallas (Triton) kernel (plus an XLA sum of the k
    splits' partials where split_k > 1). x [..., k] bf16 or fp32; q, scale from `quantize`
    of a [k, n] weight, or with layer (an int, traced or not) of stacked [L, k, n] weights,
    whose layer `layer` the kernel reads in place (no slice copied). blocks: `QuantBlocks`
    fields (block_m, block_n, block_k, split_k, num_warps, num_stages, unpack); those
    not given (or None) come from `default_blocks`. Returns [..., n] in x's dtype."""
    *lead, k = x.shape
    _check_shapes(k, q, scale, fmt, stacked=layer is not None)
    if layer is None:
        q, scale, layer = q[None], scale[None], 0
    n = q.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    b = _blocks(m, k, n, fmt, blocks)
    s3 = scale.reshape(scale.shape[0], 1, n) if fmt == "int8" else scale
    li = jnp.asarray(layer, jnp.int32).reshape(1)
    out_dtype = x.dtype if b.split_k == 1 else jnp.float32
    out = pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, m=m, n=n,
                          g=group_size(k) if fmt == "int4" else 1, block_m=b.block_m,
                          block_n=b.block_n, block_k=b.block_k,
                          steps=k // b.block_k // b.split_k,
                          asm=b.unpack == "asm" and not interpret),
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

"""Weight-only quantized matmul for drafts: x [m, k] @ dequantize(q, scale) with the packed
weights read once and dequantized in registers, fp32 accumulation.

A draft only proposes (the verify decides with the model's own weights), so its matmuls
may read quantized weights: int8 halves and int4 quarters the bytes a bandwidth-bound draft
step reads. XLA dequantizes to memory before its dot, so it reads more, not fewer, bytes.

Formats of a weight w [..., k, n] (x @ w), symmetric, no zero point. q is stored
transposed, each output column's k values contiguous: a tensor-core dot needs each
thread's values k-adjacent, and from column-contiguous bytes Triton gathers them one
byte at a time from shared memory (seen in the kernel's SASS).
- "int8": q int8 [..., n, k] = round(w.T / s), s = max|w| / 127 per output column, scale
  fp32 [..., n].
- "int4": q in [-7, 7] (the symmetric range: -8 would need its own scale and biases
  rounding), s = max|w| / 7 per group of G = `group_size(k)` rows along k and column,
  scale bf16 [..., k // G, n]. Two values a byte, stored with an offset of 8 (nibble =
  q + 8), q uint8 [..., n, k // 2]: in each column's group, byte j holds row j in its low
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
UNPACKS = ("jnp", "asm")
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


def quantize(w, fmt: str, group: int | None = None):
    """w [..., k, n] -> (q, scale) in `fmt` (module docstring). Runs under jit. group:
    int4's group along k (default `group_size(k)`, the only one the kernels take; any
    even divisor of k serves `dequantize` and the reference, e.g. for a study)."""
    _check_fmt(fmt)
    *lead, k, n = w.shape
    if group is not None and (fmt != "int4" or group < 2 or group % 2 or k % group):
        raise ValueError(f"group must be an even divisor of k {k} (int4 only), got {group} "
                         f"for {fmt}")
    wf = jnp.swapaxes(w.astype(jnp.float32), -1, -2)  # [..., n, k]
    if fmt == "int8":
        s = jnp.max(jnp.abs(wf), axis=-1) / _QMAX[fmt]  # [..., n]
        safe = jnp.where(s == 0.0, 1.0, s)
        q = jnp.clip(jnp.round(wf / safe[..., None]), -127, 127).astype(jnp.int8)
        return q, s
    g = group or group_size(k)
    wg = wf.reshape(*lead, n, k // g, g)
    # quantize against the stored (bf16) scale, so that dequantize inverts it
    s = (jnp.max(jnp.abs(wg), axis=-1) / _QMAX[fmt]).astype(jnp.bfloat16)  # [..., n, k/g]
    sf = s.astype(jnp.float32)
    safe = jnp.where(sf == 0.0, 1.0, sf)
    q = jnp.clip(jnp.round(wg / safe[..., None]), -7, 7).astype(jnp.int32) + 8
    packed = (q[..., : g // 2] | (q[..., g // 2:] << 4)).astype(jnp.uint8)
    return packed.reshape(*lead, n, k // 2), jnp.swapaxes(s, -1, -2)


def weight_shape(q, fmt: str) -> tuple[int, int]:
    """(k, n) of the [k, n] weight whose `quantize` gave q (stacked: one layer's)."""
    _check_fmt(fmt)
    n, kq = q.shape[-2:]
    return kq * (2 if fmt == "int4" else 1), n


def dequantize(q, scale, fmt: str):
    """(q, scale) -> w [..., k, n] fp32: `quantize`'s inverse up to its rounding."""
    _check_fmt(fmt)
    if fmt == "int8":
        w = q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]  # [..., n, k]
        return jnp.swapaxes(w, -1, -2)
    *lead, n, k2 = q.shape
    ng = scale.shape[-2]
    g = 2 * k2 // ng
    b = q.astype(jnp.int32).reshape(*lead, n, ng, g // 2)
    vals = jnp.concatenate([(b & 15) - 8, (b >> 4) - 8], axis=-1)  # [..., n, ng, g]
    w = vals.astype(jnp.float32) * jnp.swapaxes(scale.astype(jnp.float32), -1, -2)[..., None]
    return jnp.swapaxes(w.reshape(*lead, n, 2 * k2), -1, -2)


def quant_matmul_reference(x, q, scale, fmt: str):
    """x [..., k] @ dequantize(q, scale) in fp32 (HIGHEST precision), rounded to x's dtype:
    the exact product the kernel approximates only in its summation order."""
    w = dequantize(q, scale, fmt)
    out = jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    return out.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class QuantBlocks:
    """A call's tiling: rows of a program (a power of two >= 16, a Triton dot's least:
    fewer rows are padded), columns, k rows a loop step (int4: whole groups); split_k
    programs along k (their partial sums meet in a fixed-order XLA sum); Triton's warps
    and stages; unpack: "asm" (inline PTX turning 4 packed values into bf16 at once, no
    int-to-float instruction) or "jnp" (jnp ops; interpret mode always runs these)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    unpack: str = "jnp"


def smem_bytes(b: QuantBlocks, fmt: str, x_bytes: int = 2) -> int:
    """Shared memory a config's kernel needs, as Triton 3.x lays it out for sm_90 (fits
    its compiled kernels): num_stages - 1 buffers of the x and weight tiles, and from 64
    rows (Hopper's wgmma reads its B operand from shared memory) the dequantized bf16
    [block_k, block_n] tile (int8: and the int8 tile once more)."""
    w = b.block_n * b.block_k // (2 if fmt == "int4" else 1)
    tiles = (b.num_stages - 1) * (b.block_m * b.block_k * x_bytes + w)
    wgmma = b.block_k * b.block_n * (2 if fmt == "int4" else 3)
    return tiles + (wgmma if b.block_m >= 64 else 0)


SMEM_BUDGET = 200 * 1024  # of the SM's 227 KiB (`common.SMEM_BYTES`): Triton's scratch


def default_blocks(m: int, k: int, n: int, fmt: str, x_bytes: int = 2) -> QuantBlocks:
    """The tiling for an (m, k, n) call: rows padded to 16 up to 64 a program; 128 columns
    (64 for narrow weights); 256 k rows a step; the fewest k splits (a divisor of the
    steps) that give two waves of programs (a GEMV's column tiles alone leave most SMs
    idle), else the most whose partial sums stay under a quarter of the weight's bytes;
    4 stages, fewer (then a smaller k block) where the
    tiles would not fit in shared memory (`smem_bytes`); int4 unpacked by inline PTX, int8
    by Triton's own conversion (the fewer instructions a weight in each's SASS)."""
    _check_fmt(fmt)
    g = group_size(k) if fmt == "int4" else 16
    b = QuantBlocks(block_m=min(pow2_at_least(m), 64), block_n=128 if n >= 1024 else 64,
                    block_k=256, split_k=1, num_warps=4, num_stages=4,
                    unpack="asm" if fmt == "int4" else "jnp")
    while b.block_k > g and k % b.block_k:
        b = dataclasses.replace(b, block_k=b.block_k // 2)
    while smem_bytes(b, fmt, x_bytes) > SMEM_BUDGET:
        if b.num_stages > 3 or b.block_k <= g:
            b = dataclasses.replace(b, num_stages=b.num_stages - 1)
        else:
            b = dataclasses.replace(b, block_k=b.block_k // 2)
    tiles = pl.cdiv(m, b.block_m) * pl.cdiv(n, b.block_n)
    steps = k // b.block_k
    # the splits' fp32 partials are written and read again: at most a quarter of the
    # weight's bytes
    w_bytes = k * n // (2 if fmt == "int4" else 1)
    splits = [d for d in range(1, steps + 1)
              if steps % d == 0 and (d == 1 or 8 * d * m * n <= w_bytes // 4)]
    split = next((d for d in splits if tiles * d >= 2 * sm_count()), splits[-1])
    return dataclasses.replace(b, split_k=split)


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
ASM_LO = _ASM_INT4.format(nibbles="and.b32 t, $2, 0x0F0F0F0F;")
ASM_HI = _ASM_INT4.format(nibbles="shr.u32 t, $2, 4;\nand.b32 t, t, 0x0F0F0F0F;")
# int8: v + 128 into the low byte of fp32 2^23 (bits 0x4B0000uu), minus 2^23 + 128: v,
# exact; its bf16 is the fp32's high half (exact for |v| <= 128).
ASM_INT8 = """{
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
    (bf16 or fp32): a group's first and second halves of rows. asm: inline PTX (GPU only;
    fewer instructions in the kernel's SASS than the jnp ops, neither with an int-to-float
    conversion)."""
    if asm:
        lo, hi = _asm(ASM_LO, b), _asm(ASM_HI, b)
    else:  # the same bits from jnp ops
        b16 = b.astype(jnp.uint16)
        lo = lax.bitcast_convert_type((b16 & 15) | 0x4300, jnp.bfloat16) - 136
        hi = lax.bitcast_convert_type((b16 >> 4) | 0x4300, jnp.bfloat16) - 136
    return lo.astype(dtype), hi.astype(dtype)


def unpack_int8(b, dtype, asm: bool):
    """int8 values b [r, c] as dtype (bf16 or fp32), exact. asm: inline PTX (GPU only)."""
    if asm:
        return _asm(ASM_INT8, b).astype(dtype)
    return b.astype(dtype)


def _load(ref, mask):  # `other` only beside a mask (Triton's lowering insists)
    return pltr.load(ref, mask=mask, other=None if mask is None else 0)


@dataclasses.dataclass(frozen=True)
class _Call:
    """`_kernel`'s static settings: the format, x's rows m, the weight's columns n, int4's
    group g (int8: block_k), the tile, k steps a program and whether to unpack by PTX."""

    fmt: str
    m: int
    n: int
    g: int
    block_m: int
    block_n: int
    block_k: int
    steps: int
    asm: bool


def _kernel(layer_ref, x_ref, q_ref, s_ref, o_ref, *, call: _Call):
    # layer_ref [1] int32; x_ref [m, k]; q_ref [L, n, k] int8 or [L, n, k/2] uint8;
    # s_ref [L, 1, n] fp32 or [L, k/g, n] bf16; o_ref [split * m, n] (each k split's
    # partial product, scaled)
    fmt, m, n, g, steps, asm = call.fmt, call.m, call.n, call.g, call.steps, call.asm
    block_m, block_n, block_k = call.block_m, call.block_n, call.block_k
    li = layer_ref[0]
    i, j, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, cols = pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)
    # masks only where a block passes the array's end (static)
    row_ok = (i * block_m + jnp.arange(block_m) < m)[:, None] if m % block_m else None
    col_ok = (j * block_n + jnp.arange(block_n) < n)[None, :] if n % block_n else None
    w_ok = None if col_ok is None else col_ok.T  # [bn, 1]: a weight tile's columns
    cdt = x_ref.dtype  # the dots' operand type: the weights' integers are exact in bf16

    def step(t, acc):  # acc [bm, bn] += x [bm, rows] @ w [rows, bn], k block kb
        kb = sp * steps + t
        if fmt == "int8":
            xb = _load(x_ref.at[rows, pl.ds(kb * block_k, block_k)], row_ok)
            wb = _load(q_ref.at[li, cols, pl.ds(kb * block_k, block_k)], w_ok)  # [bn, bk]
            return acc + dot(xb, unpack_int8(wb, cdt, asm), trans_b=True)
        for c in range(block_k // g):  # int4: a group at a time, scaled by its row
            k0 = kb * block_k + c * g
            b = _load(q_ref.at[li, cols, pl.ds(kb * (block_k // 2) + c * (g // 2), g // 2)],
                      w_ok)  # [bn, g/2]
            lo, hi = unpack_int4(b, cdt, asm)
            sc = _load(s_ref.at[li, pl.ds(kb * (block_k // g) + c, 1), cols], col_ok)
            part = (dot(_load(x_ref.at[rows, pl.ds(k0, g // 2)], row_ok), lo, trans_b=True)
                    + dot(_load(x_ref.at[rows, pl.ds(k0 + g // 2, g // 2)], row_ok), hi,
                          trans_b=True))
            acc = acc + part * sc.astype(jnp.float32)  # [bm, bn]
        return acc

    acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    if fmt == "int8":
        acc = acc * _load(s_ref.at[li, pl.ds(0, 1), cols], col_ok)
    mask = None
    if row_ok is not None or col_ok is not None:
        mask = jnp.broadcast_to((True if row_ok is None else row_ok)
                                & (True if col_ok is None else col_ok), acc.shape)
    pltr.store(o_ref.at[pl.ds(sp * m + i * block_m, block_m), cols],
               acc.astype(o_ref.dtype), mask=mask)


def _check_shapes(k: int, q, scale, fmt: str, stacked: bool) -> int:
    """n, the output width, of `quantize`'s (q, scale) of a [k, n] weight (stacked: with a
    leading layer axis)."""
    _check_fmt(fmt)
    n = q.shape[-2] if q.ndim >= 2 else -1
    lead = q.shape[:1] if stacked else ()
    if fmt == "int8":
        want_q, want_s, qdt = (*lead, n, k), (*lead, n), jnp.int8
    else:
        want_q, want_s, qdt = (*lead, n, k // 2), (*lead, k // group_size(k), n), jnp.uint8
    if q.shape != want_q or q.dtype != qdt:
        raise ValueError(f"q must be {jnp.dtype(qdt).name} {list(want_q)} for {fmt} with "
                         f"k {k}, got {q.dtype} {list(q.shape)}")
    if scale.shape != want_s:
        raise ValueError(f"scale must be {list(want_s)} for {fmt}, got {list(scale.shape)}")
    return n


def _blocks(m: int, k: int, n: int, fmt: str, given: dict, x_bytes: int = 2) -> QuantBlocks:
    """`default_blocks` with the caller's settings (those not None) put in, checked."""
    names = [f.name for f in dataclasses.fields(QuantBlocks)]
    if set(given) - set(names):
        raise ValueError(f"unknown block settings {sorted(set(given) - set(names))}; "
                         f"QuantBlocks has {names}")
    b = dataclasses.replace(default_blocks(m, k, n, fmt, x_bytes),
                            **{f: v for f, v in given.items() if v is not None})
    g = group_size(k) if fmt == "int4" else 1
    if b.block_k < 16 or k % b.block_k or b.block_k % g or (
            fmt == "int8" and b.block_k & (b.block_k - 1)):
        raise ValueError(f"block_k {b.block_k} must divide k {k} and be "
                         + (f"a multiple of the group {g}" if g > 1
                            else "a power of two >= 16"))
    if b.split_k < 1 or (k // b.block_k) % b.split_k:
        raise ValueError(f"split_k {b.split_k} must divide k / block_k = {k // b.block_k}")
    for name in ("block_m", "block_n"):
        v = getattr(b, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
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
    n = _check_shapes(k, q, scale, fmt, stacked=layer is not None)
    if layer is None:
        q, scale, layer = q[None], scale[None], 0
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    b = _blocks(m, k, n, fmt, blocks, x.dtype.itemsize)
    s3 = scale.reshape(scale.shape[0], 1, n) if fmt == "int8" else scale
    li = jnp.asarray(layer, jnp.int32).reshape(1)
    out_dtype = x.dtype if b.split_k == 1 else jnp.float32
    out = pl.pallas_call(
        functools.partial(_kernel, call=_Call(
            fmt=fmt, m=m, n=n, g=group_size(k) if fmt == "int4" else b.block_k,
            block_m=b.block_m, block_n=b.block_n, block_k=b.block_k,
            steps=k // b.block_k // b.split_k, asm=b.unpack == "asm" and not interpret)),
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

"""A draft layer's MLP input in one kernel: RMS norm row scale, gate/up projection and the
SwiGLU activation.

A layer's MLP input is otherwise three kernels (the norm's row scale, the gate/up GEMM,
silu(gate) * up), each with a fixed cost that small drafts feel. Here one program per (row
tile, column tile) walks the hidden dimension once, accumulating both x @ W_gate and
x @ W_up for its columns and the rows' sum of squares; the norm's row scale
r = rsqrt(mean(x^2) + eps) commutes with the projection ((r x) @ W = r (x @ W)) and is
applied to the fp32 accumulators with the activation. The norm's weight must already be
folded into W. Rounded once at the end (the XLA path rounds r x, then x @ W, then the
activation): drafts only, whose tokens the verify checks.

Shapes: x [m, h]; w_gate_up [h, 2f] (gate columns, then up columns); out [m, f]. With
fmt ("int8" or "int4", `quant_matmul`'s formats) w_gate_up and scale are `quantize`'s
(q, scale) of that weight (q stored transposed): the packed weights are read once and
dequantized in registers (int4's group scale on each group's products, int8's column
scale on the sums).
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
from pallas_kernels.quant_matmul import (FORMATS, UNPACKS, dequantize, group_size,
                                         unpack_int4, unpack_int8)


@dataclasses.dataclass(frozen=True)
class MlpTile:
    """Rows, hidden and output columns of a program's block; Triton's warps and stages
    (the hidden walk is a pipelined `fori_loop`). The defaults: the fastest tile at
    SmolLM2's draft gate/up (RESULTS.md "Levers measured and not kept", draft GEMMs in
    Pallas); each program multiplies two column tiles, gate and up."""

    block_m: int = 64
    block_k: int = 64
    block_n: int = 16
    num_warps: int = 4
    num_stages: int = 4
    # quantized weights: "jnp" or "asm" (`quant_matmul.QuantBlocks`); None: the format's
    # default there (int4 "asm", int8 "jnp")
    unpack: str | None = None


# The kernel pays where a layer's gate/up weights are small (SmolLM2's: RESULTS.md "Levers
# measured and not kept"): there the three kernels' fixed costs outweigh their bytes; on
# large weights the bytes dominate, and cuBLAS's GEMM is the one tuned to read them.
SMALL_BYTES = 4 << 20
# ... and where the draft has many rows: with fewer, its row tile shrinks and XLA's three
# kernels win (RESULTS.md "Levers measured and not kept": the draft MLP kernel below 64 rows).
MIN_ROWS = 64


def norm_gate_up_reference(x, w_gate_up, *, eps: float, scale=None, fmt: str | None = None):
    """silu(g) * u with [g | u] = rms_norm(x) @ w_gate_up, in fp32, rounded to x's dtype
    (with fmt: w_gate_up = dequantize(w_gate_up, scale, fmt))."""
    xf = x.astype(jnp.float32)
    r = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)  # [m, 1]
    w = dequantize(w_gate_up, scale, fmt) if fmt else w_gate_up.astype(jnp.float32)
    gu = jnp.einsum("mh,hn->mn", xf, w, precision=lax.Precision.HIGHEST) * r
    f = w.shape[-1] // 2
    return (jax.nn.silu(gu[:, :f]) * gu[:, f:]).astype(x.dtype)


def tile_for(h: int, f: int, tile: MlpTile | None = None,
             fmt: str | None = None) -> MlpTile | None:
    """`tile` (default `MlpTile()`) with block_k halved until it divides h and block_n
    until it divides f (neither below 16), or None if none does. int4: block_k at least
    the group (`group_size(h)`), whose multiple it stays."""
    tile = tile or MlpTile()
    bk, bn = tile.block_k, tile.block_n
    if fmt == "int4":
        if h % 64:
            return None
        bk = max(bk, group_size(h))
    while bk >= 16 and h % bk:
        bk //= 2
    while bn >= 16 and f % bn:
        bn //= 2
    if bk < 16 or bn < 16:
        return None
    return dataclasses.replace(tile, block_k=bk, block_n=bn)


def _kernel(x_ref, w_ref, o_ref, *, m, h, f, eps, block_m, block_k, block_n):
    # x_ref [m, h]; w_ref [h, 2f]; o_ref [m, f]
    i, j = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block_m, block_m)
    ok = (i * block_m + jnp.arange(block_m) < m)[:, None]  # [bm, 1]

    def step(kb, carry):
        acc_g, acc_u, ss = carry
        k0 = kb * block_k
        xb = pltr.load(x_ref.at[rows, pl.ds(k0, block_k)], mask=ok, other=0.0)  # [bm, bk]
        xf = xb.astype(jnp.float32)
        wg = w_ref[pl.ds(k0, block_k), pl.ds(j * block_n, block_n)]  # [bk, bn]
        wu = w_ref[pl.ds(k0, block_k), pl.ds(f + j * block_n, block_n)]
        return (acc_g + dot(xb, wg), acc_u + dot(xb, wu), ss + jnp.sum(xf * xf, axis=1))

    zero = jnp.zeros((block_m, block_n), jnp.float32)
    acc_g, acc_u, ss = lax.fori_loop(0, h // block_k, step,
                                     (zero, zero, jnp.zeros((block_m,), jnp.float32)))
    r = lax.rsqrt(ss / h + eps)[:, None]  # [bm, 1]
    g, u = acc_g * r, acc_u * r
    out = g / (1.0 + jnp.exp(-g)) * u  # silu(g) * u
    pltr.store(o_ref.at[rows, pl.ds(j * block_n, block_n)], out.astype(o_ref.dtype),
               mask=jnp.broadcast_to(ok, (block_m, block_n)))


@dataclasses.dataclass(frozen=True)
class _QuantMlp:
    """`_quant_kernel`'s static settings: the format, rows m, hidden h, output width f,
    the norm's eps, the tile and whether to unpack by PTX."""

    fmt: str
    m: int
    h: int
    f: int
    eps: float
    block_m: int
    block_k: int
    block_n: int
    asm: bool


def _quant_kernel(x_ref, w_ref, s_ref, o_ref, *, cfg: _QuantMlp):
    # x_ref [m, h]; w_ref [2f, h] int8 or [2f, h/2] uint8 (int4, groups of g; the formats'
    # transposed storage); s_ref [1, 2f] fp32 (int8) or [h/g, 2f] bf16 (int4); o_ref [m, f]
    fmt, m, h, f, eps, asm = cfg.fmt, cfg.m, cfg.h, cfg.f, cfg.eps, cfg.asm
    block_m, block_k, block_n = cfg.block_m, cfg.block_k, cfg.block_n
    i, j = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block_m, block_m)
    ok = (i * block_m + jnp.arange(block_m) < m)[:, None]  # [bm, 1]
    gate, up = pl.ds(j * block_n, block_n), pl.ds(f + j * block_n, block_n)
    g = group_size(h) if fmt == "int4" else block_k
    cdt = x_ref.dtype  # the weights' integers are exact in bf16

    def xs(k0, width):
        xb = pltr.load(x_ref.at[rows, pl.ds(k0, width)], mask=ok, other=0.0)  # [bm, width]
        xf = xb.astype(jnp.float32)
        return xb, jnp.sum(xf * xf, axis=1)

    def step(kb, carry):
        acc_g, acc_u, ss = carry
        if fmt == "int8":
            xb, sq = xs(kb * block_k, block_k)
            wg, wu = (unpack_int8(w_ref[cols, pl.ds(kb * block_k, block_k)], cdt, asm)
                      for cols in (gate, up))  # [bn, bk]
            return (acc_g + dot(xb, wg, trans_b=True), acc_u + dot(xb, wu, trans_b=True),
                    ss + sq)
        for c in range(block_k // g):  # int4: a group at a time, scaled by its row
            k0 = kb * block_k + c * g
            (xl, sl), (xh, sh) = xs(k0, g // 2), xs(k0 + g // 2, g // 2)
            ss = ss + sl + sh
            for cols, is_gate in ((gate, True), (up, False)):
                b = w_ref[cols, pl.ds(kb * (block_k // 2) + c * (g // 2), g // 2)]
                lo, hi = unpack_int4(b, cdt, asm)  # [bn, g/2]
                sc = s_ref[pl.ds(kb * (block_k // g) + c, 1), cols].astype(jnp.float32)
                prod = (dot(xl, lo, trans_b=True) + dot(xh, hi, trans_b=True)) * sc
                acc_g, acc_u = (acc_g + prod, acc_u) if is_gate else (acc_g, acc_u + prod)
        return acc_g, acc_u, ss

    zero = jnp.zeros((block_m, block_n), jnp.float32)
    acc_g, acc_u, ss = lax.fori_loop(0, h // block_k, step,
                                     (zero, zero, jnp.zeros((block_m,), jnp.float32)))
    if fmt == "int8":
        acc_g, acc_u = acc_g * s_ref[pl.ds(0, 1), gate], acc_u * s_ref[pl.ds(0, 1), up]
    r = lax.rsqrt(ss / h + eps)[:, None]  # [bm, 1]
    gg, u = acc_g * r, acc_u * r
    out = gg / (1.0 + jnp.exp(-gg)) * u  # silu(g) * u
    pltr.store(o_ref.at[rows, gate], out.astype(o_ref.dtype),
               mask=jnp.broadcast_to(ok, (block_m, block_n)))


def one_wave(t: MlpTile, m: int, f: int) -> MlpTile:
    """t with block_n doubled (up to 64, while it divides f) until the grid fits one wave
    of the GPU's SMs: a second, partial wave costs more than wider column tiles."""
    bm = min(t.block_m, pow2_at_least(m))
    bn = t.block_n
    while -(-m // bm) * (f // bn) > sm_count() and bn < 64 and f % (2 * bn) == 0:
        bn *= 2
    return dataclasses.replace(t, block_n=bn)


def _check_weights(h: int, w_gate_up, scale, fmt: str | None) -> int:
    """f, the output width, of a [h, 2f] weight (fmt: `quantize`'s q and scale of it)."""
    if fmt is None:
        f = w_gate_up.shape[-1] // 2
        if w_gate_up.shape != (h, 2 * f):
            raise ValueError(f"w_gate_up must be [{h}, 2f], got {w_gate_up.shape}")
        return f
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be None or one of {FORMATS}, got {fmt!r}")
    if fmt == "int4" and h % 64:
        raise ValueError(f"hidden {h} must be a multiple of 64 for int4")
    f = w_gate_up.shape[0] // 2
    cols, srows = (h, 1) if fmt == "int8" else (h // 2, h // group_size(h))
    if w_gate_up.shape != (2 * f, cols):
        raise ValueError(f"w_gate_up must be [2f, {cols}] for {fmt} (`quantize`'s "
                         f"transposed q), got {w_gate_up.shape}")
    if scale is None or scale.size != srows * 2 * f:
        raise ValueError(f"scale must be [{'' if fmt == 'int8' else str(srows) + ', '}"
                         f"{2 * f}] for {fmt}, got "
                         f"{None if scale is None else list(scale.shape)}")
    return f


def norm_gate_up(x, w_gate_up, *, eps: float, scale=None, fmt: str | None = None,
                 tile: MlpTile | None = None, interpret: bool = False):
    """`norm_gate_up_reference` as one Pallas (Triton) kernel. x [m, h], w_gate_up [h, 2f],
    or with fmt (`quant_matmul.FORMATS`) `quantize`'s q ([2f, h] int8, [2f, h/2] uint8)
    and scale of that weight; h must be a multiple of 16 (int4: 64) and f of 16
    (`tile_for`). tile: None for `MlpTile()`
    with its columns widened to one wave (`one_wave`); a given tile is used as it is.
    Returns [m, f] in x's dtype."""
    m, h = x.shape
    f = _check_weights(h, w_gate_up, scale, fmt)
    t = tile_for(h, f, tile, fmt)
    if t is None:
        raise ValueError(f"hidden {h} and width {f} must be multiples of 16")
    if t.unpack not in (None, *UNPACKS):
        raise ValueError(f"tile.unpack must be None or one of {UNPACKS}, got {t.unpack!r}")
    if tile is None:
        t = one_wave(t, m, f)
    bm = min(t.block_m, pow2_at_least(m))
    common = dict(
        grid=(pl.cdiv(m, bm), f // t.block_n),
        out_specs=whole((m, f)),
        out_shape=jax.ShapeDtypeStruct((m, f), x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret)
    if fmt is None:
        kernel = functools.partial(_kernel, m=m, h=h, f=f, eps=eps, block_m=bm,
                                   block_k=t.block_k, block_n=t.block_n)
        return pl.pallas_call(kernel, in_specs=[whole(x.shape), whole(w_gate_up.shape)],
                              name="vegas_draft_mlp", **common)(x, w_gate_up.astype(x.dtype))
    s2 = scale.reshape(1, 2 * f) if fmt == "int8" else scale
    kernel = functools.partial(_quant_kernel, cfg=_QuantMlp(
        fmt=fmt, m=m, h=h, f=f, eps=eps, block_m=bm, block_k=t.block_k, block_n=t.block_n,
        asm=(t.unpack or ("asm" if fmt == "int4" else "jnp")) == "asm" and not interpret))
    return pl.pallas_call(
        kernel, in_specs=[whole(x.shape), whole(w_gate_up.shape), whole(s2.shape)],
        name=f"vegas_draft_mlp_{fmt}", **common)(x, w_gate_up, s2)

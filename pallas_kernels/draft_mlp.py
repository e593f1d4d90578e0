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

Shapes: x [m, h]; w_gate_up [h, 2f] (gate columns, then up columns); out [m, f].
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


@dataclasses.dataclass(frozen=True)
class MlpTile:
    """Rows, hidden and output columns of a program's block; Triton's warps and stages
    (the hidden walk is a pipelined `fori_loop`). The defaults: the fastest tile measured
    (each program multiplies two column tiles, gate and up)."""

    block_m: int = 64
    block_k: int = 64
    block_n: int = 16
    num_warps: int = 4
    num_stages: int = 4


# The kernel pays where a layer's gate/up weights are small: there the three kernels'
# fixed costs outweigh their bytes, while on large weights it reads slower than cuBLAS.
SMALL_BYTES = 4 << 20
# ... and where the draft has many rows: with fewer, its row tile shrinks and XLA's three
# kernels are faster.
MIN_ROWS = 64


def norm_gate_up_reference(x, w_gate_up, *, eps: float):
    """silu(g) * u with [g | u] = rms_norm(x) @ w_gate_up, in fp32, rounded to x's dtype."""
    xf = x.astype(jnp.float32)
    r = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)  # [m, 1]
    gu = jnp.einsum("mh,hn->mn", xf, w_gate_up.astype(jnp.float32),
                    precision=lax.Precision.HIGHEST) * r
    f = w_gate_up.shape[-1] // 2
    return (jax.nn.silu(gu[:, :f]) * gu[:, f:]).astype(x.dtype)


def tile_for(h: int, f: int, tile: MlpTile | None = None) -> MlpTile | None:
    """`tile` (default `MlpTile()`) with block_k halved until it divides h and block_n
    until it divides f (neither below 16), or None if none does."""
    tile = tile or MlpTile()
    bk, bn = tile.block_k, tile.block_n
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


def one_wave(t: MlpTile, m: int, f: int) -> MlpTile:
    """t with block_n doubled (up to 64, while it divides f) until the grid fits one wave
    of the GPU's SMs: a second, partial wave costs more than wider column tiles."""
    bm = min(t.block_m, pow2_at_least(m))
    bn = t.block_n
    while -(-m // bm) * (f // bn) > sm_count() and bn < 64 and f % (2 * bn) == 0:
        bn *= 2
    return dataclasses.replace(t, block_n=bn)


def norm_gate_up(x, w_gate_up, *, eps: float, tile: MlpTile | None = None,
                 interpret: bool = False):
    """`norm_gate_up_reference` as one Pallas (Triton) kernel. x [m, h], w_gate_up [h, 2f];
    h must be a multiple of 16 and f of 16 (`tile_for`). tile: None for `MlpTile()` with
    its columns widened to one wave (`one_wave`); a given tile is used as it is.
    Returns [m, f] in x's dtype."""
    m, h = x.shape
    f = w_gate_up.shape[-1] // 2
    if w_gate_up.shape != (h, 2 * f):
        raise ValueError(f"w_gate_up must be [{h}, 2f], got {w_gate_up.shape}")
    t = tile_for(h, f, tile)
    if t is None:
        raise ValueError(f"hidden {h} and width {f} must be multiples of 16")
    if tile is None:
        t = one_wave(t, m, f)
    bm = min(t.block_m, pow2_at_least(m))
    kernel = functools.partial(_kernel, m=m, h=h, f=f, eps=eps, block_m=bm,
                               block_k=t.block_k, block_n=t.block_n)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, bm), f // t.block_n),
        in_specs=[whole(x.shape), whole(w_gate_up.shape)],
        out_specs=whole((m, f)),
        out_shape=jax.ShapeDtypeStruct((m, f), x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name="vegas_draft_mlp",
    )(x, w_gate_up.astype(x.dtype))

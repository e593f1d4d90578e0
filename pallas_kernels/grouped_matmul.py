"""Grouped matmul for mixture-of-experts layers: rows sorted by expert, each group of rows
times its own expert's weights (`lax.ragged_dot`'s semantics).

XLA lowers `lax.ragged_dot` on the GPU (jax 0.11) as a dense computation over every
(row, expert) pair: e times the work, and temporaries of rows x e x hidden. `ragged_dot`'s
"pallas" path reads only the weights of experts that have rows: for many rows jax's own
Mosaic-GPU grouped matmul (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, Hopper
only), for few rows our Pallas Triton kernel (`grouped_matmul`), whose grid holds one
program per non-empty row tile, where the Mosaic kernel runs every spare row tile's K loop.

Shapes: lhs [m, k] rows sorted by group; rhs [g, k, n]; group_sizes [g] (summing to m).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import dot, whole

IMPLS = ("xla", "pallas")
# "pallas": the Triton kernel up to this many expert rows (tokens x experts per token:
# 28 tokens of Qwen3-MoE's top-8 are 224 rows), the Mosaic kernel above
TRITON_MAX_ROWS = 256

# The Mosaic kernel's tiles: block_k must divide k and block_n n (Qwen3-MoE's and gpt-oss's
# gate/up fit; gpt-oss's down projection, n 2880, falls back to XLA)
BLOCK_M, BLOCK_N, BLOCK_K, STEPS = 64, 128, 64, 4


@dataclasses.dataclass(frozen=True)
class GmmTile:
    """`grouped_matmul`'s tile: rows, columns and k of a block, Triton's warps and
    stages, and whether k is walked in a pipelined `fori_loop` (else unrolled). The
    defaults: the fastest of `benchmarks/tune_grouped_matmul.py`'s tiles, confirmed in the
    model's decode step (RESULTS.md "MoE shapes", the pipelined expert tile)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    loop: bool = True


def tile_for(k: int, tile: GmmTile = GmmTile()) -> GmmTile | None:
    """`tile` with its block_k halved until it divides k (not below 16: gpt-oss's k 2880
    takes 64), or None if none does."""
    bk = tile.block_k
    while bk >= 16 and k % bk:
        bk //= 2
    return dataclasses.replace(tile, block_k=bk) if bk >= 16 else None


def mosaic_fits(lhs, rhs) -> bool:
    """Whether the Mosaic kernel takes these operands (16-bit floats, whole tiles)."""
    _, k, n = rhs.shape
    return (lhs.dtype == rhs.dtype and lhs.dtype in (jnp.bfloat16, jnp.float16)
            and k % BLOCK_K == 0 and n % BLOCK_N == 0)


def triton_fits(lhs, rhs, tile: GmmTile = GmmTile()) -> bool:
    """Whether `grouped_matmul` (a `tile_for` tile) takes these operands."""
    _, k, n = rhs.shape
    return (lhs.dtype in (jnp.bfloat16, jnp.float16) and tile_for(k, tile) is not None
            and n % tile.block_n == 0)


def hopper() -> bool:
    """The default device is an NVIDIA GPU of compute capability 9.x (Hopper)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def tile_plan(group_sizes, m: int, block_m: int):
    """Row tiles of the rows sorted by group, each within one group: (group [T],
    first row [T], rows [T]) with T = min(g, m) + cdiv(m, block_m) - 1 (a static bound: at
    most m groups have rows); tiles past the last real one have 0 rows."""
    g = group_sizes.shape[0]
    n_tiles = min(g, m) + pl.cdiv(m, block_m) - 1
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes  # [g]
    per = (sizes + block_m - 1) // block_m  # tiles of each group (0 when empty)
    ends = jnp.cumsum(per)  # [g]: one past each group's last tile
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    grp = jnp.minimum(jnp.searchsorted(ends, t, side="right"), g - 1).astype(jnp.int32)
    row0 = starts[grp] + (t - (ends[grp] - per[grp])) * block_m
    rows = jnp.clip(starts[grp] + sizes[grp] - row0, 0, block_m)
    rows = jnp.where(t < ends[-1], rows, 0)
    return grp, row0, rows


def _gmm_kernel(grp_ref, row0_ref, rows_ref, x_ref, w_ref, o_ref, *, block_m, block_k,
                block_n, k, loop):
    # grp/row0/rows [T]; x_ref [m, k]; w_ref [g, k, n]; o_ref [m, n]
    t, j = pl.program_id(0), pl.program_id(1)
    rows = rows_ref[t]

    @pl.when(rows > 0)
    def _():
        g, r0 = grp_ref[t], row0_ref[t]
        ri = jnp.arange(block_m, dtype=jnp.int32)
        ok = (ri < rows)[:, None]  # [block_m, 1]

        def step(k0, acc):
            xb = pltr.load(x_ref.at[pl.ds(r0, block_m), pl.ds(k0, block_k)], mask=ok,
                           other=0.0)  # [block_m, block_k]
            wb = w_ref[g, pl.ds(k0, block_k), pl.ds(j * block_n, block_n)]  # [block_k, block_n]
            return acc + dot(xb, wb)

        acc = jnp.zeros((block_m, block_n), jnp.float32)
        if loop:  # a loop Triton can software-pipeline (num_stages)
            acc = lax.fori_loop(0, k // block_k, lambda i, a: step(i * block_k, a), acc)
        else:  # unrolled: k is a static weight dimension
            for k0 in range(0, k, block_k):
                acc = step(k0, acc)
        pltr.store(o_ref.at[pl.ds(r0, block_m), pl.ds(j * block_n, block_n)],
                   acc.astype(o_ref.dtype), mask=ok)


def grouped_matmul(lhs, rhs, group_sizes, *, tile: GmmTile = GmmTile(), interpret=False):
    """`lax.ragged_dot` for few rows as a Pallas (Triton) kernel: each (row tile, column
    tile) program multiplies up to block_m rows of one group by that group's [k, block_n]
    weight columns, so only groups with rows are read. k must be a multiple of
    tile.block_k and n of tile.block_n (`tile_for` fits block_k). Returns [m, n] in
    lhs.dtype."""
    m, k = lhs.shape
    g, _, n = rhs.shape
    if k % tile.block_k or n % tile.block_n:
        raise ValueError(f"k={k} and n={n} must be multiples of block_k={tile.block_k} and "
                         f"block_n={tile.block_n}")
    grp, row0, rows = tile_plan(group_sizes, m, tile.block_m)  # [T] each
    kernel = functools.partial(_gmm_kernel, block_m=tile.block_m, block_k=tile.block_k,
                               block_n=tile.block_n, k=k, loop=tile.loop)
    return pl.pallas_call(
        kernel,
        grid=(grp.shape[0], n // tile.block_n),
        in_specs=[whole(grp.shape), whole(row0.shape), whole(rows.shape), whole(lhs.shape),
                  whole(rhs.shape)],
        out_specs=whole((m, n)),
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        compiler_params=pltr.CompilerParams(num_warps=tile.num_warps,
                                            num_stages=tile.num_stages),
        interpret=interpret,
        name="vegas_grouped_matmul",
    )(grp, row0, rows, lhs, rhs)


def ragged_dot(lhs, rhs, group_sizes, precision=None, *, impl: str = "xla",
               tile: GmmTile = GmmTile()):
    """lhs [m, k] x rhs [g, k, n] by groups -> [m, n] in lhs.dtype. impl "xla": XLA's
    ragged_dot; "pallas" (Hopper): `grouped_matmul` (its `tile` fitted to k) up to
    TRITON_MAX_ROWS rows, the Mosaic-GPU kernel above, each where it fits the operands
    (`triton_fits`, `mosaic_fits`), XLA's ragged_dot elsewhere (fp32 operands among them:
    the kernels' tensor-core products would round them to TF32)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "pallas":
        if lhs.shape[0] <= TRITON_MAX_ROWS and triton_fits(lhs, rhs, tile):
            return grouped_matmul(lhs, rhs, group_sizes, tile=tile_for(lhs.shape[1], tile))
        if mosaic_fits(lhs, rhs):
            from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

            return ragged_dot_mgpu.ragged_dot(
                lhs, rhs, group_sizes=group_sizes.astype(jnp.int32), block_m=BLOCK_M,
                block_n=BLOCK_N, block_k=BLOCK_K, max_concurrent_steps=STEPS,
                grid_block_n=1)
    return lax.ragged_dot(lhs, rhs, group_sizes, precision=precision)

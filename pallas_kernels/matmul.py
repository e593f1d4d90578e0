"""A row-invariant matmul: each output row depends on its input row and the weights only.

cuBLAS picks its tiles and split-K by the number of rows, so a row's rounding changes with
the rows computed beside it. Here every call uses the same tiles whatever m: one program
per (row block, column block) walks k in fixed blocks in order, accumulating in fp32, so
row i of x @ w is bit for bit the same in a one-row decode step, a gamma + 1 row verify
or a batch of any size.

Shapes: x [m, k]; w [k, n] (or [n, k] with `transpose_w`); out [m, n] in x's dtype.
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


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    """One tile for every call (that is what makes rows invariant): rows, k and columns of
    a program's block; Triton's warps and pipeline stages. block_k None: chosen from the
    weight's k alone (`k_block`), never from the rows. group_m: 0 runs a (row block,
    column block) grid; g > 0 one program axis on which g row blocks sweep the columns
    together, so that a weight tile is read from L2 by g programs in a row (the order of
    the programs, never what each computes)."""

    block_m: int = 16
    block_k: int | None = None
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 0


# The tile of prompt steps (`exact` prefill): thousands of rows a call, compute-bound. A
# prompt row never has to equal a decode row (other tile), only itself in any batch or
# chunking, which one tile for every prompt step gives.
PREFILL_BLOCKS = MatmulBlocks(block_m=128, block_k=64, block_n=128, num_warps=8,
                              num_stages=3, group_m=8)


def k_block(k: int) -> int:
    """A weight's k block: 256 for long rows that it divides (fewer, larger loads keep a
    memory-bound decode GEMM streaming), else 64."""
    return 256 if k >= 4096 and k % 256 == 0 else 64


def matmul_reference(x, w, *, transpose_w: bool = False, out_dtype=None):
    """x @ w (x @ w.T with transpose_w) with fp32 accumulation, rounded once."""
    prec = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    w = w.T if transpose_w else w
    out = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32, precision=prec)
    return out.astype(out_dtype or x.dtype)


def _block_ids(m, n, block_m, block_n, group_m):
    """This program's (row block, column block): the grid's two axes, or with group_m one
    axis walked group_m row blocks at a time across the columns."""
    if not group_m:
        return pl.program_id(0), pl.program_id(1)
    rows, cols = pl.cdiv(m, block_m), pl.cdiv(n, block_n)
    pid = pl.program_id(0)
    first = pid // (group_m * cols) * group_m  # the group's first row block
    size = jnp.minimum(rows - first, group_m)
    at = pid % (group_m * cols)
    return first + at % size, at // size


def _kernel(x_ref, w_ref, o_ref, *, m, k, n, block_m, block_k, block_n, transpose_w,
            group_m=0):
    # x_ref [m, k]; w_ref [k, n] ([n, k] with transpose_w); o_ref [m, n]
    i, j = _block_ids(m, n, block_m, block_n, group_m)
    rows = pl.ds(i * block_m, block_m)
    cols = pl.ds(j * block_n, block_n)
    row_ok = (i * block_m + jnp.arange(block_m) < m)[:, None]  # [bm, 1]
    col_ok = (j * block_n + jnp.arange(block_n) < n)[None, :]  # [1, bn]

    def step(kb, acc):
        k0 = kb * block_k
        kk = k0 + jnp.arange(block_k)
        xb = pltr.load(x_ref.at[rows, pl.ds(k0, block_k)], mask=row_ok & (kk < k)[None, :],
                       other=0.0)  # [bm, bk]
        if transpose_w:
            wb = pltr.load(w_ref.at[cols, pl.ds(k0, block_k)],
                           mask=col_ok.T & (kk < k)[None, :], other=0.0)  # [bn, bk]
            return acc + dot(xb, wb, trans_b=True)
        wb = pltr.load(w_ref.at[pl.ds(k0, block_k), cols], mask=(kk < k)[:, None] & col_ok,
                       other=0.0)  # [bk, bn]
        return acc + dot(xb, wb)

    acc = lax.fori_loop(0, pl.cdiv(k, block_k), step,
                        jnp.zeros((block_m, block_n), jnp.float32))  # [bm, bn]
    pltr.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=row_ok & col_ok)


def matmul(x, w, *, transpose_w: bool = False, out_dtype=None,
           blocks: MatmulBlocks = MatmulBlocks(), interpret: bool = False):
    """`matmul_reference`'s product as one Pallas (Triton) kernel with fixed tiles: x
    [..., k] @ w [k, n] (w [n, k] with transpose_w) -> [..., n]."""
    *lead, k = x.shape
    n = w.shape[0] if transpose_w else w.shape[-1]
    if w.shape != ((n, k) if transpose_w else (k, n)):
        raise ValueError(f"w must be {'[n, ' + str(k) + ']' if transpose_w else '[' + str(k) + ', n]'}"
                         f", got {w.shape}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    b = blocks
    block_k = b.block_k or k_block(k)
    grid = (pl.cdiv(m, b.block_m), pl.cdiv(n, b.block_n))
    out = pl.pallas_call(
        functools.partial(_kernel, m=m, k=k, n=n, block_m=b.block_m, block_k=block_k,
                          block_n=b.block_n, transpose_w=transpose_w, group_m=b.group_m),
        grid=(grid[0] * grid[1],) if b.group_m else grid,
        in_specs=[whole(x2.shape), whole(w.shape)],
        out_specs=whole((m, n)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype or x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages),
        interpret=interpret,
        name="vegas_matmul",
    )(x2, w.astype(x.dtype))
    return out.reshape(*lead, n)

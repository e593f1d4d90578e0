"""Matmuls of few rows (a draft step's projections) with their neighbours fused in.

A draft step of a small model is bound by the number of kernels, not their bytes
(BENCHMARKS.md: at SmolLM2 B = 64 a layer ran four cuBLAS GEMMs of ~4 us each for ~7 MB
of weights, plus the RMS norms, the SwiGLU product and the residual adds as kernels of
their own). `rows_matmul` computes one projection of x [m, K] (m small: the batch) and
folds into the same kernel what sits around it in the layer:

  norm:     out = rms_normalise(x) @ w, the norm's weight already folded into w
            (`model.fold_norms`): the per-row scale commutes with the matmul, so the kernel
            accumulates sum(x**2) beside the product and scales the result rows;
  swiglu:   w [K, 2f] holds gate | up columns: out [m, f] = silu(x @ w_gate) * (x @ w_up);
  residual: out = residual + x @ w.

The arithmetic is the layer's up to rounding (products accumulate in fp32; the norm scales
after the product, not before; the SwiGLU and the residual are applied in fp32 before the
one rounding to x's dtype). The model uses it for sparse drafts only: a draft's numbers
never reach the output, only which drafts are accepted, and the verify and plain decoding
keep XLA's matmuls, so greedy speculative output still equals vanilla's.

Shapes: x [m, K], w [K, N] (N = 2f with swiglu), residual [m, N]; out [m, N or f] in x's
dtype. Grid: (row blocks, column blocks); each program walks K in `block_k` steps.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import dot, pow2_at_least, whole


@dataclasses.dataclass(frozen=True)
class RowsBlocks:
    """Tuning knobs: rows, columns and K-step of a program's tile (upper bounds: each is
    cut to the largest power of two that divides the operand), Triton's warps and
    pipeline stages."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


ROWS_BLOCKS = RowsBlocks()  # read at call time (benchmarks.tune_rows_matmul swaps it)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n (0 if below 16, Triton's smallest dot)."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p if p >= 16 else 0


def supported(m: int, k: int, n: int, swiglu: bool = False) -> bool:
    """Whether the kernel takes these sizes (K and the output width need a power-of-two
    divisor of at least 16)."""
    out = n // 2 if swiglu else n
    return m >= 1 and _pow2_divisor(k, 128) > 0 and _pow2_divisor(out, 128) > 0 and (
        not swiglu or n % 2 == 0)


def rows_matmul_reference(x, w, residual=None, *, norm=False, swiglu=False, eps=1e-6):
    """The layer's own ops in plain XLA: rms_norm (weight folded), matmul, SwiGLU, residual."""
    prec = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    h = x
    if norm:
        xf = x.astype(jnp.float32)
        h = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = jnp.einsum("mk,kn->mn", h, w, precision=prec)
    if swiglu:
        f = w.shape[1] // 2
        y = jax.nn.silu(y[:, :f]) * y[:, f:]
    if residual is not None:
        y = residual + y.astype(residual.dtype)
    return y.astype(x.dtype)


def _kernel(x_ref, w_ref, *refs, m, k_dim, f, block_m, block_n, block_k, norm, swiglu,
            residual, eps):
    # x_ref [m, K]; w_ref [K, N]; r_ref [m, N_out] (residual only); o_ref [m, N_out]
    r_ref, o_ref = refs if residual else (None, refs[0])
    i, j = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block_m, block_m)
    row_ok = (i * block_m + jnp.arange(block_m)) < m  # [block_m]
    cols = pl.ds(j * block_n, block_n)
    up_cols = pl.ds(f + j * block_n, block_n)

    def body(kk, carry):
        acc, acc_up, ss = carry
        ks = pl.ds(pl.multiple_of(kk * block_k, block_k), block_k)
        x = pltr.load(x_ref.at[rows, ks], mask=row_ok[:, None], other=0)  # [block_m, block_k]
        acc = acc + dot(x, w_ref[ks, cols])
        if swiglu:
            acc_up = acc_up + dot(x, w_ref[ks, up_cols])
        if norm:
            xf = x.astype(jnp.float32)
            ss = ss + jnp.sum(xf * xf, axis=1)
        return acc, acc_up, ss

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    acc, acc_up, ss = lax.fori_loop(
        0, k_dim // block_k, body, (zeros, zeros, jnp.zeros((block_m,), jnp.float32)))
    if norm:
        scale = lax.rsqrt(ss / k_dim + eps)[:, None]  # [block_m, 1]
        acc, acc_up = acc * scale, acc_up * scale
    if swiglu:
        acc = acc * jax.nn.sigmoid(acc) * acc_up
    if residual:
        acc = acc + pltr.load(r_ref.at[rows, cols], mask=row_ok[:, None],
                              other=0).astype(jnp.float32)
    pltr.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=row_ok[:, None])


def rows_matmul(x, w, residual=None, *, norm=False, swiglu=False, eps=1e-6,
                interpret=False, blocks: RowsBlocks | None = None):
    """Pallas (Triton) op with `rows_matmul_reference`'s semantics (up to rounding).

    x [m, K], w [K, N]; residual [m, N] (N / 2 with swiglu) or None. Returns [m, N or N/2]
    in x's dtype. Sizes must pass `supported`.
    """
    blocks = blocks or ROWS_BLOCKS
    m, k_dim = x.shape
    n = w.shape[1]
    if not supported(m, k_dim, n, swiglu):
        raise ValueError(f"rows_matmul does not take x {x.shape} @ w {w.shape}")
    out_n = n // 2 if swiglu else n
    bm = min(blocks.block_m, pow2_at_least(m))
    bn = _pow2_divisor(out_n, blocks.block_n) or _pow2_divisor(out_n, 128)
    bk = _pow2_divisor(k_dim, blocks.block_k) or _pow2_divisor(k_dim, 128)
    kernel = functools.partial(
        _kernel, m=m, k_dim=k_dim, f=out_n, block_m=bm, block_n=bn, block_k=bk, norm=norm,
        swiglu=swiglu, residual=residual is not None, eps=eps)
    args = [x, w] + ([residual] if residual is not None else [])
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, bm), out_n // bn),
        in_specs=[whole(a.shape) for a in args],
        out_specs=whole((m, out_n)),
        out_shape=jax.ShapeDtypeStruct((m, out_n), x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=blocks.num_warps,
                                            num_stages=blocks.num_stages),
        interpret=interpret,
        name="vegas_rows_matmul",
    )(*args)

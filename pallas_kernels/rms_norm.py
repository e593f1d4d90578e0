"""A row-invariant RMSNorm: each row's mean square reduced by one program of a fixed shape.

XLA picks its reduction strategy, and the fusion a norm lands in, by the whole tensor's
shape, so a row's rounding can follow the rows beside it. Here the tile is chosen from the
row width alone: row i of the output is bit for bit the same for any number of rows.

Shapes: x [..., h] -> [..., h] in x's dtype (normalised in fp32, no weight).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import pow2_at_least, whole


def rms_norm_reference(x, eps: float):
    xf = x.astype(jnp.float32)
    return (xf * lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) / x.shape[-1] + eps)
            ).astype(x.dtype)


def _kernel(x_ref, o_ref, *, m, h, hp, block_m, eps):
    # x_ref, o_ref [m, h]; one program: block_m rows, the row padded to hp columns
    i = pl.program_id(0)
    rows = pl.ds(i * block_m, block_m)
    ok = ((i * block_m + jnp.arange(block_m) < m)[:, None]
          & (jnp.arange(hp) < h)[None, :])  # [bm, hp]
    x = pltr.load(x_ref.at[rows, pl.ds(0, hp)], mask=ok, other=0.0).astype(jnp.float32)
    r = lax.rsqrt(jnp.sum(x * x, axis=1) / h + eps)  # [bm]
    pltr.store(o_ref.at[rows, pl.ds(0, hp)], (x * r[:, None]).astype(o_ref.dtype), mask=ok)


def rms_norm(x, eps: float, *, tile: int = 8192, num_warps: int = 4, interpret: bool = False):
    """`rms_norm_reference` as one Pallas (Triton) kernel; `tile` bounds a program's
    elements (rows a program = tile // the padded row width, at least one)."""
    *lead, h = x.shape
    x2 = x.reshape(-1, h)
    m = x2.shape[0]
    hp = pow2_at_least(h, lo=1)
    block_m = max(1, tile // hp)
    out = pl.pallas_call(
        functools.partial(_kernel, m=m, h=h, hp=hp, block_m=block_m, eps=eps),
        grid=(pl.cdiv(m, block_m),),
        in_specs=[whole(x2.shape)],
        out_specs=whole((m, h)),
        out_shape=jax.ShapeDtypeStruct((m, h), x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="vegas_rms_norm",
    )(x2)
    return out.reshape(*lead, h)

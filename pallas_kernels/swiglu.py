"""A draft layer's MLP activation with the MLP norm's row scale, in one kernel.

A fused draft step of a small model is bound by its kernel count, not its bytes: each
draft layer ran the MLP's RMS norm (one kernel: x -> bf16 x * r) before the gate/up
matmul and the SwiGLU (another) after it. With the norm's weight folded into w_gate_up
(`model.fold_norms`), the row scale r = rsqrt(mean(x**2) + eps) commutes with the
matmul: (r x) @ W = r (x @ W). So the draft multiplies the raw residual x by W and this
kernel applies r and the SwiGLU together: silu(r g) * (r u). One launch a layer fewer.
Drafts only: the verify and plain decoding keep the model's order (the draft's rounding
differs slightly, which only its acceptance could notice).

Shapes: gate_up [b, 2f] (gate | up), x [b, h] (the rows whose norm scales them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import pow2_at_least, whole


def scaled_swiglu_reference(gate_up, x, eps):
    """silu(r g) * (r u) in fp32, r = rsqrt(mean(x**2) + eps) per row; in gate_up's
    dtype. gate_up [b, 2f], x [b, h] -> [b, f]."""
    f = gate_up.shape[-1] // 2
    xf = x.astype(jnp.float32)
    r = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)  # [b, 1]
    g = gate_up[:, :f].astype(jnp.float32) * r  # [b, f]
    u = gate_up[:, f:].astype(jnp.float32) * r
    return (g * jax.nn.sigmoid(g) * u).astype(gate_up.dtype)


def _kernel(x_ref, g_ref, u_ref, o_ref, *, b, hidden, eps):
    # x_ref [b, h] whole; g_ref, u_ref, o_ref [R, C] blocks of the gate, up and output
    rows_blk = o_ref.shape[0]
    r0 = pl.program_id(0) * rows_blk
    rows = r0 + jnp.arange(rows_blk, dtype=jnp.int32)  # [R]
    # the rows' sum of squares in chunks of at most 1024 columns (a Qwen3-8B row of 4096
    # fp32 for 8 rows at once would spill registers)
    chunk = min(pow2_at_least(hidden, 1), 1024)
    cols = jnp.arange(chunk, dtype=jnp.int32)
    ss = jnp.zeros((rows_blk,), jnp.float32)
    for c0 in range(0, hidden, chunk):
        # the last chunk ends at the row's end (a static slice may not start past it);
        # columns an earlier chunk counted are masked
        s0 = max(0, min(c0, hidden - chunk))
        col = s0 + cols[None, :]
        xr = pltr.load(x_ref.at[pl.ds(r0, rows_blk), pl.ds(s0, chunk)],
                       mask=(rows[:, None] < b) & (col >= c0) & (col < hidden),
                       other=0).astype(jnp.float32)  # [R, chunk]
        ss = ss + jnp.sum(xr * xr, axis=1)
    r = lax.rsqrt(ss / hidden + eps)[:, None]  # [R, 1]
    g = g_ref[...].astype(jnp.float32) * r  # [R, C]
    u = u_ref[...].astype(jnp.float32) * r
    o_ref[...] = (g * jax.nn.sigmoid(g) * u).astype(o_ref.dtype)


def column_block(f: int) -> int | None:
    """The kernel's column block: the largest power of two up to 512 dividing f (the
    gate's and the up's blocks are then whole blocks of one array), or None."""
    c = 512
    while c >= 16:
        if f % c == 0:
            return c
        c //= 2
    return None


def scaled_swiglu(gate_up, x, eps, *, interpret=False):
    """`scaled_swiglu_reference` as one Pallas (Triton) kernel; falls back to the
    reference (XLA) when f has no power-of-two block of at least 16 columns.
    gate_up [b, 2f], x [b, h] -> [b, f] in gate_up's dtype."""
    b, two_f = gate_up.shape
    f = two_f // 2
    c = column_block(f)
    if c is None:
        return scaled_swiglu_reference(gate_up, x, eps)
    # 8 rows a block: a draft's rows (padded to 8, `ExecConfig.row_pad`) in one or a few
    # blocks, and enough programs over the columns to fill the card a little
    rblk = min(8, pow2_at_least(b, 1))
    nc = f // c
    return pl.pallas_call(
        functools.partial(_kernel, b=b, hidden=x.shape[-1], eps=eps),
        grid=(pl.cdiv(b, rblk), nc),
        in_specs=[whole(x.shape),
                  pl.BlockSpec((rblk, c), lambda i, j: (i, j)),
                  pl.BlockSpec((rblk, c), lambda i, j: (i, j + nc))],
        out_specs=pl.BlockSpec((rblk, c), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((b, f), gate_up.dtype),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="vegas_scaled_swiglu",
    )(x, gate_up, gate_up)

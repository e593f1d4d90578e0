"""Grouped matmul for mixture-of-experts layers: rows sorted by expert, each group of rows
times its own expert's weights (`lax.ragged_dot`'s semantics).

XLA lowers `lax.ragged_dot` on the GPU (jax 0.11) as a dense computation over every
(row, expert) pair: e times the work, and temporaries of rows x e x hidden (1.8 GB and
6.7 ms a layer for a Qwen3-30B-A3B verify of 448 rows; BENCHMARKS.md, 2026-12-02 e).
On Hopper GPUs the "mosaic" path runs jax's own Pallas Mosaic-GPU grouped matmul
(`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`), which reads only the weights of
experts that have rows and needs no temporaries (0.61 ms at 448 rows, bitwise equal).

Shapes: lhs [m, k] rows sorted by group; rhs [g, k, n]; group_sizes [g] (summing to m).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

IMPLS = ("xla", "mosaic")

# The Mosaic kernel's tiles: block_k must divide k and block_n must divide n (Qwen3-MoE:
# k 2048 / 768, n 1536 / 2048 fit; gpt-oss's gate/up fits (k 2880, n 5760), its down
# projection (n 2880, not a multiple of 128) falls back to XLA).
BLOCK_M, BLOCK_N, BLOCK_K, STEPS = 64, 128, 64, 4


def mosaic_fits(lhs, rhs) -> bool:
    """Whether the Mosaic kernel takes these operands (16-bit floats, whole tiles)."""
    _, k, n = rhs.shape
    return (lhs.dtype == rhs.dtype and lhs.dtype in (jnp.bfloat16, jnp.float16)
            and k % BLOCK_K == 0 and n % BLOCK_N == 0)


def hopper() -> bool:
    """The default device is an NVIDIA GPU of compute capability 9.x (H100 / H200)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def ragged_dot(lhs, rhs, group_sizes, precision=None, *, impl: str = "xla"):
    """lhs [m, k] x rhs [g, k, n] by groups -> [m, n] in lhs.dtype. impl "mosaic" runs the
    Mosaic-GPU kernel where it fits (`mosaic_fits`), XLA's ragged_dot elsewhere (fp32
    operands among them: the kernel's wgmma would multiply them in TF32)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "mosaic" and mosaic_fits(lhs, rhs):
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        return ragged_dot_mgpu.ragged_dot(
            lhs, rhs, group_sizes=group_sizes.astype(jnp.int32), block_m=BLOCK_M,
            block_n=BLOCK_N, block_k=BLOCK_K, max_concurrent_steps=STEPS, grid_block_n=1)
    return lax.ragged_dot(lhs, rhs, group_sizes, precision=precision)

"""MXFP4 (OCP microscaling FP4) weights, as gpt-oss checkpoints store their experts:
dequantised on the host when the checkpoint is read.

A block of 32 values is 16 bytes of FP4 E2M1 codes, two a byte (the low nibble is the
earlier value), and one E8M0 scale byte s: the values are code * 2**(s - 127). Every
E2M1 value times a power of two within bf16's exponent range is exact in bf16 and fp32,
so the dequantised weights are the checkpoint's, not an approximation of them.
"""

from __future__ import annotations

import numpy as np

# E2M1 code -> value: sign bit, two exponent bits, one mantissa bit.
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32  # values per scale
_E8M0_NAN = 255  # the one E8M0 code that is not a power of two


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> values [..., G * 32] of
    `dtype`: row r of the prefix holds its G blocks of 32 values one after the other."""
    blocks = np.asarray(blocks)
    scales = np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not "
                         f"match: expected [..., G, {BLOCK // 2}] and [..., G]")
    if np.any(scales == _E8M0_NAN):
        raise ValueError("MXFP4 scale 255 (NaN in E8M0) in the checkpoint")
    vals = np.empty(blocks.shape[:-1] + (BLOCK,), np.float32)  # [..., G, 32]
    vals[..., 0::2] = FP4_E2M1[blocks & 0x0F]
    vals[..., 1::2] = FP4_E2M1[blocks >> 4]
    vals = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127)
    return vals.reshape(blocks.shape[:-2] + (-1,)).astype(dtype, copy=False)

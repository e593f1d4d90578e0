"""Lowering Pallas kernels for CUDA on a machine without a GPU (the Triton IR is built
at lowering time, so a kernel that Triton cannot express fails here, not on the GPU)."""

import jax
import pytest


def lower_cuda(fn, *shapes):
    """The StableHLO of `fn` lowered for CUDA; skips where this jaxlib cannot."""
    try:
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # pragma: no cover - depends on the jaxlib build
        if "platform" in str(e).lower() and "cuda" in str(e).lower():
            pytest.skip(f"this jaxlib cannot lower for CUDA: {e}")
        raise

"""The draft step's row-matmul kernel (interpret mode) against its plain-XLA reference."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.rows_matmul import (
    RowsBlocks, rows_matmul, rows_matmul_reference, supported,
)

# (K, N, norm, swiglu, residual): SmolLM2's four projections, and a small odd-width one
SHAPES = [
    (576, 960, True, False, False),  # norm + q|k|v
    (576, 576, False, False, True),  # output projection + residual
    (576, 3072, True, True, False),  # norm + gate|up + SwiGLU
    (1536, 576, False, False, True),  # down projection + residual
    (96, 48, False, False, False),  # K and N with power-of-two divisors 32 and 16 only
]


@pytest.mark.parametrize("m", [1, 5, 64, 80])
@pytest.mark.parametrize("k,n,norm,swiglu,residual", SHAPES)
def test_rows_matmul_matches_reference(m, k, n, norm, swiglu, residual):
    key = jax.random.PRNGKey(m * 7 + n)
    kx, kw, kr = jax.random.split(key, 3)
    # rows of very different scales: the norm must scale each row by its own RMS
    x = jax.random.normal(kx, (m, k)) * jnp.linspace(0.1, 10.0, m)[:, None]
    w = jax.random.normal(kw, (k, n)) * k**-0.5
    out_n = n // 2 if swiglu else n
    r = jax.random.normal(kr, (m, out_n)) if residual else None
    # small tiles: several row blocks, column blocks and K steps at every size
    blocks = RowsBlocks(block_m=16, block_n=32, block_k=32)
    got = rows_matmul(x, w, r, norm=norm, swiglu=swiglu, interpret=True, blocks=blocks)
    ref = rows_matmul_reference(x, w, r, norm=norm, swiglu=swiglu)
    assert got.shape == ref.shape == (m, out_n)
    err = jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)
    assert float(err) < 1e-5


def test_rows_matmul_bf16_is_bf16_close():
    kx, kw, kr = jax.random.split(jax.random.PRNGKey(3), 3)
    x = jax.random.normal(kx, (64, 576), jnp.bfloat16)
    w = (jax.random.normal(kw, (576, 3072)) * 576**-0.5).astype(jnp.bfloat16)
    got = rows_matmul(x, w, norm=True, swiglu=True, interpret=True)
    ref = rows_matmul_reference(x.astype(jnp.float32), w.astype(jnp.float32), norm=True,
                                swiglu=True)
    assert got.dtype == jnp.bfloat16
    err = jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
    assert float(err) < 1e-2


def test_unsupported_sizes_are_refused():
    assert not supported(4, 100, 64)  # K = 100: no power-of-two divisor >= 16
    assert not supported(4, 64, 24)
    assert not supported(4, 64, 40, swiglu=True)  # f = 20
    with pytest.raises(ValueError, match="does not take"):
        rows_matmul(jnp.zeros((4, 100)), jnp.zeros((100, 64)), interpret=True)

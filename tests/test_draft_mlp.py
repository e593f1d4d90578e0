"""The draft MLP-input kernel against its reference (interpret mode on the CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.draft_mlp import (MlpTile, norm_gate_up, norm_gate_up_reference, one_wave,
                                      tile_for)
from tests.cuda import lower_cuda


# (m, h, f, dtype, tile): rows not a multiple of the row tile (3, 70), SmolLM2's widths,
# several column and hidden blocks, a tile whose blocks must shrink to fit
CASES = [
    (3, 64, 48, jnp.float32, None),
    (70, 96, 32, jnp.float32, MlpTile(block_m=64, block_k=64, block_n=32)),
    (8, 576, 1536, jnp.bfloat16, None),
    (16, 48, 80, jnp.float32, MlpTile(block_m=16, block_k=64, block_n=64)),
]


@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_norm_gate_up_matches_reference(case):
    m, h, f, dtype, tile = case
    k1, k2 = jax.random.split(jax.random.PRNGKey(m + h + f))
    # rows of very different scales: the row scale must be each row's own
    x = (jax.random.normal(k1, (m, h)) * jnp.linspace(0.1, 3.0, m)[:, None]).astype(dtype)
    w = (jax.random.normal(k2, (h, 2 * f)) * 0.1).astype(dtype)
    ref = norm_gate_up_reference(x, w, eps=1e-6)
    out = jax.jit(functools.partial(norm_gate_up, eps=1e-6, tile=tile, interpret=True))(x, w)
    assert out.shape == (m, f) and out.dtype == dtype
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)
    # the reference is the model's unfused MLP input (rms_norm, gate/up, silu(gate) * up)
    xf = x.astype(jnp.float32)
    h_ = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)
    gu = h_ @ w.astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(ref, np.float32),
                               np.asarray(jax.nn.silu(gu[:, :f]) * gu[:, f:], np.float32),
                               rtol=tol, atol=tol)


def test_tile_for_shrinks_blocks_to_divide_the_widths():
    assert tile_for(576, 1536) == MlpTile()
    assert tile_for(48, 80, MlpTile(block_k=64, block_n=64)) == MlpTile(block_k=16, block_n=16)
    assert tile_for(40, 64) is None  # no block of 16+ divides 40


def test_one_wave_widens_columns_until_the_grid_fits_the_sms(monkeypatch):
    from pallas_kernels import draft_mlp

    monkeypatch.setattr(draft_mlp, "sm_count", lambda: 132)
    t = MlpTile()  # 64 rows, 16 columns
    assert one_wave(t, 64, 1536).block_n == 16  # 96 programs
    assert one_wave(t, 8, 1536).block_n == 16
    assert one_wave(t, 128, 1536).block_n == 32  # 192 -> 96
    assert one_wave(t, 256, 1536).block_n == 64  # 384 -> 96
    assert one_wave(t, 1024, 1536).block_n == 64  # never past 64
    assert one_wave(t, 128, 48).block_n == 16  # 32 does not divide 48
    # the default tile is widened in the call; a given tile is kept
    seen = []
    monkeypatch.setattr(draft_mlp.pl, "pallas_call",
                        lambda kernel, **kw: seen.append(kernel.keywords["block_n"])
                        or (lambda *a: None))
    x, w = jnp.zeros((128, 64)), jnp.zeros((64, 2 * 1536))
    norm_gate_up(x, w, eps=1e-6, interpret=True)
    norm_gate_up(x, w, eps=1e-6, tile=MlpTile(), interpret=True)
    assert seen == [32, 16]


def test_bad_shapes_raise():
    x = jnp.zeros((4, 40))
    with pytest.raises(ValueError, match="multiples of 16"):
        norm_gate_up(x, jnp.zeros((40, 64)), eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="must be"):
        norm_gate_up(jnp.zeros((4, 64)), jnp.zeros((48, 64)), eps=1e-6, interpret=True)


def test_lowers_for_cuda():
    sd = jax.ShapeDtypeStruct
    txt = lower_cuda(functools.partial(norm_gate_up, eps=1e-6),
                     sd((64, 576), jnp.bfloat16), sd((576, 3072), jnp.bfloat16))
    assert "xla.gpu.triton" in txt

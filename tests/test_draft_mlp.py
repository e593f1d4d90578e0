"""The draft MLP-input kernel against its reference (interpret mode on the CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.draft_mlp import (MlpTile, norm_gate_up, norm_gate_up_reference, one_wave,
                                      tile_for)
from pallas_kernels.quant_matmul import dequantize, quantize
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


# (m, h, f, fmt, dtype, tile): SmolLM2's widths (h 576: int4 groups of 64), groups of 128
# (h 256), several groups a k block, rows past the row tile, the "asm" setting (its jnp
# equivalent in interpret mode)
QCASES = [
    (8, 576, 96, "int8", jnp.bfloat16, None),
    (8, 576, 96, "int4", jnp.bfloat16, None),
    (70, 256, 32, "int4", jnp.float32, MlpTile(block_m=64, block_k=256, block_n=32)),
    (5, 128, 48, "int8", jnp.float32, MlpTile(block_m=16, block_k=32, block_n=16,
                                               unpack="asm")),
    (3, 192, 16, "int4", jnp.float32, MlpTile(block_m=16, block_k=64, block_n=16,
                                               unpack="asm")),
]


@pytest.mark.parametrize("case", QCASES, ids=[f"q{i}" for i in range(len(QCASES))])
def test_quantized_weights_match_the_reference(case):
    m, h, f, fmt, dtype, tile = case
    k1, k2 = jax.random.split(jax.random.PRNGKey(m + h + f))
    x = (jax.random.normal(k1, (m, h)) * jnp.linspace(0.1, 3.0, m)[:, None]).astype(dtype)
    q, s = quantize(jax.random.normal(k2, (h, 2 * f)) * 0.1, fmt)
    ref = norm_gate_up_reference(x, q, eps=1e-6, scale=s, fmt=fmt)
    out = jax.jit(functools.partial(norm_gate_up, eps=1e-6, fmt=fmt, tile=tile,
                                    interpret=True))(x, q, scale=s)
    assert out.shape == (m, f) and out.dtype == dtype
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)
    # the quantized reference is the unquantized one on the dequantized weight
    w = dequantize(q, s, fmt)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(norm_gate_up_reference(
        x, w, eps=1e-6)))


def test_quantized_bad_inputs_raise():
    x = jnp.zeros((4, 128))
    q4, s4 = quantize(jnp.ones((128, 64)), "int4")
    q8, s8 = quantize(jnp.ones((128, 64)), "int8")
    with pytest.raises(ValueError, match="fmt"):
        norm_gate_up(x, q8, eps=1e-6, scale=s8, fmt="fp8", interpret=True)
    with pytest.raises(ValueError, match="scale must be"):
        norm_gate_up(x, q8, eps=1e-6, fmt="int8", interpret=True)
    with pytest.raises(ValueError, match="w_gate_up must be"):
        norm_gate_up(x, q8, eps=1e-6, scale=s8, fmt="int4", interpret=True)
    with pytest.raises(ValueError, match="scale must be"):
        norm_gate_up(x, q4, eps=1e-6, scale=s4[:, :8], fmt="int4", interpret=True)
    with pytest.raises(ValueError, match="unpack"):
        norm_gate_up(x, q8, eps=1e-6, scale=s8, fmt="int8", tile=MlpTile(unpack="ptx"),
                     interpret=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        norm_gate_up(jnp.zeros((4, 96)), q4, eps=1e-6, scale=s4, fmt="int4",
                     interpret=True)


def test_tile_for_shrinks_blocks_to_divide_the_widths():
    assert tile_for(576, 1536) == MlpTile()
    assert tile_for(48, 80, MlpTile(block_k=64, block_n=64)) == MlpTile(block_k=16, block_n=16)
    assert tile_for(40, 64) is None  # no block of 16+ divides 40
    # int4: k blocks of whole groups
    assert tile_for(4096, 1536, fmt="int4").block_k == 128
    assert tile_for(576, 1536, MlpTile(block_k=256), fmt="int4").block_k == 64
    assert tile_for(96, 16, fmt="int4") is None


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


@pytest.mark.parametrize("fmt,unpack", [(None, "jnp"), ("int8", "jnp"), ("int8", "asm"),
                                        ("int4", "jnp"), ("int4", "asm")])
def test_lowers_for_cuda(fmt, unpack):
    sd = jax.ShapeDtypeStruct
    w = {None: (sd((576, 3072), jnp.bfloat16), None),
         "int8": (sd((3072, 576), jnp.int8), sd((3072,), jnp.float32)),
         "int4": (sd((3072, 288), jnp.uint8), sd((9, 3072), jnp.bfloat16))}[fmt]
    def fn(x, q, s=None):
        return norm_gate_up(x, q, eps=1e-6, scale=s, fmt=fmt, tile=MlpTile(unpack=unpack))

    txt = lower_cuda(fn, sd((64, 576), jnp.bfloat16), w[0], *([w[1]] if fmt else []))
    assert "xla.gpu.triton" in txt

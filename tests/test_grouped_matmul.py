"""The MoE grouped matmul: our Triton kernel (interpret mode) against XLA's ragged_dot,
and the "pallas" path's routing between it, jax's Mosaic-GPU kernel (which runs only on
Hopper GPUs) and XLA's ragged_dot, checked in the CUDA lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import mosaic_fits, ragged_dot
from tests.cuda import lower_cuda
from tests import rand

sd = jax.ShapeDtypeStruct


def _lowered(dtype, k, n, rows=264):
    """impl "pallas" at `rows` expert rows (past TRITON_MAX_ROWS: the Mosaic kernel's)."""
    return lower_cuda(lambda a, b, g: ragged_dot(a, b, g, impl="pallas"),
                      sd((rows, k), dtype), sd((8, k, n), dtype), sd((8,), jnp.int32))


def test_mosaic_lowers_for_bf16_whole_tiles():
    txt = _lowered(jnp.bfloat16, 256, 128)
    assert "custom_call @mosaic_gpu" in txt and "chlo.ragged_dot" not in txt


@pytest.mark.parametrize("dtype,k,n", [(jnp.float32, 256, 128),  # fp32: no TF32 products
                                       (jnp.bfloat16, 2880, 2880)])  # gpt-oss down
def test_falls_back_to_xla_where_the_kernel_does_not_fit(dtype, k, n):
    assert not mosaic_fits(jnp.zeros((1, k), dtype), jnp.zeros((1, k, n), dtype))
    txt = _lowered(dtype, k, n)
    assert "custom_call @mosaic_gpu" not in txt and "chlo.ragged_dot" in txt


def test_xla_path_is_ragged_dot():
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    a = rand.normal(ks[0], (10, 64))
    w = rand.normal(ks[1], (3, 64, 128))
    sizes = jnp.array([4, 0, 6], jnp.int32)
    ref = np.concatenate([np.asarray(a[:4]) @ np.asarray(w[0]),
                          np.asarray(a[4:]) @ np.asarray(w[2])])
    for impl in ("xla", "pallas"):  # fp32 operands: "pallas" takes XLA's too
        out = ragged_dot(a, w, sizes, precision=jax.lax.Precision.HIGHEST, impl=impl)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-4)


def test_impl_choice():
    for impl in ("cutlass", "mosaic", "triton"):
        with pytest.raises(ValueError, match="impl"):
            ragged_dot(jnp.zeros((2, 64)), jnp.zeros((1, 64, 128)), jnp.array([2]), impl=impl)


@pytest.mark.parametrize("sizes, loop", [((3, 0, 20, 1, 0, 8), False),  # a group over one row tile
                                         ((3, 0, 20, 1, 0, 8), True),  # k walked in a loop
                                         ((0, 0, 0, 0, 0, 32), False),  # all in the last group
                                         ((1, 1, 1, 1, 1, 2), True)])  # more groups than tiles
def test_triton_grouped_matmul_matches_ragged_dot(sizes, loop):
    """Our few-rows kernel (interpret mode, fp32) against XLA's ragged_dot: rows sorted by
    group, empty groups, a group longer than a row tile, a last tile past the rows; k
    unrolled or walked in a fori_loop."""
    from pallas_kernels.grouped_matmul import GmmTile, grouped_matmul, tile_plan

    sizes = jnp.array(sizes, jnp.int32)
    m, g, k, n = int(sizes.sum()), sizes.shape[0], 128, 128
    ks = jax.random.split(jax.random.PRNGKey(int(sizes[0]) + m), 2)
    a = rand.normal(ks[0], (m, k))
    w = rand.normal(ks[1], (g, k, n))
    ref = jax.lax.ragged_dot(a, w, sizes, precision=jax.lax.Precision.HIGHEST)
    out = grouped_matmul(a, w, sizes, tile=GmmTile(block_k=64, loop=loop), interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-4)
    grp, row0, rows = tile_plan(sizes, m, 16)
    assert int(rows.sum()) == m  # every row in exactly one tile
    assert grp.shape[0] == min(g, m) + -(-m // 16) - 1


def test_tile_for_halves_block_k_until_it_divides_k():
    from pallas_kernels.grouped_matmul import GmmTile, tile_for

    assert tile_for(2048).block_k == 128 and tile_for(768).block_k == 128
    assert tile_for(2880) == GmmTile(block_k=64)  # gpt-oss's hidden size; the rest kept
    assert tile_for(2880, GmmTile(block_k=32, loop=False)) == GmmTile(block_k=32, loop=False)
    assert tile_for(40) is None


def test_triton_grouped_matmul_lowers_for_cuda():
    from pallas_kernels.grouped_matmul import GmmTile, grouped_matmul

    txt = lower_cuda(lambda a, b, g: ragged_dot(a, b, g, impl="pallas"),
                     sd((32, 2048), jnp.bfloat16), sd((128, 2048, 1536), jnp.bfloat16),
                     sd((128,), jnp.int32))
    assert "xla.gpu.triton" in txt and "chlo.ragged_dot" not in txt
    txt = lower_cuda(lambda a, b, g: grouped_matmul(a, b, g, tile=GmmTile(block_k=64,
                                                                          loop=False)),
                     sd((8, 2048), jnp.bfloat16), sd((128, 2048, 1536), jnp.bfloat16),
                     sd((128,), jnp.int32))
    assert "xla.gpu.triton" in txt
    # gpt-oss's gate/up (k 2880): the default tile with 64-column k blocks, still Triton
    txt = lower_cuda(lambda a, b, g: ragged_dot(a, b, g, impl="pallas"),
                     sd((8, 2880), jnp.bfloat16), sd((32, 2880, 5760), jnp.bfloat16),
                     sd((32,), jnp.int32))
    assert "xla.gpu.triton" in txt and "chlo.ragged_dot" not in txt


@pytest.mark.parametrize("rows,kernel", [(32, "xla.gpu.triton"), (256, "xla.gpu.triton"),
                                         (264, "custom_call @mosaic_gpu")])
def test_pallas_picks_the_kernel_by_row_count(rows, kernel):
    """impl "pallas": our Triton kernel up to TRITON_MAX_ROWS expert rows (decode and
    draft sizes), the Mosaic one above (verify and prefill sizes)."""
    from pallas_kernels.grouped_matmul import TRITON_MAX_ROWS

    assert TRITON_MAX_ROWS == 256
    txt = lower_cuda(lambda a, b, g: ragged_dot(a, b, g, impl="pallas"),
                     sd((rows, 2048), jnp.bfloat16), sd((128, 2048, 1536), jnp.bfloat16),
                     sd((128,), jnp.int32))
    assert kernel in txt and "chlo.ragged_dot" not in txt

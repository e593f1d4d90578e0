"""The draft MLP's scaled SwiGLU kernel (interpret mode) against its jnp reference, and a
fused draft layer's MLP with it against the model's own order (norm, then matmul)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.swiglu import column_block, scaled_swiglu, scaled_swiglu_reference


@pytest.mark.parametrize("b, f, h, dtype", [
    (1, 1536, 576, jnp.bfloat16),  # SmolLM2, B 1
    (64, 1536, 576, jnp.float32),  # SmolLM2, B 64: several row and column blocks
    (3, 48, 64, jnp.float32),  # rows not a multiple of the row block; 16-column blocks
    (8, 40, 32, jnp.float32),  # no power-of-two column block: the XLA reference
    (2, 64, 1500, jnp.float32),  # the row's norm over two column chunks, the last partial
])
def test_scaled_swiglu_matches_reference(b, f, h, dtype):
    kg, kx = jax.random.split(jax.random.PRNGKey(0))
    gate_up = (jax.random.normal(kg, (b, 2 * f)) * 3).astype(dtype)
    x = (jax.random.normal(kx, (b, h)) * 0.5).astype(dtype)
    out = scaled_swiglu(gate_up, x, 1e-5, interpret=True)
    ref = scaled_swiglu_reference(gate_up, x, 1e-5)
    assert out.shape == (b, f) and out.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)
    # the row scale is really applied: the unscaled SwiGLU differs
    g, u = gate_up[:, :f].astype(jnp.float32), gate_up[:, f:].astype(jnp.float32)
    assert np.abs(np.asarray(jax.nn.silu(g) * u) - np.asarray(out, np.float32)).max() > 0.1


def test_column_block():
    assert column_block(1536) == 512 and column_block(12288) == 512
    assert column_block(9728) == 512 and column_block(48) == 16 and column_block(40) is None


def test_draft_mlp_scales_after_the_product(pallas_interpret):
    """A fused draft layer's MLP (norm weight folded, row scale applied with the SwiGLU
    after the gate/up matmul) equals the model's order (normalise, then multiply) in
    fp32, to rounding."""
    from tests.tiny import tiny_model
    from vegas_jax.execution import ExecConfig
    from vegas_jax.model import _mlp, fold_norms, params_layer

    m = tiny_model(scale=0.3)
    cfg = m.config
    lp = jax.tree.map(lambda a: a[0], params_layer(fold_norms(m.params)))  # layer 0
    xc = ExecConfig(attn="pallas", draft="fused").resolve("cpu")
    kx, ko = jax.random.split(jax.random.PRNGKey(3))
    x = jax.random.normal(kx, (8, 1, cfg.hidden_size))
    o = jax.random.normal(ko, (8, 1, cfg.num_heads, cfg.head_dim))
    draft = _mlp(cfg, xc, x, o, lp, draft=True)
    model_order = _mlp(cfg, xc, x, o, lp)
    np.testing.assert_allclose(np.asarray(draft), np.asarray(model_order), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b, f, h", [(64, 1536, 576), (8, 12288, 4096), (1, 1536, 576)])
def test_scaled_swiglu_lowers_for_cuda(b, f, h):
    from tests.cuda import lower_cuda

    text = lower_cuda(lambda gu, x: scaled_swiglu(gu, x, 1e-6),
                      jax.ShapeDtypeStruct((b, 2 * f), jnp.bfloat16),
                      jax.ShapeDtypeStruct((b, h), jnp.bfloat16))
    assert "vegas_scaled_swiglu" in text

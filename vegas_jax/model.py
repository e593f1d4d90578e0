"""The transformer: pure functions over a params pytree (Llama and Qwen3 families).

One `forward` serves prefill, decode, verify and sparse draft; they differ only in the
`AttnSpec` handed to the attention dispatch. Layer weights are stacked on a leading axis
and `lax.scan` walks them, so compile time does not grow with depth.

Einsum letters, used throughout the package:
  b batch, t query tokens, s key positions, k KV heads, g query heads per KV head,
  n query heads (= k*g), d head dim, h hidden, f MLP width, v vocabulary.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from vegas_jax.attention import AttnSpec, attention, per_layer_inputs
from vegas_jax.cache import KVCache, write_kv
from vegas_jax.config import ModelConfig, rope_inv_freq


@struct.dataclass
class LayerParams:
    """Every field has a leading layer axis L."""

    attn_norm: jax.Array  # [L, h]
    wq: jax.Array  # [L, h, n*d]
    wk: jax.Array  # [L, h, k*d]
    wv: jax.Array  # [L, h, k*d]
    wo: jax.Array  # [L, n*d, h]
    mlp_norm: jax.Array  # [L, h]
    w_gate: jax.Array  # [L, h, f]
    w_up: jax.Array  # [L, h, f]
    w_down: jax.Array  # [L, f, h]
    q_norm: jax.Array | None = None  # [L, d], Qwen3 only
    k_norm: jax.Array | None = None  # [L, d], Qwen3 only


@struct.dataclass
class Params:
    embed: jax.Array  # [v, h]
    layers: LayerParams
    final_norm: jax.Array  # [h]
    lm_head: jax.Array | None = None  # [h, v]; None when tied to `embed`


def rms_norm(x, w, eps):
    # Normalise in fp32 as the reference implementations do, then return to x's dtype.
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions):
    """cos, sin: [b, t, d] for integer positions [b, t]."""
    inv, scale = rope_inv_freq(cfg)
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x, cos, sin):
    # x: [b, t, heads, d]; rotate-half layout (the HF convention).
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None, :] + rot * sin[:, :, None, :]).astype(x.dtype)


def _layer(cfg: ModelConfig, spec: AttnSpec, cos, sin, positions):
    k_heads, g, d = cfg.num_kv_heads, cfg.group_size, cfg.head_dim

    def step(carry, xs):
        x, k_cache, v_cache = carry  # x [b, t, h]
        lp, layer_inputs, li = xs
        b, t, _ = x.shape
        h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
        q = jnp.einsum("bth,hn->btn", h, lp.wq).reshape(b, t, k_heads * g, d)
        k = jnp.einsum("bth,hn->btn", h, lp.wk).reshape(b, t, k_heads, d)
        v = jnp.einsum("bth,hn->btn", h, lp.wv).reshape(b, t, k_heads, d)
        if cfg.qk_norm:
            q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin).reshape(b, t, k_heads, g, d)  # [b, t, k, g, d]
        k = apply_rope(k, cos, sin)  # [b, t, k, d]
        k_cache, v_cache = write_kv(k_cache, v_cache, li, k, v, positions)
        o, aux = attention(spec, q, k_cache, v_cache, li, positions, layer_inputs)
        x = x + jnp.einsum("btn,nh->bth", o.reshape(b, t, -1).astype(x.dtype), lp.wo)
        h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
        gate = jnp.einsum("bth,hf->btf", h, lp.w_gate)
        up = jnp.einsum("bth,hf->btf", h, lp.w_up)
        x = x + jnp.einsum("btf,fh->bth", jax.nn.silu(gate) * up, lp.w_down)
        return (x, k_cache, v_cache), aux

    return step


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens,
    positions,
    cache: KVCache,
    spec: AttnSpec,
    logits_at=None,
):
    """Run the model on `tokens` [b, t] at `positions` [b, t].

    Writes the new tokens' K/V into `cache` at their positions, then attends as `spec`
    says. `logits_at` [b] picks one position per sequence for the LM head (prefill);
    None returns logits for every position. The cache's `lengths` are not changed here:
    the caller knows how many of the written entries to keep.

    Returns (logits fp32 [b, t or 1, v], cache, aux) where aux holds per-layer captured
    attention scores when `spec` asks for them.
    """
    x = params.embed[tokens]  # [b, t, h]
    cos, sin = rope_tables(cfg, positions)
    step = _layer(cfg, spec, cos, sin, positions)
    xs = (params.layers, per_layer_inputs(spec), jnp.arange(cfg.num_layers))
    # VEGAS_LAYER_UNROLL (experiment knob): unrolled layers turn the per-layer dynamic
    # slices of the stacked weights into static ones.
    unroll = int(os.environ.get("VEGAS_LAYER_UNROLL", "1"))
    (x, k_cache, v_cache), aux = lax.scan(step, (x, cache.k, cache.v), xs, unroll=unroll)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)  # [b, 1, h]
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:
        logits = jnp.einsum("bth,vh->btv", x, params.embed)
    else:
        logits = jnp.einsum("bth,hv->btv", x, params.lm_head)
    return logits.astype(jnp.float32), cache.replace(k=k_cache, v=v_cache), aux


def init_params(cfg: ModelConfig, key, dtype=jnp.bfloat16, scale: float = 0.02) -> Params:
    """Random weights of the full model shapes, made on the default device.

    Norm weights are ones, like a fresh checkpoint; projections N(0, scale).
    """
    L, h, f, d = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    n, kv = cfg.num_heads, cfg.num_kv_heads
    # list(): split eagerly; iterating a typed key array lazily inside `make` (traced) fails.
    keys = iter(list(jax.random.split(key, 10)))

    def normal(shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(dtype)

    def make():
        layers = LayerParams(
            attn_norm=jnp.ones((L, h), dtype),
            wq=normal((L, h, n * d)),
            wk=normal((L, h, kv * d)),
            wv=normal((L, h, kv * d)),
            wo=normal((L, n * d, h)),
            mlp_norm=jnp.ones((L, h), dtype),
            w_gate=normal((L, h, f)),
            w_up=normal((L, h, f)),
            w_down=normal((L, f, h)),
            q_norm=jnp.ones((L, d), dtype) if cfg.qk_norm else None,
            k_norm=jnp.ones((L, d), dtype) if cfg.qk_norm else None,
        )
        return Params(
            embed=normal((cfg.vocab_size, h)),
            layers=layers,
            final_norm=jnp.ones((h,), dtype),
            lm_head=None if cfg.tie_embeddings else normal((h, cfg.vocab_size)),
        )

    return jax.jit(make)()


def param_dtype(params: Params):
    """The weights' dtype (the KV cache and activations use the same)."""
    return params.embed.dtype


def param_bytes(params: Params) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))

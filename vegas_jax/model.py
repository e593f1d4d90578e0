"""The transformer: pure functions over a params pytree (Llama and Qwen3 families).

One `forward` serves prefill, decode, verify and sparse draft; they differ only in the
`AttnSpec` handed to the attention dispatch. Layer weights are stacked on a leading axis
and `lax.scan` walks them, so compile time does not grow with depth.

Einsum letters, used throughout the package:
  b batch, t query tokens, s key positions, k KV heads, g query heads per KV head,
  n query heads (= k*g), d head dim, h hidden, f MLP width, v vocabulary.
"""

from __future__ import annotations

import functools
import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from vegas_jax.attention import AttnSpec, attention, per_layer_inputs
from vegas_jax.cache import KVCache, write_kv
from vegas_jax.config import ModelConfig, rope_inv_freq

# Which GEMM emitter XLA uses on the GPU, by model width (H200, BENCHMARKS.md "Weight
# reads"). Qwen3-8B (hidden 4096): decode-shaped matmuls (a few rows against a large
# weight) through XLA's Triton GEMM read weights at ~1.1 TB/s, through cuBLAS at 2.4-4.3;
# a B=1/32K decode step goes 14.3 -> 7.9 ms. SmolLM2 (hidden 576): the Triton GEMM wins
# (B=16/7.7K Vegas 7847 vs 5304 tok/s): its fusions save launches that dominate there.
# Measured at those two widths only; the cut between them is a guess. VEGAS_TRITON_GEMM=1
# or 0 forces one. CPU backends ignore the option.
CUBLAS_MIN_HIDDEN = 2048


def compiler_options(cfg: ModelConfig) -> dict:
    env = os.environ.get("VEGAS_TRITON_GEMM")
    triton = env == "1" if env in ("0", "1") else cfg.hidden_size < CUBLAS_MIN_HIDDEN
    return {} if triton else {"xla_gpu_enable_triton_gemm": False}


def model_jit(fun=None, **kwargs):
    """`jax.jit` for functions with a `cfg` argument: compiled with `compiler_options(cfg)`
    (one jitted variant per option set)."""
    if fun is None:
        return functools.partial(model_jit, **kwargs)
    sig = inspect.signature(fun)
    variants: dict = {}

    def pick(*args, **kw):
        opts = compiler_options(sig.bind_partial(*args, **kw).arguments["cfg"])
        key = tuple(sorted(opts.items()))
        if key not in variants:
            variants[key] = jax.jit(fun, compiler_options=opts, **kwargs)
        return variants[key]

    @functools.wraps(fun)
    def call(*args, **kw):
        return pick(*args, **kw)(*args, **kw)

    call.lower = lambda *args, **kw: pick(*args, **kw).lower(*args, **kw)
    return call


@struct.dataclass
class LayerParams:
    """Every field has a leading layer axis L.

    Q/K/V and gate/up projections are stored side by side (`FUSED`): one matmul each,
    fewer launches, and no narrow K/V matmul, which XLA on the GPU lowered as an
    elementwise multiply of the whole weight plus a reduction (Qwen3-8B, B=1: 1.26 ms
    per step for 0.6 GB of K/V weights, ~10x their read time on the H200).
    """

    attn_norm: jax.Array  # [L, h]
    w_qkv: jax.Array  # [L, h, (n + 2k)*d]: columns q | k | v
    wo: jax.Array  # [L, n*d, h]
    mlp_norm: jax.Array  # [L, h]
    w_gate_up: jax.Array  # [L, h, 2f]: columns gate | up
    w_down: jax.Array  # [L, f, h]
    q_norm: jax.Array | None = None  # [L, d], Qwen3 only
    k_norm: jax.Array | None = None  # [L, d], Qwen3 only


# Fused field -> the checkpoint projections it holds, in column order.
FUSED = {"w_qkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def fused_widths(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Column widths of each fused field's parts, in `FUSED` order."""
    n, k, d, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return {"w_qkv": (n * d, k * d, k * d), "w_gate_up": (f, f)}


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
        qkv = jnp.einsum("bth,hn->btn", h, lp.w_qkv)  # [b, t, (n + 2k)*d]
        nq, nk = k_heads * g * d, k_heads * d
        q = qkv[..., :nq].reshape(b, t, k_heads * g, d)
        k = qkv[..., nq:nq + nk].reshape(b, t, k_heads, d)
        v = qkv[..., nq + nk:].reshape(b, t, k_heads, d)
        if cfg.qk_norm:
            q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin).reshape(b, t, k_heads, g, d)  # [b, t, k, g, d]
        k = apply_rope(k, cos, sin)  # [b, t, k, d]
        k_cache, v_cache = write_kv(k_cache, v_cache, li, k, v, positions)
        o, aux = attention(spec, q, k_cache, v_cache, li, positions, layer_inputs)
        x = x + jnp.einsum("btn,nh->bth", o.reshape(b, t, -1).astype(x.dtype), lp.wo)
        h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
        gate_up = jnp.einsum("bth,hf->btf", h, lp.w_gate_up)  # [b, t, 2f]
        gate, up = gate_up[..., :cfg.intermediate_size], gate_up[..., cfg.intermediate_size:]
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
            w_qkv=normal((L, h, (n + 2 * kv) * d)),
            wo=normal((L, n * d, h)),
            mlp_norm=jnp.ones((L, h), dtype),
            w_gate_up=normal((L, h, 2 * f)),
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

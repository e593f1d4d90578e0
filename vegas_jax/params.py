"""The params pytree: per-layer weights (stacked on a leading layer axis or one buffer a
layer), their load-time layouts (norm weights folded, stacked or unrolled) and random
weights of a model's full shapes for timing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from vegas_jax.config import ModelConfig
from vegas_jax.execution import ExecConfig


@struct.dataclass
class LayerParams:
    """Stacked, every field has a leading layer axis L (shapes below); unstacked, one
    LayerParams per layer without it.

    Q/K/V and gate/up projections are stored side by side (`FUSED`): one matmul each,
    fewer launches, and no narrow K/V matmul (which XLA on the GPU lowers poorly).
    """

    attn_norm: jax.Array | None  # [L, h]; None once folded into w_qkv (`fold_norms`)
    w_qkv: jax.Array  # [L, h, (n + 2k)*d]: columns q | k | v
    wo: jax.Array  # [L, n*d, h]
    mlp_norm: jax.Array | None  # [L, h]; None once folded into the MLP's first matmuls
    w_gate_up: jax.Array | None = None  # [L, h, 2f]: columns gate | up; dense models only
    w_down: jax.Array | None = None  # [L, f, h]; dense models only
    q_norm: jax.Array | None = None  # [L, d], Qwen3 only
    k_norm: jax.Array | None = None  # [L, d], Qwen3 only
    # Mixture-of-experts models only (`ModelConfig.num_experts`), in place of w_gate_up
    # and w_down; f is an expert's width.
    w_router: jax.Array | None = None  # [L, h, e]
    w_expert_gate_up: jax.Array | None = None  # [L, e, h, 2f]: columns gate | up
    w_expert_down: jax.Array | None = None  # [L, e, f, h]
    # gpt-oss only: attention biases (`ModelConfig.attn_bias`), sinks (`attn_sinks`), and
    # the router's and experts' biases (moe_style "gpt-oss")
    b_qkv: jax.Array | None = None  # [L, (n + 2k)*d]: q | k | v
    bo: jax.Array | None = None  # [L, h]
    sinks: jax.Array | None = None  # [L, n]: one logit per query head
    b_router: jax.Array | None = None  # [L, e]
    b_expert_gate_up: jax.Array | None = None  # [L, e, 2f]: gate | up
    b_expert_down: jax.Array | None = None  # [L, e, h]


# Fused field -> the checkpoint projections it holds, in column order (last axis).
FUSED = {"w_qkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up"),
         "w_expert_gate_up": ("w_expert_gate", "w_expert_up"),
         "b_qkv": ("bq", "bk", "bv"), "b_expert_gate_up": ("b_expert_gate", "b_expert_up")}


def fused_widths(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Column widths of the parts of each fused field `cfg`'s layers have, `FUSED` order."""
    n, k, d, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    out = {"w_qkv": (n * d, k * d, k * d)}
    if cfg.is_moe:
        fe = cfg.moe_intermediate_size
        out["w_expert_gate_up"] = (fe, fe)
        if cfg.moe_style == "gpt-oss":
            out["b_expert_gate_up"] = (fe, fe)
    else:
        out["w_gate_up"] = (f, f)
    if cfg.attn_bias:
        out["b_qkv"] = (n * d, k * d, k * d)
    return out


@struct.dataclass
class Params:
    embed: jax.Array  # [v, h]
    layers: LayerParams | tuple[LayerParams, ...]  # stacked [L, ...] or one per layer
    final_norm: jax.Array  # [h]
    lm_head: jax.Array | None = None  # [h, v]; None when tied to `embed`


def fold_norms(params: Params, donate: bool = False) -> Params:
    """Params whose attention and MLP RMS-norm weights are folded into the projections
    they feed: (x̂ * w) @ W = x̂ @ (w[:, None] * W) for the normalised x̂. On the GPU a scan's
    slice of a norm weight is not read in place by XLA's norm fusion but copied first (a
    device memcpy per norm per layer); folded, there is nothing to slice. The product is
    rounded once to the weights' dtype. donate: the projections' old buffers are freed
    as each folded one is made (params nobody else holds: a fresh load)."""
    @functools.partial(jax.jit, donate_argnums=1 if donate else ())
    def fold(w, m):  # w [..., h], m [..., h, n] or [..., e, h, n] (every expert)
        w = w.reshape(w.shape[:-1] + (1,) * (m.ndim - w.ndim - 1) + (w.shape[-1], 1))
        return (w.astype(jnp.float32) * m.astype(jnp.float32)).astype(m.dtype)

    def one(lp: LayerParams) -> LayerParams:
        if lp.attn_norm is None:
            return lp
        norm = lp.mlp_norm
        lp = lp.replace(attn_norm=None, w_qkv=fold(lp.attn_norm, lp.w_qkv), mlp_norm=None)
        if lp.w_router is not None:  # the MLP norm feeds the router and every expert
            return lp.replace(w_router=fold(norm, lp.w_router),
                              w_expert_gate_up=fold(norm, lp.w_expert_gate_up))
        return lp.replace(w_gate_up=fold(norm, lp.w_gate_up))

    return map_layers(params, one)


def stack_layers(params: Params) -> Params:
    """Params with stacked layer weights ([L, ...] per field), whatever their layout."""
    if not isinstance(params.layers, tuple):
        return params
    return params.replace(layers=jax.tree.map(lambda *a: jnp.stack(a), *params.layers))


def unstack_layers(params: Params, donate: bool = False) -> Params:
    """Params with one weight buffer per layer (a tuple of LayerParams); host (numpy)
    arrays are cut into views. donate: each stacked device buffer is freed once its layers
    are cut (params nobody else holds), so the weights are held twice only one field at a
    time."""
    if isinstance(params.layers, tuple):
        return params
    n = params.layers.wo.shape[0]
    leaves, tree = jax.tree.flatten(params.layers)
    cut = []
    for a in leaves:
        cut.append([a[i] for i in range(n)])
        if donate and isinstance(a, jax.Array):
            jax.block_until_ready(cut[-1])
            a.delete()
    return params.replace(layers=tuple(
        jax.tree.unflatten(tree, [c[i] for c in cut]) for i in range(n)))


def layout_params(params: Params, xc: ExecConfig, donate: bool = False) -> Params:
    """The layer layout `xc.layers` runs on, norm weights folded (`fold_norms`)."""
    params = fold_norms(params, donate)
    return unstack_layers(params, donate) if xc.layers == "unrolled" else stack_layers(params)


def map_layers(params: Params, fn) -> Params:
    """Params with `fn` applied to the layer weights: to each layer's buffers (unrolled
    layout) or once to the stacked ones."""
    layers = params.layers
    return params.replace(layers=tuple(map(fn, layers)) if isinstance(layers, tuple)
                          else fn(layers))


def init_params(cfg: ModelConfig, key, dtype=jnp.bfloat16, scale: float = 0.02,
                unrolled: bool = False) -> Params:
    """Random weights of the full model shapes, made on the default device.

    Norm weights are ones, like a fresh checkpoint; projections N(0, scale). unrolled:
    one buffer per layer (the same values): no stacked field is ever made, so a large
    model's load never holds a field twice (nor leaves the holes a cut stacked one would).
    """
    L, h, f, d = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    n, kv = cfg.num_heads, cfg.num_kv_heads
    # list(): split eagerly; iterating a typed key array lazily inside `make` (traced) fails.
    keys = iter(list(jax.random.split(key, 10)))

    def normal(shape):
        return _random_normal(next(keys), shape, dtype, scale, per_layer=unrolled)

    moe, e, fe = cfg.is_moe, cfg.num_experts, cfg.moe_intermediate_size
    # gpt-oss's extra tensors draw from keys of their own: the other models' weights stay
    # what they were
    extra_keys = iter(list(jax.random.split(jax.random.fold_in(key, 1), 6)))
    oss = cfg.moe_style == "gpt-oss"

    def extra(shape, on):
        if not on:
            return None
        return _random_normal(next(extra_keys), shape, dtype, scale, per_layer=unrolled)

    def ones(shape):
        if unrolled:
            return [jnp.ones(shape[1:], dtype) for _ in range(shape[0])]
        return jnp.ones(shape, dtype)

    def make():
        fields = dict(
            attn_norm=ones((L, h)),
            w_qkv=normal((L, h, (n + 2 * kv) * d)),
            wo=normal((L, n * d, h)),
            mlp_norm=ones((L, h)),
            w_gate_up=None if moe else normal((L, h, 2 * f)),
            w_down=None if moe else normal((L, f, h)),
            q_norm=ones((L, d)) if cfg.qk_norm else None,
            k_norm=ones((L, d)) if cfg.qk_norm else None,
            w_router=normal((L, h, e)) if moe else None,
            w_expert_gate_up=normal((L, e, h, 2 * fe)) if moe else None,
            w_expert_down=normal((L, e, fe, h)) if moe else None,
            b_qkv=extra((L, (n + 2 * kv) * d), cfg.attn_bias),
            bo=extra((L, h), cfg.attn_bias),
            sinks=extra((L, n), cfg.attn_sinks),
            b_router=extra((L, e), oss),
            b_expert_gate_up=extra((L, e, 2 * fe), oss),
            b_expert_down=extra((L, e, h), oss),
        )
        if unrolled:
            layers = tuple(LayerParams(**{f: None if v is None else v[i]
                                          for f, v in fields.items()}) for i in range(L))
        else:
            layers = LayerParams(**fields)
        return Params(
            embed=_random_normal(next(keys), (cfg.vocab_size, h), dtype, scale),
            layers=layers,
            final_norm=jnp.ones((h,), dtype),
            lm_head=None if cfg.tie_embeddings else _random_normal(
                next(keys), (h, cfg.vocab_size), dtype, scale),
        )

    return make()


# A field larger than this is drawn a layer at a time into its buffer: drawn whole, its
# fp32 normals and random bits would need several times its own bytes at once.
_DRAW_WHOLE_BYTES = 1 << 30


def _random_normal(key, shape, dtype, scale: float, per_layer: bool = False):
    """N(0, scale) weights of `shape`, made on the device, one jitted draw a field (the
    same values as one draw inside a larger jit) or, over 1 GiB, a block of leading rows
    (layers) at a time. per_layer: a list of the leading rows (layers) as buffers of
    their own, the same values, no stacked buffer made over 1 GiB."""
    dtype = jnp.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes <= _DRAW_WHOLE_BYTES:
        whole = _draw(key, shape, dtype, scale)
        return [whole[i] for i in range(shape[0])] if per_layer else whole
    rows = max(1, shape[0] * _DRAW_WHOLE_BYTES // nbytes)  # leading rows a draw
    if per_layer:
        out = []
        for i in range(0, shape[0], rows):
            n = min(rows, shape[0] - i)
            block = _draw(jax.random.fold_in(key, i), (n,) + tuple(shape[1:]), dtype, scale)
            out += [block[j] for j in range(n)]
        return out
    buf = jnp.zeros(shape, dtype)
    for i in range(0, shape[0], rows):
        n = min(rows, shape[0] - i)
        buf = _draw_rows(buf, jax.random.fold_in(key, i), i, (n,) + tuple(shape[1:]), scale)
    return buf


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw(key, shape, dtype, scale):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


@functools.partial(jax.jit, static_argnums=(3, 4), donate_argnums=0)
def _draw_rows(buf, key, i, shape, scale):
    return lax.dynamic_update_slice_in_dim(buf, _draw(key, shape, buf.dtype, scale), i, 0)


def param_dtype(params: Params):
    """The weights' dtype (the KV cache and activations use the same)."""
    return params.embed.dtype


def param_bytes(params: Params) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))

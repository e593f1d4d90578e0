"""The transformer: pure functions over a params pytree (Llama and Qwen3 families, Qwen3
dense or mixture of experts, gpt-oss).

One `forward` serves prefill, decode, verify and sparse draft; they differ only in the
`AttnPlan` handed to the attention dispatch. Layer weights are either stacked on a leading
axis and walked by a `lax.while_loop` (compile time flat in depth) or held one buffer per
layer and walked by a Python loop (no per-layer slicing on the GPU): `ExecConfig.layers`
chooses.

Einsum letters, used throughout the package:
  b batch, t query tokens, s key positions, k KV heads, g query heads per KV head,
  n query heads (= k*g), d head dim, h hidden, f MLP width (an expert's in an MoE layer),
  e experts, v vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from pallas_kernels import draft_mlp, grouped_matmul
from pallas_kernels.sparse_attention import rope_halves
from vegas_jax.attention import (
    AttnPlan, RawCapture, attention, capture_start, fused_draft, sparse_block,
)
from vegas_jax.cache import KVCache, write_kv
from vegas_jax.config import ModelConfig, rope_inv_freq
from vegas_jax.execution import ExecConfig


@struct.dataclass
class LayerParams:
    """Stacked, every field has a leading layer axis L (shapes below); unstacked, one
    LayerParams per layer without it.

    Q/K/V and gate/up projections are stored side by side (`FUSED`): one matmul each,
    fewer launches, and no narrow K/V matmul, which XLA on the GPU lowered as an
    elementwise multiply of the whole weight plus a reduction at ~10x its read time
    (BENCHMARKS.md, "Weight reads").
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
    # Draft-only weights (`ExecConfig.draft` "merged", made at load by `merge_draft`; never
    # saved): a draft layer's four matmuls as three. The attention's input projection and
    # the MLP's gate/up both read the layer input (their norms' row scales are applied
    # after the product), and the MLP input is x + o @ wo, so
    # gate/up = r2 (x @ w_gate_up + o @ (wo @ w_gate_up)).
    w_draft_in: jax.Array | None = None  # [L, h, (n + 2k)*d + 2f]: w_qkv | w_gate_up
    w_draft_o: jax.Array | None = None  # [L, n*d, h + 2f]: wo | wo @ w_gate_up

DRAFT_ONLY = ("w_draft_in", "w_draft_o")


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


def mm(spec, a, b):
    """einsum of activations and weights; fp32 operands multiply in full fp32 (on the GPU
    XLA would use TF32 by default, and fp32 results must not depend on the batch shape)."""
    return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST if a.dtype == jnp.float32
                      else None)


def rms_norm(x, w, eps):
    """Normalise in fp32 as the reference implementations do, then return to x's dtype;
    w None: a weight already folded into the next matmul (`fold_norms`)."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return xf.astype(x.dtype) if w is None else w * xf.astype(x.dtype)


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


@functools.partial(jax.jit, static_argnames=("cfg", "xc", "write"))
def _layer(cfg: ModelConfig, xc: ExecConfig, write: bool, plan: AttnPlan, cos, sin, positions,
           rope, carry, lp: LayerParams, li):
    """One transformer layer: carry (x [b, t, h], k_cache, v_cache[, capture buffer]) ->
    (carry, scores). A raw capture's stacked buffer (`Capture.raw`) rides in the carry:
    each layer's verify writes its rows into it, and the layer's scores are its offsets.

    Jitted on its own, with the layer index `li` traced: every layer of a forward is then
    traced and lowered once, whether the layers run in a loop or unrolled (per-layer
    weight buffers: on the GPU the host walks no loop body per layer, but 30 layers traced
    and lowered one by one took ~10 s a round on the CPU). XLA inlines the calls."""
    k_heads, g, d = cfg.num_kv_heads, cfg.group_size, cfg.head_dim
    x, k_cache, v_cache, *cap_buf = carry  # x [b, t, h]
    b, t, _ = x.shape
    fused = write and fused_draft(plan, xc, cfg)
    # a fused draft with the norm's weight folded into w_qkv: the norm's row scale
    # commutes with the projection, so the draft kernel applies it (one launch fewer a
    # layer); drafts only, the verify and plain decoding keep the model's exact order
    scaled_in_kernel = fused and lp.attn_norm is None
    merged = scaled_in_kernel and lp.w_draft_in is not None
    h = x if scaled_in_kernel else rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    if merged:  # [b, t, (n + 2k)*d + 2f]: the projection and the MLP's x @ w_gate_up
        # the draft kernel takes the whole product and reads its q/k/v columns only
        # (a slice would be copied out for it: one launch a layer)
        qkv = mm("bth,hn->btn", x, lp.w_draft_in)
        gate_up_x = qkv[..., lp.w_qkv.shape[-1]:]
    else:
        qkv = mm("bth,hn->btn", h, lp.w_qkv)  # [b, t, (n + 2k)*d]
    if lp.b_qkv is not None:
        qkv = qkv + lp.b_qkv
    if fused:  # the attention block in one kernel
        # the Q/K norm weights of models without QK-norm: a literal, never read
        ones = np.ones((d,), np.float32)
        qn, kn = (lp.q_norm, lp.k_norm) if cfg.qk_norm else (ones, ones)
        o, k_cache, v_cache = sparse_block(plan, xc, cfg, qkv, qn, kn, rope, k_cache,
                                           v_cache, li, positions,
                                           x.reshape(b, -1) if scaled_in_kernel else None)
        if merged:
            return _merged_mlp(cfg, x, o, gate_up_x, lp), k_cache, v_cache, None
        return _mlp(cfg, xc, x, o, lp, draft=True), k_cache, v_cache, None
    # columns per shard: [q_i | k_i | v_i] for each of the tp shards (`sharding`)
    per = qkv.reshape(b, t, xc.tp, -1)  # [b, t, tp, (n + 2k)*d / tp]
    nq, nk = k_heads * g * d // xc.tp, k_heads * d // xc.tp
    q = per[..., :nq].reshape(b, t, k_heads * g, d)
    k = per[..., nq:nq + nk].reshape(b, t, k_heads, d)
    v = per[..., nq + nk:].reshape(b, t, k_heads, d)
    if cfg.qk_norm:
        q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin).reshape(b, t, k_heads, g, d)  # [b, t, k, g, d]
    k = apply_rope(k, cos, sin)  # [b, t, k, d]
    if write:
        k_cache, v_cache = write_kv(k_cache, v_cache, li, k, v, positions)
    window = slot = None
    if cfg.sliding_layers:  # this layer's window (0: full) and row of the selection
        window = jnp.asarray(cfg.layer_windows, jnp.int32)[li]
        slot = jnp.asarray(cfg.selection_slots, jnp.int32)[li]
    sinks = None if lp.sinks is None else lp.sinks.reshape(k_heads, g)  # [k, g]
    o, scores = attention(plan, xc, q, k_cache, v_cache, li, positions, window=window,
                          sinks=sinks, slot=slot, capture_into=cap_buf[0] if cap_buf else None)
    if cap_buf:
        cap_buf, scores = scores
        return _mlp(cfg, xc, x, o, lp), k_cache, v_cache, cap_buf, scores
    return _mlp(cfg, xc, x, o, lp), k_cache, v_cache, scores


def draft_mlp_kernel(xc: ExecConfig, lp: LayerParams, rows: int) -> bool:
    """Whether a fused draft layer's MLP input runs as `draft_mlp.norm_gate_up` (one
    kernel for the norm's row scale, gate/up and the activation): `ExecConfig.draft`
    "fused-mlp", a dense MLP whose norm weight is folded into w_gate_up, one device,
    widths the kernel tiles, gate/up weights of at most `draft_mlp.SMALL_BYTES` and at
    least `draft_mlp.MIN_ROWS` rows (where it was measured faster than XLA's kernels)."""
    return (xc.draft == "fused-mlp" and xc.tp == 1 and lp.w_gate_up is not None
            and rows >= draft_mlp.MIN_ROWS
            and lp.mlp_norm is None
            and (lp.w_gate_up.shape[-2] * lp.w_gate_up.shape[-1]
                 * lp.w_gate_up.dtype.itemsize) <= draft_mlp.SMALL_BYTES
            and draft_mlp.tile_for(lp.w_gate_up.shape[-2], lp.w_gate_up.shape[-1] // 2)
            is not None)


def _mlp(cfg: ModelConfig, xc: ExecConfig, x, o, lp: LayerParams, draft: bool = False):
    """The layer after attention: output projection, residual, MLP, residual. draft: a
    fused draft layer's (`draft_mlp_kernel`)."""
    b, t, _ = x.shape
    attn = mm("btn,nh->bth", o.reshape(b, t, -1).astype(x.dtype), lp.wo)
    x = x + (attn if lp.bo is None else attn + lp.bo)
    if draft and draft_mlp_kernel(xc, lp, b * t):
        act = draft_mlp.norm_gate_up(x.reshape(b * t, -1), lp.w_gate_up, eps=cfg.rms_norm_eps)
        return x + mm("btf,fh->bth", act.reshape(b, t, -1), lp.w_down)
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    if cfg.is_moe:
        impl = "xla" if xc.moe == "auto" else xc.moe
        return x + _moe(cfg, h, lp, functools.partial(grouped_matmul.ragged_dot, impl=impl))
    gate_up = mm("bth,hf->btf", h, lp.w_gate_up)  # [b, t, 2f], per shard [gate_i | up_i]
    gate_up = gate_up.reshape(b, t, xc.tp, -1)
    f = cfg.intermediate_size // xc.tp
    gate = gate_up[..., :f].reshape(b, t, -1)  # [b, t, f]
    up = gate_up[..., f:].reshape(b, t, -1)
    return x + mm("btf,fh->bth", jax.nn.silu(gate) * up, lp.w_down)


def _merged_mlp(cfg: ModelConfig, x, o, gate_up_x, lp: LayerParams):
    """A merged draft layer after attention (`w_draft_o`): one matmul gives o @ wo and
    o @ (wo @ w_gate_up); with gate_up_x = x @ w_gate_up from the layer's first matmul,
    the MLP's input x2 = x + o @ wo and its RMS-normalised gate/up
    r2 (gate_up_x + o @ wo @ w_gate_up), r2 = rsqrt(mean(x2**2) + eps) (the norm's weight
    is folded into w_gate_up). Drafts only: rounded differently from `_mlp`."""
    b, t, hd = x.shape
    both = mm("btn,nh->bth", o.reshape(b, t, -1).astype(x.dtype), lp.w_draft_o)
    x2 = x + both[..., :hd]  # [b, t, h]
    xf = x2.astype(jnp.float32)
    r2 = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    gate_up = ((gate_up_x.astype(jnp.float32) + both[..., hd:].astype(jnp.float32))
               * r2).astype(x.dtype)  # [b, t, 2f]
    f = cfg.intermediate_size
    return x2 + mm("btf,fh->bth", jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:], lp.w_down)


def merge_draft(params: Params) -> Params:
    """Params with the draft-only merged weights (`LayerParams.w_draft_in` / `w_draft_o`)
    of every layer, for `ExecConfig.draft` "merged": dense models whose norm weights are
    folded (`fold_norms`), without projection biases. wo @ w_gate_up is multiplied in
    fp32 and rounded once. Memory: a layer's q/k/v, gate/up and o weights again, plus the
    [n*d, 2f] product (SmolLM2-135M: +265 MB)."""
    @jax.jit
    def one(lp: LayerParams) -> LayerParams:
        prod = jnp.einsum("...nh,...hf->...nf", lp.wo.astype(jnp.float32),
                          lp.w_gate_up.astype(jnp.float32),
                          precision=lax.Precision.HIGHEST).astype(lp.wo.dtype)
        return lp.replace(w_draft_in=jnp.concatenate([lp.w_qkv, lp.w_gate_up], axis=-1),
                          w_draft_o=jnp.concatenate([lp.wo, prod], axis=-1))

    first = params_layer(params)
    if first.w_gate_up is None or first.attn_norm is not None or first.mlp_norm is not None \
            or first.b_qkv is not None or first.bo is not None:
        raise ValueError("draft='merged' needs a dense MLP, folded norm weights and no "
                         "projection biases (Llama / Qwen3 dense models)")
    return map_layers(params, one)


def moe_route(cfg: ModelConfig, x, lp: LayerParams):
    """Each token's experts and their weights: x [T, h] -> (weights [T, k] fp32, experts
    [T, k]). Qwen3: top-k of the router's softmax (renormalised with `norm_topk_prob`);
    gpt-oss: the router's bias, then the softmax of the k largest logits alone."""
    k = cfg.experts_per_token
    logits = mm("th,he->te", x, lp.w_router)
    if lp.b_router is not None:
        logits = logits + lp.b_router
    logits = logits.astype(jnp.float32)
    if cfg.moe_style == "gpt-oss":
        top, experts = lax.top_k(logits, k)
        weights = jax.nn.softmax(top, axis=-1)
    else:
        weights, experts = lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def _moe(cfg: ModelConfig, h, lp: LayerParams, ragged_dot=lax.ragged_dot):
    """The MoE MLP of the normalised h [b, t, h]. Qwen3 (`moe_style` "qwen3"): each
    token's top-k experts by router softmax (fp32), their SwiGLU outputs summed with the
    routing weights (renormalised to sum to 1 when `norm_topk_prob`). gpt-oss: the router
    has a bias, the weights are the softmax of the k largest logits alone, and each
    expert adds its biases around the clamped SwiGLU (`_clamped_swiglu`).

    The expert matmuls are `lax.ragged_dot` over the b*t*k (token, expert) rows sorted by
    expert: every expert's weights are read once and each row is multiplied only by its
    own expert. Gathering each row's k experts' weights instead would read ~34 GB a layer
    for a B 64, gamma 6 verify of Qwen3-30B in bf16, and running every expert on every
    token would cost e/k times the FLOPs. No capacity limit: no token is ever dropped, so
    a token's output does not depend on which other tokens share the call (as decode,
    verify and draft need). XLA on the CPU lowers ragged_dot to one dense dot over
    masked copies of the rows, e times the work: fine at test sizes. (So does XLA on the
    GPU: `benchmarks.moe_memory`; `ragged_dot` swaps in another grouped matmul.)"""
    b, t, hd = h.shape
    e, k, f = cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size
    gpt_oss = cfg.moe_style == "gpt-oss"
    x = h.reshape(b * t, hd)
    weights, experts = moe_route(cfg, x, lp)
    flat = experts.reshape(-1)  # [b*t*k], row r is token r // k
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    prec = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    gate_up = ragged_dot(x[order // k], lp.w_expert_gate_up, sizes, precision=prec)
    if lp.b_expert_gate_up is not None:  # each sorted row's own expert's bias
        gate_up = gate_up + lp.b_expert_gate_up[flat[order]]
    if gpt_oss:
        act = _clamped_swiglu(gate_up[:, :f], gate_up[:, f:], cfg)
    else:
        act = jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]  # [b*t*k, f]
    out = ragged_dot(act, lp.w_expert_down, sizes, precision=prec)  # sorted rows
    if lp.b_expert_down is not None:
        out = out + lp.b_expert_down[flat[order]]
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # token-major again
    y = jnp.sum(out.reshape(b * t, k, hd).astype(jnp.float32) * weights[..., None], axis=1)
    return y.astype(h.dtype).reshape(b, t, hd)


def _clamped_swiglu(gate, up, cfg: ModelConfig):
    """gpt-oss's expert activation: (up + 1) * g * sigmoid(alpha * g) with the gate capped
    at +limit and up clipped to [-limit, limit] (the model was trained so)."""
    lim = cfg.swiglu_limit
    gate = jnp.minimum(gate, lim)
    up = jnp.clip(up, -lim, lim)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))


def forward(
    params: Params,
    cfg: ModelConfig,
    xc: ExecConfig,
    tokens,
    positions,
    cache: KVCache,
    plan: AttnPlan,
    logits_at=None,
    write: bool = True,
    on_layer=None,
):
    """Run the model on `tokens` [b, t] at `positions` [b, t].

    Writes the new tokens' K/V into `cache` at their positions, then attends as `plan`
    says. `logits_at` [b] picks one position per sequence for the LM head (prefill);
    None returns logits for every position. The cache's `lengths` are not changed here:
    the caller knows how many of the written entries to keep. `write=False` leaves the
    cache as it is, for tokens whose K/V it already holds (a capture-only pass: rewriting
    them from a differently shaped computation would change them by rounding).

    Returns (logits fp32 [b, t or 1, v], cache, scores) where scores stacks the
    full-attention layers' captured attention scores [len(cfg.full_layers), ...] (every
    layer but gpt-oss's sliding ones) when `plan` asks for a capture (else None); a raw
    capture returns a `RawCapture` instead.
    """
    b = tokens.shape[0]
    fused = write and fused_draft(plan, xc, cfg)
    pad = -b % xc.row_pad if fused and b > 1 and not cfg.is_moe else 0
    # a fused draft's padding rows (token 0; the draft kernel outputs zeros for them):
    # matmul inputs of a multiple of 8 rows, which cuBLAS would otherwise pad layer by layer
    x = params.embed[jnp.pad(tokens, ((0, pad), (0, 0)))]  # [b + pad, t, h]
    cos, sin = rope_tables(cfg, positions)
    # the fused draft kernel's RoPE table, made once per forward: made inside the layer,
    # it would cost a small kernel launch per layer
    rope = rope_halves(cos, sin) if fused else None
    if cfg.sliding_layers and plan.mode == "sparse":
        # a draft's sliding layers read their window as the tail (`attention`): room for it
        plan = plan.replace(tail_len=max(plan.tail_len, cfg.sliding_window))

    def step(carry, lp, li):
        *carry, sc = _layer(cfg, xc, write, plan, cos, sin, positions, rope, tuple(carry), lp,
                            jnp.int32(li))
        if on_layer is not None:  # fed one value of the output, so it runs after the layer
            jax.debug.callback(on_layer, carry[0][0, 0, 0])
        return tuple(carry), sc

    cap_buf = capture_start(plan, cfg, b, cache.max_len)  # a raw capture's buffer, or None
    carry = (x, cache.k, cache.v) + (() if cap_buf is None else (cap_buf,))
    if isinstance(params.layers, tuple):
        # Per-layer weight buffers: nothing is sliced per layer (in a loop, XLA reads each
        # layer's weight slices at offsets the host computes, so the host walks every
        # layer of every call; BENCHMARKS.md, "Host dispatch").
        per_layer = []
        for li, lp in enumerate(params.layers):
            carry, sc = step(carry, lp, li)
            per_layer.append(sc)
        scores = None if plan.capture is None else jnp.stack(
            [per_layer[i] for i in cfg.full_layers])
    else:
        cap = plan.capture
        shape = None if cap is None else cap.scores_shape(*cache.k.shape[1:4], cfg.group_size)
        carry, scores = _layer_loop(step, carry, params.layers, cfg, shape)
    x, k_cache, v_cache, *cap_buf = carry
    if cap_buf:  # scores: every layer's offsets [L, b, R]
        active = jnp.ones((b,), bool) if plan.active is None else plan.active
        scores = RawCapture(cap_buf[0], scores, active)
    x = x[:b]
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)  # [b, 1, h]
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:
        logits = mm("bth,vh->btv", x, params.embed)
    else:
        logits = mm("bth,hv->btv", x, params.lm_head)
    return logits.astype(jnp.float32), cache.replace(k=k_cache, v=v_cache), scores


def _layer_loop(step, carry, layers: LayerParams, cfg: ModelConfig, scores_shape):
    """`step` over the stacked layers; returns (carry, scores [Lf, *scores_shape] or None)
    for the Lf = len(cfg.full_layers) full-attention layers.

    A while loop whose counter is the layer index: a scan would slice the index from an
    iota, which XLA on the GPU runs as one more device memcpy per layer."""
    n = cfg.num_layers

    def at(li):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, li, keepdims=False), layers)

    scores = None if scores_shape is None else jnp.zeros(
        (len(cfg.full_layers), *scores_shape), jnp.float32)

    def body(state):
        li, carry, scores = state
        carry, sc = step(carry, at(li), li)
        if scores is not None:
            sc = sc.astype(jnp.float32)
            row = li
            if cfg.sliding_layers:  # a sliding layer writes back the row it was given
                row = jnp.asarray(cfg.selection_slots, jnp.int32)[li]
                full = jnp.asarray(cfg.layer_windows, jnp.int32)[li] == 0
                sc = jnp.where(full, sc, lax.dynamic_index_in_dim(scores, row, 0, False))
            scores = lax.dynamic_update_index_in_dim(scores, sc, row, 0)
        return li + 1, carry, scores

    _, carry, scores = lax.while_loop(lambda st: st[0] < n, body, (jnp.int32(0), carry, scores))
    return carry, scores


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
    """Params with one weight buffer per layer (a tuple of LayerParams). donate: each
    stacked buffer is freed once its layers are cut (params nobody else holds), so the
    weights are held twice only one field at a time (Qwen3-30B-A3B: 61 GB of weights +
    its 36 GB expert gate/up field, not 122 GB)."""
    if isinstance(params.layers, tuple):
        return params
    n = params.layers.wo.shape[0]
    leaves, tree = jax.tree.flatten(params.layers)
    cut = []
    for a in leaves:
        cut.append([a[i] for i in range(n)])
        if donate:
            jax.block_until_ready(cut[-1])
            a.delete()
    return params.replace(layers=tuple(
        jax.tree.unflatten(tree, [c[i] for c in cut]) for i in range(n)))


def layout_params(params: Params, xc: ExecConfig, donate: bool = False) -> Params:
    """The layer layout `xc.layers` runs on, norm weights folded (`fold_norms`), with the
    draft-only merged weights when `xc.draft` is "merged" (`merge_draft`)."""
    params = fold_norms(params, donate)
    if xc.draft == "merged" and params_layer(params).w_draft_in is None:
        params = merge_draft(params)
    return unstack_layers(params, donate) if xc.layers == "unrolled" else stack_layers(params)


def params_layer(params: Params) -> LayerParams:
    """The first layer's weights (stacked: every layer's)."""
    return params.layers[0] if isinstance(params.layers, tuple) else params.layers


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
    model's load never holds a field twice (Qwen3-30B-A3B's 36 GB expert gate/up field
    stacked and then cut peaked at 93.6 GiB for 57 GiB of weights, and the holes it left
    kept a 24 GiB cache half from finding room on a 141 GB card).
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
# fp32 normals and random bits sit beside every other field (Qwen3-30B-A3B's 36 GB expert
# gate/up field would need ~110 GB more than its own bytes).
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

"""The transformer: pure functions over a params pytree (Llama and Qwen3 families, Qwen3
dense or mixture of experts, gpt-oss).

One `forward` serves prefill, decode, verify and sparse draft; they differ only in the
`AttnPlan` handed to the attention dispatch (and a draft may run on a quantized copy of
the weights, `quant`: the same forward, other params). Layer weights are either stacked
on a leading axis and walked by a `lax.while_loop` (compile time flat in depth) or held
one buffer per layer and walked by a Python loop (no per-layer slicing on the GPU):
`ExecConfig.layers` chooses.

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
from pallas_kernels.matmul import PREFILL_BLOCKS, MatmulBlocks, matmul
from pallas_kernels.rms_norm import rms_norm as invariant_rms_norm
from pallas_kernels.sparse_attention import rope_halves
from vegas_jax import quant
from vegas_jax.attention import (
    AttnPlan, RawCapture, attention, capture_start, fused_draft, sparse_block,
)
from vegas_jax.cache import KVCache, write_kv
from vegas_jax.config import ModelConfig, rope_inv_freq
from vegas_jax.execution import ExecConfig
from vegas_jax.params import LayerParams, Params, fused_widths
from vegas_jax.quant import QuantWeight
from vegas_jax.sharding import split_columns

# A fused draft carries its rows padded to a multiple of this: cuBLAS pads half-precision
# matmul operands to multiples of 8, with a pad kernel before every matmul otherwise.
ROW_PAD = 8


def mm(spec, a, b):
    """einsum of activations and weights; fp32 operands multiply in full fp32 (on the GPU
    XLA would use TF32 by default, and fp32 results must not depend on the batch shape)."""
    return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST if a.dtype == jnp.float32
                      else None)


def row_invariant(xc: ExecConfig, plan: AttnPlan) -> MatmulBlocks | None:
    """The row-invariant matmul tile of this forward, None where it runs the fast kernels:
    prefill, decode and verify under `ExecConfig.exact` (drafts only propose, and keep the
    fast ones); prompt steps take the prefill tile (`AttnPlan.prefill`)."""
    if not (xc.exact and plan.mode == "causal"):
        return None
    return PREFILL_BLOCKS if plan.prefill else MatmulBlocks()


def linear(x, w, inv: MatmulBlocks | None, xc: ExecConfig, transpose_w: bool = False):
    """x [..., h] @ w [h, n] (w [n, h] with transpose_w). inv: the tile of the row-invariant
    kernel (`ExecConfig.exact`), whose rows never depend on the rows beside them. A
    `QuantWeight` (a quantized draft's, `quant`) goes through its own matmul."""
    if isinstance(w, QuantWeight):
        return quant.linear(x, w, xc)
    if inv:
        return matmul(x, w, transpose_w=transpose_w, blocks=inv, interpret=xc.interpret)
    return mm("...h,nh->...n" if transpose_w else "...h,hn->...n", x, w)


def rms_norm(x, w, eps, inv: bool = False, xc: ExecConfig | None = None):
    """Normalise in fp32 as the reference implementations do, then return to x's dtype;
    w None: a weight already folded into the next matmul (`fold_norms`). inv: through the
    row-invariant kernel (`ExecConfig.exact`)."""
    if inv:
        y = invariant_rms_norm(x, eps, interpret=xc.interpret)
    else:
        xf = x.astype(jnp.float32)
        y = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return y if w is None else w * y


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


@struct.dataclass
class LayerInputs:
    """What every layer of one forward reads besides its weights and the carry."""

    plan: AttnPlan
    cos: jax.Array  # [b, t, d] RoPE tables (`rope_tables`)
    sin: jax.Array
    positions: jax.Array  # [b, t]
    rope: jax.Array | None  # [b, 2, d/2] the fused draft kernel's table (`rope_halves`)
    write: bool = struct.field(pytree_node=False, default=True)  # K/V into the cache


@struct.dataclass
class Carry:
    """What one layer hands the next: one structure for every layer of a forward."""

    x: jax.Array  # [b, t, h]
    k_cache: jax.Array  # [L, b, k, s, d]
    v_cache: jax.Array
    # a raw capture's stacked buffer (`Capture.raw`): each layer's verify writes its rows
    # into it; None for every other forward
    capture: jax.Array | None = None


@functools.partial(jax.jit, static_argnames=("cfg", "xc"))
def _layer(cfg: ModelConfig, xc: ExecConfig, inp: LayerInputs, carry: Carry, lp: LayerParams,
           li):
    """One transformer layer: (carry, scores). scores: the layer's captured scores (a raw
    capture's: the offsets of the rows it wrote into `carry.capture`), else None.

    Jitted on its own, with the layer index `li` traced: every layer of a forward is then
    traced and lowered once, whether the layers run in a loop or unrolled (per-layer
    weight buffers: on the GPU the host walks no loop body per layer, but tracing and
    lowering each of 30 layers apart made a round's compile slow on the CPU). XLA inlines
    the calls."""
    x = carry.x  # [b, t, h]
    fused = inp.write and fused_draft(inp.plan, xc, cfg)
    # a fused draft with the norm's weight folded into w_qkv applies the norm's row scale in
    # its kernel (it commutes with the projection); the verify keeps the model's exact order
    scaled_in_kernel = fused and lp.attn_norm is None
    inv = row_invariant(xc, inp.plan)
    h = x if scaled_in_kernel else rms_norm(x, lp.attn_norm, cfg.rms_norm_eps, inv, xc)
    qkv = linear(h, lp.w_qkv, inv, xc)  # [b, t, (n + 2k)*d]
    if lp.b_qkv is not None:
        qkv = qkv + lp.b_qkv
    if fused:  # the attention block in one kernel
        b = x.shape[0]
        # the Q/K norm weights of models without QK-norm: a literal, never read
        ones = np.ones((cfg.head_dim,), np.float32)
        qn, kn = (lp.q_norm, lp.k_norm) if cfg.qk_norm else (ones, ones)
        o, k_cache, v_cache = sparse_block(inp.plan, xc, cfg, qkv, qn, kn, inp.rope,
                                           carry.k_cache, carry.v_cache, li, inp.positions,
                                           x.reshape(b, -1) if scaled_in_kernel else None)
        x = _mlp(cfg, xc, x, o, lp, draft=True)
        return carry.replace(x=x, k_cache=k_cache, v_cache=v_cache), None
    o, carry, scores = _attend(cfg, xc, inp, carry, lp, li, qkv, inv)
    return carry.replace(x=_mlp(cfg, xc, x, o, lp, inv=inv)), scores


def _attend(cfg: ModelConfig, xc: ExecConfig, inp: LayerInputs, carry: Carry,
            lp: LayerParams, li, qkv, inv: bool):
    """A layer's attention from its projection qkv [b, t, (n + 2k)*d]: Q/K norms, RoPE, the
    cache write and the plan's attention. Returns (out [b, t, k, g, d], carry with the
    caches (and capture buffer) written, scores or None)."""
    k_heads, g, d = cfg.num_kv_heads, cfg.group_size, cfg.head_dim
    b, t, _ = qkv.shape
    q, k, v = split_columns(qkv, fused_widths(cfg)["w_qkv"], xc.tp)
    q, k, v = (q.reshape(b, t, k_heads * g, d), k.reshape(b, t, k_heads, d),
               v.reshape(b, t, k_heads, d))
    if cfg.qk_norm:
        q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps, inv, xc)
        k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps, inv, xc)
    q = apply_rope(q, inp.cos, inp.sin).reshape(b, t, k_heads, g, d)  # [b, t, k, g, d]
    k = apply_rope(k, inp.cos, inp.sin)  # [b, t, k, d]
    k_cache, v_cache = carry.k_cache, carry.v_cache
    if inp.write:
        k_cache, v_cache = write_kv(k_cache, v_cache, li, k, v, inp.positions)
    window = slot = None
    if cfg.sliding_layers:  # this layer's window (0: full) and row of the selection
        window = jnp.asarray(cfg.layer_windows, jnp.int32)[li]
        slot = jnp.asarray(cfg.selection_slots, jnp.int32)[li]
    sinks = None if lp.sinks is None else lp.sinks.reshape(k_heads, g)  # [k, g]
    o, scores = attention(inp.plan, xc, q, k_cache, v_cache, li, inp.positions,
                          window=window, sinks=sinks, slot=slot, capture_into=carry.capture)
    cap = carry.capture
    if cap is not None:  # a raw capture: (its buffer, this layer's offsets)
        cap, scores = scores
    return o, carry.replace(k_cache=k_cache, v_cache=v_cache, capture=cap), scores


def draft_mlp_kernel(xc: ExecConfig, lp: LayerParams, rows: int) -> bool:
    """Whether a fused draft layer's MLP input runs as `draft_mlp.norm_gate_up` (norm row
    scale, gate/up and activation in one kernel): a dense MLP whose norm weight is folded,
    one device, widths the kernel tiles, small weights (in the bytes a call reads: a
    quantized draft's, its packed ones) and many rows (where it pays)."""
    w = lp.w_gate_up
    if not (xc.draft_mlp and w is not None and rows >= draft_mlp.MIN_ROWS
            and lp.mlp_norm is None):
        return False
    quantized = isinstance(w, QuantWeight)
    h, f = (w.k, w.n // 2) if quantized else (w.shape[-2], w.shape[-1] // 2)
    nbytes = w.layer_bytes() if quantized else h * 2 * f * w.dtype.itemsize
    return (nbytes <= draft_mlp.SMALL_BYTES
            and draft_mlp.tile_for(h, f, fmt=w.fmt if quantized else None) is not None)


def _mlp(cfg: ModelConfig, xc: ExecConfig, x, o, lp: LayerParams, draft: bool = False,
         inv: bool = False):
    """The layer after attention: output projection, residual, MLP, residual. draft: a
    fused draft layer's (`draft_mlp_kernel`); inv: row-invariant matmuls."""
    b, t, _ = x.shape
    attn = linear(o.reshape(b, t, -1).astype(x.dtype), lp.wo, inv, xc)
    x = x + (attn if lp.bo is None else attn + lp.bo)
    if draft and draft_mlp_kernel(xc, lp, b * t):
        w, kw = lp.w_gate_up, {}
        if isinstance(w, QuantWeight):
            w, kw = w.layer_q(), dict(scale=w.layer_scale(), fmt=w.fmt)
        act = draft_mlp.norm_gate_up(x.reshape(b * t, -1), w, eps=cfg.rms_norm_eps,
                                     interpret=xc.interpret, **kw)
        return x + linear(act.reshape(b, t, -1), lp.w_down, False, xc)
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps, inv, xc)
    if cfg.is_moe:
        return x + _moe(cfg, h, lp, functools.partial(grouped_matmul.ragged_dot, impl=xc.moe))
    gate_up = linear(h, lp.w_gate_up, inv, xc)  # [b, t, 2f]
    gate, up = split_columns(gate_up, fused_widths(cfg)["w_gate_up"], xc.tp)  # [b, t, f]
    return x + linear(jax.nn.silu(gate) * up, lp.w_down, inv, xc)


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
    own expert (gathering each row's experts' weights would read them many times over).
    No capacity limit: no token is ever dropped, so a token's output does not depend on
    which other tokens share the call (as decode, verify and draft need). XLA lowers
    ragged_dot densely over every expert; on a Hopper GPU `ragged_dot` is our kernels."""
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
    pad = -b % ROW_PAD if fused and b > 1 and not cfg.is_moe else 0
    # a fused draft's padding rows (token 0) come out of the draft kernel as zeros
    x = params.embed[jnp.pad(tokens, ((0, pad), (0, 0)))]  # [b + pad, t, h]
    cos, sin = rope_tables(cfg, positions)
    # the fused draft kernel's RoPE table, made once per forward: made inside the layer,
    # it would cost a small kernel launch per layer
    rope = rope_halves(cos, sin) if fused else None
    if cfg.sliding_layers and plan.mode == "sparse":
        # a draft's sliding layers read their window as the tail (`attention`): room for it
        plan = plan.replace(tail_len=max(plan.tail_len, cfg.sliding_window))

    inp = LayerInputs(plan=plan, cos=cos, sin=sin, positions=positions, rope=rope, write=write)

    def step(carry, lp, li):
        return _layer(cfg, xc, inp, carry, lp, jnp.int32(li))

    # a raw capture's buffer, or None
    carry = Carry(x, cache.k, cache.v, capture_start(plan, cfg, b, cache.max_len))
    if isinstance(params.layers, tuple):
        # Per-layer weight buffers: nothing is sliced per layer (in a loop the host computes
        # each layer's weight offsets on every call).
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
    if carry.capture is not None:  # scores: every layer's offsets [L, b, R]
        active = jnp.ones((b,), bool) if plan.active is None else plan.active
        scores = RawCapture(carry.capture, scores, active)
    x = carry.x[:b]
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)  # [b, 1, h]
    inv = row_invariant(xc, plan)
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps, inv, xc)
    if params.lm_head is None:
        logits = linear(x, params.embed, inv, xc, transpose_w=True)
    else:
        logits = linear(x, params.lm_head, inv, xc)
    return (logits.astype(jnp.float32), cache.replace(k=carry.k_cache, v=carry.v_cache),
            scores)


def _layer_loop(step, carry, layers: LayerParams, cfg: ModelConfig, scores_shape):
    """`step` over the stacked layers; returns (carry, scores [Lf, *scores_shape] or None)
    for the Lf = len(cfg.full_layers) full-attention layers.

    A while loop whose counter is the layer index: a scan would slice the index from an
    iota, which XLA on the GPU runs as one more device memcpy per layer."""
    n = cfg.num_layers

    def at(li):  # a quantized weight's layer is read in place by its matmul
        return jax.tree.map(
            lambda a: a.at_layer(li) if isinstance(a, QuantWeight)
            else lax.dynamic_index_in_dim(a, li, keepdims=False),
            layers, is_leaf=lambda a: isinstance(a, QuantWeight))

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

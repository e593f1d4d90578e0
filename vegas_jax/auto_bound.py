"""Whether a round can beat plain steps at all, from what each reads: decided before
anything is compiled.

Under a roofline (a call takes at least its bytes over the memory bandwidth, and at least
its flops over the compute throughput, on one device for all calls), a round of gamma
drafts and one verify emits at most gamma + 1 tokens in at least (1 + gamma * rho) plain
steps' time, rho = a draft step's bytes over a plain step's: the verify reads at least
what a step reads (the same weights and cache), a draft step the same weights (the model
drafts for itself) and only its selection of the cache. Compute cannot lift the bound:
where flops set a step's time, the verify, which computes gamma + 1 tokens as a step
computes one, costs gamma + 1 steps. So a round's speedup over plain steps is at most
(gamma + 1) / (1 + gamma * rho) on any device, and close to 1 wherever the weights
outweigh the cache (a small batch with short contexts: e.g. B 1 on a CPU).

A quantized draft (`SpecConfig.draft_weights`, `quant`) reads fewer weight bytes: its
rounds may pay where the model's own drafts' cannot (rho per format: `draft_weight_bytes`)."""

from __future__ import annotations

import math

import jax
import numpy as np

from vegas_jax.auto_choice import SAME, Config
from vegas_jax.params import param_dtype
from vegas_jax.quant import quantize_params


def weight_bytes(params, cfg, rows: int) -> float:
    """Bytes of weights a forward of `rows` tokens reads: every leaf, less an untied
    embedding table (a step gathers its rows), the experts in the expected share that
    `rows` tokens route to (each picks experts_per_token of num_experts)."""
    untied = getattr(params, "lm_head", None) is not None
    share = 1.0
    if cfg.is_moe:
        share = 1.0 - (1.0 - cfg.experts_per_token / cfg.num_experts) ** rows
    total = 0.0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if untied and name == ".embed":
            continue
        total += math.prod(x.shape) * x.dtype.itemsize * (share if "expert" in name else 1.0)
    return total


def draft_positions(spec, gamma: int, n: float) -> float:
    """Cache positions a full-attention layer's draft step reads at context n: the
    budget (`methods.budget`: a share of the context, at least min_tokens) and the tail
    after the ranked range (the accepted tokens and drafts, gamma on average)."""
    budget = max(math.ceil(spec.sparsity * (n + gamma + 1)), spec.min_tokens)
    return min(n, budget + gamma)


def draft_weight_bytes(model, fmt: str, rows: int) -> float:
    """Bytes of weights a draft step of `rows` tokens reads in `fmt` (`quant.DRAFT_WEIGHTS`):
    the model's own, or its quantized copy's (shapes only: nothing is made) packed
    matrices and scales, the LM head one of them, the embedding gathered."""
    if fmt == SAME:
        return weight_bytes(model.params, model.config, rows)
    draft = jax.eval_shape(lambda p: quantize_params(p, fmt), model.params)
    return weight_bytes(draft, model.config, rows)


def round_bounds(model, spec, gammas, xc, slots: int, contexts, max_len: int,
                 formats=(SAME,)) -> dict[Config, float]:
    """Each candidate round's bound on its speedup over plain steps (module docstring),
    per (gamma, draft format in `formats`), at the mean context of the prompts' decoding
    (`contexts` [prompts]: prompt length + half its new tokens), `slots` sequences at
    once in a cache of `max_len` positions, run as `xc` says (the XLA reference's
    attention reads every cache position, masked, where the kernels read the visible
    ones)."""
    cfg = model.config
    itemsize = np.dtype(param_dtype(model.params)).itemsize
    per_pos = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize  # K and V, one layer
    n = float(np.mean(contexts))
    windows = cfg.layer_windows
    whole = not (xc.pallas or xc.exact)
    step_pos = sum(max_len if whole else (min(n, w) if w else n) for w in windows)
    step = weight_bytes(model.params, cfg, slots) + slots * per_pos * step_pos
    out = {}
    for f in formats:
        weights = draft_weight_bytes(model, f, slots)
        for g in gammas:
            draft_pos = sum(min(n, w) if w else draft_positions(spec, g, n) for w in windows)
            rho = (weights + slots * per_pos * draft_pos) / step
            out[Config(g, f)] = (g + 1) / (1 + g * rho)
    return out

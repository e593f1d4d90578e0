"""Prefill: full causal attention over the prompts, planned so that activations stay
bounded however large the batch or long the prompt, with the first selection's capture."""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from vegas_jax.attention import PROMPT, PROMPT_CHUNK, AttnPlan, Capture
from vegas_jax.cache import KVCache, init_cache
from vegas_jax.config import ModelConfig
from vegas_jax.execution import ExecConfig, model_jit
from vegas_jax.model import forward
from vegas_jax.params import param_dtype
from vegas_jax.sampling import SamplingParams, sample
from vegas_jax.sharding import place_cache

PROMPT_BUCKET = 64  # prompts are padded to a multiple of this: fewer compilations

PREFILL_TOKENS = 128 * 1024  # query tokens per prefill step across the batch (activations)

PROGRESS_TOKENS = 32 * 1024  # prompts holding this many tokens show a progress bar

_bar: list = []  # the progress bar of the prefill running now, if any (`_layer_done`)

def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def available_bytes() -> int | None:
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return None


def pad_prompts(prompts: list[list[int]]):
    lens = np.array([len(p) for p in prompts], np.int32)
    width = round_up(int(lens.max()), PROMPT_BUCKET)
    toks = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    return jax.device_put(toks), jax.device_put(lens)  # transfers: jnp.asarray compiles a copy


def prefill_budget(cfg: ModelConfig, free: int | None) -> int:
    """Query tokens a prefill step may hold: PREFILL_TOKENS, or fewer where a third of the
    `free` bytes (None: unknown) cannot hold their activations (a smaller GPU, a larger
    model): a power of two, so that free memory moving a little does not change the plan
    (a new compile, other rounding)."""
    if free is None:
        return PREFILL_TOKENS
    fits = free // 3 // act_bytes(cfg)
    budget = PREFILL_TOKENS
    while budget > PROMPT_BUCKET and budget > fits:
        budget //= 2
    return budget


def act_bytes(cfg: ModelConfig) -> int:
    """Activation bytes a prefill token holds at once (the MLP's rows are the largest: an
    MoE layer's are each token's k experts)."""
    mlp = cfg.experts_per_token * cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size
    return (cfg.hidden_size * 4 + mlp * 3) * 4


def prefill_chunk(batch: int, width: int, budget: int = PREFILL_TOKENS) -> int:
    """Query tokens per sequence per prefill step: the whole prompt while the budget (query
    tokens a step) holds one whole prompt (`prefill_rows` sequences at a time), else equal
    slices (multiples of PROMPT_BUCKET), so the activations stay bounded however large the
    batch or long the prompt."""
    if width <= budget:
        return width
    n = -(-width // budget)
    return max(PROMPT_BUCKET, round_up(-(-width // n), PROMPT_BUCKET))


def prefill_rows(batch: int, width: int, budget: int = PREFILL_TOKENS) -> int:
    """Sequences per prefill step: as many whole prompts as the budget holds (at least
    one). A step of whole prompts starts at position 0, which cuDNN's causal attention
    needs; slicing the batch instead of the prompts keeps it so."""
    if batch * width <= budget:
        return batch
    return max(1, min(batch, budget // width))


def prefill_plan(cfg: ModelConfig, batch: int, width: int, free: int | None = None):
    """(chunk, group) of a prefill of `batch` prompts padded to `width`, for `free` bytes."""
    budget = prefill_budget(cfg, free)
    chunk = prefill_chunk(batch, width, budget)
    return chunk, prefill_rows(batch, width, budget) if chunk == width else batch


def _rows(x, start, n, axis):
    return lax.dynamic_slice_in_dim(x, start, n, axis=axis)


def prefill_steps(batch: int, width: int, chunk: int, group: int) -> int:
    """Steps of one `prefill` call (groups of whole prompts, or slices of them)."""
    return -(-batch // group) if chunk == width else -(-width // chunk)


def _layer_done(_):
    if _bar:
        _bar[0].update(1)


@model_jit(static_argnames=("cfg", "xc", "capture", "chunk", "group", "progress"),
           donate_argnames=("cache",))
def prefill(params, cfg: ModelConfig, xc: ExecConfig, tokens, lens, cache: KVCache,
            capture: Capture | None, chunk: int | None = None, group: int | None = None,
            progress: bool = False):
    """Full causal attention over the (right-padded) prompts: `group` sequences at a time
    when each step holds whole prompts (from position 0: `PROMPT`, which may run cuDNN),
    else the whole batch `chunk` query tokens at a time (a scan; each slice attends to the
    cache the earlier ones wrote). Default: `prefill_plan` with the default budget.

    Returns (logits of each prompt's last token [b, v], cache with lengths = lens, scores):
    with `capture` (rows 0..r-1), the last r prompt tokens' queries are run once more
    against the cache, without writing, and their attention yields the first selection's
    scores [L, b, s] (the paper: r = 1, the prefill ranks the prompt by its last token
    alone); the cache is exactly what plain prefill leaves.
    Padding writes K/V past each prompt's end; those slots are overwritten before any
    query can see them (every query sees only positions <= its own).
    `progress`: each layer of each step ticks the bar `prefill_prompts` shows.
    """
    b, t = tokens.shape
    on_layer = _layer_done if progress else None
    plan_chunk, plan_group = prefill_plan(cfg, b, t)
    chunk = min(chunk or plan_chunk, t)
    group = min(group or plan_group, b) if chunk == t else b
    at = lens - 1
    if group < b:
        # Groups of whole prompts; the last one starts at b - group and redoes a few rows
        # of the one before (the same tokens, so the same K/V), so every step has one shape.
        starts = jnp.minimum(jnp.arange(-(-b // group), dtype=jnp.int32) * group, b - group)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (group, t))

        def rows_step(carry, r0):
            k, v, last = carry
            sub = KVCache(k=_rows(k, r0, group, 1), v=_rows(v, r0, group, 1),
                          lengths=_rows(lens, r0, group, 0))
            logits, sub, _ = forward(params, cfg, xc, _rows(tokens, r0, group, 0), pos, sub,
                                     PROMPT, logits_at=_rows(at, r0, group, 0),
                                     on_layer=on_layer)
            k = lax.dynamic_update_slice_in_dim(k, sub.k, r0, axis=1)
            v = lax.dynamic_update_slice_in_dim(v, sub.v, r0, axis=1)
            return (k, v, lax.dynamic_update_slice_in_dim(last, logits[:, 0], r0, 0)), None

        init = (cache.k, cache.v, jnp.zeros((b, cfg.vocab_size), jnp.float32))
        (k, v, logits), _ = lax.scan(rows_step, init, starts)
        cache = cache.replace(k=k, v=v)
    else:
        n = -(-t // chunk)
        tokens_p = jnp.pad(tokens, ((0, 0), (0, n * chunk - t)))

        def step(carry, c):
            cache, last = carry
            toks = lax.dynamic_slice_in_dim(tokens_p, c * chunk, chunk, axis=1)  # [b, chunk]
            pos = c * chunk + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
            here = jnp.clip(at - c * chunk, 0, chunk - 1)
            logits, cache, _ = forward(params, cfg, xc, toks, pos, cache,
                                       PROMPT if n == 1 else PROMPT_CHUNK, logits_at=here,
                                       on_layer=on_layer)
            mine = at // chunk == c  # this slice holds the prompt's last token
            return (cache, jnp.where(mine[:, None], logits[:, 0], last)), None

        init = (cache, jnp.zeros((b, cfg.vocab_size), jnp.float32))
        if n == 1:
            (cache, logits), _ = step(init, jnp.int32(0))
        else:
            (cache, logits), _ = lax.scan(step, init, jnp.arange(n, dtype=jnp.int32))
    scores = None
    if capture is not None:
        # the prompt's last len(capture.rows) tokens, oldest first; a shorter prompt
        # repeats its first token (whose query sees position 0 only)
        back = jnp.arange(len(capture.rows) - 1, -1, -1, dtype=at.dtype)
        rows = jnp.maximum(at[:, None] - back[None, :], 0)  # [b, r]
        last = jnp.take_along_axis(tokens, rows, axis=1)
        _, cache, scores = forward(params, cfg, xc, last, rows, cache,
                                   AttnPlan(capture=capture), write=False)
    return logits, cache.replace(lengths=lens), scores


@functools.partial(jax.jit, donate_argnames=("cache",))
def _put_rows(cache: KVCache, sub: KVCache, rows):
    return cache.replace(k=cache.k.at[:, rows].set(sub.k), v=cache.v.at[:, rows].set(sub.v))


def prefill_prompts(params, cfg, xc: ExecConfig, ids: list[list[int]], cache: KVCache,
                    capture: Capture | None):
    """Prefill a ragged batch. Prompts are grouped by padded length so that a short prompt
    does not pay for the longest one's padding; one group uses the cache in place. Prompts
    of PROGRESS_TOKENS or more show a progress bar (layers done) on a terminal.

    Returns (last-token logits [b, v], cache with lengths set, scores [L, b, s] or None).
    """
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(ids):
        groups.setdefault(round_up(len(p), PROMPT_BUCKET), []).append(i)
    lens = jax.device_put(np.array([len(p) for p in ids], np.int32))
    free = available_bytes()
    plans = {w: prefill_plan(cfg, len(r), w, free) for w, r in groups.items()}
    show = sum(map(len, ids)) >= PROGRESS_TOKENS
    if show:
        from tqdm import tqdm

        steps = sum(prefill_steps(len(r), w, *plans[w]) for w, r in groups.items())
        _bar[:] = [tqdm(total=steps * cfg.num_layers, unit="layer", file=sys.stderr,
                        desc=f"prefill {sum(map(len, ids))} tokens", disable=None)]
    try:
        if len(groups) == 1:
            tokens, _ = pad_prompts(ids)
            out = prefill(params, cfg, xc, tokens, lens, cache, capture, *plans[tokens.shape[1]],
                          progress=show)
        else:
            out = _prefill_groups(params, cfg, xc, ids, cache, capture, groups, plans, lens, show)
        if show:
            jax.block_until_ready(out)
            jax.effects_barrier()  # every tick has run
        return out
    finally:
        if show:
            _bar.pop().close()


def _prefill_groups(params, cfg, xc, ids, cache, capture, groups, plans, lens, show):
    logits = [None] * len(ids)
    scores = [None] * len(ids)
    for width, rows in groups.items():
        tokens, sub_lens = pad_prompts([ids[r] for r in rows])
        r = jnp.asarray(rows)
        sub = KVCache(k=cache.k[:, r], v=cache.v[:, r], lengths=sub_lens)
        lg, sub, sc = prefill(params, cfg, xc, tokens, sub_lens, sub, capture, *plans[width],
                              progress=show)
        cache = _put_rows(cache, sub, r)
        for j, row in enumerate(rows):
            logits[row] = lg[j]
            if capture is not None:
                scores[row] = sc[:, j]
    cache = cache.replace(lengths=lens)
    return (jnp.stack(logits), cache,
            jnp.stack(scores, axis=1) if capture is not None else None)


def prefill_group(model, xc: ExecConfig, prompts: list[list[int]], rows: int, max_len: int,
                  capture: Capture | None, key, sampling: SamplingParams):
    """Waiting prompts prefilled together for freed slots, padded to `rows` sequences
    (repeats of the last prompt, which the caller drops) and to their longest prompt, so
    few shapes compile however the slots free up. Returns (their cache of `max_len`
    positions, first tokens [rows], capture scores [L, rows, s] or None)."""
    cfg = model.config
    ids = list(prompts) + [prompts[-1]] * (rows - len(prompts))
    cache = place_cache(init_cache(cfg, rows, max_len, param_dtype(model.params)), xc.tp)
    tokens, lens = pad_prompts(ids)
    logits, cache, scores = prefill(model.params, cfg, xc, tokens, lens, cache, capture,
                                    *prefill_plan(cfg, *tokens.shape, available_bytes()))
    first, _ = sample(key, logits, sampling)
    return cache, first, scores

"""Prefill: full causal attention over the prompts, planned so that activations stay
bounded however large the batch or long the prompt, with the first selection's capture."""

from __future__ import annotations

import functools
import os
import sys
import threading

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


def prefill(params, cfg: ModelConfig, xc: ExecConfig, tokens, lens, cache: KVCache,
            capture: Capture | None, chunk: int | None = None, group: int | None = None,
            on_step=None):
    """Full causal attention over the (right-padded) prompts: `group` sequences at a time
    when each step holds whole prompts (from position 0: `PROMPT`, which may run cuDNN),
    else the whole batch `chunk` query tokens at a time (each slice attends to the cache
    the earlier ones wrote). Default: `prefill_plan` with the default budget. One jitted
    call a step; on_step(done, steps), if given, runs on the host as each step ends.

    Returns (logits of each prompt's last token [b, v], cache with lengths = lens, scores):
    with `capture` (rows 0..r-1), the last r prompt tokens' queries are run once more
    against the cache, without writing, and their attention yields the first selection's
    scores [L, b, s] (the paper: r = 1, the prefill ranks the prompt by its last token
    alone); the cache is exactly what plain prefill leaves.
    Padding writes K/V past each prompt's end; those slots are overwritten before any
    query can see them (every query sees only positions <= its own).
    """
    b, t = tokens.shape
    plan_chunk, plan_group = prefill_plan(cfg, b, t)
    chunk = min(chunk or plan_chunk, t)
    group = min(group or plan_group, b) if chunk == t else b
    steps = prefill_steps(b, t, chunk, group)
    logits = jnp.zeros((b, cfg.vocab_size), jnp.float32)
    kv = (cache.k, cache.v)  # donated to each step (not `lens`, which the cache may hold)
    for i in range(steps):
        # whole prompts: the last group starts at b - group and redoes a few rows of the one
        # before (the same tokens, so the same K/V), so every step has one shape
        at = min(i * group, b - group) if chunk == t else i * chunk
        logits, kv = _prefill_step(params, cfg, xc, tokens, lens, kv, logits, jnp.int32(at),
                                   chunk, group, steps == 1)
        if on_step is not None:
            jax.block_until_ready(logits)
            on_step(i + 1, steps)
    scores = None
    if capture is not None:
        kv, scores = _prefill_capture(params, cfg, xc, tokens, lens, kv, capture)
    return logits, KVCache(*kv, lengths=lens), scores


@model_jit(static_argnames=("cfg", "xc", "chunk", "group", "whole"),
           donate_argnames=("kv", "logits"))
def _prefill_step(params, cfg: ModelConfig, xc: ExecConfig, tokens, lens, kv, logits, at,
                  chunk: int, group: int, whole: bool):
    """One prefill step (`prefill`): sequences at..at+group-1 whole (chunk = the prompt
    width), or every sequence's tokens at..at+chunk-1. whole: one step does everything.
    kv: the cache's (k, v). Returns (last-token logits [b, v], the step's prompts' set;
    (k, v))."""
    b, t = tokens.shape
    last = lens - 1
    cache = KVCache(*kv, lengths=lens)
    if chunk == t and group < b:
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (group, t))
        sub = KVCache(k=_rows(cache.k, at, group, 1), v=_rows(cache.v, at, group, 1),
                      lengths=_rows(lens, at, group, 0))
        out, sub, _ = forward(params, cfg, xc, _rows(tokens, at, group, 0), pos, sub, PROMPT,
                              logits_at=_rows(last, at, group, 0))
        k = lax.dynamic_update_slice_in_dim(cache.k, sub.k, at, axis=1)
        v = lax.dynamic_update_slice_in_dim(cache.v, sub.v, at, axis=1)
        return lax.dynamic_update_slice_in_dim(logits, out[:, 0], at, 0), (k, v)
    tokens_p = jnp.pad(tokens, ((0, 0), (0, -t % chunk)))
    toks = lax.dynamic_slice_in_dim(tokens_p, at, chunk, axis=1)  # [b, chunk]
    pos = at + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
    here = jnp.clip(last - at, 0, chunk - 1)
    plan = PROMPT if whole else PROMPT_CHUNK
    out, cache, _ = forward(params, cfg, xc, toks, pos, cache, plan,
                            logits_at=here)
    mine = last // chunk == at // chunk  # this slice holds the prompt's last token
    return jnp.where(mine[:, None], out[:, 0], logits), (cache.k, cache.v)


@model_jit(static_argnames=("cfg", "xc", "capture"), donate_argnames=("kv",))
def _prefill_capture(params, cfg: ModelConfig, xc: ExecConfig, tokens, lens, kv,
                     capture: Capture):
    """The first selection's scores: the prompts' last len(capture.rows) tokens, oldest
    first, run against the prefilled cache (k, v) without writing (a shorter prompt
    repeats its first token, whose query sees position 0 only). Returns ((k, v), scores)."""
    back = jnp.arange(len(capture.rows) - 1, -1, -1, dtype=lens.dtype)
    rows = jnp.maximum(lens[:, None] - 1 - back[None, :], 0)  # [b, r]
    last = jnp.take_along_axis(tokens, rows, axis=1)
    _, cache, scores = forward(params, cfg, xc, last, rows, KVCache(*kv, lengths=lens),
                               AttnPlan(capture=capture), write=False)
    return (cache.k, cache.v), scores


@functools.partial(jax.jit, donate_argnames=("cache",))
def _put_rows(cache: KVCache, sub: KVCache, rows):
    return cache.replace(k=cache.k.at[:, rows].set(sub.k), v=cache.v.at[:, rows].set(sub.v))


def prefill_prompts(params, cfg, xc: ExecConfig, ids: list[list[int]], cache: KVCache,
                    capture: Capture | None):
    """Prefill a ragged batch. Prompts are grouped by padded length so that a short prompt
    does not pay for the longest one's padding; one group uses the cache in place. Prompts
    of PROGRESS_TOKENS or more show a progress bar on a terminal (`PrefillBar`).

    Returns (last-token logits [b, v], cache with lengths set, scores [L, b, s] or None).
    """
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(ids):
        groups.setdefault(round_up(len(p), PROMPT_BUCKET), []).append(i)
    lens = jax.device_put(np.array([len(p) for p in ids], np.int32))
    free = available_bytes()
    plans = {w: prefill_plan(cfg, len(r), w, free) for w, r in groups.items()}
    total = sum(map(len, ids))
    bar = PrefillBar(total) if total >= PROGRESS_TOKENS else None
    try:
        if len(groups) == 1:
            tokens, _ = pad_prompts(ids)
            on_step = None if bar is None else bar.group(total)
            return prefill(params, cfg, xc, tokens, lens, cache, capture,
                           *plans[tokens.shape[1]], on_step=on_step)
        return _prefill_groups(params, cfg, xc, ids, cache, capture, groups, plans, lens, bar)
    finally:
        if bar is not None:
            bar.close()


class PrefillBar:
    """A long prefill's progress bar on stderr (when it is a terminal): prompt tokens done,
    moved as each prefill step ends, its clock redrawn every second meanwhile (a prefill
    of one step moves only at its end)."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="tok", unit_scale=True, file=sys.stderr,
                        desc=f"prefill {total} tokens", disable=None)
        self.start = 0
        self.stop = threading.Event()
        self.clock = None
        if not getattr(self.bar, "disable", True):
            self.clock = threading.Thread(target=self._redraw, daemon=True)
            self.clock.start()

    def _redraw(self):
        while not self.stop.wait(1.0):
            self.bar.refresh()

    def group(self, tokens: int):
        """on_step for a `prefill` call over the next `tokens` prompt tokens."""
        start, self.start = self.start, self.start + tokens

        def on_step(done: int, steps: int):
            self.bar.update(start + tokens * done // steps - self.bar.n)
        return on_step

    def close(self):
        self.stop.set()
        if self.clock is not None:
            self.clock.join()
        self.bar.close()


def _prefill_groups(params, cfg, xc, ids, cache, capture, groups, plans, lens,
                    bar: PrefillBar | None):
    logits = [None] * len(ids)
    scores = [None] * len(ids)
    for width, rows in groups.items():
        tokens, sub_lens = pad_prompts([ids[r] for r in rows])
        r = jnp.asarray(rows)
        sub = KVCache(k=cache.k[:, r], v=cache.v[:, r], lengths=sub_lens)
        on_step = None if bar is None else bar.group(sum(len(ids[i]) for i in rows))
        lg, sub, sc = prefill(params, cfg, xc, tokens, sub_lens, sub, capture, *plans[width],
                              on_step=on_step)
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

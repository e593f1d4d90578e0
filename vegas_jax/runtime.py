"""What every decoding loop shares: prompt preparation, input checks, the memory estimate,
prefill, the on-device stop rule, the pipelined host loop and the result type."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from pallas_kernels.common import pow2_at_least
from vegas_jax.attention import CAUSAL, PROMPT, AttnPlan, Capture
from vegas_jax.cache import KVCache, cache_bytes, init_cache
from vegas_jax.config import ModelConfig
from vegas_jax.execution import ExecConfig, model_jit
from vegas_jax.model import forward, param_bytes, param_dtype
from vegas_jax.sampling import SamplingParams, sample
from vegas_jax.sharding import place_cache

PROMPT_BUCKET = 64  # prompts are padded to a multiple of this: fewer compilations
LEN_BUCKET = 128  # cache lengths are rounded up to this
PREFILL_TOKENS = 128 * 1024  # query tokens per prefill step across the batch (activations)


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per prompt (EOS included when it ended the text)
    text: list[str] | None  # decoded new tokens, when the model has a tokenizer
    stats: dict[str, Any]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def encode_prompts(model, prompts) -> list[list[int]]:
    """Strings or lists of token ids -> lists of token ids, checked."""
    if isinstance(prompts, (str, bytes)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], (int, np.integer))
    ):
        raise TypeError("prompts must be a list of prompts (strings or lists of token ids)")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("empty batch: pass at least one prompt")
    out = []
    vocab = model.config.vocab_size
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            ids = list(model.tokenizer.encode(p))
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
        out.append(ids)
    return out


def token_limits(max_new_tokens, n_prompts: int) -> np.ndarray:
    """New tokens allowed per prompt [n_prompts]: one whole number >= 1 for all, or one per
    prompt (a workload of ragged output lengths)."""
    lim = np.asarray(max_new_tokens)
    if lim.ndim > 1 or (lim.ndim == 1 and len(lim) != n_prompts):
        raise ValueError(f"max_new_tokens must be one number or one per prompt ({n_prompts}), "
                         f"got shape {lim.shape}")
    if lim.size == 0 or not np.all(np.mod(lim, 1) == 0) or np.min(lim) < 1:
        raise ValueError(f"max_new_tokens must be whole numbers >= 1, got {max_new_tokens}")
    return np.broadcast_to(lim.astype(np.int64), (n_prompts,)).copy()


def rows_of(limits: np.ndarray, prompts: Sequence[int], rows: int) -> np.ndarray:
    """The limits of a refill group's rows: its prompts', padded with the last one's (the
    padding rows repeat the last prompt)."""
    picked = [int(limits[p]) for p in prompts]
    return np.asarray(picked + picked[-1:] * (rows - len(picked)))


def plan_cache_len(cfg: ModelConfig, prompt_lens, max_new_tokens, extra: int) -> int:
    """Static cache length for this batch; refuses prompts that do not fit the context.
    max_new_tokens: one limit for all prompts or one per prompt."""
    limits = token_limits(max_new_tokens, len(prompt_lens))
    longest = max(prompt_lens)
    totals = np.asarray(prompt_lens) + limits
    worst = int(np.argmax(totals))
    need = int(totals[worst])
    if need > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {prompt_lens[worst]} tokens + {limits[worst]} new tokens = {need} "
            f"exceeds {cfg.name}'s context of {cfg.max_position_embeddings} tokens"
        )
    # Decoding writes a few entries past the last kept token (speculative drafts, finished
    # sequences idling): keep room for them so no write is ever dropped.
    return _round_up(max(_round_up(longest, PROMPT_BUCKET), need) + extra, LEN_BUCKET)


def available_bytes() -> int | None:
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return None


def check_memory(model, batch: int, max_len: int, prompt_len: int, attn: str = "xla"):
    """Refuse up front, with numbers, when the KV cache and activations cannot fit."""
    cfg = model.config
    kv = cache_bytes(cfg, batch, max_len, param_dtype(model.params))
    # Largest transients: prefill activations and the chunked attention logits.
    width = _round_up(prompt_len, PROMPT_BUCKET)
    free = available_bytes()
    q_len, rows = prefill_plan(cfg, batch, width, None if free is None else max(free - kv, 0))
    act = rows * q_len * _act_bytes(cfg)
    # The XLA attention path materialises [b, heads, 512 queries, s] logits per chunk; the
    # Pallas kernels keep them on chip.
    att = rows * cfg.num_heads * min(q_len, 512) * max_len * 4 * 3 if attn == "xla" else 0
    logits = batch * cfg.vocab_size * 4 * 4
    need = kv + act + att + logits
    if free is not None and need > 0.9 * free:
        gib = 1 << 30
        raise MemoryError(
            f"not enough memory: KV cache {kv / gib:.2f} GiB (batch {batch} x {max_len} "
            f"positions) + activations ~{(need - kv) / gib:.2f} GiB > 90% of the "
            f"{free / gib:.2f} GiB free (weights {param_bytes(model.params) / gib:.2f} GiB "
            f"already loaded). Use a smaller batch, shorter prompts or fewer new tokens."
        )
    return need


def pad_prompts(prompts: list[list[int]]):
    lens = np.array([len(p) for p in prompts], np.int32)
    width = _round_up(int(lens.max()), PROMPT_BUCKET)
    toks = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    return jnp.asarray(toks), jnp.asarray(lens)


def prefill_budget(cfg: ModelConfig, free: int | None) -> int:
    """Query tokens a prefill step may hold: PREFILL_TOKENS, or fewer where a third of the
    `free` bytes (None: unknown) cannot hold their activations (a smaller GPU, a larger
    model): a power of two, so that free memory moving a little does not change the plan
    (a new compile, other rounding)."""
    if free is None:
        return PREFILL_TOKENS
    fits = free // 3 // _act_bytes(cfg)
    budget = PREFILL_TOKENS
    while budget > PROMPT_BUCKET and budget > fits:
        budget //= 2
    return budget


def _act_bytes(cfg: ModelConfig) -> int:
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
    return max(PROMPT_BUCKET, _round_up(-(-width // n), PROMPT_BUCKET))


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


PROGRESS_TOKENS = 32 * 1024  # prompts holding this many tokens show a progress bar
_bar: list = []  # the progress bar of the prefill running now, if any (`_layer_done`)


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
                                       PROMPT if n == 1 else CAUSAL, logits_at=here,
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



class TokenCollector:
    """Host-side bookkeeping: appends emitted tokens, stops each sequence at EOS or at
    `max_new_tokens`, and streams what it accepted.

    Rows of the device's output are slots; each slot holds one prompt at a time (`owner`).
    With more prompts than slots, a finished slot is handed the next prompt (`assign`),
    whose first token (sampled by its prefill) is read with the next output."""

    def __init__(self, batch, max_new_tokens, eos_ids, on_tokens=None, n_prompts=None):
        self.tokens = [[] for _ in range(n_prompts or batch)]
        self.owner = np.arange(batch)
        self.done = np.zeros(batch, bool)
        self.max_new = token_limits(max_new_tokens, len(self.tokens))  # per prompt
        self.eos = set(int(e) for e in eos_ids)
        self.on_tokens = on_tokens
        self.first: dict[int, Any] = {}  # slot -> its new prompt's first token (device)

    def assign(self, slot: int, prompt: int, first):
        """Slot `slot` now decodes prompt `prompt`; `first` [1] is its prefill's token."""
        self.owner[slot] = prompt
        self.done[slot] = False
        self.first[slot] = first

    def add(self, rows) -> np.ndarray:
        """rows: per slot, the tokens emitted this step (sequence of ints)."""
        first = {s: [int(jax.device_get(t)[0])] for s, t in self.first.items()}
        self.first = {}
        new = [[] for _ in self.tokens]
        for i, row in enumerate(rows):
            got = new[self.owner[i]]
            for t in [*first.get(i, []), *row]:
                if self.done[i]:
                    break
                t = int(t)
                got.append(t)
                self.tokens[self.owner[i]].append(t)
                if t in self.eos or len(self.tokens[self.owner[i]]) >= self.max_new[self.owner[i]]:
                    self.done[i] = True
        if self.on_tokens is not None:
            self.on_tokens(new)
        return ~self.done

    @property
    def n_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    def remaining(self) -> np.ndarray:
        """Tokens each slot may still emit [b] (0 for finished slots)."""
        left = [self.max_new[o] - len(self.tokens[o]) for o in self.owner]
        return np.where(self.done, 0, np.asarray(left, np.int64))


class DecodeClock:
    """Decode timing. The first device call compiles, so throughput is measured over the
    calls after it (all calls when there is only one). Per call: `dispatch_s` the host's
    time handing the next call to the runtime, `wait_s` its time blocked on the previous
    call's output, `host_s` its own
    bookkeeping; a call whose output was ready before the host asked (wait under 50 us)
    may have left the device idle."""

    READY_S = 50e-6
    WAITED_S = 2e-4  # a read that blocked this long found the device busy
    TRACE = 4096  # calls kept in the per-call trace

    def __init__(self, collector: TokenCollector):
        self.collector = collector
        self.start_tokens = collector.n_generated
        self.t0 = time.perf_counter()
        self.calls = 0
        self.first = None  # (time, tokens) at the end of the first call
        self.wait_s = self.host_s = self.dispatch_s = 0.0
        self.ready_calls = 0
        # (arrived, waited, active, tokens generated so far)
        self.arrivals: list[tuple[float, float, int, int]] = []

    def tick(self, wait_s: float = 0.0, host_s: float = 0.0, dispatch_s: float = 0.0,
             arrived: float | None = None, active: int | None = None):
        self.calls += 1
        if arrived is not None and len(self.arrivals) < self.TRACE:
            self.arrivals.append((arrived, wait_s, -1 if active is None else int(active),
                                  self.collector.n_generated))
        if self.calls == 1:
            self.first = (time.perf_counter(), self.collector.n_generated)
            return
        self.wait_s += wait_s
        self.host_s += host_s
        self.dispatch_s += dispatch_s
        self.ready_calls += wait_s < self.READY_S

    def stats(self) -> dict:
        end = time.perf_counter()
        total = self.collector.n_generated - self.start_tokens
        t_first, n_first = self.first if self.first else (end, self.collector.n_generated)
        if self.calls > 1:
            s, n = end - t_first, self.collector.n_generated - n_first
        else:
            s, n = end - self.t0, total
        later = max(self.calls - 1, 1)
        return {
            "decode_s": end - self.t0,
            "decode_tokens": total,
            "first_call_s": t_first - self.t0,
            "decode_tokens_per_s": n / s if s > 0 else float("nan"),
            "device_calls": self.calls,
            "ms_per_call": s / max(self.calls - 1, 1) * 1e3 if self.calls > 1 else float("nan"),
            "host_ms_per_call": self.host_s / later * 1e3,
            "wait_ms_per_call": self.wait_s / later * 1e3,
            "dispatch_ms_per_call": self.dispatch_s / later * 1e3,
            "host_bound_calls": self.ready_calls / later,
            **self.trace(),
        }

    def trace(self) -> dict:
        """Per call (after the first): its device time in ms, where the host blocked on
        both its output and the one before (else None: the interval holds host time), the
        sequences active when it ran (those left after the call before it) and the tokens
        it emitted (with a refill, also the refilled prompts' first tokens). Shows what a
        batch's tail costs: the rounds where few sequences are left."""
        pairs = list(zip(self.arrivals, self.arrivals[1:]))
        ms = [round((t - t0) * 1e3, 3) if w >= self.WAITED_S and w0 >= self.WAITED_S else None
              for (t0, w0, *_), (t, w, *_) in pairs]
        return {"call_ms": ms, "active_by_call": [a[2] for a in self.arrivals[:-1]],
                "tokens_by_call": [b[3] - a[3] for a, b in pairs]}


def eos_ids(model) -> tuple[int, ...]:
    ids = set(model.config.eos_token_ids)
    tok = model.tokenizer
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    return tuple(sorted(ids))


def decode_text(model, tokens):
    if model.tokenizer is None:
        return None
    return [model.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]


def exec_config(model, attn_impl: str | None = None) -> ExecConfig:
    """The model's execution config, resolved, with the attention backend overridden by
    `attn_impl` when given (the XLA attention takes the XLA selection with it; Pallas keeps
    the configured selection, by default the kernels'). The layer loop follows
    the params' layout (set at load time by `layout_params`), so the two can never
    disagree."""
    xc = getattr(model, "exec_config", None) or ExecConfig()
    layers = "unrolled" if isinstance(model.params.layers, tuple) else "scan"
    if attn_impl:
        xc = dataclasses.replace(xc, attn=attn_impl,
                                 select="xla" if attn_impl == "xla" else xc.select)
    return dataclasses.replace(xc, layers=layers).resolve()


def start(model, prompts, max_new_tokens, sampling, extra_len, attn_impl, max_batch=None):
    """Checks shared by every decoding loop; returns (prompt token ids, an empty cache of
    the planned length for min(len(prompts), max_batch) slots, the execution config)."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError("sampling must be a SamplingParams")
    if max_batch is not None and (int(max_batch) != max_batch or max_batch < 1):
        raise ValueError(f"max_batch must be a whole number >= 1, got {max_batch}")
    ids = encode_prompts(model, prompts)
    lens = [len(p) for p in ids]
    slots = min(len(ids), max_batch or len(ids))
    max_len = plan_cache_len(model.config, lens, max_new_tokens, extra_len)
    xc = exec_config(model, attn_impl)
    # refills prefill into a group cache of up to refill_group(slots) rows beside the batch
    extra = refill_group(slots) if len(ids) > slots else 0
    check_memory(model, slots + extra, max_len, max(lens), xc.attn)
    cache = place_cache(init_cache(model.config, slots, max_len, param_dtype(model.params)),
                        xc.tp)
    return ids, cache, xc


class Launch(NamedTuple):
    """What `launch` sets up for a decoding loop."""

    ids: list  # prompt token ids
    cache: KVCache  # empty, for the first min(len(ids), max_batch) prompts
    xc: ExecConfig
    limits: np.ndarray  # new tokens allowed per prompt
    key: Any  # the loop's PRNG key
    k0: Any  # the prefills' key
    eos: tuple
    collector: TokenCollector


def launch(model, prompts, max_new_tokens, sampling, extra_len, attn_impl, max_batch, seed,
           on_tokens) -> Launch:
    """`start`, plus what every decoding loop makes next: the per-prompt limits, the keys,
    the EOS ids and the host's token collector."""
    ids, cache, xc = start(model, prompts, max_new_tokens, sampling, extra_len, attn_impl,
                           max_batch)
    limits = token_limits(max_new_tokens, len(ids))
    key, k0 = jax.random.split(jax.random.PRNGKey(seed))
    eos = eos_ids(model)
    collector = TokenCollector(cache.batch, limits, eos, on_tokens, n_prompts=len(ids))
    return Launch(ids, cache, xc, limits, key, k0, eos, collector)


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
        groups.setdefault(_round_up(len(p), PROMPT_BUCKET), []).append(i)
    lens = jnp.asarray([len(p) for p in ids], jnp.int32)
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


@struct.dataclass
class Progress:
    """Per-sequence stopping state kept on the device, so the host never has to answer
    "go on?" before the next call is dispatched."""

    n_gen: jax.Array  # [b] int32: tokens emitted so far
    limit: jax.Array  # [b] int32: max_new_tokens
    done: jax.Array  # [b] bool: hit EOS or the limit
    eos: tuple = struct.field(pytree_node=False, default=())

    @classmethod
    def start(cls, first, max_new_tokens, eos: tuple) -> "Progress":
        """After the prefill sampled `first` [b]; max_new_tokens: one limit or one a row."""
        b = first.shape[0]
        p = cls(n_gen=jnp.zeros((b,), jnp.int32),
                limit=jnp.asarray(token_limits(max_new_tokens, b), jnp.int32),
                done=jnp.zeros((b,), bool), eos=tuple(eos))
        _, p = p.emit(first[:, None])
        return p

    def emit(self, tokens):
        """tokens [b, T] (-1 = nothing) -> (the tokens kept, -1 elsewhere; new progress).
        A sequence keeps tokens up to its limit and up to and including its first EOS."""
        valid = (tokens >= 0) & ~self.done[:, None]
        is_eos = jnp.isin(tokens, jnp.asarray(self.eos or (-2,), jnp.int32)) & valid
        room = (self.limit - self.n_gen)[:, None]
        before = jnp.cumsum(is_eos, axis=1) - is_eos == 0  # no EOS earlier in the row
        keep = valid & before & (jnp.cumsum(valid, axis=1) <= room)
        n_gen = self.n_gen + keep.sum(axis=1, dtype=jnp.int32)
        done = self.done | (n_gen >= self.limit) | jnp.any(is_eos & keep, axis=1)
        return jnp.where(keep, tokens, -1), self.replace(n_gen=n_gen, done=done)


def refill_group(slots: int) -> int:
    """The most freed slots refilled by one prefill: a power of two, a quarter of the slots
    (a group's cache sits beside the batch's while it is prefilled), at least one."""
    cap = 1
    while cap * 2 <= max(1, slots // 4):
        cap *= 2
    return cap


@functools.partial(jax.jit, donate_argnums=0)
def put_slots(state, group, slots):
    """`state` with slots `slots` [k] replaced by rows 0..k-1 of the group state `group`
    (same pytree, g >= k rows; `group`'s own key is not used). Every batch leaf has
    exactly one axis where the two shapes differ (the batch: `Refill` keeps g != b); with
    no such axis (g = b = k = 1) the group's leaf is taken whole."""
    group = group.replace(key=state.key)
    k = slots.shape[0]

    def put(big, small):
        axes = [a for a, (m, n) in enumerate(zip(big.shape, small.shape)) if m != n]
        if not axes:  # no batch axis, or a batch of one slot refilled whole
            return small.astype(big.dtype)
        ax = axes[0]
        rows = lax.slice_in_dim(small, 0, k, axis=ax).astype(big.dtype)
        return big.at[(slice(None),) * ax + (slots,)].set(rows)

    return jax.tree.map(put, state, group)


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


class Refill:
    """Keeps the batch full: after each output is read, the finished slots get the next
    waiting prompts, prefilled together in groups of up to `refill_group(slots)` (a
    prefill of many prompts costs far less per token than many prefills of one).
    `make(prompts, rows)` prefills them as a group of `rows` sequences and returns (its
    decoding state, its first tokens [rows]); both stay on the device (no host wait)."""

    def __init__(self, waiting: Sequence[int], make: Callable, collector: TokenCollector):
        self.waiting = list(waiting)
        self.make = make
        self.collector = collector
        self.refills = 0
        self.prefills = 0

    def rows(self, k: int) -> int:
        """Rows of a group of k prompts: a power of two (few compiled shapes), never the
        batch size unless both are one (`put_slots` finds the batch axis by the sizes)."""
        b = len(self.collector.done)
        rows = pow2_at_least(k, lo=1)
        return rows + 1 if rows == b and b > 1 else rows

    def __call__(self, state):
        free = [int(s) for s in np.nonzero(self.collector.done)[0]][:len(self.waiting)]
        cap = refill_group(len(self.collector.done))
        for at in range(0, len(free), cap):
            slots = free[at:at + cap]
            prompts = [self.waiting.pop(0) for _ in slots]
            group, first = self.make(prompts, self.rows(len(slots)))
            state = put_slots(state, group, jnp.asarray(slots, jnp.int32))
            for i, (slot, prompt) in enumerate(zip(slots, prompts)):
                self.collector.assign(slot, prompt, first[i:i + 1])
            self.refills += len(slots)
            self.prefills += 1
        return state


def drive(step: Callable, state, collector: TokenCollector, clock: DecodeClock, on_out=None,
          refill: Refill | None = None):
    """Run `step(state) -> (state, out)` until the collector has every sequence done.

    One call stays in flight: call k + 1 is dispatched before call k's output is read, so
    the device never waits for the host's bookkeeping (JAX dispatches asynchronously). The
    device keeps its own stop state (`Progress`): finished sequences emit nothing, and the
    call in flight when everything ends runs on after this returns, its output unread
    (stop detection lags by one call). `out` starts with the emitted tokens [b, T] (-1 =
    none) and the device's done flags [b]; `on_out(out, ready_at, wait_s)` sees each
    output (host arrays), when it arrived and how long the host blocked for it.
    `refill` hands finished slots the waiting prompts: it rewrites the state the next call
    starts from (the call in flight still ran the finished sequence, which emits nothing)."""
    state, out = step(state)
    while True:
        t0 = time.perf_counter()
        state, nxt = step(state)  # queued behind `out`'s call
        t1 = time.perf_counter()
        out = jax.device_get(out)  # waits for the earlier call only
        t2 = time.perf_counter()
        active = collector.add([row[row >= 0] for row in out[0]])
        if on_out is not None:
            on_out(out, t2, t2 - t1)  # when it arrived, how long the host waited for it
        if refill is not None:
            state = refill(state)
            active = ~collector.done
        clock.tick(dispatch_s=t1 - t0, wait_s=t2 - t1, host_s=time.perf_counter() - t2,
                   arrived=t2, active=int(active.sum()))
        if not active.any() or (refill is None and out[1].all()):
            return state
        out = nxt

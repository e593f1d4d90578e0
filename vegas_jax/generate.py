"""Vanilla autoregressive decoding (the baseline every method is measured against)."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from vegas_jax.attention import AttnPlan
from vegas_jax.cache import KVCache
from vegas_jax.config import ModelConfig
from vegas_jax.execution import ExecConfig, model_jit
from vegas_jax.model import forward
from vegas_jax.driver import (DecodeClock, GenerationResult, Progress, Refill, drive, launch,
                              run_stats)
from vegas_jax.prefill import prefill_group, prefill_prompts
from vegas_jax.prompts import decode_text, rows_of
from vegas_jax.sampling import SamplingParams, sample


@struct.dataclass
class DecodeState:
    cache: KVCache  # lengths = tokens in the cache
    tok: jax.Array  # [b] last sampled token, not yet in the cache
    key: jax.Array
    progress: Progress


def decode_steps_body(params, cfg: ModelConfig, xc: ExecConfig, state: DecodeState,
                      sp: SamplingParams, n_steps: int):
    """`n_steps` single-token steps in one scan: no host round trip per token.

    Returns (state, tokens [b, n_steps] with -1 where a sequence had stopped, done [b]).
    Finished sequences stay where they are: their length does not advance. `done` is its
    own buffer (the state's is donated to the next call while the host still reads this).
    """

    def step(st: DecodeState, rng):
        active = ~st.progress.done
        pos = st.cache.lengths
        logits, cache, _ = forward(params, cfg, xc, st.tok[:, None], pos[:, None], st.cache,
                                   AttnPlan(active=active))
        nxt, _ = sample(rng, logits[:, 0], sp)
        nxt = jnp.where(active, nxt, st.tok)
        out, progress = st.progress.emit(jnp.where(active, nxt, -1)[:, None])
        cache = cache.replace(lengths=pos + active.astype(jnp.int32))
        return st.replace(cache=cache, tok=nxt, progress=progress), out[:, 0]

    key, rng = jax.random.split(state.key)
    state, toks = lax.scan(step, state.replace(key=key), jax.random.split(rng, n_steps))
    return state, toks.T, jnp.copy(state.progress.done)


# jitted on its own; inside another jitted function, the body (a nested `model_jit` would
# carry compiler options, which only a top-level jit may)
decode_steps = model_jit(decode_steps_body, static_argnames=("cfg", "xc", "sp", "n_steps"),
                         donate_argnames=("state",))


def generate(
    model,
    prompts,
    max_new_tokens: int | Sequence[int] = 128,
    sampling: SamplingParams = SamplingParams(),
    seed: int = 0,
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    max_batch: int | None = None,
    exec_config: ExecConfig | None = None,
    steps_per_call: int = 8,
) -> GenerationResult:
    """Vanilla decoding of prompts of different lengths (each a conversation of {"role",
    "content"} messages, a raw string or token ids: `vegas_jax.prompts.encode_prompts`).

    `on_tokens` receives, after each device call, the new tokens of every prompt.
    `max_batch`: at most this many sequences at once; each finished one's slot is refilled
    with the next prompt (results stay in prompt order). `max_new_tokens`: one limit, or
    one per prompt. `exec_config`: how to run (default: the model's).
    """
    if steps_per_call < 1:
        raise ValueError("steps_per_call must be >= 1")
    cfg = model.config
    ids, cache, xc, limits, key, k0, eos, collector = launch(
        model, prompts, max_new_tokens, sampling, steps_per_call, exec_config, max_batch, seed,
        on_tokens)
    slots = cache.batch

    t0 = time.perf_counter()
    logits, cache, _ = prefill_prompts(model.params, cfg, xc, ids[:slots], cache, None)
    tok, _ = sample(k0, logits, sampling)
    state = DecodeState(cache, tok, key, Progress.start(tok, limits[:slots], eos))
    collector.add([[t] for t in jax.device_get(tok)])
    prefill_s = time.perf_counter() - t0

    def prefill_some(prompts, rows):  # waiting prompts, prefilled together for free slots
        grp, first, _ = prefill_group(model, xc, [ids[p] for p in prompts], rows,
                                      cache.max_len, None, jax.random.fold_in(k0, prompts[0]),
                                      sampling)
        return (DecodeState(grp, first, key,
                            Progress.start(first, rows_of(limits, prompts, rows), eos)), first)

    refill = Refill(range(slots, len(ids)), prefill_some, collector) if len(ids) > slots else None
    clock = DecodeClock(collector)
    if not collector.done.all() or refill is not None:
        drive(lambda st: (lambda s, toks, done: (s, (toks, done)))(
            *decode_steps(model.params, cfg, xc, st, sampling, steps_per_call)),
            state, collector, clock, refill=refill)
    stats = {"method": "vanilla", **run_stats(ids, slots, refill, prefill_s, clock),
             "backend": xc.backend}
    return GenerationResult(collector.tokens, decode_text(model, collector.tokens), stats)

"""Vanilla autoregressive decoding (the baseline every method is measured against)."""

from __future__ import annotations

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
from vegas_jax.driver import GenerationResult, Progress, launch, run_loop
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


class PlainRunner:
    """`run_loop`'s runner for plain decoding: `steps_per_call` steps a device call."""

    name = "vanilla"
    capture = None

    def __init__(self, model, xc: ExecConfig, sampling: SamplingParams, key, steps_per_call: int):
        self.model, self.xc, self.sampling, self.key = model, xc, sampling, key
        self.steps_per_call = steps_per_call

    def compile_init(self, cache, first, scores, progress):
        pass  # nothing to compile: the state is its parts

    def init(self, cache, first, scores, progress) -> DecodeState:
        return DecodeState(cache, first, self.key, progress)

    def step(self, state: DecodeState):
        state, toks, done = decode_steps(self.model.params, self.model.config, self.xc, state,
                                         self.sampling, self.steps_per_call)
        return state, (toks, done)

    def count(self, out, ready_at, wait_s, collector, waiting):
        pass

    def stats(self) -> dict:
        return {}


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
    lc = launch(model, prompts, max_new_tokens, sampling, steps_per_call, exec_config,
                max_batch, seed, on_tokens)
    return run_loop(model, lc, sampling,
                    PlainRunner(model, lc.xc, sampling, lc.key, steps_per_call))

"""Self-speculative decoding: sparse drafts, one full verify, selection from the verify's
own attention, lossless acceptance. One jitted round; the Python loop only streams."""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from vegas_jax import selection as sel
from vegas_jax.attention import AttnSpec
from vegas_jax.cache import KVCache
from vegas_jax.config import ModelConfig
from vegas_jax.generate import (
    DecodeClock, GenerationResult, TokenCollector, decode_text, eos_ids, generate, prefill_prompts, start,
)
from vegas_jax.model import forward, model_jit
from vegas_jax.sampling import SamplingParams, accept, draft_sample, sample
from vegas_jax.selection import SpecConfig


@struct.dataclass
class SpecState:
    cache: KVCache  # lengths = committed tokens n
    x0: jax.Array  # [b] last emitted token; sits at position n, not yet in the cache
    key: jax.Array
    sel_idx: jax.Array | None = None  # [L, b, K] verify-guided selection
    sel_count: jax.Array | None = None  # [L, b]
    sel_end: jax.Array | None = None  # [b] first position after the ranked range
    page_min: jax.Array | None = None  # [L, b, k, P, d] quest
    page_max: jax.Array | None = None


def tail_len(spec: SpecConfig, max_len: int) -> int:
    """Static length of the contiguous tail every draft step reads."""
    if spec.method == "stream":
        return sel.max_budget(spec, max_len)
    if spec.method == "quest":
        # from the last complete page's end (< page_size behind n) to the last draft, n + gamma - 1
        return spec.page_size + spec.gamma
    # after a verify the ranked range ends at n; the tail then holds up to gamma accepted
    # tokens + the bonus + gamma - 1 drafts
    return 2 * spec.gamma + 1


def _draft_spec(spec: SpecConfig, state: SpecState, pos, impl, cfg, max_len):
    L = cfg.num_layers
    if spec.method in sel.VERIFY_GUIDED:
        return AttnSpec(mode="sparse", impl=impl, tail_len=tail_len(spec, max_len),
                        idx=state.sel_idx, count=state.sel_count, tail_start=state.sel_end)
    if spec.method == "stream":
        sink_count, start = sel.stream_window(spec, pos, max_len)
        b = pos.shape[0]
        n_sink = max(spec.sink, 1)
        idx = jnp.broadcast_to(jnp.arange(n_sink, dtype=jnp.int32), (L, b, n_sink))
        count = jnp.broadcast_to(sink_count, (L, b))
        return AttnSpec(mode="sparse", impl=impl, tail_len=tail_len(spec, max_len),
                        idx=idx, count=count, tail_start=start)
    if spec.method == "quest":
        n = state.cache.lengths
        k = sel.budget(spec, pos, max_len)
        ready = (n // spec.page_size) * spec.page_size
        max_pages = -(-sel.max_budget(spec, max_len) // spec.page_size)
        return AttnSpec(mode="quest", impl=impl, tail_len=tail_len(spec, max_len),
                        page_size=spec.page_size, max_pages=max_pages, tail_start=ready,
                        page_min=state.page_min, page_max=state.page_max,
                        page_budget=-(-k // spec.page_size))
    raise ValueError(f"no draft for method {spec.method!r}")


def draft_phase(params, cfg: ModelConfig, state: SpecState, key, spec: SpecConfig,
                sp: SamplingParams, impl: str):
    """gamma sparse single-token steps (a scan). Each writes its K/V at its true position
    (the verify rewrites them). Returns (cache, drafts [b, gamma], q): q is None (greedy),
    [b, gamma, v], or with top-k its sparse form ([b, gamma, k] indices, probabilities)."""
    n = state.cache.lengths
    max_len = state.cache.max_len

    def step(carry, xs):
        cache, tok = carry
        j, k = xs
        pos = n + j
        aspec = _draft_spec(spec, state, pos, impl, cfg, max_len)
        logits, cache, _ = forward(params, cfg, tok[:, None], pos[:, None], cache, aspec)
        nxt, q = draft_sample(k, logits[:, 0], sp)
        return (cache, nxt), (nxt, q)

    (cache, _), (drafts, q) = lax.scan(
        step, (state.cache, state.x0),
        (jnp.arange(spec.gamma, dtype=jnp.int32), jax.random.split(key, spec.gamma)),
    )
    return cache, drafts.T, jax.tree.map(lambda a: a.swapaxes(0, 1), q)


def verify_phase(params, cfg: ModelConfig, cache: KVCache, x0, drafts, spec: SpecConfig,
                 impl: str, capture: bool = True):
    """Full causal attention over x0, d_1..d_gamma at positions n..n+gamma: rewrites their
    K/V and, in the same attention call, captures the next selection's scores.
    Returns (logits [b, gamma + 1, v], cache, scores)."""
    mode, rows = sel.capture_plan(spec) if capture else ("none", (0,))
    n = cache.lengths
    vtok = jnp.concatenate([x0[:, None], drafts], axis=1)
    vpos = n[:, None] + jnp.arange(spec.gamma + 1, dtype=jnp.int32)
    vspec = AttnSpec(impl=impl, capture=mode, capture_rows=rows, score=spec.score)
    return forward(params, cfg, vtok, vpos, cache, vspec)


def select_phase(state: SpecState, scores, n, n_acc, spec: SpecConfig) -> SpecState:
    """The next draft's inputs: top-k of the verify scores over the ranked range 0..n, or
    Quest's page bounds for the pages this round completed."""
    max_len = state.cache.max_len
    if spec.method in sel.VERIFY_GUIDED:
        if spec.method == "last":
            scores = sel.pick_rows(scores, n_acc)
        idx, count = sel.select_topk(scores, n, spec, max_len)
        return state.replace(sel_idx=idx, sel_count=count, sel_end=n + 1)
    if spec.method == "quest":
        width = -(-(spec.gamma + 2) // spec.page_size) + 1
        lo, hi = sel.update_page_bounds(state.page_min, state.page_max, state.cache.k,
                                        n // spec.page_size, width, spec.page_size)
        return state.replace(page_min=lo, page_max=hi)
    return state


@model_jit(static_argnames=("cfg", "spec", "sp", "impl"), donate_argnames=("state",))
def spec_round(params, cfg: ModelConfig, state: SpecState, active, spec: SpecConfig,
               sp: SamplingParams, impl: str):
    """One round: gamma sparse drafts, one verify, acceptance, the next selection.

    Returns (state, emitted [b, gamma + 1] with -1 after the last emitted token,
    n_accepted [b]). Inactive sequences keep their length and last token.
    """
    gamma = spec.gamma
    n = state.cache.lengths  # [b]
    key, k_draft, k_acc = jax.random.split(state.key, 3)
    cache, drafts, q = draft_phase(params, cfg, state, k_draft, spec, sp, impl)
    logits, cache, scores = verify_phase(params, cfg, cache, state.x0, drafts, spec, impl)
    n_acc, nxt = accept(k_acc, drafts, q, logits, sp)

    slot = jnp.arange(gamma + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    emitted = jnp.where(slot < n_acc[:, None], padded,
                        jnp.where(slot == n_acc[:, None], nxt[:, None], -1))
    new = state.replace(cache=cache, key=key)
    new = select_phase(new, scores, n, n_acc, spec)
    new = new.replace(cache=cache.replace(lengths=jnp.where(active, n + n_acc + 1, n)),
                      x0=jnp.where(active, nxt, state.x0))
    return new, emitted, n_acc


def init_state(spec: SpecConfig, cache: KVCache, x0, key, scores, lens) -> SpecState:
    state = SpecState(cache=cache, x0=x0, key=key)
    max_len = cache.max_len
    if spec.method in sel.VERIFY_GUIDED:
        # First selection: the last prompt token's row ranks the whole prompt.
        idx, count = sel.select_topk(scores, lens - 1, spec, max_len)
        state = state.replace(sel_idx=idx, sel_count=count, sel_end=lens)
    elif spec.method == "quest":
        lo, hi = sel.page_bounds(cache.k, spec.page_size)
        state = state.replace(page_min=lo, page_max=hi)
    return state


def speculative_generate(
    model,
    prompts,
    max_new_tokens: int = 128,
    spec: SpecConfig = SpecConfig(),
    sampling: SamplingParams = SamplingParams(),
    seed: int = 0,
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    attn_impl: str | None = None,
) -> GenerationResult:
    """Self-speculative decoding of a batch; output has the vanilla distribution
    (greedy: the same tokens). `spec.method="vanilla"` runs plain decoding."""
    if not isinstance(spec, SpecConfig):
        raise TypeError("spec must be a SpecConfig")
    if spec.method == "vanilla":
        res = generate(model, prompts, max_new_tokens, sampling, seed, on_tokens, attn_impl)
        steps = max(len(t) for t in res.tokens) - 1  # one token per step after the prefill's
        res.stats.update(tau=1.0, gamma=0, acceptance_by_position=[], rounds=steps)
        return res
    cfg = model.config
    gamma = spec.gamma
    # Room past the last kept token: a round writes gamma + 1 entries after n, and the last
    # round may overshoot max_new_tokens by gamma; Quest's page refresh reads a page beyond.
    extra = 2 * gamma + 2 + (spec.page_size if spec.method == "quest" else 0)
    ids, cache, impl = start(model, prompts, max_new_tokens, sampling, extra, attn_impl)
    batch = len(ids)
    key = jax.random.PRNGKey(seed)
    key, k0 = jax.random.split(key)
    collector = TokenCollector(batch, max_new_tokens, eos_ids(model), on_tokens)
    capture = spec.method in sel.VERIFY_GUIDED

    t0 = time.perf_counter()
    logits, cache, scores = prefill_prompts(model.params, cfg, ids, cache, impl, capture)
    x0, _ = sample(k0, logits, sampling)
    state = init_state(spec, cache, x0, key, scores, cache.lengths + 0)  # own buffer: state is donated
    active = collector.add([[t] for t in np.asarray(x0)])
    prefill_s = time.perf_counter() - t0

    accepted_at = np.zeros(gamma, np.int64)  # rounds in which draft position i was accepted
    rounds_active = 0
    emitted_total = 0
    clock = DecodeClock(collector)
    while active.any():
        was_active = active.copy()
        state, emitted, n_acc = spec_round(model.params, cfg, state, jnp.asarray(active), spec,
                                           sampling, impl)
        emitted = np.asarray(emitted)
        n_acc = np.asarray(n_acc)
        active = collector.add([row[row >= 0] for row in emitted])
        clock.tick()
        rounds_active += int(was_active.sum())
        emitted_total += int((n_acc[was_active] + 1).sum())
        accepted_at += (n_acc[was_active][:, None] > np.arange(gamma)[None, :]).sum(0)
    stats = {
        "method": spec.method,
        "gamma": gamma,
        "sparsity": spec.sparsity,
        "batch": batch,
        "prompt_tokens": [len(p) for p in ids],
        "prefill_s": prefill_s,
        **clock.stats(),
        "rounds": clock.calls,
        "tau": emitted_total / max(rounds_active, 1),
        "acceptance_by_position": (accepted_at / max(rounds_active, 1)).tolist(),
        "attn_impl": impl,
        "cache_len": cache.max_len,
    }
    return GenerationResult(collector.tokens, decode_text(model, collector.tokens), stats)

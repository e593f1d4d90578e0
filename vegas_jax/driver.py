"""The decoding driver: the on-device stop rule, the host's token collector and clock,
refilled slots, and the pipelined loop that keeps one device call in flight."""

from __future__ import annotations

import dataclasses
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from pallas_kernels.common import pow2_at_least
from vegas_jax.cache import KVCache, init_cache
from vegas_jax.execution import ExecConfig
from vegas_jax.params import param_dtype
from vegas_jax.prompts import (
    check_memory, decode_text, encode_prompts, eos_ids, plan_cache_len, rows_of, token_limits,
)
from vegas_jax.sampling import SamplingParams, sample
from vegas_jax.sharding import place_cache

@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per prompt (EOS included when it ended the text)
    text: list[str] | None  # decoded new tokens, when the model has a tokenizer
    stats: dict[str, Any]


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
        """After the prefill sampled `first` [b]; max_new_tokens: one limit or one a row.
        One jitted program (op by op, each of emit's ops compiled on its own before the
        first token)."""
        limit = np.asarray(token_limits(max_new_tokens, first.shape[0]), np.int32)
        return _start_progress(first, limit, tuple(eos))

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


@functools.partial(jax.jit, static_argnums=2)
def _start_progress(first, limit, eos: tuple) -> Progress:
    b = first.shape[0]
    p = Progress(n_gen=jnp.zeros((b,), jnp.int32), limit=limit, done=jnp.zeros((b,), bool),
                 eos=eos)
    _, p = p.emit(first[:, None])
    return p


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
    bookkeeping; a call whose output was ready before the host asked (wait under READY_S)
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


def run_stats(ids, batch: int, refill: Refill | None, prefill_s: float,
              clock: DecodeClock) -> dict:
    """What every generation reports about its run: slots, prompts, refills, prefill time
    and the clock's timings."""
    return {
        "batch": batch,
        "prompts": len(ids),
        "refills": refill.refills if refill else 0,
        "refill_prefills": refill.prefills if refill else 0,  # calls: refills go in groups
        "prompt_tokens": [len(p) for p in ids],
        "prefill_s": prefill_s,
        **clock.stats(),
    }


def exec_config(model, override: ExecConfig | None = None) -> ExecConfig:
    """The model's execution config (or `override`), resolved. The layer loop is the
    params' layout (set at load time by `layout_params`): an override naming the other
    one is refused."""
    if override is not None and not isinstance(override, ExecConfig):
        raise TypeError("exec_config must be an ExecConfig")
    layers = "unrolled" if isinstance(model.params.layers, tuple) else "scan"
    if override is not None and override.layers not in ("auto", layers):
        raise ValueError(f"exec_config layers={override.layers!r} differs from the params' "
                         f"layout ({layers!r}, set at load time): load the model with "
                         f"exec_config=ExecConfig(layers={override.layers!r}) instead")
    xc = override or getattr(model, "exec_config", None) or ExecConfig()
    return dataclasses.replace(xc, layers=layers).resolve()


def start(model, prompts, max_new_tokens, sampling, extra_len, exec_cfg=None, max_batch=None):
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
    xc = exec_config(model, exec_cfg)
    if xc.exact and model.config.is_moe:
        raise ValueError("exact=True covers dense models: the expert matmuls of "
                         f"{model.config.name} are not row-invariant yet")
    # refills prefill into a group cache of up to refill_group(slots) rows beside the batch
    extra = refill_group(slots) if len(ids) > slots else 0
    check_memory(model, slots + extra, max_len, max(lens), xc.backend)
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


def _split(seed) -> tuple:
    return tuple(jax.random.split(jax.random.PRNGKey(seed)))


_split_jit = jax.jit(_split)


def _keys(seed) -> tuple:
    """The loop's and the prefills' PRNG keys: one program where the seed fits int32 (op
    by op, three are compiled before the first token)."""
    return _split_jit(seed) if -2**31 <= seed < 2**31 else _split(seed)


def launch(model, prompts, max_new_tokens, sampling, extra_len, exec_cfg, max_batch, seed,
           on_tokens) -> Launch:
    """`start`, plus what every decoding loop makes next: the per-prompt limits, the keys,
    the EOS ids and the host's token collector."""
    ids, cache, xc = start(model, prompts, max_new_tokens, sampling, extra_len, exec_cfg,
                           max_batch)
    limits = token_limits(max_new_tokens, len(ids))
    key, k0 = _keys(seed)
    eos = eos_ids(model)
    collector = TokenCollector(cache.batch, limits, eos, on_tokens, n_prompts=len(ids))
    return Launch(ids, cache, xc, limits, key, k0, eos, collector)


class Runner(Protocol):
    """What `run_loop` decodes with: plain steps (`generate`) or speculative rounds."""

    name: str  # the method, for the stats
    capture: Any  # what the prefills capture for the first selection (None: nothing)

    def compile_init(self, cache, first, scores, progress) -> None:
        """Compile `init` for these arguments (on a thread while the first token streams)."""

    def init(self, cache, first, scores, progress):
        """The decoding state of a prefilled group: its cache, first tokens [rows],
        captured scores and stop state."""

    def step(self, state) -> tuple:
        """One device call: (state, outputs), outputs starting with `drive`'s two."""

    def count(self, out, ready_at: float, wait_s: float, collector: TokenCollector,
              waiting: bool) -> None:
        """Sees each call's outputs as `drive` reads them; `waiting`: prompts wait for slots."""

    def stats(self) -> dict:
        """The runner's own statistics, added to the run's."""


def run_loop(model, lc: Launch, sampling: SamplingParams, runner: Runner) -> GenerationResult:
    """Decode `lc`'s prompts with `runner`: prefill the first slots, stream their first
    tokens while the first state compiles, then `drive` with finished slots refilled."""
    from vegas_jax.prefill import prefill_group, prefill_prompts

    batch, collector = lc.cache.batch, lc.collector
    t0 = time.perf_counter()
    logits, cache, scores = prefill_prompts(model.params, model.config, lc.xc, lc.ids[:batch],
                                            lc.cache, runner.capture)
    first, _ = sample(lc.k0, logits, sampling)
    args = (cache, first, scores, Progress.start(first, lc.limits[:batch], lc.eos))
    # the first state compiles on a thread while the prefill runs and its token is read
    # and streamed (that compile would otherwise hold the first token)
    with ThreadPoolExecutor(1) as pool:
        built = pool.submit(runner.compile_init, *args)
        collector.add([[t] for t in jax.device_get(first)])
        built.result()
    state = runner.init(*args)
    prefill_s = time.perf_counter() - t0

    def prefill_some(prompts, rows):  # waiting prompts, prefilled together for free slots
        grp, first, sc = prefill_group(model, lc.xc, [lc.ids[p] for p in prompts], rows,
                                       lc.cache.max_len, runner.capture,
                                       jax.random.fold_in(lc.k0, prompts[0]), sampling)
        progress = Progress.start(first, rows_of(lc.limits, prompts, rows), lc.eos)
        return runner.init(grp, first, sc, progress), first

    refill = (Refill(range(batch, len(lc.ids)), prefill_some, collector)
              if len(lc.ids) > batch else None)

    def count(out, ready_at, wait_s):
        runner.count(out, ready_at, wait_s, collector, refill is not None and bool(refill.waiting))

    clock = DecodeClock(collector)
    if not collector.done.all() or refill is not None:
        drive(runner.step, state, collector, clock, on_out=count, refill=refill)
    stats = {"method": runner.name, **runner.stats(),
             **run_stats(lc.ids, batch, refill, prefill_s, clock), "backend": lc.xc.backend,
             "cache_len": lc.cache.max_len}
    return GenerationResult(collector.tokens, decode_text(model, collector.tokens), stats)

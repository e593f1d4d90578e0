"""Self-speculative decoding: sparse drafts, one full verify, selection from the verify's
own attention, lossless acceptance. One jitted round (paper §3: draft, verify, accept,
select); which KV entries a draft reads is the method's business (`selection`)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from vegas_jax.attention import AttnPlan, Capture, raw_capture
from vegas_jax.cache import KVCache
from vegas_jax.config import ModelConfig
from vegas_jax.execution import ExecConfig, model_jit
from vegas_jax.generate import DecodeState, decode_steps_body, generate
from vegas_jax.model import forward
from vegas_jax.runtime import (
    DecodeClock, GenerationResult, Progress, Refill, decode_text, drive,
    launch, prefill_group, prefill_prompts, rows_of,
)
from vegas_jax.sampling import SamplingParams, accept, sample
from vegas_jax.selection import SCORES, Auto, Method, method_named


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Self-speculative decoding settings.

    method: a name from `selection.METHODS` ("vegas", "vegas-paper", "vegas-all", "last",
    "stream", "quest", "auto", "vanilla", ...) or a strategy object (e.g. `Stream(sink=4)`);
    names become
    objects here, once. With "auto", gamma is where it starts. gamma: draft tokens per round. sparsity: fraction of the context each draft
    step reads, in (0, 1]. min_tokens: floor of that budget. score: "weight" (softmax
    weights, the authors' default) or "logit" (raw logits). exact: the verify runs as
    gamma + 1 one-token forwards, each the very computation of a plain decode step (same
    shapes, kernels and reduction order), so greedy output equals plain decoding's at the
    same batch size bit for bit in any dtype (bf16 included), at the cost of reading the
    weights and the KV cache once a verify row instead of once a verify.
    """

    method: Method | str = "vegas"
    gamma: int = 6
    sparsity: float = 0.07
    min_tokens: int = 256
    score: str = "weight"
    exact: bool = False

    def __post_init__(self):
        object.__setattr__(self, "method", method_named(self.method))
        if int(self.gamma) != self.gamma or self.gamma < 1:
            raise ValueError(f"gamma must be a whole number >= 1, got {self.gamma}")
        if not 0 < self.sparsity <= 1:
            raise ValueError(f"sparsity must be in (0, 1], got {self.sparsity}")
        if int(self.min_tokens) != self.min_tokens or self.min_tokens < 1:
            raise ValueError(f"min_tokens must be a whole number >= 1, got {self.min_tokens}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        self.method.check(self)

    @property
    def name(self) -> str:
        return self.method.name


jax.tree_util.register_static(SpecConfig)


@struct.dataclass
class SpecState:
    cache: KVCache  # lengths = committed tokens n
    x0: jax.Array  # [b] last emitted token; sits at position n, not yet in the cache
    key: jax.Array
    sel: Any  # the method's selection state (`Method.init` / `update`)
    progress: Progress


def draft_phase(params, cfg: ModelConfig, xc: ExecConfig, state: SpecState, key,
                spec: SpecConfig, sp: SamplingParams):
    """gamma sparse single-token steps (a scan). Each writes its K/V at its true position
    (the verify rewrites them). Returns (cache, drafts [b, gamma], q): q is None (greedy),
    [b, gamma, v], or with top-k its sparse form ([b, gamma, k] indices, probabilities)."""
    n = state.cache.lengths
    active = ~state.progress.done

    def step(carry, xs):
        cache, tok = carry
        j, rng = xs
        pos = n + j
        plan = spec.method.draft_plan(spec, state.sel, state.cache, pos).replace(active=active)
        logits, cache, _ = forward(params, cfg, xc, tok[:, None], pos[:, None], cache, plan)
        nxt, q = sample(rng, logits[:, 0], sp)
        return (cache, nxt), (nxt, q)

    (cache, _), (drafts, q) = lax.scan(
        step, (state.cache, state.x0),
        (jnp.arange(spec.gamma, dtype=jnp.int32), jax.random.split(key, spec.gamma)),
    )
    return cache, drafts.T, jax.tree.map(lambda a: a.swapaxes(0, 1), q)


def verify_phase(params, cfg: ModelConfig, xc: ExecConfig, cache: KVCache, x0, drafts,
                 capture: Capture | None, active=None, exact: bool = False):
    """Full causal attention over x0, d_1..d_gamma at positions n..n+gamma: rewrites their
    K/V and, in the same attention call, captures the next selection's scores. active [b]
    (or None): finished sequences, False, read no cache. exact: row by row (`_verify_rows`).
    Returns (logits [b, gamma + 1, v], cache, scores | None)."""
    n = cache.lengths
    vtok = jnp.concatenate([x0[:, None], drafts], axis=1)
    vpos = n[:, None] + jnp.arange(drafts.shape[1] + 1, dtype=jnp.int32)
    if exact:
        return _verify_rows(params, cfg, xc, cache, vtok, vpos, capture, active)
    return forward(params, cfg, xc, vtok, vpos, cache, AttnPlan(capture=capture, active=active))


def _verify_rows(params, cfg, xc, cache, vtok, vpos, capture, active):
    """The verify as one-token forwards in a scan, each shaped as `decode_steps`' step: a
    batched verify computes its 7 rows with other matmul tiles and attention splits than a
    one-row step, and in bf16 that moves logits enough to flip near-ties. Each row
    captures its own scores; the capture's rows are then combined as `capture` says."""
    one = None if capture is None else Capture(
        (0,), "heads" if capture.reduce == "heads" else "mean", capture.score)

    def step(cache, xs):
        tok, pos = xs  # [b], [b]
        logits, cache, sc = forward(params, cfg, xc, tok[:, None], pos[:, None], cache,
                                    AttnPlan(capture=one, active=active))
        return cache, (logits[:, 0], sc)

    cache, (logits, scores) = lax.scan(step, cache, (vtok.T, vpos.T))
    logits = logits.swapaxes(0, 1)  # [b, gamma + 1, v]
    if capture is None:
        return logits, cache, None
    rows = scores[jnp.asarray(capture.rows)]  # [r, L, b, (k,) s]
    return logits, cache, jnp.moveaxis(rows, 0, 2) if capture.reduce == "rows" else rows.mean(0)


@model_jit(static_argnames=("cfg", "xc", "spec", "sp"), donate_argnames=("state",))
def spec_round(params, cfg: ModelConfig, xc: ExecConfig, state: SpecState, spec: SpecConfig,
               sp: SamplingParams):
    """One round: gamma sparse drafts, one verify, acceptance, the next selection.

    Returns (state, emitted [b, gamma + 1] with -1 after the last kept token, done [b],
    n_accepted [b], active [b] at the round's start). Finished sequences keep their length
    and token. (No `lax.cond` skips a round where everything has finished: a conditional
    over the donated state makes XLA copy the whole cache every round: BENCHMARKS.md.)
    """

    gamma = spec.gamma
    n = state.cache.lengths  # [b]
    active = ~state.progress.done
    key, k_draft, k_acc = jax.random.split(state.key, 3)
    cache, drafts, q = draft_phase(params, cfg, xc, state, k_draft, spec, sp)
    logits, cache, scores = verify_phase(params, cfg, xc, cache, state.x0, drafts,
                                         round_capture(spec, cfg, xc, cache.max_len), active,
                                         spec.exact)
    n_acc, nxt = accept(k_acc, drafts, q, logits, sp)
    slot = jnp.arange(gamma + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    emitted = jnp.where(slot < n_acc[:, None], padded,
                        jnp.where(slot == n_acc[:, None], nxt[:, None], -1))
    emitted, progress = state.progress.emit(jnp.where(active[:, None], emitted, -1))
    sel = spec.method.update(spec, state.sel, scores, cache, n, n_acc, xc)
    new = SpecState(cache=cache.replace(lengths=jnp.where(active, n + n_acc + 1, n)),
                    x0=jnp.where(active, nxt, state.x0), key=key, sel=sel, progress=progress)
    return new, emitted, jnp.copy(progress.done), n_acc, active


@model_jit(static_argnames=("cfg", "xc", "spec", "sp", "n_steps"), donate_argnames=("state",))
def plain_steps(params, cfg: ModelConfig, xc: ExecConfig, state: SpecState, spec: SpecConfig,
                sp: SamplingParams, n_steps: int):
    """`n_steps` plain decoding steps from a speculative state (auto's plain calls), and the
    selection state the next round drafts from (`Method.after_plain`; rounds of any gamma
    >= spec.gamma follow). Returns (state, emitted [b, n_steps], done [b], None, None): a
    round's outputs, with no acceptance."""
    ds, toks, done = decode_steps_body(params, cfg, xc, DecodeState(
        state.cache, state.x0, state.key, state.progress), sp, n_steps)
    sel = spec.method.after_plain(spec, state.sel, ds.cache.lengths)
    return SpecState(ds.cache, ds.tok, ds.key, sel, ds.progress), toks, done, None, None


@functools.partial(jax.jit, static_argnames=("spec", "xc"), donate_argnames=("cache",))
def init_state(spec: SpecConfig, xc: ExecConfig, cache: KVCache, x0, key, scores, lens,
               progress: Progress) -> SpecState:
    """The first state after a prefill. Jitted: run op by op, the selection's top-k took
    ~75 ms a call (CPU), paid again for every refilled slot."""
    sel = spec.method.init(spec, cache, scores, lens, xc)
    return SpecState(cache=cache, x0=x0, key=key, sel=sel, progress=progress)


@functools.partial(jax.jit, donate_argnums=0)
def _all_finished(state: SpecState, flag) -> SpecState:
    """The state, in its own buffers, with every sequence marked finished."""
    done = state.progress.done
    return state.replace(progress=state.progress.replace(
        done=jnp.where(flag, jnp.ones_like(done), done)))


def _without_kv(state: SpecState) -> SpecState:
    """Everything in the state but the cache's K/V."""
    return state.replace(cache=state.cache.replace(k=None, v=None))


def _small_leaves(state: SpecState) -> SpecState:
    """A copy of everything in the state but the cache's K/V."""
    return jax.tree.map(jnp.copy, _without_kv(state))


@functools.partial(jax.jit, donate_argnums=0)
def _restored(state: SpecState, saved: SpecState, flag) -> SpecState:
    """`saved`'s small leaves with `state`'s K/V, in `state`'s buffers (donated: each
    output leaf takes the buffer of the input leaf in its place). The small leaves are
    computed (`where` on a traced flag): a leaf passed through from `saved` would get a
    buffer of its own, not the donated one."""
    small = jax.tree.map(lambda old, new: jnp.where(flag, new, old), _without_kv(state), saved)
    return small.replace(cache=small.cache.replace(k=state.cache.k, v=state.cache.v))


def round_capture(spec: SpecConfig, cfg: ModelConfig, xc: ExecConfig,
                  max_len: int) -> Capture | None:
    """What a round's verify captures: the method's capture, handed over raw (the logits
    for the selection's own kernel) where the method and the kernels allow it."""
    cap = spec.method.capture(spec)
    if spec.exact or not spec.method.takes_raw(spec):
        return cap
    return raw_capture(cap, cfg, xc, max_len)


def prefill_capture(spec: SpecConfig) -> Capture | None:
    """The prefill's capture, when the method ranks anything: the rows of the prompt's
    last `method.prefill_rows` tokens, averaged (`runtime.prefill` runs their queries)."""
    cap = spec.method.capture(spec)
    if cap is None:
        return None
    return Capture(tuple(range(spec.method.prefill_rows)),
                   "heads" if cap.reduce == "heads" else "mean", cap.score)


class AutoController:
    """Chooses each device call of `method="auto"`: a round at one of the candidate gammas,
    or VANILLA_STEPS plain decoding steps.

    Cost model, updated online: the device time of a call of each configuration (the
    interval between reading consecutive outputs, which the one call in flight makes the
    device's time), a line t(gamma) =
    a + b * gamma through the round times seen (proportional to gamma + 1 while one gamma
    is seen), and tau(gamma) = 1 + sum_i prod_{j <= i} a_j from the conditional acceptance
    a_j of draft position j seen so far (positions not yet drafted take the last one seen).
    Each call goes to the configuration with the most tokens per second (tau / t for
    rounds, VANILLA_STEPS / t for plain steps); while no prompt waits for a slot, tau is
    the batch's finish as its slowest sequence sees it (`finish_tau`: tokens left over
    each sequence's own tau), since a batch of fixed-length outputs ends with its last
    sequence, not its mean one. The round times are those at the number of sequences the
    next call decodes: where the calls timed so far ran at different counts (a batch of
    fixed-length outputs thins out at its end), the line takes a term in that count,
    t = a + b * gamma + c * active, fitted to the calls themselves (`_timing`): a draft
    step costs about the same with few sequences left (launch-bound kernels) while the
    verify shrinks, so in the batch's tail the drafts are a larger share of a round. It
    starts with rounds of the configured
    gamma, then of a second candidate (two gammas give the line's slope). Plain steps are
    run only where they could win: the line's intercept a (the part of a round that does
    not grow with gamma: the verify's full-attention pass, which reads what a plain step
    reads, and more) bounds a plain step's time, and one call of plain steps is tried
    when 1 / a comes within PLAIN_MARGIN of the best round's rate (small, launch-bound
    batches; its measured time then decides whether more follow),
    once MIN_TRIALS sequence-rounds have been seen (acceptance from a handful of rounds
    is too noisy to give up on speculation: at B = 1 the first seven said 0.71). At
    B = 64 the old start (four calls of 8 plain steps) cost ~15 % of a 256-token run
    (H100, BENCHMARKS.md 2026-12-02 f). It drops the rounds still queued for exploration
    as soon as a round could not beat measured plain decoding even with every draft
    accepted (tau = gamma + 1); every REPROBE calls it runs the runner-up once, when its
    estimate is within REPROBE_MARGIN of the best, so an estimate from a few early calls
    does not decide the whole run. Every candidate is built and run before decoding starts
    (`prepare`), so a switch does not stall the device; a call of a candidate that was not
    warmed (none in `speculative_generate`) is not timed (`run` marks it, `read` drops
    it): counted, its first call made plain steps look a third slower than they are at
    B = 1 on the H200 (BENCHMARKS.md). The
    acceptance of a round that follows plain steps is not counted either: its drafts read a
    selection that predates those steps."""

    WINDOW = 3
    VANILLA_STEPS = 8
    REPROBE = 12
    REPROBE_MARGIN = 0.15
    TRACE = 64  # calls kept in stats["trace"]
    # sequence-rounds seen before plain steps may be tried (and REPROBE calls: at B 64 on
    # the H200 the first seven rounds' estimate sent auto to plain steps in three runs of
    # three, where a plain step was 2x slower than a round's token): at B = 1
    # seven rounds' acceptance (0.71 at position 1 against 0.93 over the run) sent auto to
    # plain decoding where vegas was 1.06x faster (H200, 2026-12-03)
    MIN_TRIALS = 24
    WAITED_S = DecodeClock.WAITED_S  # a read that blocked this long found the device busy
    # a dispatch this long held the host past the call in flight (a command buffer
    # recorded, kernels loaded): the read after it found the device idle, yet its wait
    # (the copy of the output, ~0.7-0.9 ms at B 64 on the H200) passed WAITED_S. Such an
    # interval (17.3 ms for an 11.2 ms round) and a short one after it (7.6 ms for 8.7)
    # made the rounds' line cross 2 ms where a plain step took 3.6: auto probed plain
    # steps in every B 64 run (BENCHMARKS.md 2026-12-03 b). Normal dispatch: 0.7-2.2 ms.
    STALL_S = 5e-3
    # per-sequence acceptance is shrunk toward the batch's by this many pseudo-trials (a
    # sequence's own count is a handful of rounds early on)
    PRIOR = 16
    # plain steps are probed when the bound's rate is within this of the best round's:
    # at 0.3 a B 64 run probed (3 calls of 8 plain steps, ~7 % of its time) where the
    # bound (3.5 ms) was a plain step's own time (3.6) and 30 % below the rounds' rate
    PLAIN_MARGIN = 0.15
    # the active counts of the timed calls spread by at least this fraction of the largest
    # before the line takes a term in them (`_timing`): at B 64 on the H100 each
    # configuration's median mixed the whole batch's calls with the tail's, and gamma 8's
    # came out below gamma 6's (10.7 against 12.0 ms; 13.6 against 12.2 on the calls that
    # ran the whole batch): auto kept gamma 8 through the tail (BENCHMARKS.md 2026-12-06 e)
    ACTIVE_SPREAD = 0.25

    def __init__(self, spec: SpecConfig):
        g0 = spec.gamma
        self.gammas = list(spec.method.candidates(g0))
        # every round's spec names all candidates: the draft's tail is sized for the
        # largest gamma a previous round may have run (`Auto.tail_len`)
        self.spec = dataclasses.replace(
            spec, method=dataclasses.replace(spec.method, gammas=tuple(self.gammas)))
        # one more call of the first configuration: the first read has no interval
        lower = [g for g in self.gammas if g < g0]
        second = lower[-1] if lower else next((g for g in self.gammas if g > g0), None)
        self.queue = [g0] * (self.WINDOW + 1) + [second] * self.WINDOW * (second is not None)
        self.plain_probed = False
        self.times: dict[int, list[float]] = collections.defaultdict(list)
        self.loose: dict[int, list[float]] = collections.defaultdict(list)
        # the active sequences of each call in `times` / `loose` (None: not known)
        self.times_n: dict[int, list] = collections.defaultdict(list)
        self.loose_n: dict[int, list] = collections.defaultdict(list)
        self.n_active = None  # sequences the next call decodes (from the latest read)
        self.last_waited = True
        top = max(self.gammas)
        self.trials = np.zeros(top + 1)
        self.hits = np.zeros(top + 1)
        # the same per slot ([b, top + 1]), and the slots decoding now (`_live`)
        self.slot_trials = self.slot_hits = self.live = None
        self.remaining = None  # tokens left per slot (`read`), None while prompts wait
        self.in_flight: collections.deque = collections.deque()
        self.last_read = None
        self.skip_next = False  # the next read's interval holds a first dispatch
        self.prev = None  # the configuration dispatched before the one being read
        self.calls = collections.Counter()
        self.runners: dict[int, Callable] = {}
        self.dispatch_s: dict[int, list[float]] = collections.defaultdict(list)
        self._cache = None  # `_timing`'s
        self.warm_set: set[int] = set()  # candidates run once before decoding (`prepare`)
        # the first calls: (configuration, interval s or None, fair, wait s, dispatch s)
        self.trace: list = []
        self.compile_s = 0.0

    def prepare(self, make: Callable[[int], Callable], warm: Callable | None = None):
        """Build and warm every candidate before decoding: `make(config)` returns its
        runner; `warm(runner, again)` runs it, in two passes over all candidates (the
        first builds the executables, the second records their command buffers: see
        `speculative_generate`). A first call in the middle of decoding held the host
        12-24 ms on the H200 (auto at B 1: 0.91x vanilla)."""
        t = time.perf_counter()
        configs = [0, *self.gammas]
        for c in configs:
            self.runners[c] = make(c)
        for again in (False, True) if warm is not None else ():
            for c in configs:
                if warm(self.runners[c], again):
                    self.warm_set.add(c)
        self.compile_s = time.perf_counter() - t

    def choose(self) -> int:
        """The next call's configuration: a gamma, or 0 for plain decoding."""
        rates = self.rates()
        if self.queue and self.queue[0] and 0 in rates:
            t = self.round_time(self.queue[0])
            if t is not None and (self.queue[0] + 1) / t < rates[0]:
                self.queue = [c for c in self.queue if c == 0]  # rounds cannot win here
        if self.queue:
            return self.queue.pop(0)
        if not rates:
            return self.spec.gamma
        if (0 not in rates and not self.plain_probed and self.trials[1] >= self.MIN_TRIALS
                and sum(self.calls.values()) >= self.REPROBE):
            self.plain_probed = True  # asked once: a plain probe's estimate then decides
            step = self.plain_step_bound()
            if step is not None and 1 / step >= (1 - self.PLAIN_MARGIN) * max(rates.values()):
                return 0  # one call: its time decides (`rates`) whether more follow
        ranked = sorted(rates, key=rates.get, reverse=True)
        best = ranked[0]
        if self.call_time(best) is None:  # chosen on an estimate: measure it
            self.queue = [best] * (self.WINDOW - 1)
        elif (len(ranked) > 1 and sum(self.calls.values()) % self.REPROBE == 0
              and rates[ranked[1]] > (1 - self.REPROBE_MARGIN) * rates[best]):
            if best == 0 and ranked[1] != 0:
                # the first round after plain steps drafts from a stale selection and its
                # acceptance is not counted: a second one is what updates the estimate
                self.queue = [ranked[1]]
            return ranked[1]
        return best

    def run(self, config: int, state):
        # dispatched while the call before it runs: the interval that the next read closes
        # (a candidate warmed before decoding has its kernels and command buffers ready)
        self.skip_next |= self.calls[config] == 0 and config not in self.warm_set
        self.calls[config] += 1
        t = time.perf_counter()
        out = self.runners[config](state)
        dt = time.perf_counter() - t
        self.dispatch_s[config].append(dt)
        self.in_flight.append((config, dt))
        return out

    def read(self, n_acc=None, active=None, ready_at=None, wait_s=None, remaining=None):
        """Called as each call's output is read, in dispatch order. ready_at: when the
        output arrived on the host (`time.perf_counter()`; None: now); wait_s: how long
        the host blocked for it (None: it did); remaining [b]: tokens each slot has left
        to emit, when no prompt waits for a slot (the batch then ends with its slowest
        sequence: `rates`), else None."""
        config, dispatch = self.in_flight.popleft()
        now = time.perf_counter() if ready_at is None else ready_at
        # the call dispatched after this one (already in flight) may have stalled the host
        # past this call's end: then this read found the device idle
        stalled = bool(self.in_flight) and self.in_flight[0][1] > self.STALL_S
        waited = (wait_s is None or wait_s >= self.WAITED_S) and not stalled
        self.remaining = None if remaining is None else np.asarray(remaining)
        active = None if active is None else np.asarray(active, bool)
        n_ran = None if active is None else int(active.sum())  # sequences this call ran
        if self.last_read is not None and not self.skip_next:  # the first read has no start
            # An interval is the call's device time only when the host waited at both of
            # its ends; after a read that found its output ready, the next call may have
            # started before that read, and the interval comes out short (plain calls
            # timed 20.9 ms against 38.9 on the H200 made auto choose plain decoding).
            fair = waited and self.last_waited
            (self.times if fair else self.loose)[config].append(now - self.last_read)
            (self.times_n if fair else self.loose_n)[config].append(n_ran)
            if len(self.trace) < self.TRACE:
                self.trace.append((config, now - self.last_read, fair, wait_s, dispatch))
        elif len(self.trace) < self.TRACE:
            self.trace.append((config, None, False, wait_s, dispatch))
        self.last_waited = waited
        self.skip_next = False
        self.last_read = now
        if active is not None:  # the sequences the next call decodes
            self.n_active = n_ran
            if self.remaining is not None and len(self.remaining) == len(active):
                self.n_active = int((active & (self.remaining > 0)).sum())
        stale, self.prev = self.prev == 0, config
        if config and n_acc is not None:
            self._live(active)
        # a round right after plain steps drafts from a selection older than those steps
        # (`Method.after_plain`): its acceptance says little about the next rounds'
        if config and n_acc is not None and not stale:
            j = np.arange(1, config + 1)[None, :]
            tried = (n_acc[:, None] >= j - 1) & active[:, None]  # [b, config]
            hit = (n_acc[:, None] >= j) & active[:, None]
            self.trials[1:config + 1] += tried.sum(0)
            self.hits[1:config + 1] += hit.sum(0)
            self.slot_trials[:, 1:config + 1] += tried
            self.slot_hits[:, 1:config + 1] += hit

    def _live(self, active):
        """The sequences the next calls decode: those active in the latest round. A slot
        that comes back to life holds a new prompt (refilled): its counts start over."""
        active = np.asarray(active, bool)
        if self.slot_trials is None or len(self.slot_trials) != len(active):
            self.slot_trials = np.zeros((len(active), len(self.trials)))
            self.slot_hits = np.zeros_like(self.slot_trials)
            self.live = active
        reborn = active & ~self.live
        self.slot_trials[reborn] = 0
        self.slot_hits[reborn] = 0
        self.live = active

    def _pooled(self):
        """(trials, hits) per draft position of the sequences still decoding: once most
        have finished, a batch of fixed-length outputs waits on the rest, whose acceptance
        is what sets how long (gamma 8 won on the mean rate at B 64 on the H200, gamma 6
        end to end: its slowest sequences took 23 % more rounds than the mean against
        13 %)."""
        if self.slot_trials is not None and self.live.any() and not self.live.all():
            return self.slot_trials[self.live].sum(0), self.slot_hits[self.live].sum(0)
        return self.trials, self.hits

    @staticmethod
    def _alpha(trials, hits, prior=0.0, weight=0.0):
        """Conditional acceptance per draft position ([..., top + 1], entry 0 unused):
        hits / trials, shrunk toward `prior` by `weight` pseudo-trials; positions never
        drafted take the last one seen."""
        alpha = (hits + weight * prior) / np.maximum(trials + weight, 1e-9)
        seen = (trials + weight) > 0
        seen[..., 0] = False
        last_i = np.where(seen, np.arange(seen.shape[-1]), 0).max(-1, keepdims=True)
        last = np.take_along_axis(alpha, last_i, -1)
        return np.where(seen, alpha, last)

    def tau(self, gamma: int) -> float:
        """The mean accepted length of a gamma round over the sequences still decoding."""
        trials, hits = self._pooled()
        if not (trials[1:] > 0).any():
            return float(gamma + 1)  # nothing seen yet: every draft accepted
        alpha = self._alpha(trials, hits)
        return 1.0 + float(np.cumprod(alpha[1:gamma + 1]).sum())

    def finish_tau(self, gamma: int) -> float:
        """tau as the batch's finish sees it. While no prompt waits for a slot, the batch
        ends with the sequence whose tokens left / own tau is largest (R_s / tau_s(gamma)
        rounds): the value returned is R / max_s(R_s / tau_s), R the most tokens any has
        left, so that finish-time ratios read as tau / call time (all R_s equal: the
        smallest tau_s). tau_s from each sequence's own acceptance, shrunk toward the
        batch's by PRIOR trials. Otherwise (prompts waiting, nothing read yet) `tau`."""
        rem = self.remaining
        if rem is None or self.slot_trials is None or len(rem) != len(self.slot_trials):
            return self.tau(gamma)
        left = rem > 0
        trials, hits = self._pooled()
        if not left.any() or not (trials[1:] > 0).any():
            return self.tau(gamma)
        pool = self._alpha(trials, hits)
        alpha = self._alpha(self.slot_trials[left], self.slot_hits[left], pool[None, :],
                            self.PRIOR)  # [n, top + 1]
        tau_s = 1.0 + np.cumprod(alpha[:, 1:gamma + 1], axis=1).sum(1)  # [n]
        r = rem[left].astype(float)
        return float(r.max() / (r / tau_s).max())

    def _samples(self, c):
        """The last 8 timed calls of configuration c and their active counts: those the
        host waited for at both ends, or while there are none, all."""
        t, n = (self.times, self.times_n) if self.times.get(c) else (self.loose, self.loose_n)
        ts = (t.get(c) or [])[-8:]
        ns = (n.get(c) or [])[-8:]
        # times set without counts (tests) count as unknown
        return ts, [None] * (len(ts) - len(ns)) + ns[max(0, len(ns) - len(ts)):]

    def _active_line(self):
        """(a, b, c) of t = a + b * gamma + c * active, least squares over the rounds'
        last timed calls, where their active counts spread by ACTIVE_SPREAD and two gammas
        were timed; None otherwise, or where the fit is not a cost (b <= 0, c < 0)."""
        rows = [(g, n, t) for g in self.gammas for t, n in zip(*self._samples(g))
                if n is not None]
        if len({g for g, _, _ in rows}) < 2:
            return None
        g, n, t = np.array(rows, dtype=float).T
        if n.max() - n.min() < self.ACTIVE_SPREAD * n.max():
            return None
        (a, b, c), *_ = np.linalg.lstsq(np.stack([np.ones_like(g), g, n], 1), t, rcond=None)
        if not (b > 0 and c >= 0):
            return None
        return float(a), float(b), float(c)

    def _timing(self):
        """(call time of each timed configuration, the line (a, b) through the rounds' at
        the number of sequences the next call decodes, or None), recomputed only when a sample
        changed: `choose` asks for them several times a call, and refitting each time
        (np.polyfit) took 1.2-1.6 ms of host time a call on the H200. The line is
        `_active_line`'s at that count where it has one, else one through each
        configuration's median."""
        key = (self.n_active,) + tuple((c, tuple(v[-8:])) for d in (self.times, self.loose)
                                       for c, v in sorted(d.items()))
        if self._cache is None or self._cache[0] != key:
            med = {}
            for c in (0, *self.gammas):
                t, _ = self._samples(c)
                if t:
                    med[c] = float(np.median(t))
            pts = [(g, t) for g, t in med.items() if g]
            fit = None
            line = self._active_line() if self.n_active is not None else None
            if line is not None:
                a, b, c = line
                fit = (a + c * self.n_active, b)
            elif len(pts) > 1:  # least squares, closed form
                g, t = np.array(pts, dtype=float).T
                b = float(((g - g.mean()) * (t - t.mean())).sum() / ((g - g.mean()) ** 2).sum())
                fit = (float(t.mean()) - b * float(g.mean()), b)
            self._cache = (key, med, fit)
        return self._cache[1], self._cache[2]

    def call_time(self, config: int) -> float | None:
        """The median of a configuration's last timed calls: those the host waited for at
        both ends, or while there are none (a host-bound loop never waits), all."""
        return self._timing()[0].get(config)

    def rounds(self):
        """((gamma, call time) of every round configuration timed so far, the line (a, b)
        through them or None)."""
        med, fit = self._timing()
        return [(g, t) for g, t in med.items() if g], fit

    def round_time(self, gamma: int) -> float | None:
        pts, fit = self.rounds()
        if pts and fit:
            a, b = fit
            if b > 0 and a >= 0:
                return a + b * gamma
        if not pts:
            return None
        g, t = min(pts, key=lambda p: p[1] / (p[0] + 1))  # one gamma seen, or noise
        return t * (gamma + 1) / (g + 1)

    def plain_step_bound(self) -> float | None:
        """A plain step's time estimated from the rounds alone: the intercept of the line
        through the round times (from above: a verify reads the whole cache, as a step
        does, and also captures and selects); where the line does not grow with gamma
        (drafts too cheap to see among the noise) the shortest round; with one gamma timed,
        or a line through the origin or below (launch-bound drafts, a step's cost each),
        the shortest round time per token it processes (t / (gamma + 1), from below).
        None before any round is timed. (At B = 64 on the H200 the per-token bound alone
        sent auto to three calls of plain steps, 12 % of the run.)"""
        pts, fit = self.rounds()
        if not pts:
            return None
        if fit is not None:
            if fit[1] <= 0:
                return min(t for _, t in pts)
            if fit[0] > 0:
                return fit[0]
        return min(t / (g + 1) for g, t in pts)

    def rates(self) -> dict[int, float]:
        out = {}
        if (t := self.call_time(0)) is not None:
            out[0] = self.VANILLA_STEPS / t
        for g in self.gammas:
            t = self.round_time(g)
            if t is not None:
                out[g] = self.finish_tau(g) / t
        return out

    def stats(self) -> dict:
        rates = self.rates()
        name = lambda c: "vanilla" if c == 0 else f"gamma {c}"  # noqa: E731
        ms = lambda t: None if t is None else round(1e3 * t, 3)  # noqa: E731
        return {
            "calls": {name(c): n for c, n in sorted(self.calls.items())},
            "tokens_per_s_per_seq": {name(c): float(r) for c, r in sorted(rates.items())},
            "choice": name(max(rates, key=rates.get)) if rates else None,
            "ms_per_call": {name(c): 1e3 * t for c in sorted(self.calls)
                            if (t := self.call_time(c)) is not None},
            # intervals the host waited for at both ends (the device's time) / the others
            "timed_calls": {name(c): [len(self.times.get(c, ())), len(self.loose.get(c, ()))]
                            for c in sorted(self.calls)},
            # the host's time handing each call to the runtime (median)
            "dispatch_ms": {name(c): 1e3 * float(np.median(t))
                            for c, t in sorted(self.dispatch_s.items())},
            "compile_s": self.compile_s,
            # the line t = a + b gamma + c active (ms) in use at the end, if the calls' active
            # counts spread (`_active_line`)
            "active_line_ms": (None if (ln := self._active_line()) is None
                               else [1e3 * ln[0], 1e3 * ln[1], 1e3 * ln[2]]),
            # the first calls: configuration, interval ms (None: not timed), fair, the
            # host's wait for its output and its dispatch (ms)
            "trace": [[name(c), ms(t), f, ms(w), ms(d)] for c, t, f, w, d in self.trace],
            "warmed": len(self.warm_set),
        }


def speculative_generate(
    model,
    prompts,
    max_new_tokens: int | Sequence[int] = 128,
    spec: SpecConfig = SpecConfig(),
    sampling: SamplingParams = SamplingParams(),
    seed: int = 0,
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    attn_impl: str | None = None,
    max_batch: int | None = None,
) -> GenerationResult:
    """Self-speculative decoding of prompts; output has the vanilla distribution
    (greedy: the same tokens). `spec.method="vanilla"` runs plain decoding; "auto" chooses
    gamma or plain decoding as it goes (`AutoController`). `max_batch`: at most this many
    sequences at once; each finished one's slot is refilled with the next prompt's prefill
    (results stay in prompt order). `max_new_tokens`: one limit, or one per prompt."""
    if not isinstance(spec, SpecConfig):
        raise TypeError("spec must be a SpecConfig")
    if not spec.method.speculative:
        res = generate(model, prompts, max_new_tokens, sampling, seed, on_tokens, attn_impl,
                       max_batch=max_batch)
        steps = max(len(t) for t in res.tokens) - 1  # one token per step after the prefill's
        res.stats.update(tau=1.0, gamma=0, acceptance_by_position=[], rounds=steps)
        return res
    cfg = model.config
    auto = AutoController(spec) if isinstance(spec.method, Auto) else None
    gamma = max(auto.gammas) if auto else spec.gamma
    # Room past the last kept token: a round writes gamma + 1 entries after n, and the last
    # round may overshoot max_new_tokens by gamma; Quest's page refresh reads a page beyond.
    extra = 2 * gamma + 2 + getattr(spec.method, "extra_len", lambda: 0)()
    ids, cache, xc, limits, key, k0, eos, collector = launch(
        model, prompts, max_new_tokens, sampling, extra, attn_impl, max_batch, seed, on_tokens)
    batch = cache.batch

    t0 = time.perf_counter()
    logits, cache, scores = prefill_prompts(model.params, cfg, xc, ids[:batch], cache,
                                            prefill_capture(spec))
    x0, _ = sample(k0, logits, sampling)
    progress = Progress.start(x0, limits[:batch], eos)
    state = init_state(spec, xc, cache, x0, key, scores, cache.lengths + 0,  # own buffer: donated
                       progress)
    collector.add([[t] for t in jax.device_get(x0)])
    prefill_s = time.perf_counter() - t0

    tally = {"accepted_at": np.zeros(gamma, np.int64), "rounds": 0, "emitted": 0, "calls": 0,
             "seq_rounds": np.zeros(len(ids), np.int64),
             "seq_emitted": np.zeros(len(ids), np.int64), "accepted_by_call": []}

    def count(out, ready_at=None, wait_s=None):
        _, _, n_acc, was_active = out
        if auto is not None:  # tokens left matter while no prompt waits for a slot
            left = None if refill is not None and refill.waiting else collector.remaining()
            auto.read(n_acc, was_active, ready_at, wait_s, left)
        if n_acc is None:  # plain decoding steps
            tally["accepted_by_call"].append(None)
            return
        tally["accepted_by_call"].append(np.where(was_active, n_acc, -1).tolist())
        tally["calls"] += 1
        owner = collector.owner[was_active]  # the prompt each active slot decodes
        np.add.at(tally["seq_rounds"], owner, 1)
        np.add.at(tally["seq_emitted"], owner, n_acc[was_active] + 1)
        n_acc = n_acc[was_active]
        tally["rounds"] += len(n_acc)
        tally["emitted"] += int((n_acc + 1).sum())
        tally["accepted_at"] += (n_acc[:, None] > np.arange(gamma)[None, :]).sum(0)

    def step(st):
        if auto is None:
            st, *out = spec_round(model.params, cfg, xc, st, spec, sampling)
            return st, tuple(out)
        return auto.run(auto.choose(), st)

    if auto is not None:
        def call(config):  # (jitted function, its static arguments after the state)
            if config == 0:  # plain decoding on the same cache; the selection goes stale
                low = dataclasses.replace(auto.spec, gamma=min(auto.gammas))
                return plain_steps, (low, sampling, AutoController.VANILLA_STEPS)
            return spec_round, (dataclasses.replace(auto.spec, gamma=config), sampling)

        def make(config):
            # the jitted functions themselves, dispatched like the other methods' rounds
            # (`.lower().compile()` executables took 7-9 ms of host time a call on the
            # H200 against 1.0-1.6 for jit's own dispatch: auto 0.55x vanilla at B 1)
            fn, static = call(config)

            def run(st):
                st, *out = fn(model.params, cfg, xc, st, *static)
                return st, tuple(out)
            return run

        warming = {}  # the state with every sequence marked finished, its small leaves

        def warm(run, again: bool) -> bool:
            """Run a candidate on the decoding state's own buffers, every sequence marked
            finished (`_all_finished`: nothing is emitted or advanced; K/V written past
            each sequence's length is rewritten before any draft or verify reads it), its
            small leaves restored in place at the end. Twice over all candidates: XLA
            drops every executable's command buffers (CUDA graphs) whenever a new
            executable is built, and records them again on the next call, 12-24 ms of
            host time for a round (H200, benchmarks/first_dispatch.py); the first pass
            builds every executable (the restore's included), the second records their
            command buffers with nothing built after them."""
            w = warming
            if not w:
                w["saved"] = _small_leaves(state)  # before the state's buffers are donated
                w["state"] = _all_finished(state, True)
            if again and not w.get("restored"):  # build the restore before graphs record
                w["state"] = _all_finished(_restored(w["state"], w["saved"], True), True)
                w["restored"] = True
            w["state"], _ = run(w["state"])
            return True

        auto.prepare(make, warm)
        state = jax.block_until_ready(_restored(warming["state"], warming["saved"], True))

    def prefill_some(prompts, rows):  # waiting prompts, prefilled together for free slots
        grp, first, sc = prefill_group(model, xc, [ids[p] for p in prompts], rows,
                                       cache.max_len, prefill_capture(spec),
                                       jax.random.fold_in(k0, prompts[0]), sampling)
        return init_state(spec, xc, grp, first, key, sc, grp.lengths + 0,
                          Progress.start(first, rows_of(limits, prompts, rows), eos)), first

    refill = Refill(range(batch, len(ids)), prefill_some, collector) if len(ids) > batch else None
    clock = DecodeClock(collector)
    if not collector.done.all() or refill is not None:
        drive(step, state, collector, clock, on_out=count, refill=refill)
    rounds = max(tally["rounds"], 1)
    if auto is not None:  # rounds of several gammas: the controller counted each position
        conditional = [float(h / t) if t else None  # None: never drafted
                       for h, t in zip(auto.hits[1:], auto.trials[1:])]
    else:
        reached = np.concatenate([[tally["rounds"]], tally["accepted_at"][:-1]])
        conditional = (tally["accepted_at"] / np.maximum(reached, 1)).tolist()
    stats = {
        "method": spec.name,
        "gamma": gamma if auto is None else None,
        "sparsity": spec.sparsity,
        "batch": batch,
        "prompts": len(ids),
        "refills": refill.refills if refill else 0,
        "refill_prefills": refill.prefills if refill else 0,  # calls: refills go in groups
        "prompt_tokens": [len(p) for p in ids],
        "prefill_s": prefill_s,
        **clock.stats(),
        "rounds": tally["calls"],  # speculative rounds (auto also makes plain-step calls)
        # tau = mean acceptance length (accepted drafts + 1 per round); acceptance by
        # position i: cumulative = P(drafts 1..i all accepted), conditional = P(draft i
        # accepted | drafts 1..i-1 accepted, draft i made). `acceptance_by_position` is the
        # cumulative one (its old name).
        "tau": tally["emitted"] / rounds,
        "acceptance_by_position": (tally["accepted_at"] / rounds).tolist(),
        "acceptance_cumulative": (tally["accepted_at"] / rounds).tolist(),
        "acceptance_conditional": conditional,
        # per prompt, in prompt order (None: no round, the prefill's token ended it)
        "tau_by_sequence": [float(e / r) if r else None
                            for e, r in zip(tally["seq_emitted"], tally["seq_rounds"])],
        "rounds_by_sequence": tally["seq_rounds"].tolist(),
        # per call, per slot: drafts accepted (-1: slot inactive; None: a plain-steps call)
        # for replaying a gamma policy offline
        "accepted_by_call": tally["accepted_by_call"],
        "attn_impl": xc.attn,
        "cache_len": cache.max_len,
    }
    if auto is not None:
        stats["auto"] = auto.stats()
    return GenerationResult(collector.tokens, decode_text(model, collector.tokens), stats)

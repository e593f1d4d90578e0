"""`method="auto"`: vegas with gamma, or plain decoding, chosen call by call while
generating, from measured call times and the acceptance seen so far.

Start: auto decodes at once with its configured gamma, which its first call compiles (as
a fixed method's does). At the first read, where the tokens left need BUILD_MIN_CALLS calls
or more and, for a background build, outlast it (`_covers_build`), a thread compiles the
other candidates while it decodes (`compile_only`: each runner called on the state the
first call donated; XLA's compile releases the GIL; on a CPU device the read waits for it
instead: the compile would take the calls' cores); a shorter generation could not use
them and keeps the configured gamma. Until the last one is built every call runs the
configured gamma and none is timed (a compile holds the host and, with its autotuning, the
GPU); after it each candidate's first dispatch is not timed either (building an executable
drops every command buffer), then the controller explores and chooses as below.
Acceptance is counted throughout: it is the device's, not the clock's."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import weakref
from typing import Callable

import jax
import numpy as np

from vegas_jax.driver import DecodeClock


class AutoController:
    """Chooses each device call of `method="auto"`: a round at one of the candidate gammas,
    or VANILLA_STEPS plain decoding steps, whichever gives the most tokens a second.

    The cost model is learnt online. A call's device time is the interval between reading
    consecutive outputs (one call stays in flight, so the host waits on the device); a
    round's time is a line t = a + b * gamma through the rounds timed, with a term
    c * active in the sequences the next call decodes once the calls' counts spread (a
    batch of fixed-length outputs thins out at its end). tau(gamma) = 1 + sum_i prod_{j<=i}
    a_j from the conditional acceptance a_j of each draft position seen so far; while no
    prompt waits for a slot it is the batch's finish as its slowest sequence sees it
    (`finish_tau`). It starts with rounds of the configured gamma, then a second candidate
    (two gammas give the slope); plain steps are tried once, and only where the line's
    intercept (a verify reads what a plain step reads, and more) says they could win;
    every REPROBE calls the runner-up runs once when its estimate is close. The
    candidates other than the configured gamma are built in the background (`prepare`,
    module docstring); the acceptance of a round right after plain steps is not counted
    (its drafts read a selection older than those steps)."""

    WINDOW = 3
    VANILLA_STEPS = 8
    REPROBE = 12
    REPROBE_MARGIN = 0.15
    TRACE = 64  # calls kept in stats["trace"]
    # sequence-rounds seen before plain steps may be tried: acceptance from a handful of
    # rounds is too noisy to give up on speculation
    MIN_TRIALS = 24
    WAITED_S = DecodeClock.WAITED_S  # a read that blocked this long found the device busy
    # a dispatch this long held the host past the call in flight (a command buffer
    # recorded): the read after it found the device idle, so its interval is not timed
    STALL_S = 5e-3
    # per-sequence acceptance is shrunk toward the batch's by this many pseudo-trials (a
    # sequence's own count is a handful of rounds early on)
    PRIOR = 16
    # plain steps are probed when the bound's rate is within this of the best round's
    PLAIN_MARGIN = 0.15
    # the timed calls' active counts spread by this fraction of the largest before the
    # line takes a term in them: a median over whole-batch and tail calls misleads
    ACTIVE_SPREAD = 0.25
    # None: the others are built in the background unless the device is the host's CPU
    # (a compile there takes the cores the calls run on: the first read waits for it);
    # False: the first read waits for them however short the generation (benchmarks of
    # the adaptive choice from the first calls on); True: in the background
    BACKGROUND = None
    # calls left at the first read (the slowest sequence's tokens left over its tau at
    # the configured gamma) below which the others are not built: exploring takes as many
    BUILD_MIN_CALLS = 24
    # and, for a background build, the decode time left (those calls at the first call's
    # device time) over the build's (the first call's compile per candidate) below which
    # they are not built either: a build the generation does not outlast is never used,
    # and it slows the calls it overlaps
    BUILD_MIN_COVER = 1.0

    def __init__(self, spec):
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
        # configurations whose executables exist (the builder thread adds to it) / that
        # were dispatched since the last build (their kernels loaded, command buffers
        # recorded: their next dispatch does not stall the host)
        self.ready: set[int] = set()
        self.warm: set[int] = set()
        self.pending: list[int] = []  # built in the background after the first call
        self.spent = None  # the state the first call donated (`compile_only`)
        # "none" (nothing to build), "pending", "skipped" (too little decoding left), "running",
        # "done"
        self.build = "none"
        self.background = None  # whether the build ran in the background
        # when the background build ended (perf_counter); None until then
        self.built_at: float | None = -np.inf
        self.build_seen = True  # `run` has seen the build end
        self.built_after_calls = None  # calls dispatched before it saw the end
        # the first calls: (configuration, interval s or None, fair, wait s, dispatch s)
        self.trace: list = []
        self.compile_s = None  # the background build's seconds (None: not finished)

    def prepare(self, make: Callable[[int], Callable]):
        """`make(config)` returns each candidate's runner (run(state) -> (state, out),
        donating the state). The configured gamma is compiled by its first call; the
        others, the second one explored first, in a thread from the first read on
        (`read`, `_build`)."""
        g0 = self.spec.gamma
        for c in (0, *self.gammas):
            self.runners[c] = make(c)
        second = next((c for c in self.queue if c != g0), None)
        rest = [g for g in sorted(self.gammas, reverse=True) if g not in (g0, second)]
        self.pending = [c for c in (second, *rest, 0) if c is not None]
        if self.pending:
            self.built_at, self.build_seen, self.build = None, False, "pending"

    def _build(self, spent):
        """Compile the pending candidates in a thread (`compile_only` on `spent`, the
        state the first call donated), one after another; it stops early once the
        controller is dropped (the generation is over: the process waits at exit for the
        compile under way only). Where `spent` holds no donated buffer, each candidate is
        compiled by its first call instead."""
        order, self.pending, self.spent = self.pending, [], None
        if not any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(spent)):
            self.built_at, self.build = time.perf_counter(), "done"
            return
        self.build = "running"
        self.background = self._background()
        me, runners, ready, t0 = weakref.ref(self), self.runners, self.ready, time.perf_counter()

        def build():
            for c in order:
                if me() is None:
                    return
                try:
                    compile_only(runners[c], spent)
                    ready.add(c)
                except Exception:  # noqa: BLE001 (its first call compiles it, and raises)
                    pass
            ctl = me()
            if ctl is not None:
                ctl.compile_s, ctl.build = time.perf_counter() - t0, "done"
                ctl.built_at = time.perf_counter()

        thread = threading.Thread(target=build, name="vegas_jax auto build")
        thread.start()
        if not self.background:
            thread.join()

    def choose(self) -> int:
        """The next call's configuration: a gamma, or 0 for plain decoding (the configured
        gamma while the other candidates are built)."""
        if self.built_at is None:
            return self.spec.gamma
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
        if not self.build_seen and self.built_at is not None:
            # the background build is over: every command buffer was dropped on the way
            self.build_seen, self.warm = True, set()
            self.built_after_calls = sum(self.calls.values())
        self.ready.add(config)  # built by this dispatch if not before
        # dispatched while the call before it runs: the interval that the next read closes
        # holds its first dispatch since the last build (kernels loaded, command buffers
        # recorded) unless it is warm
        self.skip_next |= config not in self.warm
        self.warm.add(config)
        self.calls[config] += 1
        t = time.perf_counter()
        out = self.runners[config](state)
        dt = time.perf_counter() - t
        self.dispatch_s[config].append(dt)
        self.in_flight.append((config, dt))
        if self.pending and self.spent is None:
            self.spent = state  # donated by the call just dispatched
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
        # no interval is timed that began before the background build ended
        built = self.built_at is not None and self.last_read is not None \
            and self.built_at <= self.last_read
        if built and not self.skip_next:  # the first read has no start
            # An interval is the call's device time only when the host waited at both of
            # its ends; otherwise the next call may have started before the read.
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
        if self.spent is not None:  # the first read: build the others if they can be used
            rem = self.remaining
            left = None if rem is None or not len(rem) else \
                rem.max() / self.finish_tau(self.spec.gamma)
            if self.BACKGROUND is False or left is None or (
                    left >= self.BUILD_MIN_CALLS and self._covers_build(left, dispatch, wait_s)):
                self._build(self.spent)
            else:
                self.pending, self.spent, self.build = [], None, "skipped"

    def _background(self) -> bool:
        return jax.default_backend() != "cpu" if self.BACKGROUND is None else self.BACKGROUND

    def _covers_build(self, calls_left: float, compile_s: float, call_s) -> bool:
        """Whether `calls_left` calls of `call_s` (the first call's wait for its output: its
        device time; None: not known) outlast building the pending candidates, each as
        long as the first call's dispatch (`compile_s`, its compile). A foreground build
        holds the generation whatever its length: the calls left alone decide there."""
        if not self._background() or call_s is None:
            return True
        return calls_left * call_s >= self.BUILD_MIN_COVER * compile_s * len(self.pending)

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
        is what sets how long."""
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
        changed (`choose` asks for them several times a call). The line is
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
        None before any round is timed."""
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
            # the other candidates' build in the background (`build`), its seconds and
            # the calls dispatched before it ended (None: not finished when they were)
            "build": self.build,
            "build_background": self.background,
            "compile_s": self.compile_s,
            "built_after_calls": self.built_after_calls,
            # the line t = a + b gamma + c active (ms) in use at the end, if the calls' active
            # counts spread (`_active_line`)
            "active_line_ms": (None if (ln := self._active_line()) is None
                               else [1e3 * ln[0], 1e3 * ln[1], 1e3 * ln[2]]),
            # the first calls: configuration, interval ms (None: not timed), fair, the
            # host's wait for its output and its dispatch (ms)
            "trace": [[name(c), ms(t), f, ms(w), ms(d)] for c, t, f, w, d in self.trace],
            "compiled": len(self.ready),  # candidates built by the end
        }


def compile_only(run: Callable, spent) -> None:
    """Compile `run`'s executable without running it. `spent`: a state whose buffers were
    donated to an earlier call of the same shapes: jit traces and compiles the call (which
    fills the caches that later calls hit), then refuses to run on deleted buffers."""
    try:
        run(spent)
    except RuntimeError as e:
        if "deleted" not in str(e):
            raise

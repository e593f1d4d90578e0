"""`method="auto"`: vegas with gamma and the draft's weights, or plain decoding, chosen
call by call while generating, from measured call times and the acceptance seen so far.

Before anything is compiled, the sizes decide whether a round could pay at all: each
(gamma, draft format)'s bound (`auto_bound`: what a draft step reads beside a plain step;
a quantized draft reads fewer weight bytes) is set against `AutoPolicy.min_gain`; a
format none of whose rounds reaches it is dropped, and where none is left auto decodes
plainly throughout, with vanilla's programs (`decode_plainly`). A format whose weights'
copy does not fit is dropped too (`drop_format`). Otherwise it decodes at once with its
configured gamma and format, which its first call compiles (as a fixed method's does);
the other candidates, one executable each, are built after it (`auto_build`). Until they
are, every call runs the configured one and none is timed; then the controller explores
and chooses (`auto_choice`). Acceptance is counted throughout, per format: it is the
device's, not the clock's (`auto_capture`)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Mapping

import numpy as np

from vegas_jax.auto_build import Build, BuildScheduler, compile_only  # noqa: F401 (re-exported)
from vegas_jax.auto_capture import CallTimer, FormatAcceptance, RoundCounts
from vegas_jax.auto_choice import (
    PLAIN, AutoPolicy, Config, Evidence, Exploration, decide, estimate, first_exploration,
)


class AutoController:
    """Chooses each device call of `method="auto"`: a round at one of the candidate
    (gamma, draft format) pairs, or `policy.plain_steps` plain decoding steps, whichever
    gives the most tokens a second (`auto_choice.decide`). The acceptance of a round
    right after plain steps is not counted (its drafts read a selection older than those
    steps)."""

    def __init__(self, spec, policy: AutoPolicy = AutoPolicy()):
        if not isinstance(policy, AutoPolicy):
            raise TypeError("auto_policy must be an AutoPolicy")
        self.policy = policy
        self.gammas = tuple(spec.method.candidates(spec.gamma))
        # every round's spec names all candidates: the draft's tail is sized for the
        # largest gamma a previous round may have run (`Auto.tail_len`)
        self.spec = dataclasses.replace(
            spec, method=dataclasses.replace(spec.method, gammas=self.gammas))
        self.formats = spec.method.candidate_formats(spec.draft_weights)
        self.dropped: dict[str, str] = {}  # format -> why it is no candidate
        self.bounds: dict[Config, float] = {}  # a round's best speedup (`allow_rounds`)
        self._explore(Config(spec.gamma, spec.draft_weights))
        self.timer = CallTimer()
        self.build = BuildScheduler(policy)
        self.calls: collections.Counter = collections.Counter()
        self.ran = RoundCounts()
        self.runners: dict[Config, Callable] = {}
        self.n_active = None  # sequences the next call decodes (from the latest read)
        self.prev: Config | None = None  # the configuration read before this one

    def _explore(self, start: Config):
        self.plan = first_exploration(self.policy, self.gammas, start, self.formats)
        self.acceptance = FormatAcceptance(self.formats, max(self.gammas))

    @property
    def configs(self) -> tuple[Config, ...]:
        return (PLAIN, *(Config(g, f) for f in self.formats for g in self.gammas))

    def drop_format(self, fmt: str, why: str):
        """Leave `fmt` out of the candidates (before `prepare`), `why` in the stats. The
        start moves, where it was in `fmt`, to the configured gamma in the format whose
        rounds' bound is highest (the first left where none is known)."""
        self.formats = tuple(f for f in self.formats if f != fmt)
        self.dropped[fmt] = why
        start = self.plan.start
        if self.formats and start.draft_weights == fmt:
            best = {f: max((b for c, b in self.bounds.items() if c.draft_weights == f),
                           default=0.0) for f in self.formats}
            start = Config(start.gamma, max(self.formats, key=best.get))
        if self.formats:
            self._explore(start)

    def prepare(self, make: Callable[[Config], Callable]):
        """`make(config)` returns each candidate's runner (run(state) -> (state, out),
        donating the state). The start is compiled by its first call; the others after
        the first read: those the exploration queues first, in its order, then the other
        rounds (larger gammas first), plain steps last."""
        self.runners = {c: make(c) for c in self.configs}
        start = self.plan.start
        queued = dict.fromkeys(c for c in self.plan.queue if c != start)
        rest = [Config(g, f) for f in self.formats for g in sorted(self.gammas, reverse=True)
                if Config(g, f) != start and Config(g, f) not in queued]
        self.build.plan([*queued, *rest, PLAIN])

    def allow_rounds(self, bounds: Mapping[Config, float]) -> bool:
        """Record each candidate round's bound on its speedup over plain steps
        (`auto_bound`); drop the formats none of whose rounds reaches the policy's
        `min_gain`; whether any format is left (else auto decodes plainly:
        `decode_plainly`)."""
        self.bounds = dict(bounds)
        for f in self.formats:
            best = max(b for c, b in self.bounds.items() if c.draft_weights == f)
            if best < self.policy.min_gain:
                self.drop_format(f, f"a round could at best be {best:.2f}x plain steps, "
                                    f"below min_gain")
        return bool(self.formats)

    def decode_plainly(self, run: Callable):
        """Plain steps only, `run(state) -> (state, out)` a call: no round is compiled."""
        self.runners = {PLAIN: run}
        self.plan = Exploration(PLAIN)

    def evidence(self) -> Evidence:
        fair, loose = self.timer.timed()
        return Evidence(self.gammas, self.acceptance.snapshot(), fair, loose, self.n_active,
                        sum(self.calls.values()))

    def choose(self) -> Config:
        """The next call's configuration (the start while the other candidates are
        built, or where they never will be)."""
        if not self.build.settled:
            return self.plan.start
        config, self.plan = decide(self.policy, self.evidence(), self.plan)
        return config

    def run(self, config: Config, state):
        """Dispatch `config`'s call on `state` (donated); returns (state, outputs)."""
        if self.build.dispatched(config, state, sum(self.calls.values())):
            self.timer.forget_warm()  # the build dropped every command buffer
        self.calls[config] += 1
        return self.timer.dispatch(config, self.runners[config], state)

    def read(self, n_acc=None, active=None, ready_at=None, wait_s=None, remaining=None):
        """Called as each call's output is read, in dispatch order. n_acc [b]: drafts
        accepted (None: plain steps); active [b]: the slots the call ran; ready_at: when
        the output arrived on the host (`time.perf_counter()`; None: now); wait_s: how
        long the host blocked for it (None: it did); remaining [b]: tokens each slot has
        left to emit, when no prompt waits for a slot (the batch then ends with its
        slowest sequence), else None."""
        active = None if active is None else np.asarray(active, bool)
        n_ran = None if active is None else int(active.sum())
        config, dispatch = self.timer.read(ready_at, wait_s, n_ran, self.build.quiet_since)
        rem = None if remaining is None else np.asarray(remaining)
        self.acceptance.set_remaining(rem)
        if active is not None:  # the sequences the next call decodes
            self.n_active = n_ran
            if rem is not None and len(rem) == len(active):
                self.n_active = int((active & (rem > 0)).sum())
        stale, self.prev = self.prev == PLAIN, config
        if not config.plain and n_acc is not None:
            self.ran.add(config, n_acc, active)
            # a round right after plain steps drafts from a selection older than those
            # steps (`Method.after_plain`): its acceptance says little about the next ones
            self.acceptance.add(config.draft_weights, config.gamma, n_acc,
                                np.ones(len(n_acc), bool) if active is None else active,
                                count=not stale)
        if self.build.state is Build.ARMED:  # the first read: build if they can be used
            start = self.plan.start
            left = None if rem is None or not len(rem) else rem.max() / self.acceptance \
                .snapshot()[start.draft_weights].finish_tau(start.gamma, self.policy.prior)
            self.build.first_read(left, dispatch, wait_s, self.runners)

    def _sorted(self, configs) -> list[Config]:
        """Plain steps first, then rounds by format (the candidates' order), then gamma."""
        order = {f: i for i, f in enumerate((*self.formats, *self.dropped))}
        return sorted(configs, key=lambda c: (not c.plain, order.get(c.draft_weights, 0),
                                              c.gamma))

    def stats(self) -> dict:
        est = estimate(self.policy, self.evidence())
        ms = lambda t: None if t is None else round(1e3 * t, 3)  # noqa: E731
        return {
            # (gamma, format) -> the most a round could gain over plain steps
            # (`auto_bound`), and whether any reached `min_gain` (else every call was
            # plain steps)
            "round_bound": {c.name: round(b, 4) for c, b in self.bounds.items()},
            "min_gain": self.policy.min_gain,
            "rounds_allowed": not self.plan.start.plain,
            # the draft weights chosen among, those left out and why, the start
            "formats": list(self.formats),
            "formats_dropped": dict(self.dropped),
            "start": self.plan.start.name,
            "calls": {c.name: self.calls[c] for c in self._sorted(self.calls)},
            # the rounds read per configuration, and their tau (tokens a sequence-round)
            "by_config": {c.name: self.ran.stats(c) for c in self._sorted(self.ran.rounds)},
            "tokens_per_s_per_seq": {c.name: float(est.rates[c])
                                     for c in self._sorted(est.rates)},
            "choice": None if est.best() is None else est.best().name,
            "ms_per_call": {c.name: 1e3 * est.call_times[c] for c in self._sorted(self.calls)
                            if c in est.call_times},
            # intervals the host waited for at both ends (the device's time) / the others
            "timed_calls": {c.name: [len(self.timer.fair.get(c, ())),
                                     len(self.timer.loose.get(c, ()))]
                            for c in self._sorted(self.calls)},
            # the host's time handing each call to the runtime (median)
            "dispatch_ms": {c.name: 1e3 * float(np.median(self.timer.dispatch_s[c]))
                            for c in self._sorted(self.timer.dispatch_s)},
            **self.build.stats(),
            # the line t = a + b[format] gamma + c active (ms) in use at the end, if the
            # calls' active counts spread (`auto_choice.fit_active_line`)
            "active_line_ms": None if est.active_line is None else est.active_line.ms(),
            # the first calls: configuration, interval ms (None: not timed), fair, the
            # host's wait for its output and its dispatch (ms)
            "trace": [[c.name, ms(t), f, ms(w), ms(d)] for c, t, f, w, d in self.timer.trace],
        }

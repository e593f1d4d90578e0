"""`method="auto"`: vegas with gamma, or plain decoding, chosen call by call while
generating, from measured call times and the acceptance seen so far.

Before anything is compiled, the sizes decide whether a round could pay at all: where no
candidate's bound (`auto_bound`: what a draft step reads beside a plain step) reaches
`AutoPolicy.min_gain`, auto decodes plainly throughout, with vanilla's programs
(`decode_plainly`). Otherwise it decodes at once with its configured gamma, which its
first call compiles (as a fixed method's does); the other candidates are built after it
(`auto_build`). Until they are, every call runs the configured gamma and none is timed;
then the controller explores and chooses (`auto_choice`). Acceptance is counted
throughout: it is the device's, not the clock's (`auto_capture`)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import numpy as np

from vegas_jax.auto_build import Build, BuildScheduler, compile_only  # noqa: F401 (re-exported)
from vegas_jax.auto_capture import AcceptanceCounter, CallTimer
from vegas_jax.auto_choice import (
    PLAIN, AutoPolicy, Config, Evidence, Exploration, decide, estimate, first_exploration,
)


class AutoController:
    """Chooses each device call of `method="auto"`: a round at one of the candidate gammas,
    or `policy.plain_steps` plain decoding steps, whichever gives the most tokens a
    second (`auto_choice.decide`). The acceptance of a round right after plain steps is
    not counted (its drafts read a selection older than those steps)."""

    def __init__(self, spec, policy: AutoPolicy = AutoPolicy()):
        if not isinstance(policy, AutoPolicy):
            raise TypeError("auto_policy must be an AutoPolicy")
        self.policy = policy
        g0 = spec.gamma
        self.gammas = tuple(spec.method.candidates(g0))
        # every round's spec names all candidates: the draft's tail is sized for the
        # largest gamma a previous round may have run (`Auto.tail_len`)
        self.spec = dataclasses.replace(
            spec, method=dataclasses.replace(spec.method, gammas=self.gammas))
        self.plan = first_exploration(policy, self.gammas, g0)
        self.timer = CallTimer()
        self.acceptance = AcceptanceCounter(max(self.gammas))
        self.build = BuildScheduler(policy)
        self.calls: collections.Counter = collections.Counter()
        self.runners: dict[Config, Callable] = {}
        self.n_active = None  # sequences the next call decodes (from the latest read)
        self.prev: Config | None = None  # the configuration read before this one
        self.bounds: dict[int, float] = {}  # gamma -> a round's best speedup (`allow_rounds`)

    @property
    def configs(self) -> tuple[Config, ...]:
        return (PLAIN, *(Config(g) for g in self.gammas))

    def prepare(self, make: Callable[[Config], Callable]):
        """`make(config)` returns each candidate's runner (run(state) -> (state, out),
        donating the state). The configured gamma is compiled by its first call; the
        others, the second one explored first, plain steps last, after the first read."""
        self.runners = {c: make(c) for c in self.configs}
        start = self.plan.start
        second = next((c for c in self.plan.queue if c != start), None)
        rest = [Config(g) for g in sorted(self.gammas, reverse=True)
                if Config(g) not in (start, second)]
        self.build.plan(c for c in (second, *rest, PLAIN) if c is not None)

    def allow_rounds(self, bounds: dict[int, float]) -> bool:
        """Record each candidate gamma's bound on a round's speedup over plain steps
        (`auto_bound`); whether any reaches the policy's `min_gain` (else auto decodes
        plainly: `decode_plainly`)."""
        self.bounds = dict(bounds)
        return max(self.bounds.values()) >= self.policy.min_gain

    def decode_plainly(self, run: Callable):
        """Plain steps only, `run(state) -> (state, out)` a call: no round is compiled."""
        self.runners = {PLAIN: run}
        self.plan = Exploration(PLAIN)

    def evidence(self) -> Evidence:
        fair, loose = self.timer.timed()
        return Evidence(self.gammas, self.acceptance.snapshot(), fair, loose, self.n_active,
                        sum(self.calls.values()))

    def choose(self) -> Config:
        """The next call's configuration (the configured gamma while the other candidates
        are built, or where they never will be)."""
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
        rem = self.acceptance.remaining = None if remaining is None else np.asarray(remaining)
        if active is not None:  # the sequences the next call decodes
            self.n_active = n_ran
            if rem is not None and len(rem) == len(active):
                self.n_active = int((active & (rem > 0)).sum())
        stale, self.prev = self.prev == PLAIN, config
        if not config.plain and n_acc is not None:
            # a round right after plain steps drafts from a selection older than those
            # steps (`Method.after_plain`): its acceptance says little about the next ones
            self.acceptance.add(config.gamma, n_acc, active, count=not stale)
        if self.build.state is Build.ARMED:  # the first read: build if they can be used
            left = None if rem is None or not len(rem) else rem.max() / \
                self.acceptance.snapshot().finish_tau(self.plan.start.gamma, self.policy.prior)
            self.build.first_read(left, dispatch, wait_s, self.runners)

    def stats(self) -> dict:
        est = estimate(self.policy, self.evidence())
        ms = lambda t: None if t is None else round(1e3 * t, 3)  # noqa: E731
        line = est.active_line
        return {
            # gamma -> the most a round could gain over plain steps (`auto_bound`), and
            # whether any reached `min_gain` (else every call was plain steps)
            "round_bound": {Config(g).name: round(b, 4) for g, b in self.bounds.items()},
            "min_gain": self.policy.min_gain,
            "rounds_allowed": not self.plan.start.plain,
            "calls": {c.name: n for c, n in sorted(self.calls.items())},
            "tokens_per_s_per_seq": {c.name: float(r) for c, r in sorted(est.rates.items())},
            "choice": None if est.best() is None else est.best().name,
            "ms_per_call": {c.name: 1e3 * est.call_times[c] for c in sorted(self.calls)
                            if c in est.call_times},
            # intervals the host waited for at both ends (the device's time) / the others
            "timed_calls": {c.name: [len(self.timer.fair.get(c, ())),
                                     len(self.timer.loose.get(c, ()))]
                            for c in sorted(self.calls)},
            # the host's time handing each call to the runtime (median)
            "dispatch_ms": {c.name: 1e3 * float(np.median(t))
                            for c, t in sorted(self.timer.dispatch_s.items())},
            **self.build.stats(),
            # the line t = a + b gamma + c active (ms) in use at the end, if the calls'
            # active counts spread (`auto_choice.fit_active_line`)
            "active_line_ms": None if line is None else [1e3 * v for v in line],
            # the first calls: configuration, interval ms (None: not timed), fair, the
            # host's wait for its output and its dispatch (ms)
            "trace": [[c.name, ms(t), f, ms(w), ms(d)] for c, t, f, w, d in self.timer.trace],
        }

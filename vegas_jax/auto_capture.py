"""What auto measures: each device call's time, from the intervals between reading
consecutive outputs (`CallTimer`), the drafts accepted per position in each draft format
(`AcceptanceCounter`, `FormatAcceptance`) and the rounds each configuration ran
(`RoundCounts`). `auto_choice` turns them into a choice."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

import numpy as np

from vegas_jax.auto_choice import Acceptance, Config
from vegas_jax.driver import DecodeClock


@dataclasses.dataclass(frozen=True)
class Interval:
    """The interval since the last read, which the next read closes."""

    start: float  # when the last read's output arrived (perf_counter)
    waited: bool  # that read found the device busy (the host waited for it)
    cold: bool = False  # a dispatch in it was its executable's first since a build


class CallTimer:
    """Times calls from the reads of their outputs, in dispatch order. An interval is a
    call's device time only when the host waited at both of its ends (`fair`); otherwise
    the next call may have started before the read (`loose`). An interval holding a cold
    dispatch (kernels loaded, command buffers recorded) or one that began before a build
    ended is not timed."""

    TRACE = 64  # calls kept in `trace`
    WAITED_S = DecodeClock.WAITED_S  # a read that blocked this long found the device busy
    # a dispatch this long held the host past the call in flight (a command buffer
    # recorded): the read after it found the device idle, so its interval is not timed
    STALL_S = 5e-3

    def __init__(self):
        self.in_flight: collections.deque = collections.deque()  # (config, dispatch s)
        self.open: Interval | None = None  # None before the first read: no start
        self.warm: set[Config] = set()  # dispatched since the last build
        self.fair: dict[Config, list] = collections.defaultdict(list)  # (s, active)
        self.loose: dict[Config, list] = collections.defaultdict(list)
        self.dispatch_s: dict[Config, list[float]] = collections.defaultdict(list)
        # the first calls: (configuration, interval s or None, fair, wait s, dispatch s)
        self.trace: list = []

    def dispatch(self, config: Config, run: Callable, state):
        """`run(state)`, its dispatch timed; returns its result."""
        if config not in self.warm and self.open is not None:
            self.open = dataclasses.replace(self.open, cold=True)
        self.warm.add(config)
        t = time.perf_counter()
        out = run(state)
        dt = time.perf_counter() - t
        self.dispatch_s[config].append(dt)
        self.in_flight.append((config, dt))
        return out

    def forget_warm(self):
        """A build dropped every command buffer: each configuration's next dispatch is cold."""
        self.warm = set()

    def read(self, ready_at: float | None, wait_s: float | None, n_ran: int | None,
             quiet_since: Callable[[float], bool]) -> tuple[Config, float]:
        """The oldest call in flight was read: ready_at when its output arrived (None:
        now), wait_s how long the host blocked for it (None: it did), n_ran the sequences
        it decoded; `quiet_since(t)`: no build ran after t. Returns (its configuration,
        its dispatch seconds)."""
        config, dispatch = self.in_flight.popleft()
        now = time.perf_counter() if ready_at is None else ready_at
        # the call dispatched after this one (already in flight) may have stalled the host
        # past this call's end: then this read found the device idle
        stalled = bool(self.in_flight) and self.in_flight[0][1] > self.STALL_S
        waited = (wait_s is None or wait_s >= self.WAITED_S) and not stalled
        iv = self.open
        if iv is not None and not iv.cold and quiet_since(iv.start):
            fair = waited and iv.waited
            (self.fair if fair else self.loose)[config].append((now - iv.start, n_ran))
            self._trace(config, now - iv.start, fair, wait_s, dispatch)
        else:
            self._trace(config, None, False, wait_s, dispatch)
        self.open = Interval(now, waited)
        return config, dispatch

    def _trace(self, *row):
        if len(self.trace) < self.TRACE:
            self.trace.append(row)

    def timed(self) -> tuple[dict, dict]:
        """(fair, loose) timed calls per configuration, as `Evidence` takes them."""
        return ({c: tuple(v) for c, v in self.fair.items()},
                {c: tuple(v) for c, v in self.loose.items()})


class AcceptanceCounter:
    """Drafts tried and accepted per position, pooled and per slot; a slot that comes back
    to life holds a new prompt (refilled): its counts start over."""

    def __init__(self, top: int):
        self.trials = np.zeros(top + 1)
        self.hits = np.zeros(top + 1)
        self.slot_trials = self.slot_hits = self.live = None  # [b, top + 1], [b]
        self.remaining = None  # tokens left per slot, None while prompts wait

    def add(self, gamma: int, n_acc, active, count: bool = True):
        """A gamma round's drafts accepted per slot (n_acc [b]) among the slots it ran
        (active [b]); `count` False: the slots are followed, the acceptance not counted."""
        self.follow(active)
        if not count:
            return
        j = np.arange(1, gamma + 1)[None, :]
        tried = (n_acc[:, None] >= j - 1) & active[:, None]  # [b, gamma]
        hit = (n_acc[:, None] >= j) & active[:, None]
        self.trials[1:gamma + 1] += tried.sum(0)
        self.hits[1:gamma + 1] += hit.sum(0)
        self.slot_trials[:, 1:gamma + 1] += tried
        self.slot_hits[:, 1:gamma + 1] += hit

    def follow(self, active):
        """The slots a call ran (active [b]): a slot back to life holds a new prompt."""
        active = np.asarray(active, bool)
        if self.slot_trials is None or len(self.slot_trials) != len(active):
            self.slot_trials = np.zeros((len(active), len(self.trials)))
            self.slot_hits = np.zeros_like(self.slot_trials)
            self.live = active
        reborn = active & ~self.live
        self.slot_trials[reborn] = 0
        self.slot_hits[reborn] = 0
        self.live = active

    def set_remaining(self, remaining):
        """Tokens left per slot [b] (None while prompts wait for a slot)."""
        self.remaining = remaining

    def snapshot(self) -> Acceptance:
        return Acceptance(self.trials, self.hits, self.slot_trials, self.slot_hits, self.live,
                          self.remaining)


class FormatAcceptance:
    """An `AcceptanceCounter` per draft format: a format's drafts are accepted at a rate
    of their own. Every format's counter follows every round's slots (a slot refilled
    while another format ran starts over in each)."""

    def __init__(self, formats, top: int):
        self.counters = {f: AcceptanceCounter(top) for f in formats}

    def add(self, fmt: str, gamma: int, n_acc, active, count: bool = True):
        """`AcceptanceCounter.add` of a round whose drafts read `fmt`'s weights."""
        for f, counter in self.counters.items():
            if f == fmt:
                counter.add(gamma, n_acc, active, count)
            else:
                counter.follow(active)

    def set_remaining(self, remaining):
        """Tokens left per slot (None while prompts wait), for every format's tau."""
        for counter in self.counters.values():
            counter.set_remaining(remaining)

    def snapshot(self) -> dict[str, Acceptance]:
        return {f: c.snapshot() for f, c in self.counters.items()}


class RoundCounts:
    """The rounds read per configuration: how many, and tau = tokens emitted over the
    sequence-rounds (each active sequence's drafts accepted and one token more), every
    round counted as `tally.Tally` counts it."""

    def __init__(self):
        self.rounds: collections.Counter = collections.Counter()
        self.seq_rounds: collections.Counter = collections.Counter()
        self.tokens: collections.Counter = collections.Counter()

    def add(self, config: Config, n_acc, active):
        n = np.asarray(n_acc) if active is None else np.asarray(n_acc)[active]
        self.rounds[config] += 1
        self.seq_rounds[config] += len(n)
        self.tokens[config] += int(n.sum()) + len(n)

    def stats(self, config: Config) -> dict:
        """`config`'s rounds read, their sequence-rounds and tau (None: no sequence ran)."""
        seq = self.seq_rounds[config]
        return {"rounds": self.rounds[config], "sequence_rounds": seq,
                "tau": self.tokens[config] / seq if seq else None}

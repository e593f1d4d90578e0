"""When auto compiles its candidates other than the configured gamma (`BuildScheduler`).

The configured gamma is compiled by its first call (as a fixed method's round is). At the
first read, where the tokens left need `build_min_calls` calls or more and, for a
background build, outlast it (`BuildScheduler.covers`), a thread compiles the others
while the calls run (`compile_only`: each runner called on the state the first call
donated; XLA's compile releases the GIL; on a CPU device the read waits for it instead:
the compile would take the calls' cores); a shorter generation could not use them and
keeps the configured gamma. Until the build is over every call runs the configured gamma
and no interval is timed (a compile holds the host and, with its autotuning, the GPU);
after it each candidate's first dispatch is cold (building an executable drops every
command buffer)."""

from __future__ import annotations

import enum
import threading
import time
import weakref
from typing import Callable

import jax

from vegas_jax.auto_choice import AutoPolicy, Config


class Build(enum.Enum):
    """Where the build of the other candidates stands."""

    NONE = "none"  # nothing to build: one candidate
    PENDING = "pending"  # waits for the first call, whose donated state it compiles on
    ARMED = "armed"  # holds that state; the first read decides
    SKIPPED = "skipped"  # too little decoding left to use them: never built
    RUNNING = "running"  # compiling
    BUILT = "built"  # over; no call dispatched since
    IN_USE = "done"  # over, and a call dispatched since (its buffers were dropped)


THREAD_NAME = "vegas_jax auto build"


class BuildScheduler:
    """The build's state machine: NONE, or PENDING -> ARMED (first call) -> SKIPPED |
    RUNNING -> BUILT | BUILT (first read) -> IN_USE (next call). The thread moves RUNNING
    to BUILT; it stops early once the scheduler is dropped (the generation is over: the
    process waits at exit for the compile under way only)."""

    def __init__(self, policy: AutoPolicy):
        self.policy = policy
        self.state = Build.NONE
        self.order: tuple[Config, ...] = ()  # the candidates to build, in order
        self.spent = None  # ARMED: the state the first call donated
        self.ready: set[Config] = set()  # configurations whose executables exist
        self.background: bool | None = None  # whether the build ran in a thread
        self.compile_s: float | None = None  # the thread's seconds, once BUILT
        self.ended_at: float | None = None  # when it ended (perf_counter), once BUILT
        self.in_use_from: int | None = None  # calls dispatched before a call saw it over

    def plan(self, order):
        """The candidates to build after the first call, in order."""
        self.order = tuple(order)
        self.state = Build.PENDING if self.order else Build.NONE

    @property
    def settled(self) -> bool:
        """Whether the choice is free: nothing to build, or the build is over."""
        return self.state in (Build.NONE, Build.BUILT, Build.IN_USE)

    def quiet_since(self, t: float) -> bool:
        """Whether no build ran after time t (an interval from t on may be timed)."""
        if self.state is Build.NONE:
            return True
        return self.state in (Build.BUILT, Build.IN_USE) and self.ended_at <= t

    def dispatched(self, config: Config, state, calls: int) -> bool:
        """A call of `config` on `state` was dispatched, `calls` before it. Returns
        whether it is the first since the build ended (every command buffer dropped)."""
        self.ready.add(config)  # built by this dispatch if not before
        if self.state is Build.PENDING:
            self.state, self.spent = Build.ARMED, state  # donated by that call
        elif self.state is Build.BUILT:
            self.state, self.in_use_from = Build.IN_USE, calls
            return True
        return False

    def background_default(self) -> bool:
        if self.policy.background is None:
            return jax.default_backend() != "cpu"
        return self.policy.background

    def covers(self, calls_left: float, compile_s: float, call_s: float | None) -> bool:
        """Whether `calls_left` calls of `call_s` (the first call's wait for its output:
        its device time; None: not known) outlast building the candidates, each as long
        as the first call's dispatch (`compile_s`, its compile). A foreground build holds
        the generation whatever its length: the calls left alone decide there."""
        if not self.background_default() or call_s is None:
            return True
        return calls_left * call_s >= self.policy.build_min_cover * compile_s * len(self.order)

    def first_read(self, calls_left: float | None, compile_s: float, call_s: float | None,
                   runners: dict):
        """ARMED: build the candidates if the calls left can use them (None: not known),
        else skip them."""
        p = self.policy
        if p.background is False or calls_left is None or (
                calls_left >= p.build_min_calls and self.covers(calls_left, compile_s, call_s)):
            self._start(runners)
        else:
            self.state, self.order, self.spent = Build.SKIPPED, (), None

    def _start(self, runners: dict):
        """Compile the candidates in a thread, one after another, on the donated state.
        Where it holds no donated buffer, each is compiled by its first call instead."""
        order, spent, self.order, self.spent = self.order, self.spent, (), None
        if not any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(spent)):
            self.ended_at, self.state = time.perf_counter(), Build.BUILT
            return
        self.state, self.background = Build.RUNNING, self.background_default()
        me, ready, t0 = weakref.ref(self), self.ready, time.perf_counter()

        def build():
            for c in order:
                if me() is None:
                    return
                try:
                    compile_only(runners[c], spent)
                    ready.add(c)
                except Exception:  # noqa: BLE001 (its first call compiles it, and raises)
                    pass
            if (s := me()) is not None:
                s.compile_s, s.ended_at = time.perf_counter() - t0, time.perf_counter()
                s.state = Build.BUILT  # last: a reader that sees it sees ended_at

        thread = threading.Thread(target=build, name=THREAD_NAME)
        thread.start()
        if not self.background:
            thread.join()

    def stats(self) -> dict:
        return {
            # the other candidates' build (`Build`), its seconds and the calls dispatched
            # before a call saw it over (None: not before the last call)
            "build": "done" if self.state is Build.BUILT else self.state.value,
            "build_background": self.background,
            "compile_s": self.compile_s,
            "built_after_calls": self.in_use_from,
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

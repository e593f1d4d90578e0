"""auto's choice, as pure functions: from the call times measured and the acceptance
counted so far (`Evidence`), the next device call's configuration (`decide`): a round of
gamma drafts reading the weights of one format (`Config.draft_weights`: the model's own,
or an int8 / int4 copy), or plain steps. No clock, no thread, no device here:
`auto.AutoController` gathers the evidence (`auto_capture`) and asks.

The cost model: a call's device time is the interval between reading consecutive outputs
(one call stays in flight, so the host waits on the device); a round's time is a line
t = a + b_f * gamma through the rounds timed, with a term c * active in the sequences the
next call decodes once the calls' counts spread (a batch of fixed-length outputs thins
out at its end). The intercept a (the verify, the capture, the selection: they read the
model's own weights whatever the drafts read) is shared by the formats; the slope b_f (a
draft step, and the verify's row for it) is each format's own, so that one timed gamma
of a format beside a format timed at two gives its line. tau(gamma) = 1 + sum_i
prod_{j<=i} a_j from the conditional acceptance a_j of each draft position seen so far
in that format (a format's drafts are accepted at their own rate: fewer bits, fewer);
while no prompt waits for a slot it is the batch's finish as its slowest sequence sees it
(`Acceptance.finish_tau`).

The exploration (`first_exploration`): rounds of the configured (gamma, format), then the
configured gamma in each other format, then a second gamma (the next lower, else the next
higher) in the format whose rate came out best. Acceptance is what a format changes and
what no size predicts, and at one gamma the formats share the verify, so the first calls
compare their drafts directly; the second gamma gives the slope where the choice will be
made, and the other formats' lines follow through the shared intercept. That is one
window of calls a format and one more, however many (gamma, format) pairs there are: the
rest are estimated, and measured once one is estimated best. Plain steps are tried once,
and only where the line's intercept (a verify reads what a plain step reads, and more)
says they could win; every `reprobe` calls the runner-up runs once when its estimate is
close."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

SAME = "same"  # the drafts read the model's own weights (`quant.DRAFT_WEIGHTS`)


@dataclasses.dataclass(frozen=True, order=True)
class Config:
    """What one device call of auto runs: a round of `gamma` drafts reading the weights of
    `draft_weights` (`quant.DRAFT_WEIGHTS`), or (gamma 0) plain decoding steps
    (`AutoPolicy.plain_steps` of them), which read no draft."""

    gamma: int
    draft_weights: str = SAME

    def __post_init__(self):
        if self.gamma == 0 and self.draft_weights != SAME:
            raise ValueError(f"plain steps draft nothing: draft_weights must be {SAME!r}, got "
                             f"{self.draft_weights!r}")

    @property
    def plain(self) -> bool:
        return self.gamma == 0

    @property
    def name(self) -> str:
        if self.plain:
            return "vanilla"
        fmt = "" if self.draft_weights == SAME else f" {self.draft_weights}"
        return f"gamma {self.gamma}{fmt}"


PLAIN = Config(0)


@dataclasses.dataclass(frozen=True)
class AutoPolicy:
    """auto's settings. The defaults are those RESULTS.md's auto rows ran with."""

    window: int = 3  # calls of a configuration run in a row while exploring
    plain_steps: int = 8  # plain decoding steps in one plain call
    reprobe: int = 12  # every this many calls the runner-up runs once when close...
    reprobe_margin: float = 0.15  # ... within this fraction of the best rate
    # sequence-rounds seen before plain steps may be tried: acceptance from a handful of
    # rounds is too noisy to give up on speculation
    min_trials: int = 24
    # per-sequence acceptance is shrunk toward the batch's by this many pseudo-trials (a
    # sequence's own count is a handful of rounds early on)
    prior: float = 16
    # plain steps are probed when the bound's rate is within this of the best round's
    plain_margin: float = 0.15
    # the timed calls' active counts spread by this fraction of the largest before the
    # line takes a term in them: a median over whole-batch and tail calls misleads
    active_spread: float = 0.25
    # calls left at the first read (the slowest sequence's tokens left over its tau at
    # the configured gamma) below which the other candidates are not built: exploring
    # takes as many
    build_min_calls: int = 24
    # and, for a background build, the decode time left (those calls at the first call's
    # device time) over the build's (the first call's compile per candidate) below which
    # they are not built either: a build the generation does not outlast is never used,
    # and it slows the calls it overlaps
    build_min_cover: float = 1.0
    # None: the others are built in the background unless the device is the host's CPU
    # (a compile there takes the cores the calls run on: the first read waits for it);
    # False: the first read waits for them however short the generation (benchmarks of
    # the adaptive choice from the first calls on); True: in the background
    background: bool | None = None
    # a round must be able to beat plain steps by this much, at best (`auto_bound`), or
    # auto decodes plainly and compiles no round: the bound leaves out the verify's extra
    # tokens, the selection and the compiles (RESULTS.md "auto vs vegas": B 1 gains far
    # less than its bound). 1: speculate wherever a round could at least tie.
    min_gain: float = 1.25

    def __post_init__(self):
        if self.window < 1 or self.plain_steps < 1 or self.reprobe < 1:
            raise ValueError("AutoPolicy: window, plain_steps and reprobe must be >= 1")


Sample = tuple  # (seconds, active sequences or None) of one timed call


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Drafts tried and accepted per draft position (entry 0 unused), pooled and per slot."""

    trials: np.ndarray  # [top + 1] sequence-rounds that drafted position i
    hits: np.ndarray  # [top + 1] ... and accepted it
    slot_trials: np.ndarray | None = None  # [b, top + 1] the same per slot
    slot_hits: np.ndarray | None = None
    live: np.ndarray | None = None  # [b] the slots decoding now
    remaining: np.ndarray | None = None  # [b] tokens left per slot; None: prompts wait

    def pooled(self):
        """(trials, hits) of the sequences still decoding: once most have finished, a
        batch of fixed-length outputs waits on the rest, whose acceptance sets how long."""
        if self.slot_trials is not None and self.live.any() and not self.live.all():
            return self.slot_trials[self.live].sum(0), self.slot_hits[self.live].sum(0)
        return self.trials, self.hits

    def tau(self, gamma: int) -> float:
        """The mean accepted length of a gamma round over the sequences still decoding."""
        trials, hits = self.pooled()
        if not (trials[1:] > 0).any():
            return float(gamma + 1)  # nothing seen yet: every draft accepted
        return 1.0 + float(np.cumprod(conditional(trials, hits)[1:gamma + 1]).sum())

    def finish_tau(self, gamma: int, prior: float) -> float:
        """tau as the batch's finish sees it. While no prompt waits for a slot, the batch
        ends with the sequence whose tokens left / own tau is largest (R_s / tau_s(gamma)
        rounds): the value is R / max_s(R_s / tau_s), R the most tokens any has left, so
        that finish-time ratios read as tau / call time (all R_s equal: the smallest
        tau_s). tau_s from each sequence's own acceptance, shrunk toward the batch's by
        `prior` trials. Otherwise (prompts waiting, nothing read yet) `tau`."""
        rem = self.remaining
        if rem is None or self.slot_trials is None or len(rem) != len(self.slot_trials):
            return self.tau(gamma)
        left = rem > 0
        trials, hits = self.pooled()
        if not left.any() or not (trials[1:] > 0).any():
            return self.tau(gamma)
        pool = conditional(trials, hits)
        alpha = conditional(self.slot_trials[left], self.slot_hits[left], pool[None, :],
                            prior)  # [n, top + 1]
        tau_s = 1.0 + np.cumprod(alpha[:, 1:gamma + 1], axis=1).sum(1)  # [n]
        r = rem[left].astype(float)
        return float(r.max() / (r / tau_s).max())


def conditional(trials, hits, prior=0.0, weight=0.0):
    """Conditional acceptance per draft position ([..., top + 1], entry 0 unused):
    hits / trials, shrunk toward `prior` by `weight` pseudo-trials; positions never
    drafted take the last one seen."""
    alpha = (hits + weight * prior) / np.maximum(trials + weight, 1e-9)
    seen = (trials + weight) > 0
    seen[..., 0] = False
    last_i = np.where(seen, np.arange(seen.shape[-1]), 0).max(-1, keepdims=True)
    last = np.take_along_axis(alpha, last_i, -1)
    return np.where(seen, alpha, last)


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What the choice reads: the candidates, the timed calls and the acceptance."""

    gammas: tuple[int, ...]
    # per draft format (the candidate formats, in order): its drafts' acceptance
    acceptance: Mapping[str, Acceptance]
    # per configuration, its timed calls: those the host waited for at both ends (the
    # device's time) / the others
    fair: Mapping[Config, tuple[Sample, ...]] = dataclasses.field(default_factory=dict)
    loose: Mapping[Config, tuple[Sample, ...]] = dataclasses.field(default_factory=dict)
    n_active: int | None = None  # sequences the next call decodes (None: not known)
    calls: int = 0  # device calls dispatched so far

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(self.acceptance)

    @property
    def configs(self) -> tuple[Config, ...]:
        return (PLAIN, *(Config(g, f) for f in self.formats for g in self.gammas))

    def samples(self, c: Config) -> tuple[Sample, ...]:
        """The last 8 timed calls of c: the fair ones, or while there are none (a
        host-bound loop never waits), all."""
        return tuple((self.fair.get(c) or self.loose.get(c) or ())[-8:])

    def first_drafts(self) -> float:
        """Sequence-rounds counted so far (in every format): each drafted position 1."""
        return float(sum(a.trials[1] for a in self.acceptance.values()))


@dataclasses.dataclass(frozen=True)
class Line:
    """A round's time t = a + b[format] * gamma (+ c * active: `c` where fitted)."""

    a: float
    b: Mapping[str, float]
    c: float | None = None

    def at(self, n_active: int) -> "Line":
        """The line at `n_active` sequences (its active term folded into a)."""
        return Line(self.a + (self.c or 0.0) * n_active, self.b)

    def ms(self) -> dict:
        return {"a": 1e3 * self.a, "b": {f: 1e3 * v for f, v in self.b.items()},
                "c": None if self.c is None else 1e3 * self.c}


def fit_line(rows, formats) -> Line | None:
    """Least squares of t = a + b_f * gamma (+ c * active, where every row has its count)
    over rows (gamma, format, active or None, seconds); None where the rows do not
    determine it (a format's slope needs a second gamma, its own or another format's)."""
    fmts = [f for f in formats if any(r[1] == f for r in rows)]
    counted = bool(rows) and all(r[2] is not None for r in rows)
    cols = [[1.0] * len(rows), *([g * (f == h) for g, f, _, _ in rows] for h in fmts)]
    if counted:
        cols.append([n for _, _, n, _ in rows])
    x = np.array(cols, dtype=float).T  # [rows, 1 + formats (+ 1)]
    t = np.array([r[3] for r in rows], dtype=float)
    if len(rows) < x.shape[1] or np.linalg.matrix_rank(x) < x.shape[1]:
        return None
    sol, *_ = np.linalg.lstsq(x, t, rcond=None)
    sol = [float(v) for v in sol]
    return Line(sol[0], dict(zip(fmts, sol[1:1 + len(fmts)])), sol[-1] if counted else None)


@dataclasses.dataclass(frozen=True)
class Estimates:
    """Call times and rates from one `Evidence`."""

    call_times: dict  # Config -> the median of its last timed calls (s)
    line: Line | None  # a round's time at the next call's count
    active_line: Line | None  # with its active term, where fitted
    rates: dict = dataclasses.field(default_factory=dict)  # Config -> tokens/s a sequence

    def round_time(self, gamma: int, fmt: str = SAME) -> float | None:
        """A round's time, on the line where it holds the format's slope and is a cost,
        else in proportion to gamma + 1 from the format's cheapest timed round a token
        (None: no round of the format timed)."""
        line = self.line
        if line is not None and line.b.get(fmt, 0.0) > 0 and line.a >= 0:
            return line.a + line.b[fmt] * gamma
        pts = [(c.gamma, t) for c, t in self.call_times.items()
               if not c.plain and c.draft_weights == fmt]
        if not pts:
            return None
        g, t = min(pts, key=lambda p: p[1] / (p[0] + 1))  # one gamma seen, or noise
        return t * (gamma + 1) / (g + 1)

    def rounds(self) -> list[tuple[int, float]]:
        """(gamma, call time) of every round configuration timed so far, any format."""
        return [(c.gamma, t) for c, t in self.call_times.items() if not c.plain]

    def plain_step_bound(self) -> float | None:
        """A plain step's time estimated from the rounds alone: the line's intercept
        (from above: a verify reads the whole cache, as a step does, and also captures and
        selects); where the line does not grow with gamma (drafts too cheap to see among
        the noise) the shortest round; with one gamma timed, or a line through the origin
        or below (launch-bound drafts, a step's cost each), the shortest round time per
        token it processes (t / (gamma + 1), from below). None before any round is timed."""
        pts = self.rounds()
        if not pts:
            return None
        if self.line is not None:
            if min(self.line.b.values()) <= 0:
                return min(t for _, t in pts)
            if self.line.a > 0:
                return self.line.a
        return min(t / (g + 1) for g, t in pts)

    def best(self) -> Config | None:
        return max(self.rates, key=self.rates.get) if self.rates else None


def fit_active_line(ev: Evidence, spread: float) -> Line | None:
    """The line with its active term, least squares over the rounds' last timed calls,
    where their active counts spread by `spread` and the rows determine it; None
    otherwise, or where the fit is not a cost (a slope <= 0, c < 0)."""
    rows = [(c.gamma, c.draft_weights, n, t) for c in ev.configs if not c.plain
            for t, n in ev.samples(c) if n is not None]
    if not rows:
        return None
    n = np.array([r[2] for r in rows], dtype=float)
    if n.max() - n.min() < spread * n.max():
        return None
    line = fit_line(rows, ev.formats)
    if line is None or min(line.b.values()) <= 0 or line.c < 0:
        return None
    return line


def estimate(policy: AutoPolicy, ev: Evidence) -> Estimates:
    """Each timed configuration's call time, the rounds' line (the active-count fit at
    the next call's count where there is one, else least squares through each timed
    round configuration's median) and every configuration's rate: plain steps' from their
    own time, a round's from its format's tau as the batch's finish sees it over the
    line's time."""
    med = {c: float(np.median([t for t, _ in s])) for c in ev.configs if (s := ev.samples(c))}
    active = fit_active_line(ev, policy.active_spread) if ev.n_active is not None else None
    if active is not None:
        line = active.at(ev.n_active)
    else:
        line = fit_line([(c.gamma, c.draft_weights, None, t) for c, t in med.items()
                         if not c.plain], ev.formats)
    est = Estimates(med, line, active)
    rates = {}
    if PLAIN in med:
        rates[PLAIN] = policy.plain_steps / med[PLAIN]
    for c in ev.configs:
        if not c.plain and (t := est.round_time(c.gamma, c.draft_weights)) is not None:
            rates[c] = ev.acceptance[c.draft_weights].finish_tau(c.gamma, policy.prior) / t
    return dataclasses.replace(est, rates=rates)


@dataclasses.dataclass(frozen=True)
class Exploration:
    """Where the choice stands: the configuration it falls back on, the calls queued to
    explore, the gamma still to time for the slope (in the best format, once the queue
    is done) and whether plain steps were considered once."""

    start: Config
    queue: tuple[Config, ...] = ()
    plain_probed: bool = False
    slope: int | None = None

    def pop(self) -> tuple[Config, "Exploration"]:
        return self.queue[0], dataclasses.replace(self, queue=self.queue[1:])


def first_exploration(policy: AutoPolicy, gammas: tuple[int, ...], start: Config,
                      formats: tuple[str, ...] = ()) -> Exploration:
    """The configured (gamma, format)'s calls (one more: the first read has no interval),
    then the configured gamma's in each other format of `formats`; the second gamma (the
    next lower, else the next higher) waits for them (module docstring)."""
    lower = [g for g in gammas if g < start.gamma]
    second = lower[-1] if lower else next((g for g in gammas if g > start.gamma), None)
    queue = (start,) * (policy.window + 1)
    for f in formats:
        if f != start.draft_weights:
            queue += (Config(start.gamma, f),) * policy.window
    return Exploration(start, queue, slope=second)


def _with_slope(policy: AutoPolicy, plan: Exploration, est: Estimates) -> Exploration:
    """The second gamma queued, in the format whose configured gamma timed best (the
    start's where none was timed)."""
    g0 = plan.start.gamma
    timed = [c for c in est.call_times if not c.plain and c.gamma == g0 and c in est.rates]
    fmt = max(timed, key=est.rates.get, default=plan.start).draft_weights
    return dataclasses.replace(plan, queue=(Config(plan.slope, fmt),) * policy.window,
                               slope=None)


def _without_losers(plan: Exploration, est: Estimates) -> Exploration:
    """The queued rounds that cannot beat the plain steps timed, every draft accepted,
    dropped."""
    if PLAIN not in est.rates:
        return plan

    def loses(c):
        t = None if c.plain else est.round_time(c.gamma, c.draft_weights)
        return t is not None and (c.gamma + 1) / t < est.rates[PLAIN]

    return dataclasses.replace(plan, queue=tuple(c for c in plan.queue if not loses(c)))


def decide(policy: AutoPolicy, ev: Evidence, plan: Exploration) -> tuple[Config, Exploration]:
    """The next call's configuration and the exploration after it."""
    if plan.start.plain:  # decoding plainly throughout (`AutoPolicy.min_gain`)
        return PLAIN, plan
    est = estimate(policy, ev)
    rates = est.rates
    if not plan.queue and plan.slope is not None:
        plan = _with_slope(policy, plan, est)
    plan = _without_losers(plan, est)
    if plan.queue:
        return plan.pop()
    if not rates:
        return plan.start, plan
    if (PLAIN not in rates and not plan.plain_probed
            and ev.first_drafts() >= policy.min_trials and ev.calls >= policy.reprobe):
        plan = dataclasses.replace(plan, plain_probed=True)  # once: a probe's time decides
        step = est.plain_step_bound()
        if step is not None and 1 / step >= (1 - policy.plain_margin) * max(rates.values()):
            return PLAIN, plan  # one call: its time decides (`rates`) whether more follow
    ranked = sorted(rates, key=rates.get, reverse=True)
    best = ranked[0]
    if best not in est.call_times:  # chosen on an estimate: measure it
        return best, dataclasses.replace(plan, queue=(best,) * (policy.window - 1))
    if (len(ranked) > 1 and ev.calls % policy.reprobe == 0
            and rates[ranked[1]] > (1 - policy.reprobe_margin) * rates[best]):
        if best.plain and not ranked[1].plain:
            # the first round after plain steps drafts from a stale selection and its
            # acceptance is not counted: a second one is what updates the estimate
            plan = dataclasses.replace(plan, queue=(ranked[1],))
        return ranked[1], plan
    return best, plan

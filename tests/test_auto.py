"""auto's parts without a model: the pure choice (`auto_choice`) on synthetic timings and
acceptance, the timing capture and acceptance counts (`auto_capture`), the build
scheduler's states (`auto_build`), and the controller driven like `drive` (one call in
flight) on a fake clock. Generations with method auto: test_speculative."""

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax import auto_build
from vegas_jax.auto import AutoController
from vegas_jax.auto_build import Build, BuildScheduler, compile_only
from vegas_jax.auto_capture import AcceptanceCounter, CallTimer, FormatAcceptance
from vegas_jax.auto_choice import (
    PLAIN, Acceptance, AutoPolicy, Config, Evidence, Exploration, decide, estimate,
    first_exploration, fit_active_line, fit_line,
)
from vegas_jax.execution import ExecConfig
from vegas_jax.methods import Auto
from vegas_jax.speculative import SpecConfig

P = AutoPolicy()
G = Config  # Config(4): a round of 4 drafts; Config(4, "int4"): reading int4 weights
FORMATS = ("same", "int8", "int4")
XLA = ExecConfig(backend="xla")
PALLAS = ExecConfig(backend="pallas")


def _acceptance(top, rates=None, seen=100):
    """Pooled counts: `seen` trials at every position up to top, `rates[i]` accepted."""
    trials, hits = np.zeros(top + 1), np.zeros(top + 1)
    if rates is not None:
        trials[1:] = seen
        hits[1:] = np.asarray(rates) * seen
    return Acceptance(trials, hits)


def _evidence(gammas, times, acc, n_active=None, calls=1, fair=True):
    """times: {config: [(seconds, active or None), ...]}; acc: the drafts' acceptance
    (the model's own weights), or {format: acceptance}."""
    timed = {c: tuple(v) for c, v in times.items()}
    acc = acc if isinstance(acc, dict) else {"same": acc}
    return Evidence(tuple(gammas), acc, timed if fair else {}, {} if fair else timed,
                    n_active, calls)


def _flat(ts):
    return [(t, None) for t in ts]


# ---------------------------------------------------------------------------------------
# The pure choice
# ---------------------------------------------------------------------------------------

def test_auto_candidates():
    assert Auto().candidates(6) == (4, 6, 8)
    assert Auto().candidates(1) == (1, 3)
    assert Auto(gammas=(2, 9)).candidates(4) == (2, 4, 9)
    ctl = AutoController(SpecConfig(method="auto", gamma=6))
    assert ctl.gammas == (4, 6, 8) and ctl.spec.method.gammas == (4, 6, 8)
    # every round's tail holds what the largest candidate's round may leave
    assert ctl.spec.method.tail_len(ctl.spec, 1024) == 2 * 8 + 1
    with pytest.raises(TypeError, match="auto_policy"):
        AutoController(SpecConfig(method="auto"), policy={"window": 3})
    with pytest.raises(ValueError, match="window"):
        AutoPolicy(window=0)


def test_first_exploration_runs_the_configured_gamma_then_a_second():
    """The configured gamma (one call more: the first read has no interval), then the
    second gamma (the next lower, else the next higher), queued once the first calls are
    done (in the format that came out best: one format here)."""
    for gammas, g0, second in (((4, 6, 8), 6, 4), ((1, 3), 1, 3), ((4,), 4, None)):
        plan = first_exploration(P, gammas, G(g0))
        assert plan.queue == (G(g0),) * 4 and plan.slope == second
        calls = []
        acc = _acceptance(8, [0.8] * 8)
        for _ in range(4 + 3 * (second is not None) + 1):
            c, plan = decide(P, _evidence(gammas, {}, acc), plan)
            calls.append(c)
        assert calls[:4] == [G(g0)] * 4
        assert calls[4:7] == ([G(second)] * 3 if second else [G(g0)] * 1)
    plan = first_exploration(AutoPolicy(window=1), (4, 6), G(6))
    assert plan.queue == (G(6),) * 2 and plan.slope == 4


def test_tau_from_conditional_acceptance():
    acc = _acceptance(8)
    for a in (4, 4, 2, 3):  # accepted counts of 4 sequence-rounds at gamma 4
        acc.trials[1:5] += [1, 1, 1, a >= 3]
        acc.hits[1:5] += [a >= 1, a >= 2, a >= 3, a >= 4]
    # alpha = 1, 1, 3/4, 2/3 -> tau(4) = 1 + 1 + 1 + .75 + .5 ; beyond: alpha 2/3 repeats
    assert acc.tau(4) == pytest.approx(4.25)
    assert acc.tau(5) == pytest.approx(4.25 + 0.5 * 2 / 3)
    assert _acceptance(4).tau(4) == 5.0  # nothing seen: every draft accepted


def test_cost_model_and_choice():
    """tau from conditional acceptance, time from a line through the measured rounds, and
    the choice of the configuration with the most tokens per second."""
    acc = _acceptance(8)
    for a in (4, 4, 2, 3):
        acc.trials[1:5] += [1, 1, 1, a >= 3]
        acc.hits[1:5] += [a >= 1, a >= 2, a >= 3, a >= 4]
    times = {G(4): _flat([0.010] * 3), G(8): _flat([0.014] * 3),
             PLAIN: _flat([0.001 * 8] * 3)}  # a plain step 1 ms: 1000 tokens/s
    est = estimate(P, _evidence((2, 4, 6, 8), times, acc))
    assert est.round_time(6) == pytest.approx(0.012)
    assert est.rates[PLAIN] == pytest.approx(1000)
    assert est.rates[G(4)] == pytest.approx(425)
    assert est.rates[G(2)] == pytest.approx(3 / 0.008)  # t(2) = 6 ms + 2 x 1 ms
    plan = Exploration(G(4))
    assert decide(P, _evidence((2, 4, 6, 8), times, acc), plan)[0] == PLAIN
    times[PLAIN] = _flat([0.004 * 8] * 3)  # a plain step 4 ms: 250 tokens/s, rounds win
    assert decide(P, _evidence((2, 4, 6, 8), times, acc), plan)[0] == G(4)  # 4.25 / 10 ms
    # every `reprobe` calls the runner-up (gamma 6, 400/s) runs once
    c, after = decide(P, _evidence((2, 4, 6, 8), times, acc, calls=P.reprobe), plan)
    assert c == G(6) and after.queue == ()
    # plain steps best (435/s), gamma 4 (425/s) runner-up: two rounds, the first one's
    # acceptance is stale
    times[PLAIN] = _flat([0.0023 * 8] * 3)
    c, after = decide(P, _evidence((2, 4, 6, 8), times, acc, calls=P.reprobe), plan)
    assert c == G(4) and after.queue == (G(4),)
    # chosen on an estimate (gamma 10 never ran: 11 tokens in 11.5 ms on the line through
    # 10 and 11 ms): measured next, `window` calls in all
    times = {G(4): _flat([0.010] * 3), G(8): _flat([0.011] * 3)}
    c, after = decide(P, _evidence((4, 8, 10), times, _acceptance(10, [1] * 10)), plan)
    assert c == G(10) and after.queue == (G(10),) * (P.window - 1)


def test_choice_drops_queued_rounds_that_cannot_win():
    """Plain steps of 1 ms against a 10 ms round at gamma 4: even tau = 5 loses, so the
    rounds still queued for exploration are dropped."""
    times = {PLAIN: _flat([0.008] * 2), G(4): _flat([0.010])}
    c, after = decide(P, _evidence((4,), times, _acceptance(4)),
                      Exploration(G(4), (G(4), G(4))))
    assert c == PLAIN and after.queue == ()


def test_choice_probes_plain_steps_once_where_the_rounds_intercept_allows():
    """No plain call timed yet: after `min_trials` sequence-rounds and `reprobe` calls,
    one plain call is tried where the rounds' intercept (a plain step's bound) is within
    `plain_margin` of the best round; never where drafts are cheap beside the verify."""
    acc = _acceptance(6, [0.2] * 6, seen=P.min_trials)  # tau(6) ~ 1.25
    launch_bound = {G(4): _flat([0.0012 + 4 * 0.0011] * 3),
                    G(6): _flat([0.0012 + 6 * 0.0011] * 3)}
    c, after = decide(P, _evidence((4, 6), launch_bound, acc, calls=P.reprobe),
                      Exploration(G(6)))
    assert c == PLAIN and after.plain_probed
    assert decide(P, _evidence((4, 6), launch_bound, acc, calls=P.reprobe), after)[0] != PLAIN
    cheap_drafts = {G(4): _flat([0.0065 + 4 * 0.0001] * 3),
                    G(6): _flat([0.0065 + 6 * 0.0001] * 3)}
    good = _acceptance(6, [0.9] * 6, seen=P.min_trials)
    assert decide(P, _evidence((4, 6), cheap_drafts, good, calls=P.reprobe),
                  Exploration(G(6)))[0] == G(6)


def test_cost_line_follows_the_active_count():
    """The batch's tail: gamma 4 / 6 / 8 timed with the whole batch (64 sequences), then
    gamma 8 alone with 10 left. Each configuration's median then says gamma 8 (10.5 ms,
    mostly tail calls) is cheaper than gamma 6 (12.3 ms, whole-batch calls); the line in
    the active count gives each gamma's time with 10 sequences, and gamma 6 wins there
    where gamma 8 wins with the whole batch."""
    cost = lambda g, n: 0.0025 + 0.0009 * g + 0.00006 * n  # noqa: E731  (s)
    acc = _acceptance(8, [0.9] * 8)  # tau(6) = 5.22, tau(8) = 6.13 (+17 %)
    times = {G(g): [(cost(g, 64), 64)] * 3 for g in (4, 6, 8)}
    est = estimate(P, _evidence((4, 6, 8), times, acc, n_active=64))
    assert est.round_time(6) == pytest.approx(cost(6, 64))  # no spread: the medians' line
    assert est.best() == G(8)  # 6.13 / 13.5 ms vs 5.22 / 11.7
    times[G(8)] = times[G(8)] + [(cost(8, 10), 10)] * 5
    ev = _evidence((4, 6, 8), times, acc, n_active=10)
    est = estimate(P, ev)
    assert est.call_times[G(8)] < est.call_times[G(6)]  # the medians mislead
    line = fit_active_line(ev, P.active_spread)
    assert (line.a, line.b["same"], line.c) == pytest.approx((0.0025, 0.0009, 0.00006),
                                                             rel=1e-6)
    assert est.round_time(6) == pytest.approx(cost(6, 10))
    assert est.round_time(8) == pytest.approx(cost(8, 10))
    assert est.best() == G(6)  # 5.22 / 8.5 ms vs 6.13 / 10.3
    # counts not known (plain steps, or calls timed without them): the medians' line
    unknown = {c: [(t, None) for t, _ in v] for c, v in times.items()}
    assert fit_active_line(_evidence((4, 6, 8), unknown, acc, 10), P.active_spread) is None


def test_loose_times_serve_only_where_no_fair_one_exists():
    acc = _acceptance(4)
    ev = Evidence((4,), {"same": acc}, fair={PLAIN: ((0.008, 1),)},
                  loose={PLAIN: ((0.012, 1), (0.004, 1)), G(4): ((0.006, 1),)})
    est = estimate(P, ev)
    assert est.call_times == {PLAIN: pytest.approx(0.008), G(4): pytest.approx(0.006)}


def test_config_names_and_plain_steps_read_no_draft():
    assert G(6).name == "gamma 6" and G(6, "int4").name == "gamma 6 int4"
    assert PLAIN.name == "vanilla" and PLAIN == G(0, "same")
    with pytest.raises(ValueError, match="draft_weights"):
        G(0, "int4")


def test_first_exploration_tries_each_format_at_the_configured_gamma():
    plan = first_exploration(P, (4, 6, 8), G(6, "int8"), FORMATS)
    assert plan.queue == (G(6, "int8"),) * 4 + (G(6),) * 3 + (G(6, "int4"),) * 3
    assert plan.slope == 4


def _tau(alpha, gamma):
    return 1 + sum(alpha ** i for i in range(1, gamma + 1))


def _two_formats(int4_alpha, times=None):
    """The model's own drafts: 5 ms + 1 ms a draft, timed at gammas 4 and 6, 0.9 of each
    draft accepted; int4 drafts: 0.4 ms each, timed at gamma 6 alone, `int4_alpha`."""
    times = times or {G(4): _flat([0.009] * 3), G(6): _flat([0.011] * 3),
                      G(6, "int4"): _flat([0.0074] * 3)}
    acc = {"same": _acceptance(8, [0.9] * 8), "int4": _acceptance(8, [int4_alpha] * 8)}
    return _evidence((4, 6, 8), times, acc)


def test_line_per_format_shares_the_intercept_and_tau_is_the_formats_own():
    """One gamma of int4 timed beside two of the model's own: the line's intercept (the
    verify's) is shared, int4's slope from its one point; each format's rate from its
    own acceptance."""
    est = estimate(P, _two_formats(0.8))
    assert est.line.a == pytest.approx(0.005)
    assert est.line.b == pytest.approx({"same": 0.001, "int4": 0.0004})
    assert est.round_time(8, "int4") == pytest.approx(0.0082)
    assert est.rates[G(6, "int4")] == pytest.approx(_tau(0.8, 6) / 0.0074)
    assert est.rates[G(8)] == pytest.approx(_tau(0.9, 8) / 0.013)
    # the configured gamma alone in each format: no slope; each format in proportion to
    # gamma + 1 from its own round
    est = estimate(P, _two_formats(0.8, {G(6): _flat([0.011] * 3),
                                         G(6, "int4"): _flat([0.0074] * 3)}))
    assert est.line is None and est.round_time(4, "int4") == pytest.approx(0.0074 * 5 / 7)
    assert est.round_time(4, "int8") is None  # not a candidate here, never timed


@pytest.mark.parametrize("int4_alpha,best", [
    (0.8, G(6, "int4")),  # 3.95 / 7.4 ms beats 5.22 / 11 ms
    (0.5, G(6)),  # 1.98 / 7.4 ms does not
])
def test_choice_flips_between_formats_as_acceptance_changes(int4_alpha, best):
    """int4's rounds are cheaper (0.4 ms drafts against 1 ms), its acceptance lower: it
    wins while its drafts are accepted 0.8 of the time, not at 0.5."""
    ev = _two_formats(int4_alpha)
    assert estimate(P, ev).best() == best
    assert decide(P, ev, Exploration(G(6)))[0] == best


@pytest.mark.parametrize("int4_alpha,fmt", [(0.8, "int4"), (0.5, "same")])
def test_second_gamma_is_timed_in_the_format_that_came_out_best(int4_alpha, fmt):
    """Once each format ran the configured gamma, the second gamma (the slope) runs in the
    format whose rate was best there."""
    plan = dataclasses.replace(first_exploration(P, (4, 6, 8), G(6), ("same", "int4")),
                               queue=())  # its calls done
    ev = _two_formats(int4_alpha, {G(6): _flat([0.011] * 3),
                                   G(6, "int4"): _flat([0.0074] * 3)})
    c, after = decide(P, ev, plan)
    assert c == G(4, fmt) and after.queue == (G(4, fmt),) * (P.window - 1)
    assert after.slope is None


def test_fit_line_needs_a_second_gamma_for_the_slopes():
    rows = [(6, "same", None, 0.011), (6, "int4", None, 0.0074)]
    assert fit_line(rows, FORMATS) is None
    line = fit_line(rows + [(4, "int4", None, 0.0066)], FORMATS)
    assert line.a == pytest.approx(0.005) and set(line.b) == {"same", "int4"}
    assert line.c is None


# ---------------------------------------------------------------------------------------
# Acceptance counts
# ---------------------------------------------------------------------------------------

def test_tau_from_the_sequences_still_decoding():
    """Two of four sequences accept everything, two nothing. While all four decode,
    tau(4) pools them (1 + 0.5 + 0.25 + ...); once the good two have finished, it is the
    remaining two's (1.0: a batch of fixed-length outputs waits on them). A slot that
    comes back (refilled with a new prompt) starts its counts over."""
    counts = AcceptanceCounter(4)
    both = np.array([4, 4, 0, 0])
    for active in ([True] * 4, [True] * 4, [False, False, True, True]):
        counts.add(4, both, np.array(active))
        if all(active):
            pooled = counts.snapshot().tau(4)
    assert pooled == pytest.approx(1 + 0.5 * 4)  # alpha_1 = 1/2, then 1 given reached
    assert counts.snapshot().tau(4) == pytest.approx(1.0)
    counts.add(4, both, np.array([True, False, True, False]))
    # slot 0 is back with a new prompt: its earlier four-of-four no longer counts
    snap = counts.snapshot()
    assert snap.slot_trials[0, 1] == 1 and snap.slot_trials[2, 1] == 4
    # followed but not counted (a round after plain steps): no trial added
    counts.add(4, both, np.array([True] * 4), count=False)
    assert counts.snapshot().trials[1] == snap.trials[1]


def test_finish_tau_follows_the_slowest_sequence():
    """Two of four sequences accept every draft, two none. With no prompt waiting, the
    batch ends with the slow two: finish_tau(4) is theirs (1, up to the shrinkage toward
    the batch's acceptance), not the pooled 1 + 0.5 * 4; with prompts waiting
    (remaining None) it is the pooled mean; once the slow two are done, the fast two's."""
    counts = AcceptanceCounter(4)
    for _ in range(200):
        counts.add(4, np.array([4, 4, 0, 0]), np.ones(4, bool))

    def finish(remaining):
        counts.remaining = None if remaining is None else np.array(remaining)
        return counts.snapshot().finish_tau(4, P.prior)

    assert counts.snapshot().tau(4) == pytest.approx(3.0)
    assert 1.0 < finish([100] * 4) < 1.2  # 1 + 4 x 8 / 216: 16 pseudo-trials at 0.5
    assert finish(None) == pytest.approx(3.0)
    # the slow two need 10x fewer tokens than the fast two: the fast two finish last
    # (250 tokens at tau 5 against 25 at tau ~1)
    assert finish([250, 250, 25, 25]) == pytest.approx(5.0, rel=4e-2)  # 1 + 4 x 208 / 216
    assert finish([100, 100, 0, 0]) == pytest.approx(5.0, rel=4e-2)


def test_acceptance_per_format_follows_every_rounds_slots():
    """Each format counts its own rounds; a slot refilled while another format ran starts
    over in every format's counts."""
    fa = FormatAcceptance(("same", "int4"), 4)
    fa.add("int4", 4, np.array([4, 4]), np.array([True, True]))
    fa.add("same", 4, np.array([0, 0]), np.array([False, True]))  # slot 0 finished
    fa.add("same", 4, np.array([0, 0]), np.array([True, True]))  # and holds a new prompt
    snap = fa.snapshot()
    assert snap["int4"].tau(4) == pytest.approx(5.0) and snap["same"].tau(4) == 1.0
    assert snap["int4"].slot_trials[:, 1].tolist() == [0, 1]
    assert snap["same"].slot_trials[:, 1].tolist() == [1, 2]


# ---------------------------------------------------------------------------------------
# Timing capture
# ---------------------------------------------------------------------------------------

def test_timer_keeps_a_call_only_when_the_host_waited_at_both_ends():
    """A read that found its output ready (the host was late) may have let the next call
    start before it: the interval that read opens is not the call's device time, and is
    kept apart (`loose`); a cold dispatch's interval is not kept at all."""
    timer = CallTimer()
    reads = [(PLAIN, 0.0, 1e-3), (PLAIN, 0.008, 1e-3),  # waited: 8 ms, the device's time
             (PLAIN, 0.020, 0.0), (PLAIN, 0.024, 1e-3),  # ready on arrival: the next is short
             (G(4), 0.034, 0.0), (G(4), 0.040, 0.0)]  # host-bound rounds (the first one's
    # interval holds its first, cold dispatch: not kept)
    for c, at, wait in reads:
        timer.dispatch(c, lambda st: st, None)
        timer.read(at, wait, 1, lambda t: True)
    fair, loose = timer.timed()
    assert [t for t, _ in fair[PLAIN]] == pytest.approx([0.008])
    assert [t for t, _ in loose[PLAIN]] == pytest.approx([0.012, 0.004])
    assert G(4) not in fair and [t for t, _ in loose[G(4)]] == pytest.approx([0.006])
    assert [row[1] for row in timer.trace] == pytest.approx([None, 0.008, 0.012, 0.004,
                                                             None, 0.006])


def test_timer_keeps_nothing_that_began_before_a_build_ended():
    timer = CallTimer()
    for at in (0.0, 0.01, 0.02, 0.03):
        timer.dispatch(G(4), lambda st: st, None)
        timer.read(at, 1e-3, 1, lambda t: t >= 0.015)  # a build ended at 0.015
    assert [t for t, _ in timer.timed()[0][G(4)]] == pytest.approx([0.01])


# ---------------------------------------------------------------------------------------
# The build scheduler
# ---------------------------------------------------------------------------------------

def _donated():
    spent = jnp.ones(2)
    jax.jit(lambda x: x, donate_argnums=0)(spent)  # spent now holds a donated buffer
    return spent


def _join_builds():
    for t in threading.enumerate():
        if t.name == auto_build.THREAD_NAME:
            t.join()


def test_build_states(monkeypatch):
    """NONE with nothing to build; PENDING -> ARMED (the first call's donated state) ->
    RUNNING (first read) -> BUILT (the thread, in order) -> IN_USE (the next dispatch,
    which the build's dropped buffers make cold)."""
    assert BuildScheduler(P).state is Build.NONE and BuildScheduler(P).quiet_since(0.0)
    built, gate = [], threading.Event()
    monkeypatch.setattr(auto_build, "compile_only",
                        lambda run, spent: (gate.wait(60), built.append((run, spent))))
    s = BuildScheduler(AutoPolicy(background=True))
    s.plan([G(2), G(6), PLAIN])
    assert s.state is Build.PENDING and not s.settled
    spent = _donated()
    assert not s.dispatched(G(4), spent, 0)
    assert s.state is Build.ARMED and s.spent is spent
    s.first_read(None, 0.1, 0.01, {G(2): "r2", G(6): "r6", PLAIN: "r0"})
    assert s.state is Build.RUNNING and s.background and not s.quiet_since(1e9)
    gate.set()
    _join_builds()
    assert built == [("r2", spent), ("r6", spent), ("r0", spent)]
    assert s.state is Build.BUILT and s.settled and s.compile_s >= 0
    assert s.ready == {G(2), G(4), G(6), PLAIN} and s.quiet_since(s.ended_at)
    assert s.dispatched(G(6), None, 5) and s.state is Build.IN_USE and s.in_use_from == 5
    assert not s.dispatched(G(6), None, 6)
    assert s.stats()["build"] == "done" and s.stats()["built_after_calls"] == 5


@pytest.mark.parametrize("calls_left, call_s, background, state", [
    (4, 0.01, True, Build.SKIPPED),  # fewer calls left than exploring takes
    (1000, 0.01, True, Build.SKIPPED),  # 10 s of calls do not outlast 2 builds of 6 s
    (2000, 0.01, True, Build.RUNNING),  # 20 s do
    (1000, 0.01, False, Build.BUILT),  # a foreground build: the calls left alone decide
    (None, 0.01, True, Build.RUNNING),  # tokens left not known (prompts wait)
])
def test_build_starts_only_where_the_decoding_left_can_use_it(
        monkeypatch, calls_left, call_s, background, state):
    gate = threading.Event()
    if not background:
        gate.set()  # the first read waits for a foreground build
    monkeypatch.setattr(auto_build, "compile_only", lambda run, spent: gate.wait(60))
    s = BuildScheduler(AutoPolicy(background=background))
    s.plan([G(2), PLAIN])
    s.dispatched(G(4), _donated(), 0)
    s.first_read(calls_left, 6.0, call_s, {G(2): None, PLAIN: None})
    assert s.state is state and s.order == () and s.spent is None
    assert s.settled == (state is Build.BUILT)
    gate.set()
    _join_builds()


def test_build_without_a_donated_state_leaves_each_to_its_first_call():
    s = BuildScheduler(AutoPolicy(background=True))
    s.plan([G(2)])
    s.dispatched(G(4), jnp.ones(2), 0)  # a runner that does not donate
    s.first_read(None, 0.1, 0.01, {G(2): None})
    assert not any(t.name == auto_build.THREAD_NAME for t in threading.enumerate())
    assert s.state is Build.BUILT and s.compile_s is None and s.ready == {G(4)}


def test_compile_only_compiles_what_a_later_call_runs(caplog):
    """`compile_only` on a donated state compiles the call and runs nothing; the later
    call of the same shapes compiles nothing."""
    f = jax.jit(lambda s, k: s * k + 1, static_argnums=1, donate_argnums=0)
    spent = jnp.ones(4)
    live = f(spent, 2)  # spent: donated
    with jax.log_compiles(), caplog.at_level("WARNING"):
        compile_only(lambda s: f(s, 3), spent)
        compiled = [r for r in caplog.records if "Compiling" in r.getMessage()]
        caplog.clear()
        out = f(live, 3)
        assert not [r for r in caplog.records if "Compiling" in r.getMessage()]
    assert len(compiled) == 1
    np.testing.assert_array_equal(out, 3 * 3.0 + 1)


# ---------------------------------------------------------------------------------------
# The controller, driven like `drive` (one call in flight) on a fake clock
# ---------------------------------------------------------------------------------------

@pytest.fixture
def clock(monkeypatch):
    from vegas_jax import auto_capture

    now = [0.0]
    monkeypatch.setattr(auto_capture.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(auto_build.time, "perf_counter", lambda: now[0])
    return now


def _controller(gammas, g0, runner=None, policy=P, formats=(), fmt="same"):
    ctl = AutoController(SpecConfig(method=Auto(gammas=gammas, formats=formats), gamma=g0,
                                    draft_weights=fmt), policy)
    ctl.prepare(lambda c: functools.partial(runner, c=c) if runner else (lambda st: (st, c)))
    return ctl


def _drive(ctl, now, cost, n_acc, calls, dispatch_s=0.0, state=None, before=None):
    """Call k + 1 dispatched before call k is read; a call of configuration c takes
    cost[c] of device time (a first dispatch `dispatch_s` more of host time); every round
    accepts min(n_acc, gamma) with one sequence (n_acc: a number, or {format: number}).
    `before(i)` runs before dispatch i + 1."""
    flight = []

    def dispatch():
        c = ctl.choose()
        if ctl.calls[c] == 0 or c not in ctl.timer.warm:
            now[0] += dispatch_s  # loading the executable's kernels
        ctl.run(c, state)
        flight.append(c)

    dispatch()
    for i in range(calls):
        if before is not None:
            before(i)
        dispatch()
        c = flight.pop(0)
        now[0] += cost[c]
        k = n_acc[c.draft_weights] if isinstance(n_acc, dict) else n_acc
        ctl.read(None if c.plain else np.array([min(k, c.gamma)]), np.array([True]))


def _kept(ctl):
    """Every interval the controller keeps as a call's device time, per configuration."""
    return {c: [t for t, _ in v] for c, v in ctl.evidence().fair.items()}


@pytest.mark.parametrize("plain_step,draft,n_acc,plain", [
    (0.005, 0.0011, 8, False),  # B 64-like: verify ~ a step, cheap drafts: never plain
    (0.0012, 0.0011, 1, True),  # B 1-like: launch-bound drafts, few accepted: plain wins
])
def test_controller_explores_rounds_first_and_plain_steps_only_where_they_can_win(
        clock, plain_step, draft, n_acc, plain):
    """auto starts with rounds of two gammas (the line's slope); plain steps (8 a call)
    are tried only when the rounds' intercept says they could win, and then chosen only if
    they do."""
    ctl = _controller((4, 6, 8), 6)
    verify = 1.3 * plain_step  # a verify reads what a step reads, and captures
    cost = {PLAIN: 8 * plain_step, **{G(g): verify + g * draft for g in (4, 6, 8)}}
    _drive(ctl, clock, cost, n_acc, 40)
    assert (ctl.calls[PLAIN] > 0) == plain
    # every draft accepted: 5 / 10.9 ms, 7 / 13.1 ms, 9 / 15.3 ms: gamma 8 wins
    assert ctl.choose() == (PLAIN if plain else G(8))
    assert ctl.stats()["choice"] == ctl.choose().name


def test_controller_does_not_time_first_dispatches(clock):
    """The interval in which an executable is dispatched for the first time (its kernels
    load on the host, 30 ms) is not counted: a plain call takes 8 ms, a round 1.6-1.8 ms
    (nothing accepted: plain steps get probed); every interval kept is a call's own."""
    ctl = _controller((2, 4), 4)
    cost = {PLAIN: 0.008, G(2): 0.0016, G(4): 0.0018}
    _drive(ctl, clock, cost, 0, 30, dispatch_s=0.030)
    kept = _kept(ctl)
    assert set(kept) == set(cost)
    for c, ts in kept.items():
        assert ts == pytest.approx([cost[c]] * len(ts)), (c, ts)


def test_controller_ignores_acceptance_of_a_round_after_plain_steps():
    """The first round after plain steps drafts from a selection older than those steps;
    its acceptance (here none) must not drag the estimate of the rounds that follow (here
    all accepted): tau(4) stays 5."""
    ctl = _controller((4,), 4)
    for c, n_acc in ((PLAIN, None), (G(4), np.array([0])), (G(4), np.array([4]))):
        ctl.run(c, None)
        ctl.read(n_acc, np.array([True]))
    assert ctl.evidence().acceptance["same"].tau(4) == pytest.approx(5.0)


def test_controller_times_nothing_while_its_candidates_are_built(clock, monkeypatch):
    """A background build held until call 10: every call is the configured gamma and none
    is timed, though acceptance is counted; once built, each configuration's first
    dispatch (30 ms: its command buffer recorded) is not timed either, every interval
    kept is a call's own time, and the exploration that follows finds the best gamma
    (every draft accepted: gamma 8)."""
    gate = threading.Event()
    monkeypatch.setattr(auto_build, "compile_only", lambda run, spent: gate.wait(60))
    ctl = _controller((4, 6, 8), 6, policy=AutoPolicy(background=True))
    cost = {PLAIN: 8 * 0.005, **{G(g): 0.0065 + g * 0.0011 for g in (4, 6, 8)}}
    seen = []

    def build_ends_at_10(i):
        if i < 10:
            seen.append((ctl.build.state, set(ctl.calls), dict(_kept(ctl))))
        elif i == 10:
            gate.set()
            _join_builds()  # ends at the fake clock's now

    _drive(ctl, clock, cost, 8, 40, dispatch_s=0.030, state=_donated(), before=build_ends_at_10)
    assert all(s is Build.RUNNING and c == {G(6)} and not k for s, c, k in seen[1:])
    assert ctl.evidence().acceptance["same"].trials[1] >= 10
    assert ctl.stats()["built_after_calls"] == 11  # the 12th call saw it over
    for c, ts in _kept(ctl).items():
        assert ts == pytest.approx([cost[c]] * len(ts)), (c, ts)
    assert {G(4), G(6)} <= set(_kept(ctl)) and ctl.choose() == G(8)


def test_controller_does_not_time_a_read_that_a_stalled_dispatch_delayed(clock):
    """On the H200 a warm candidate's first dispatch could still hold the host 15 ms
    (a command buffer recorded) while the call in flight ran 11 ms: the read after it
    found the device idle, yet waited ~0.8 ms for the copy of the output. Simulated like
    `drive` (dispatch k + 1, then read k): every interval the controller keeps as the
    device's time is a call's own time, and plain steps (3.6 ms a step, rounds' line
    through 4 ms) are never probed."""
    cost = {PLAIN: 8 * 0.0036, G(4): 0.0087, G(6): 0.0112, G(8): 0.0137}

    def runner(st, c):  # a configuration's first dispatch holds the host 15 ms, later ones 1
        clock[0] += 0.015 if ctl.calls[c] == 1 else 0.001
        return st, c

    ctl = _controller((4, 6, 8), 6, runner)
    free = [0.0]  # when the device finishes the calls queued so far
    flight = []

    def dispatch():
        c = ctl.choose()
        ctl.run(c, None)
        free[0] = max(free[0], clock[0]) + cost[c]
        flight.append((c, free[0]))

    dispatch()
    for _ in range(40):
        dispatch()
        c, end = flight.pop(0)
        wait = max(0.0, end - clock[0]) + 0.0008  # the output's copy
        clock[0] = max(clock[0], end) + 0.0008
        ctl.read(None if c.plain else np.array([c.gamma - 1]), np.array([True]), clock[0], wait)
    for c, ts in _kept(ctl).items():
        assert ts == pytest.approx([cost[c]] * len(ts), abs=1e-9), (c, ts)
    assert len(_kept(ctl)) >= 2 and ctl.calls[PLAIN] == 0


def test_controller_explores_each_format_then_chooses(clock):
    """Three formats, drafts of 1 / 0.6 / 0.4 ms beside a 5 ms verify, accepted 8 / 4 / 6
    of a round's drafts: the configured gamma runs in each format, then the second gamma
    in the best one (int4), and int4 at gamma 6 wins (7 tokens in 7.4 ms); the stats say
    what ran, per (gamma, format), with its tau."""
    ctl = _controller((4, 6, 8), 6, formats=FORMATS)
    draft = {"same": 0.001, "int8": 0.0006, "int4": 0.0004}
    cost = {PLAIN: 8 * 0.004, **{G(g, f): 0.005 + g * d for f, d in draft.items()
                                 for g in (4, 6, 8)}}
    _drive(ctl, clock, cost, {"same": 8, "int8": 4, "int4": 6}, 40)
    st = ctl.stats()
    # the calls read, in order: two before the build (none here) is seen over, then the
    # exploration
    order = [row[0] for row in st["trace"]]
    assert order[:15] == (["gamma 6"] * 6 + ["gamma 6 int8"] * 3 + ["gamma 6 int4"] * 3
                          + ["gamma 4 int4"] * 3)
    assert ctl.choose() == G(6, "int4")
    assert st["formats"] == list(FORMATS) and st["start"] == "gamma 6"
    assert st["choice"] == "gamma 6 int4"
    by = st["by_config"]
    assert by["gamma 6"]["tau"] == 7 and by["gamma 6 int8"]["tau"] == 5
    assert by["gamma 6 int4"]["tau"] == 7 and by["gamma 4 int4"]["tau"] == 5
    assert sum(r["rounds"] for r in by.values()) == 40  # every call read was a round
    assert st["active_line_ms"] is None


def test_controller_counts_acceptance_per_format():
    ctl = _controller((4,), 4, formats=("same", "int4"))
    for c, n_acc in ((G(4), [4, 4]), (G(4, "int4"), [0, 1]), (G(4), [4, 2])):
        ctl.run(c, None)
        ctl.read(np.array(n_acc), np.array([True, True]))
    acc = ctl.evidence().acceptance
    assert acc["same"].tau(4) == pytest.approx(1 + 1 + 1 + 0.75 + 0.75)  # 3 of 4 reach 3
    assert acc["int4"].tau(4) == pytest.approx(1.5)
    assert ctl.stats()["by_config"] == {
        "gamma 4": {"rounds": 2, "sequence_rounds": 4, "tau": 4.5},
        "gamma 4 int4": {"rounds": 1, "sequence_rounds": 2, "tau": 1.5}}


# ---------------------------------------------------------------------------------------
# The bound on a round's speedup, from what each call reads (`auto_bound`)
# ---------------------------------------------------------------------------------------

def _shapes(name, dtype):
    """A registered model's params as shapes only (nothing allocated)."""
    from types import SimpleNamespace

    from vegas_jax.config import get_config
    from vegas_jax.params import init_params

    cfg = get_config(name)
    params = jax.eval_shape(lambda k: init_params(cfg, k, dtype), jax.random.PRNGKey(0))
    return SimpleNamespace(config=cfg, params=params)


def test_round_bound_is_the_bytes_roofline():
    """(gamma + 1) / (1 + gamma * rho), rho = (weights + the draft's cache reads) / (weights
    + the step's): SmolLM2 in bf16, one sequence at a mean context of 4096 on the Pallas
    path (visible positions only): a draft reads its budget (7 % of the context, at least
    256) and gamma tail positions."""
    from vegas_jax.auto_bound import draft_positions, round_bounds, weight_bytes

    m = _shapes("smollm2-135m", jnp.bfloat16)
    spec = SpecConfig(method="auto", gamma=6)
    w = weight_bytes(m.params, m.config, 1)
    assert w == pytest.approx(134_515_008 * 2)  # SmolLM2-135M's parameters (tied), bf16
    per_pos = 30 * 2 * 3 * 64 * 2  # layers x (K, V) x kv heads x head dim x bytes
    assert draft_positions(spec, 6, 4096) == 288 + 6  # ceil(0.07 x 4103) + the tail
    rho = (w + per_pos * 294) / (w + per_pos * 4096)
    bounds = round_bounds(m, spec, (4, 6, 8), PALLAS, 1, [4096], 4352)
    assert bounds[G(6)] == pytest.approx(7 / (1 + 6 * rho))
    assert bounds[G(4)] < bounds[G(6)] < bounds[G(8)]  # more drafts a round, more to gain
    # the XLA reference reads the whole cache each step: more for a step, not for a draft
    assert round_bounds(m, spec, (6,), XLA, 1, [4096], 8192)[G(6)] > bounds[G(6)]


@pytest.mark.parametrize("dtype,slots,context,new,xc,allowed", [
    # a CPU at B 1 (fp32, the XLA path): a draft step reads what a step reads
    (jnp.float32, 1, 40, 300, XLA, False),
    (jnp.float32, 1, 40, 2000, XLA, False),
    # GPU rows of RESULTS.md (bf16, Pallas): 7.6K prompts, 256 new, B 1 and B 64
    (jnp.bfloat16, 1, 7680, 256, PALLAS, True),
    (jnp.bfloat16, 64, 7680, 256, PALLAS, True),
    # B 64 of short chat prompts: min_tokens (256) covers their whole context
    (jnp.bfloat16, 64, 40, 200, PALLAS, False),
])
def test_rounds_allowed_only_where_they_could_pay(dtype, slots, context, new, xc, allowed):
    from vegas_jax.auto_bound import round_bounds
    from vegas_jax.prompts import plan_cache_len

    m = _shapes("smollm2-135m", dtype)
    ctl = AutoController(SpecConfig(method="auto", gamma=6))
    max_len = plan_cache_len(m.config, [context], new, 18)
    bounds = round_bounds(m, ctl.spec, ctl.gammas, xc, slots, [context + new / 2], max_len)
    assert ctl.allow_rounds(bounds) == allowed, bounds
    assert all(1.0 <= b <= c.gamma + 1 for c, b in bounds.items())
    assert ctl.stats()["round_bound"] == {f"gamma {c.gamma}": pytest.approx(b, abs=1e-4)
                                          for c, b in bounds.items()}


def test_weights_read_leave_out_an_untied_embedding_and_unrouted_experts():
    from vegas_jax.auto_bound import weight_bytes
    from vegas_jax.params import param_bytes

    m = _shapes("qwen3-30b-a3b", jnp.bfloat16)
    cfg, total = m.config, param_bytes(m.params)
    embed = cfg.vocab_size * cfg.hidden_size * 2
    one, many = weight_bytes(m.params, cfg, 1), weight_bytes(m.params, cfg, 4096)
    assert many == pytest.approx(total - embed, rel=1e-3)  # every expert in use
    assert one < 0.2 * total  # 8 of 128 experts: about 3B of 30B parameters


def test_quantized_drafts_lift_the_bound_and_formats_that_cannot_pay_are_dropped():
    """A quantized draft reads fewer weight bytes: its bound is higher wherever weights
    weigh in a draft step (Qwen3-8B, B 1, 2K context: the model's own drafts read 16 GB
    of weights of a step's 16.4, int4's a quarter). auto leaves out the formats none of
    whose rounds reaches `min_gain` and starts on the configured gamma in the format of
    the highest bound; the reason is in the stats."""
    from vegas_jax.auto_bound import draft_weight_bytes, round_bounds, weight_bytes
    from vegas_jax.prompts import plan_cache_len

    m = _shapes("qwen3-8b", jnp.bfloat16)
    own = weight_bytes(m.params, m.config, 1)
    assert draft_weight_bytes(m, "same", 1) == own
    assert 0.5 < draft_weight_bytes(m, "int8", 1) / own < 0.56  # + scales, a quantized head
    assert 0.25 < draft_weight_bytes(m, "int4", 1) / own < 0.3
    ctl = _controller((4, 6, 8), 6, formats=FORMATS)
    bounds = round_bounds(m, ctl.spec, ctl.gammas, PALLAS, 1, [2128],
                          plan_cache_len(m.config, [2000], 256, 18), ctl.formats)
    for g in ctl.gammas:
        assert bounds[G(g)] < bounds[G(g, "int8")] < bounds[G(g, "int4")]
    assert max(bounds[G(g)] for g in ctl.gammas) < P.min_gain < bounds[G(4, "int8")]
    assert ctl.allow_rounds(bounds)
    st = ctl.stats()
    assert st["formats"] == ["int8", "int4"] and list(st["formats_dropped"]) == ["same"]
    assert "below min_gain" in st["formats_dropped"]["same"]
    assert ctl.plan.start == G(6, "int4") and st["start"] == "gamma 6 int4"
    assert ctl.plan.queue == (G(6, "int4"),) * 4 + (G(6, "int8"),) * 3
    assert st["round_bound"]["gamma 6 int4"] == pytest.approx(bounds[G(6, "int4")], abs=1e-4)

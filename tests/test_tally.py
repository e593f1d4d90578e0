"""The acceptance statistics of a generation's rounds (`tally.Tally`): tau is 1 + the sum
of the cumulative acceptance per position, over every round run and per gamma."""

import numpy as np
import pytest

from vegas_jax.tally import Tally

ALL = np.array([True, True, True])


def _tally(rounds):
    """rounds: (gamma, n_acc per slot or None for plain steps); slot i holds prompt i."""
    t = Tally(3)
    for gamma, n_acc in rounds:
        if n_acc is None:
            t.add(0, None, None, None)
        else:
            t.add(gamma, np.array(n_acc), ALL, np.arange(3))
    return t.stats()


def test_one_gamma():
    st = _tally([(4, [4, 2, 0]), (4, [1, 4, 3])])
    # drafts accepted: 4 + 2 + 0 + 1 + 4 + 3 = 14 over 6 sequence-rounds
    assert st["tau"] == pytest.approx(1 + 14 / 6)
    assert st["acceptance_cumulative"] == pytest.approx([5 / 6, 4 / 6, 3 / 6, 2 / 6])
    assert st["tau"] == pytest.approx(1 + sum(st["acceptance_cumulative"]))
    assert np.cumprod(st["acceptance_conditional"]) == pytest.approx(
        st["acceptance_cumulative"])
    assert st["rounds"] == 2 and st["plain_calls"] == 0 and list(st["by_gamma"]) == [4]
    assert st["by_gamma"][4]["tau"] == st["tau"]


def test_several_gammas_and_plain_calls_add_up():
    """auto's mix: rounds of gamma 2 and 6 and plain calls. Pooled and per gamma, tau
    = 1 + sum(cumulative) and the tokens per sequence-round; positions 3..6 only gamma 6
    drafts (gamma 2's rounds count there as not accepting); the per-gamma rounds add up
    to the rounds, and plain calls are apart."""
    st = _tally([(6, [6, 6, 5]), (None, None), (2, [2, 0, 1]), (2, [2, 2, 2]), (None, None),
                 (6, [0, 6, 3])])
    emitted = (6 + 6 + 5 + 0 + 6 + 3) + (2 + 0 + 1 + 2 + 2 + 2) + 12
    assert st["tau"] == pytest.approx(emitted / 12)
    assert st["tau"] == pytest.approx(1 + sum(st["acceptance_cumulative"]))
    assert len(st["acceptance_cumulative"]) == 6  # the largest gamma run, not a candidate
    assert st["rounds"] == 4 and st["plain_calls"] == 2
    assert {g: r["rounds"] for g, r in st["by_gamma"].items()} == {2: 2, 6: 2}
    for g, r in st["by_gamma"].items():
        assert len(r["acceptance_cumulative"]) == g
        assert r["tau"] == pytest.approx(1 + sum(r["acceptance_cumulative"]))
        assert np.cumprod(r["acceptance_conditional"]) == pytest.approx(
            r["acceptance_cumulative"])
    assert st["by_gamma"][6]["tau"] == pytest.approx(1 + 26 / 6)
    # the pooled tau is the per-gamma taus weighted by sequence-rounds
    by = st["by_gamma"]
    assert st["tau"] == pytest.approx((by[2]["tau"] + by[6]["tau"]) / 2)
    # draft 4 was drafted only by gamma 6's rounds that accepted drafts 1..3 (5 of 6), of
    # which 4 accepted it
    assert st["acceptance_conditional"][3] == pytest.approx(4 / 5)
    assert st["accepted_by_call"][1] is None


def test_nothing_run():
    st = _tally([(None, None)])
    assert st["tau"] == 1.0 and st["acceptance_cumulative"] == [] and st["by_gamma"] == {}
    assert st["tau_by_sequence"] == [None] * 3


def test_a_position_never_reached_has_no_conditional():
    st = _tally([(3, [0, 0, 0])])
    assert st["acceptance_conditional"] == [0.0, None, None]
    assert st["acceptance_cumulative"] == [0.0, 0.0, 0.0] and st["tau"] == 1.0

"""The selection policies of `methods`: the registry, what each method captures and where
the capture is handed over raw, and each `VerifyGuided` selection (the carried scores of
`vegas`, the last accepted row of `last`) against a brute-force reference. Lossless
decoding through each method: test_speculative."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import rand
from tests.tiny import tiny_config
from vegas_jax import methods as meth
from vegas_jax.attention import Capture
from vegas_jax.execution import ExecConfig
from vegas_jax.speculative import SpecConfig, prefill_capture, round_capture

SPEC = SpecConfig(method="vegas", gamma=4, sparsity=0.07, min_tokens=8)
MAX_LEN = 512


class _Cache:
    max_len = MAX_LEN


_CACHE = _Cache()


def _update(method, spec, sel, scores, n, n_acc):
    """`method.update` as one jitted program (op by op, the selection's count passes
    compile one small program each)."""
    return jax.jit(lambda sel, scores, n, n_acc: method.update(spec, sel, scores, _CACHE, n,
                                                               n_acc, None))(sel, scores, n, n_acc)


def _top(v, r_end, c):
    """Brute force: the c best positions of one score row over 0..r_end."""
    v = np.where(np.arange(v.shape[-1]) <= int(r_end), np.asarray(v, np.float64), -np.inf)
    return set(np.argsort(-v, kind="stable")[:c].tolist())


def _sets(s):
    idx, count = np.asarray(s.idx), np.asarray(s.count)
    return [[set(idx[l, b, :count[l, b]].tolist()) for b in range(idx.shape[1])]
            for l in range(idx.shape[0])]


def test_the_registry_names_each_method():
    assert list(meth.METHODS) == ["vegas", "vegas-paper", "last", "stream", "quest", "auto",
                                  "vanilla"]
    for name, m in meth.METHODS.items():
        assert m.name == name and meth.method_named(name) is m
        assert m.speculative == (name != "vanilla")
    assert meth.METHODS["vegas"] == meth.VerifyGuided("pair", decay=0.5)
    assert meth.METHODS["vegas-paper"] == meth.VerifyGuided("pair")
    assert meth.METHODS["last"] == meth.VerifyGuided("last")
    assert meth.METHODS["auto"].base == meth.METHODS["vegas"]
    # a policy outside the registry still has a name
    assert meth.VerifyGuided("last", decay=0.5).name == "last-decay"
    obj = meth.Stream(sink=4)
    assert meth.method_named(obj) is obj
    with pytest.raises(ValueError, match="unknown method"):
        meth.method_named("vegas-heads")


@pytest.mark.parametrize("name,rows,reduce", [
    ("vegas", (0, 4), "mean"), ("vegas-paper", (0, 4), "mean"), ("last", (0, 1, 2, 3, 4), "rows"),
    ("auto", (0, 4), "mean"), ("stream", None, None), ("quest", None, None)])
def test_what_each_method_captures(name, rows, reduce):
    """The verify rows a method ranks by (vegas: rows 0 and gamma, Collect-2-Query; last:
    every row, the one kept known after acceptance); the prefill's capture is the last
    prompt token's row, of the same score."""
    for score in ("weight", "logit"):
        spec = SpecConfig(method=name, gamma=4, score=score)
        cap = spec.method.capture(spec)
        if rows is None:
            assert cap is None and prefill_capture(spec) is None
            continue
        assert cap == Capture(rows, reduce, score)
        assert prefill_capture(spec) == Capture((0,), "mean", score)


def test_the_capture_is_handed_over_raw_only_where_the_kernels_select_from_it():
    """A raw capture (the verify's logits to the selection's own kernel): softmax weights
    averaged over rows on the Pallas backend, one device, rows that one selection program
    holds."""
    cfg = tiny_config()
    pallas, xla = ExecConfig(backend="pallas"), ExecConfig(backend="xla")

    def raw(method, xc=pallas, score="weight", max_len=1024):
        spec = SpecConfig(method=method, gamma=4, score=score)
        cap = round_capture(spec, cfg, xc, max_len)
        return None if cap is None else cap.raw

    assert raw("vegas") and raw("vegas-paper") and raw("auto")
    assert raw("vegas", xla) is False
    assert raw("vegas", score="logit") is False
    assert raw("last") is False  # one row per verify row: the fused top-k kernel selects
    assert raw("vegas", ExecConfig(backend="pallas", tp=2)) is False
    assert raw("vegas", max_len=1 << 16) is False  # longer than the selection kernel's rows
    assert raw("stream") is None


@pytest.mark.parametrize("score", ["weight", "logit"])
def test_decay_carries_the_scores_of_earlier_rounds(score):
    """decay d (the default `vegas`): the next selection ranks max(new, d * carried)
    (raw logits: max(new, carried + log d)), over the ranked range only; the paper's
    selector (`vegas-paper`, d = 0) would rank the new scores alone."""
    L, b = 2, 2
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    s1 = 3 * rand.uniform(k1, (L, b, MAX_LEN))  # the aged s1 competes with s2
    s2 = rand.uniform(k2, (L, b, MAX_LEN))
    n1, n2 = jnp.array([150, 400]), jnp.array([155, 407])
    dec = meth.METHODS["vegas"]
    spec = SpecConfig(method=dec, gamma=SPEC.gamma, sparsity=SPEC.sparsity,
                      min_tokens=SPEC.min_tokens, score=score)
    # nothing carried yet: -inf scores (as `init` leaves none), one program for both rounds
    none = meth.TopK(jnp.zeros((L, b, meth.max_budget(spec, MAX_LEN)), jnp.int32),
                     jnp.zeros((L, b), jnp.int32), jnp.zeros((b,), jnp.int32),
                     jnp.full((L, b, MAX_LEN), -jnp.inf))
    st1 = _update(dec, spec, none, s1, n1, jnp.zeros_like(n1))
    st2 = _update(dec, spec, st1, s2, n2, jnp.zeros_like(n2))
    s1, s2 = np.asarray(s1, np.float64), np.asarray(s2, np.float64)
    n1, n2 = np.asarray(n1), np.asarray(n2)
    # what is carried past the first round's range is -inf: those slots held drafts
    carried = np.where(np.arange(MAX_LEN) <= n1[None, :, None], s1, -np.inf)
    want = np.maximum(s2, 0.5 * carried if score == "weight" else carried + np.log(0.5))
    count = np.asarray(meth.budget(spec, n2, MAX_LEN))
    sets1, sets, got_count = _sets(st1), _sets(st2), np.asarray(st2.count)
    differs = False
    for l in range(L):
        for j in range(b):
            c = int(count[j])
            assert got_count[l, j] == c
            assert sets1[l][j] == _top(s1[l, j], n1[j], int(np.asarray(st1.count)[l, j]))
            assert sets[l][j] == _top(want[l, j], n2[j], c)
            differs |= sets[l][j] != _top(s2[l, j], n2[j], c)  # vegas-paper's
    assert differs  # the carried scores changed the selection somewhere
    assert np.asarray(st2.end).tolist() == (n2 + 1).tolist()


def test_last_ranks_by_the_last_accepted_tokens_row():
    """last: every verify row captured; the selection ranks the row of the last token the
    round kept (row n_acc: x0 is row 0, draft i row i), not the pair's or the mean."""
    L, b, r = 2, 3, SPEC.gamma + 1
    scores = rand.uniform(jax.random.PRNGKey(4), (L, b, r, MAX_LEN))
    n, n_acc = jnp.array([100, 300, 450]), jnp.array([0, 2, 4])
    last = meth.METHODS["last"]
    spec = SpecConfig(method=last, gamma=SPEC.gamma, sparsity=SPEC.sparsity,
                      min_tokens=SPEC.min_tokens)
    got = _sets(_update(last, spec, None, scores, n, n_acc))
    count = np.asarray(meth.budget(spec, n, MAX_LEN))
    scores, n, n_acc = np.asarray(scores), np.asarray(n), np.asarray(n_acc)
    for l in range(L):
        for j in range(b):
            row = int(n_acc[j])
            assert got[l][j] == _top(scores[l, j, row], n[j], int(count[j]))
            other = (row + 1) % r  # another row's top is another set: the check has teeth
            assert got[l][j] != _top(scores[l, j, other], n[j], int(count[j]))


@pytest.mark.parametrize("kw", [dict(decay=1.0), dict(decay=-0.1), dict(rows="accepted"),
                                dict(rows="first"), dict(rows="final")])
def test_bad_policy_settings(kw):
    with pytest.raises(ValueError):
        meth.VerifyGuided(**{"rows": "pair", **kw})


@pytest.mark.parametrize("kw", [dict(base=meth.Vanilla()), dict(base=meth.Auto()),
                                dict(gammas=(0, 2))])
def test_bad_auto_settings(kw):
    with pytest.raises(ValueError):
        meth.Auto(**kw)

"""Issue 16's selection policies (`VerifyGuided(rows="accepted" | decay | pool |
entropy)`): each
selection against a brute-force reference, and lossless decoding through each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from vegas_jax import selection as sel
from vegas_jax.generate import generate
from vegas_jax.speculative import SpecConfig, speculative_generate
from tests.tiny import tiny_model
from tests import rand

SPEC = SpecConfig(gamma=4, sparsity=0.07, min_tokens=8)
MAX_LEN = 1024


class _Cache:
    max_len = MAX_LEN


def _top(v, r_end, c):
    """Brute force: the c best positions of one score row over 0..r_end."""
    masked = jnp.where(jnp.arange(v.shape[-1]) <= r_end, v, -jnp.inf)
    return set(np.asarray(lax.top_k(masked, c)[1]).tolist())


def _sets(s):
    return [[set(np.asarray(s.idx[l, b, :int(s.count[l, b])]).tolist())
             for b in range(s.idx.shape[1])] for l in range(s.idx.shape[0])]


def test_pooled_budget_takes_the_largest_weights_over_all_layers():
    """One budget for all layers: the union of the per-layer sets is the global top
    L * budget of the scores (up to the per-layer cap), so a flat layer gets more entries
    than a peaked one, and the entries read in total never exceed the paper selector's."""
    L, b = 3, 2
    key = jax.random.PRNGKey(1)
    flat = rand.uniform(key, (b, MAX_LEN)) * 1e-3 + 1e-3
    peaked = jax.nn.softmax(8 * rand.normal(jax.random.fold_in(key, 1), (b, MAX_LEN)))
    mid = jax.nn.softmax(2 * rand.normal(jax.random.fold_in(key, 2), (b, MAX_LEN)))
    scores = jnp.stack([flat, peaked, mid])  # [L, b, s]
    n = jnp.array([500, 1000])
    pool = sel.VerifyGuided("pair", pool=2.0)
    assert pool.name == "vegas-pool"
    got = pool.update(SPEC, None, scores, _Cache(), n, jnp.zeros_like(n), None)
    per_layer = np.asarray(sel.budget(SPEC, n, MAX_LEN))
    cap = int(np.ceil(2.0 * sel.max_budget(SPEC, MAX_LEN)))
    assert got.idx.shape[-1] == cap
    sets = _sets(got)
    for j in range(b):
        total = L * int(per_layer[j])
        flat_all = jnp.where(jnp.arange(MAX_LEN) <= n[j], scores[:, j], -jnp.inf).reshape(-1)
        best = set(np.asarray(lax.top_k(flat_all, total)[1]).tolist())
        want = [{int(p) % MAX_LEN for p in best if p // MAX_LEN == l} for l in range(L)]
        for l in range(L):
            if len(want[l]) <= cap:
                assert sets[l][j] == want[l], (l, j)
            else:  # capped: the layer's own top `cap`
                assert sets[l][j] == _top(scores[l, j], n[j], cap)
        assert int(got.count[:, j].sum()) <= total
        assert int(got.count[0, j]) > int(got.count[1, j])  # flat > peaked


def test_entropy_split_follows_each_layers_perplexity():
    """entropy a: layer l's count = floor(L * budget * perp_l ** a / sum over layers),
    within [1, 2 x budget]; each layer's set is its own top `count`; a flat layer gets more
    than a peaked one for a > 0, fewer for a < 0; never more entries than the paper's."""
    L, b = 3, 2
    key = jax.random.PRNGKey(5)
    flat = jax.nn.softmax(0.1 * rand.normal(key, (b, MAX_LEN)))
    peaked = jax.nn.softmax(8 * rand.normal(jax.random.fold_in(key, 1), (b, MAX_LEN)))
    mid = jax.nn.softmax(2 * rand.normal(jax.random.fold_in(key, 2), (b, MAX_LEN)))
    scores = jnp.stack([flat, peaked, mid])  # [L, b, s]
    n = jnp.array([500, 1000])
    per_layer = np.asarray(sel.budget(SPEC, n, MAX_LEN))
    for a in (0.5, -0.5):
        ent = sel.VerifyGuided("pair", entropy=a)
        assert ent.name == "vegas-entropy"
        got = ent.update(SPEC, None, scores, _Cache(), n, jnp.zeros_like(n), None)
        sets = _sets(got)
        for j in range(b):
            ranked = np.asarray(scores[:, j, :int(n[j]) + 1], np.float64)
            p = ranked / ranked.sum(-1, keepdims=True)
            perp = np.exp(-(p * np.log(p)).sum(-1))  # [L]
            share = perp ** a / (perp ** a).sum()
            want = np.clip(np.floor(L * per_layer[j] * share), 1, np.ceil(2 * per_layer[j]))
            np.testing.assert_array_equal(np.asarray(got.count[:, j]), want.astype(int))
            for l in range(L):
                assert sets[l][j] == _top(scores[l, j], n[j], int(got.count[l, j]))
            assert int(got.count[:, j].sum()) <= L * int(per_layer[j])
            assert (int(got.count[0, j]) > int(got.count[1, j])) == (a > 0)
    with pytest.raises(ValueError, match="score='weight'"):
        SpecConfig(method=sel.VerifyGuided("pair", entropy=0.5), score="logit")


@pytest.mark.parametrize("score", ["weight", "logit"])
def test_decay_carries_the_scores_of_earlier_rounds(score):
    """decay d (the default `vegas`): the next selection ranks max(new, d * carried)
    (raw logits: max(new, carried + log d)), over the ranked range only; the paper's
    selector (`vegas-paper`, d = 0) ranks the new scores alone."""
    L, b = 2, 2
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    s1 = 3 * rand.uniform(k1, (L, b, MAX_LEN))  # the aged s1 competes with s2
    s2 = rand.uniform(k2, (L, b, MAX_LEN))
    n1, n2 = jnp.array([300, 700]), jnp.array([305, 707])
    dec = sel.METHODS["vegas"]
    assert dec == sel.VerifyGuided("pair", decay=0.5) and dec.name == "vegas"
    assert sel.VerifyGuided("pair").name == "vegas-paper"
    spec = SpecConfig(method=dec, gamma=SPEC.gamma, sparsity=SPEC.sparsity,
                      min_tokens=SPEC.min_tokens, score=score)
    st1 = dec.update(spec, sel.TopK(None, None, None, None), s1, _Cache(), n1,
                     jnp.zeros_like(n1), None)
    st2 = dec.update(spec, st1, s2, _Cache(), n2, jnp.zeros_like(n2), None)
    # what is carried past the first round's range is -inf: those slots held drafts
    carried = jnp.where(jnp.arange(MAX_LEN) <= n1[None, :, None], s1, -jnp.inf)
    want = jnp.maximum(s2, 0.5 * carried if score == "weight" else carried + np.log(0.5))
    plain = sel.METHODS["vegas-paper"].update(spec, None, s2, _Cache(), n2,
                                              jnp.zeros_like(n2), None)
    sets, plain_sets = _sets(st2), _sets(plain)
    differs = False
    for l in range(L):
        for j in range(b):
            c = int(st2.count[l, j])
            assert sets[l][j] == _top(want[l, j], n2[j], c)
            differs |= sets[l][j] != plain_sets[l][j]
    assert differs


def test_accepted_rows_average_only_the_kept_tokens():
    """rows="accepted": the mean of verify rows 0..n_acc; rows of rejected drafts (and
    the pair's row gamma when it was rejected) must not count."""
    L, b, r = 2, 3, SPEC.gamma + 1
    scores = rand.uniform(jax.random.PRNGKey(4), (L, b, r, MAX_LEN))
    n, n_acc = jnp.array([200, 600, 900]), jnp.array([0, 2, 4])
    acc = sel.VerifyGuided("accepted")
    assert acc.name == "vegas-accepted"
    assert acc.capture(SPEC).reduce == "rows" and acc.capture(SPEC).rows == tuple(range(r))
    got = _sets(acc.update(SPEC, None, scores, _Cache(), n, n_acc, None))
    count = np.asarray(sel.budget(SPEC, n, MAX_LEN))
    for l in range(L):
        for j in range(b):
            mean = scores[l, j, :int(n_acc[j]) + 1].mean(0)
            assert got[l][j] == _top(mean, n[j], int(count[j]))
            if int(n_acc[j]) < r - 1:  # averaging every row would give another set
                assert got[l][j] != _top(scores[l, j].mean(0), n[j], int(count[j]))


@pytest.mark.parametrize("name,rows", [("vegas-first", "first"), ("vegas-final", "final")])
def test_one_row_policies_capture_one_row(name, rows):
    """vegas-first / -final: one verify row (0 or gamma) captured, carried as vegas's."""
    m = sel.method_named(name)
    assert m == sel.VerifyGuided(rows, decay=0.5) and m.name == name
    cap = m.capture(SPEC)
    assert cap.rows == ((0,) if rows == "first" else (SPEC.gamma,)) and cap.reduce == "mean"
    assert sel.VerifyGuided(rows, heads=True).capture(SPEC).rows == cap.rows
    assert m.takes_raw(SPEC)  # the single-kernel selection path, as vegas


@pytest.mark.parametrize("kw", [dict(decay=1.0), dict(decay=-0.1), dict(pool=0.5),
                                dict(pool=2.0, heads=True), dict(rows="accepted", heads=True),
                                dict(entropy=0.5, pool=2.0), dict(entropy=0.5, heads=True)])
def test_bad_policy_settings(kw):
    with pytest.raises(ValueError):
        sel.VerifyGuided(**{"rows": "pair", **kw})


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(scale=0.3)


@pytest.mark.parametrize("method", ["vegas-accepted", "vegas-paper", "vegas-pool",
                                    "vegas-entropy", "vegas-first", "vegas-final"])
def test_greedy_equals_vanilla(tiny, method):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 100, size=n).tolist() for n in (37, 650)]
    want = generate(tiny, prompts, 40).tokens
    res = speculative_generate(tiny, prompts, 40, SpecConfig(method=method, gamma=3,
                                                             min_tokens=8))
    assert res.tokens == want
    assert res.stats["method"] == method

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from tests import rand
from vegas_jax import sampling
from vegas_jax.sampling import SamplingParams, accept, process_logits


def jitted(fn):
    """fn as one jitted program (op by op, each new (op, shape) compiles on its own), traced
    afresh: a new function object each call, so a monkeypatched helper is seen."""
    return jax.jit(lambda *a: fn(*a))


def numpy_process(logits, sp):
    """Independent reference of temperature -> top-k -> top-p -> min-p."""
    x = logits / sp.temperature
    out = []
    for row in x:
        row = row.astype(np.float64).copy()
        if sp.top_k:
            kth = np.sort(row)[::-1][sp.top_k - 1]
            row[row < kth] = -np.inf
        if sp.top_p < 1:
            order = np.argsort(-row, kind="stable")
            p = np.exp(row[order] - row[order][0])
            p /= p.sum()
            keep_n = int(np.searchsorted(np.cumsum(p) - p, sp.top_p, side="left"))
            cut = row[order][max(keep_n - 1, 0)]
            row[row < cut] = -np.inf
        if sp.min_p > 0:
            p = np.exp(row - row.max())
            p /= p.sum()
            row[p < sp.min_p * p.max()] = -np.inf
        p = np.exp(row - row.max())
        out.append(p / p.sum())
    return np.array(out)


@pytest.mark.parametrize("sp", [
    SamplingParams(1.0), SamplingParams(0.6, 20, 0.95, 0.0), SamplingParams(1.0, 0, 0.5),
    SamplingParams(0.8, 7), SamplingParams(1.3, 0, 1.0, 0.1), SamplingParams(0.7, 30, 0.9, 0.05),
])
def test_process_logits_matches_numpy(sp):
    logits = np.random.default_rng(0).normal(size=(6, 200)).astype(np.float32) * 3
    got = np.exp(np.asarray(process_logits(jnp.asarray(logits), sp)))
    np.testing.assert_allclose(got, numpy_process(logits, sp), atol=1e-6)


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_k=-1), dict(top_k=1.5),
                                dict(top_p=0), dict(top_p=1.5), dict(min_p=1.0), dict(min_p=-0.1)])
def test_bad_sampling_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_accept_greedy():
    v = 5
    target = jnp.array([[1, 2, 3, 4], [1, 0, 3, 4], [0, 2, 3, 4]])
    logits = jax.nn.one_hot(target, v) * 10.0
    drafts = jnp.array([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    n, nxt = accept(None, drafts, None, logits, SamplingParams())
    assert n.tolist() == [3, 1, 0]
    assert nxt.tolist() == [4, 0, 0]


def _first_two(n_rows, p_logits, q, seed):
    """Simulate one round with gamma=2 for `n_rows` independent rows."""
    key = jax.random.PRNGKey(seed)
    kd, ka = jax.random.split(key)
    drafts = jax.random.categorical(kd, jnp.log(q), axis=-1, shape=(n_rows, 2)).astype(jnp.int32)
    qb = jnp.broadcast_to(q, (n_rows,) + q.shape)
    lb = jnp.broadcast_to(p_logits, (n_rows,) + p_logits.shape)
    n_acc, nxt = jitted(accept)(ka, drafts, qb, lb, SamplingParams(1.0))
    first = jnp.where(n_acc >= 1, drafts[:, 0], nxt)
    second = jnp.where(n_acc >= 2, drafts[:, 1], nxt)
    return np.asarray(first), np.asarray(second), np.asarray(n_acc)


def distribution_pvalues(seed=0, n_rows=200_000):
    v = 6
    rng = np.random.default_rng(seed)
    p_logits = jnp.asarray(rng.normal(size=(3, v)) * 1.5, jnp.float32)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(2, v)) * 1.5, jnp.float32), axis=-1)
    p = np.exp(np.asarray(p_logits, np.float64))
    p /= p.sum(-1, keepdims=True)
    first, second, n_acc = _first_two(n_rows, p_logits, q, seed)
    pv1 = stats.chisquare(np.bincount(first, minlength=v), p[0] * n_rows).pvalue
    sec = second[n_acc >= 1]  # the second token exists in this round when d1 was kept
    pv2 = stats.chisquare(np.bincount(sec, minlength=v), p[1] * len(sec)).pvalue
    return pv1, pv2


def test_speculative_sampling_has_target_distribution():
    pv1, pv2 = distribution_pvalues()
    assert pv1 > 1e-4 and pv2 > 1e-4, (pv1, pv2)


def test_broken_residual_is_detected(monkeypatch):
    # Sampling the replacement from p instead of max(p - q, 0) biases the output towards
    # the draft: the same test must reject it.
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    pv1, _ = distribution_pvalues()
    assert pv1 < 1e-6, pv1


def test_sparse_q_gives_the_same_acceptance_as_dense():
    """accept() with draft_sample's (indices, probabilities) form of q decides exactly as
    with the same q spread over the vocabulary (same keys, same outcome)."""
    rng = np.random.default_rng(5)
    b, g, v, k = 64, 3, 40, 5
    sp = SamplingParams(0.9, k, 0.9)
    draft_logits = jnp.asarray(rng.normal(size=(b, g, v)) * 2, jnp.float32)
    target = jnp.asarray(rng.normal(size=(b, g + 1, v)) * 2, jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(3), g)
    draw = jitted(sampling.sample)
    toks, q_idx, q_val = [], [], []
    for j in range(g):
        t, (i, pv) = draw(keys[j], draft_logits[:, j], sp)
        toks.append(t), q_idx.append(i), q_val.append(pv)
    drafts = jnp.stack(toks, 1)
    sparse = (jnp.stack(q_idx, 1), jnp.stack(q_val, 1))
    dense = jnp.zeros((b, g, v)).at[jnp.arange(b)[:, None, None], jnp.arange(g)[None, :, None],
                                    sparse[0]].set(sparse[1])
    # the sparse law is the processed distribution (no ties in random normal logits)
    np.testing.assert_allclose(np.asarray(dense), np.exp(np.asarray(
        jitted(process_logits)(draft_logits, sp))), atol=1e-6)
    assert bool(jnp.all(jnp.take_along_axis(dense, drafts[..., None], -1) > 0))
    acc = jitted(accept)
    for seed in range(3):
        key = jax.random.PRNGKey(seed)
        n1, x1 = acc(key, drafts, sparse, target, sp)
        n2, x2 = acc(key, drafts, dense, target, sp)
        assert n1.tolist() == n2.tolist() and x1.tolist() == x2.tolist()
    assert 0 < int(n1.sum()) < b * g  # both accepted and rejected drafts occur


def test_draft_sample_top_k_distribution():
    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.normal(size=(1, 50)) * 1.5, jnp.float32)
    sp = SamplingParams(0.8, 8, 0.9, 0.02)
    n = 100_000
    toks, _ = jax.jit(jax.vmap(lambda kk: sampling.sample(kk, logits[0], sp)))(
        jax.random.split(jax.random.PRNGKey(0), n))
    want = numpy_process(np.asarray(logits), sp)[0]
    counts = np.bincount(np.asarray(toks), minlength=50)
    assert counts[want == 0].sum() == 0
    keep = want > 0
    assert stats.chisquare(counts[keep], want[keep] * n).pvalue > 1e-4


@pytest.mark.parametrize("spread", [6.0, 0.3], ids=["candidates-cover", "falls-back-to-sort"])
@pytest.mark.parametrize("sp", [SamplingParams(1.0, 0, 0.9), SamplingParams(0.7, 0, 0.5, 0.05)])
def test_top_p_candidates_match_numpy(spread, sp, monkeypatch):
    """Top-p ranks TOP_P_CANDIDATES logits first; with peaked logits those hold the
    prefix, with flat ones the full sort runs. Either way the law is the reference's."""
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 16)
    logits = np.random.default_rng(1).normal(size=(5, 300)).astype(np.float32) * spread
    want = numpy_process(logits, sp)
    got = np.exp(np.asarray(process_logits(jnp.asarray(logits), sp)))
    np.testing.assert_allclose(got, want, atol=1e-6)
    kept = (want > 0).sum(-1)
    assert (kept <= 16).all() if spread > 1 else (kept > 16).any()  # both regimes occur


@pytest.mark.parametrize("shape,k", [((3, 5000), 20), ((2, 4, 49152), 20), ((4, 1000), 7),
                                     ((2, 300), 50)])
def test_top_k_matches_lax(shape, k):
    x = rand.normal(jax.random.PRNGKey(k), shape) * 3
    x = x.at[..., 17].set(50.0)  # a winner at a block edge region, others spread
    vals, idx = sampling.top_k(x, k, block=64)
    want_v, want_i = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_i))


def test_top_k_when_winners_crowd_one_block():
    # every winner in one block: that block must be read in full
    x = jnp.zeros((2, 4096)).at[:, 128:148].set(jnp.arange(20.0) + 1)
    vals, idx = sampling.top_k(x, 20, block=64)
    assert sorted(np.asarray(idx[0]).tolist()) == list(range(128, 148))


def test_sparse_target_accept_matches_dense():
    """With top-k, accept() works on the target's k candidates only; its decisions and
    corrections equal the dense computation's (same keys), so the law is unchanged."""
    rng = np.random.default_rng(8)
    b, g, v = 256, 3, 60
    sp = SamplingParams(0.8, 6, 0.95)
    draft_logits = jnp.asarray(rng.normal(size=(b, g, v)) * 2, jnp.float32)
    target = jnp.asarray(rng.normal(size=(b, g + 1, v)) * 2, jnp.float32)
    drafts, q = jitted(sampling.sample)(jax.random.PRNGKey(1), draft_logits, sp)
    q_dense = jnp.zeros((b, g, v)).at[jnp.arange(b)[:, None, None],
                                      jnp.arange(g)[None, :, None], q[0]].set(q[1])
    dense_sp = SamplingParams(0.8, v, 0.95)  # top-k off: the dense path ...
    p_dense = np.exp(np.asarray(jitted(process_logits)(target, sp)))
    logits_k = jnp.where(jnp.asarray(p_dense) > 0, target, -1e9)  # ... on the same support
    acc = jitted(accept)
    for seed in range(3):
        key = jax.random.PRNGKey(seed)
        n1, x1 = acc(key, drafts, q, target, sp)
        n2, _ = acc(key, drafts, q_dense, logits_k, dense_sp)
        assert n1.tolist() == n2.tolist()
        assert bool(jnp.all(jnp.asarray(p_dense)[jnp.arange(b), n1, x1] > 0))  # in support
    assert 0 < int(n1.sum()) < b * g


def test_bonus_token_follows_the_target_after_the_last_draft():
    """Every draft kept (q(d) < p(d)): the bonus token must follow the target's law at the
    next position exactly, not a residual against the last draft's q (which overlaps it
    here on purpose, so that mistake would move most of the mass)."""
    b = 20000
    p0 = np.array([0.10, 0.60, 0.10, 0.10, 0.05, 0.05])  # target at the draft's position
    p1 = np.array([0.50, 0.30, 0.20, 1e-9, 1e-9, 1e-9])  # target after the draft
    q0 = np.array([0.45, 0.05, 0.20, 0.10, 0.10, 0.10])  # the draft's law; draft = token 1
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(np.stack([p0, p1]), jnp.float32)), (b, 2, 6))
    q = jnp.broadcast_to(jnp.asarray(q0, jnp.float32), (b, 1, 6))
    drafts = jnp.ones((b, 1), jnp.int32)
    n_acc, nxt = jitted(accept)(jax.random.PRNGKey(0), drafts, q, logits, SamplingParams(1.0))
    assert bool(jnp.all(n_acc == 1))
    seen = np.bincount(np.asarray(nxt), minlength=6)
    assert seen[3:].sum() == 0
    assert stats.chisquare(seen[:3], p1[:3] / p1[:3].sum() * b).pvalue > 1e-4

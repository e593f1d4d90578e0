"""The selection against an independent computation: transformers' own attention weights.

Vegas's draft reads, per layer, the top-`count` positions of the ranked range 0..n by the
softmax weights of verify rows 0 and gamma averaged over all query heads (`last`: of the
row of the last accepted token). Here PyTorch's eager attention (`output_attentions=True`)
on the same tiny checkpoint gives those weights; the index set our verify pass captured
and `VerifyGuided.update` selected must be exactly their top-`count`, per layer and
sequence (ragged lengths), on the XLA backend and on the Pallas backend (interpret mode on
the CPU: vegas's capture handed over raw to the selection's own kernel, last's rows
through the verify kernel's capture and the fused top-k kernel). Wrong selections (one
row only, the oldest positions) must fail the same comparison."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax.attention import Capture, RawCapture
from vegas_jax.driver import start
from vegas_jax.execution import ExecConfig
from vegas_jax.loading import load_model
from vegas_jax.prefill import prefill_prompts
from vegas_jax.sampling import SamplingParams
from vegas_jax.speculative import SpecConfig, round_capture, verify_phase

GAMMA = 3
LENS = (150, 97)


def _reference_scores(hf_model, ids, n, rows):
    """[L, n + 1] mean over heads and `rows` of the softmax weights of the verify rows
    (positions n + r) over keys 0..n, from transformers' eager attention."""
    import torch

    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_attentions=True)
    att = np.stack([a[0].double().numpy() for a in out.attentions])  # [L, H, T, T]
    return att[:, :, [n + r for r in rows], : n + 1].mean(axis=(1, 2))


def _top(scores, count):
    return set(np.argsort(-scores, kind="stable")[:count].tolist())


def _same_top(got, scores, count, tol=1e-6):
    """got is the top-`count` set of `scores`, up to entries tied with the cut within tol
    (fp32 against PyTorch's fp32 can swap exact near-ties)."""
    want = _top(scores, count)
    cut = np.sort(scores)[::-1][count - 1]
    return all(abs(scores[i] - cut) <= tol * max(abs(cut), 1e-30) for i in got ^ want)


@pytest.fixture(scope="module")
def llama(tiny_hf):
    ckpt, hf_model = tiny_hf("llama-gqa")
    return load_model(checkpoint=ckpt, dtype=jnp.float32), hf_model


@pytest.mark.parametrize("method,backend", [
    ("vegas-paper", "xla"), ("vegas-paper", "pallas"),
    pytest.param("last", "xla", marks=pytest.mark.slow),
    ("last", "pallas")])
def test_selection_is_the_top_of_the_verify_rows(llama, method, backend):
    model, hf_model = llama
    cfg = model.config
    spec = SpecConfig(method=method, gamma=GAMMA, sparsity=0.1, min_tokens=4)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in LENS]
    tails = [rng.integers(3, cfg.vocab_size, GAMMA + 1).tolist() for _ in LENS]  # x0, drafts
    n_acc = [2, 0] if method == "last" else [0, 0]  # last: the row kept differs by sequence

    ids, cache, xc = start(model, prompts, 8, SamplingParams(), 2 * GAMMA + 2,
                           ExecConfig(backend=backend))
    assert xc.backend == backend and xc.pallas == (backend == "pallas")
    _, cache, _ = prefill_prompts(model.params, cfg, xc, ids, cache, None)
    x0 = jnp.asarray([t[0] for t in tails], jnp.int32)
    drafts = jnp.asarray([t[1:] for t in tails], jnp.int32)
    cap = round_capture(spec, cfg, xc, cache.max_len)
    raw = method == "vegas-paper" and backend == "pallas"  # scores from the verify's logits
    rows = (0, GAMMA) if method == "vegas-paper" else tuple(range(GAMMA + 1))
    assert cap == Capture(rows, "mean" if method == "vegas-paper" else "rows", "weight",
                          raw=raw)

    @jax.jit
    def select(params, cache, x0, drafts, n_acc):  # one program, as in a round
        _, vcache, scores = verify_phase(params, cfg, xc, cache, x0, drafts, cap)
        assert isinstance(scores, RawCapture) == raw
        return spec.method.update(spec, None, scores, vcache, cache.lengths, n_acc, xc)

    sel = select(model.params, cache, x0, drafts, jnp.asarray(n_acc, jnp.int32))
    idx, count = np.asarray(sel.idx), np.asarray(sel.count)

    for b, (p, t) in enumerate(zip(prompts, tails)):
        ref = _reference_scores(hf_model, p + t, len(p),
                                (0, GAMMA) if method == "vegas-paper" else (n_acc[b],))
        for layer in range(cfg.num_layers):
            c = int(count[layer, b])
            assert c == int(np.ceil(0.1 * (len(p) + GAMMA + 1)))  # the budget, below n + 1
            got = set(idx[layer, b, :c].tolist())
            assert len(got) == c
            assert _same_top(got, ref[layer], c), (b, layer, sorted(got ^ _top(ref[layer], c)))
            # the comparison has teeth: the oldest positions would fail it
            assert not _same_top(set(range(c)), ref[layer], c)
        assert np.asarray(sel.end)[b] == len(p) + 1


def test_wrong_capture_rows_are_caught(tiny_hf):
    """Capturing row 0 alone (not rows 0 and gamma) selects a different set somewhere:
    the test above would fail on that bug."""
    ckpt, hf_model = tiny_hf("llama-gqa")
    rng = np.random.default_rng(7)
    p = rng.integers(3, 160, LENS[0]).tolist()
    t = rng.integers(3, 160, GAMMA + 1).tolist()
    both = _reference_scores(hf_model, p + t, len(p), (0, GAMMA))
    one = _reference_scores(hf_model, p + t, len(p), (0,))
    c = int(np.ceil(0.1 * (len(p) + GAMMA + 1)))
    assert any(not _same_top(_top(one[layer], c), both[layer], c)
               for layer in range(both.shape[0]))


@pytest.mark.parametrize("name", ["vegas", "last", "auto"])
def test_drafts_after_plain_steps_see_their_own_position(name):
    """auto's plain steps grow the cache without a verify. The next round's drafts (any
    candidate gamma) must still attend to their own positions: the tail starts at the
    selection's `end` and holds 2 gamma + 1 entries, so without `after_plain` a draft 40
    tokens past `end` reads only stale entries (fails on the code before the fix)."""
    from vegas_jax.cache import init_cache
    from vegas_jax.config import get_config
    from vegas_jax.methods import TopK, method_named

    method = method_named(name)
    spec = SpecConfig(method=name, gamma=2)
    cache = init_cache(get_config("smollm2-135m"), 2, 256, jnp.float32)
    L, K = 2, 8
    sel = TopK(jnp.zeros((L, 2, K), jnp.int32), jnp.full((L, 2), K, jnp.int32),
               jnp.array([10, 30], jnp.int32))
    n = jnp.array([50, 33], jnp.int32)  # 40 tokens past `end`; 3 past (a short plain call)
    after = method.after_plain(spec, sel, n)
    for gamma in (2, 4, 6):
        g = SpecConfig(method=name, gamma=gamma)
        for i in range(gamma):
            pos = n + i
            plan = method.draft_plan(g, after, cache, pos)
            start = np.asarray(plan.tail_start)
            assert (start <= np.asarray(pos)).all()
            assert (np.asarray(pos) - start + 1 <= plan.tail_len).all(), (gamma, i)
    # a selection the plain steps did not outrun is left alone
    np.testing.assert_array_equal(np.asarray(after.end)[1], 30)

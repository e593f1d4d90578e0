"""The attention dispatch: finished sequences skip their attention on the Pallas path
(kernels in interpret mode), and every other row is what it was."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax.attention import AttnPlan, Capture, attention, sparse_block
from vegas_jax.execution import ExecConfig
from tests.tiny import tiny_config
from tests import rand

PALLAS = ExecConfig(attn="pallas", gemm="triton", layers="scan", draft="fused")


def _cache(L=2, b=3, kh=2, s=96, d=16, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 2)
    return (rand.normal(ks[0], (L, b, kh, s, d)),
            rand.normal(ks[1], (L, b, kh, s, d)))


ACTIVE = jnp.array([True, False, True])


def _split_rows(full, skipped):
    """Rows 0 and 2 (active) equal the plan without `active`; row 1 (finished) is 0."""
    full, skipped = np.asarray(full), np.asarray(skipped)
    np.testing.assert_allclose(skipped[[0, 2]], full[[0, 2]], rtol=1e-5, atol=1e-5)
    assert np.abs(full[1]).max() > 0  # the row had something to lose
    np.testing.assert_array_equal(skipped[1], 0.0)


def test_verify_rows_of_finished_sequences_read_nothing(pallas_interpret):
    kc, vc = _cache()
    b, t, kh, g, d = 3, 4, 2, 2, 16
    q = rand.normal(jax.random.PRNGKey(5), (b, t, kh, g, d))
    pos = jnp.array([40, 70, 90])[:, None] + jnp.arange(t)[None, :]
    cap = Capture((0, t - 1))
    full, sc_full = attention(AttnPlan(capture=cap), PALLAS, q, kc, vc, 1, pos)
    out, sc = attention(AttnPlan(capture=cap, active=ACTIVE), PALLAS, q, kc, vc, 1, pos)
    _split_rows(full, out)
    _split_rows(sc_full, sc)
    # the XLA path is the reference: it computes every row
    ref, _ = attention(AttnPlan(capture=cap, active=ACTIVE), ExecConfig(attn="xla"), q, kc, vc,
                       1, pos)
    np.testing.assert_allclose(np.asarray(ref)[1], np.asarray(full)[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_sparse_drafts_of_finished_sequences_read_nothing(pallas_interpret, fused):
    cfg = tiny_config(layers=2)
    kh, g, d = cfg.num_kv_heads, cfg.group_size, cfg.head_dim
    kc, vc = _cache(b=3, kh=kh, d=d)
    b, K = 3, 12
    idx = rand.randint(jax.random.PRNGKey(7), (2, b, K), 0, 50)
    plan = AttnPlan(mode="sparse", tail_len=5, idx=idx, count=jnp.full((2, b), K),
                    tail_start=jnp.array([60, 61, 62]))
    pos = jnp.array([[63], [64], [65]])
    if fused:
        qkv = rand.normal(jax.random.PRNGKey(8), (b, 1, (kh * g + 2 * kh) * d))
        one = jnp.ones((d,))
        rope = jnp.stack([jnp.ones((b, d // 2)), jnp.zeros((b, d // 2))], axis=1)

        def run(p):
            return sparse_block(p, PALLAS, cfg, qkv, one, one, rope, kc, vc, 1, pos)[0]
    else:
        q = rand.normal(jax.random.PRNGKey(8), (b, 1, kh, g, d))

        def run(p):
            return attention(p, PALLAS, q, kc, vc, 1, pos)[0]
    _split_rows(run(plan), run(plan.replace(active=ACTIVE)))


def _draft_inputs(cfg):
    """A 3-sequence cache of 96 positions, a sparse draft plan over it, the draft tokens and
    their positions: (cache, plan, tokens [3, 1], positions [3, 1])."""
    from vegas_jax.cache import KVCache

    L, b, K = cfg.num_layers, 3, 12
    kc, vc = _cache(L=L, b=b, kh=cfg.num_kv_heads, s=96, d=cfg.head_dim)
    cache = KVCache(k=kc, v=vc, lengths=jnp.array([63, 64, 65]))
    idx = rand.randint(jax.random.PRNGKey(7), (L, b, K), 0, 50)
    plan = AttnPlan(mode="sparse", tail_len=5, idx=idx, count=jnp.full((L, b), K),
                    tail_start=jnp.array([60, 61, 62]))
    return cache, plan, jnp.array([[5], [17], [42]]), jnp.array([[63], [64], [65]])


def test_merged_draft_layer_computes_the_fused_one(pallas_interpret):
    """`ExecConfig(draft="merged")`: a draft step through the draft-only merged weights
    (three matmuls a layer, the MLP's norm scale applied after its product) gives the
    logits and cache of the fused draft step (fp32: to rounding); the weights are really
    read (zeroing w_draft_o changes the logits); verify and plain decoding never read them."""
    import dataclasses

    from vegas_jax.model import forward, layout_params
    from tests.tiny import tiny_model

    m = tiny_model(scale=0.3)
    fused = dataclasses.replace(PALLAS, draft="fused")
    merged = dataclasses.replace(PALLAS, draft="merged")
    pf, pm = layout_params(m.params, fused), layout_params(m.params, merged)
    assert pf.layers.w_draft_in is None and pm.layers.w_draft_in is not None
    assert ExecConfig(draft="merged").resolve("cpu").draft == "fused"  # XLA path: no use
    cfg = m.config
    cache, plan, tok, pos = _draft_inputs(cfg)

    def draft(p, xc):
        logits, c, _ = forward(p, cfg, xc, tok, pos, cache, plan)
        return np.asarray(logits), np.asarray(c.k)

    (lf, kf), (lm, km) = draft(pf, fused), draft(pm, merged)
    np.testing.assert_allclose(lm, lf, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(km, kf, rtol=1e-5, atol=1e-5)
    broken = pm.replace(layers=pm.layers.replace(w_draft_o=jnp.zeros_like(pm.layers.w_draft_o)))
    assert np.abs(draft(broken, merged)[0] - lf).max() > 1e-2
    # a verify (dense plan) through the merged params ignores the draft-only weights
    vf, _, _ = forward(pf, cfg, fused, tok, pos, cache, AttnPlan())
    vm, _, _ = forward(broken, cfg, merged, tok, pos, cache, AttnPlan())
    np.testing.assert_array_equal(np.asarray(vm), np.asarray(vf))


def test_fused_mlp_draft_layer_computes_the_fused_one(pallas_interpret, monkeypatch):
    """`ExecConfig(draft="fused-mlp")`: a draft step whose MLP input (norm row scale,
    gate/up, activation) is one kernel gives the fused draft step's logits and cache (fp32:
    to rounding; layer 0's K/V exactly); the kernel runs in drafts, never in a
    verify (whose logits stay bit for bit the fused config's)."""
    import dataclasses

    from pallas_kernels import draft_mlp
    from vegas_jax.model import forward, layout_params
    from tests.tiny import tiny_model

    m = tiny_model(scale=0.3)
    fused = dataclasses.replace(PALLAS, draft="fused")
    mlp = dataclasses.replace(PALLAS, draft="fused-mlp")
    assert ExecConfig(draft="fused-mlp").resolve("cpu").draft == "fused"  # XLA path: no use
    with pytest.raises(ValueError, match="one device"):
        ExecConfig(draft="fused-mlp", tp=2)
    p = layout_params(m.params, mlp)
    cfg = m.config
    cache, plan, tok, pos = _draft_inputs(cfg)
    calls = []
    kernel = draft_mlp.norm_gate_up
    monkeypatch.setattr(draft_mlp, "norm_gate_up",
                        lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    rows = tok.shape[0] * tok.shape[1]
    assert rows < draft_mlp.MIN_ROWS
    lf = np.asarray(forward(p, cfg, fused, tok, pos, cache, plan)[0])
    np.testing.assert_array_equal(np.asarray(forward(p, cfg, mlp, tok, pos, cache, plan)[0]),
                                  lf)  # too few rows: XLA's kernels
    assert not calls
    monkeypatch.setattr(draft_mlp, "MIN_ROWS", rows)
    jax.clear_caches()

    def run(xc, plan):
        logits, c, _ = forward(p, cfg, xc, tok, pos, cache, plan)
        return np.asarray(logits), np.asarray(c.k)

    (lf, kf), (lm, km) = run(fused, plan), run(mlp, plan)
    assert calls  # traced once (the layers run in a loop)
    np.testing.assert_allclose(lm, lf, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(km[0], kf[0])  # later layers' inputs differ by rounding
    np.testing.assert_allclose(km, kf, rtol=1e-5, atol=1e-5)
    calls.clear()
    vf, vm = run(fused, AttnPlan())[0], run(mlp, AttnPlan())[0]
    assert not calls
    np.testing.assert_array_equal(vm, vf)
    # layers whose gate/up weights exceed the bound keep XLA's three kernels
    monkeypatch.setattr(draft_mlp, "SMALL_BYTES", 0)
    jax.clear_caches()  # a traced draft step would keep the kernel
    assert np.array_equal(run(mlp, plan)[0], lf) and not calls


def test_padded_draft_rows_change_nothing(pallas_interpret):
    """`ExecConfig.row_pad`: a fused draft of 3 sequences carried as 8 rows (5 padding rows
    through every layer, dropped before the LM head) gives the unpadded draft's logits
    and cache, and the padding rows write no cache entry."""
    import dataclasses

    from vegas_jax.model import forward, layout_params
    from tests.tiny import tiny_model

    m = tiny_model(scale=0.3)
    padded = dataclasses.replace(PALLAS, draft="fused", row_pad=8)
    plain = dataclasses.replace(padded, row_pad=1)
    p = layout_params(m.params, padded)
    cfg, b = m.config, 3
    cache, plan, tok, pos = _draft_inputs(cfg)
    lp, cp, _ = forward(p, cfg, padded, tok, pos, cache, plan)
    l1, c1, _ = forward(p, cfg, plain, tok, pos, cache, plan)
    assert lp.shape == (b, 1, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(l1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cp.k), np.asarray(c1.k))
    np.testing.assert_array_equal(np.asarray(cp.v), np.asarray(c1.v))

"""The attention dispatch and the fused draft layer on the Pallas path (on the CPU the
kernels run in interpret mode by themselves): finished sequences skip their attention
and every other row is what it was; a fused draft step (one kernel a layer for the
attention block, the draft MLP kernel where the model allows it, rows padded to a
multiple of 8) computes the XLA reference's draft step."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax.attention import AttnPlan, Capture, attention, sparse_block
from vegas_jax.execution import ExecConfig
from tests.tiny import tiny_config
from tests import rand

PALLAS = ExecConfig(backend="pallas", layers="scan")
XLA = ExecConfig(backend="xla", layers="scan")


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


def test_verify_rows_of_finished_sequences_read_nothing():
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
    ref, _ = attention(AttnPlan(capture=cap, active=ACTIVE), XLA, q, kc, vc,
                       1, pos)
    np.testing.assert_allclose(np.asarray(ref)[1], np.asarray(full)[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused", [pytest.param(False, marks=pytest.mark.slow), True])
def test_sparse_drafts_of_finished_sequences_read_nothing(fused):
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


def _draft_inputs(cfg, b=3):
    """A b-sequence cache of 96 positions, a sparse draft plan over it, the draft tokens and
    their positions: (cache, plan, tokens [b, 1], positions [b, 1])."""
    from vegas_jax.cache import KVCache

    L, K = cfg.num_layers, 12
    kc, vc = _cache(L=L, b=b, kh=cfg.num_kv_heads, s=96, d=cfg.head_dim)
    n = 63 + jnp.arange(b, dtype=jnp.int32) % 3
    cache = KVCache(k=kc, v=vc, lengths=n)
    idx = rand.randint(jax.random.PRNGKey(7), (L, b, K), 0, 50)
    plan = AttnPlan(mode="sparse", tail_len=5, idx=idx, count=jnp.full((L, b), K),
                    tail_start=n - 3)
    tok = rand.randint(jax.random.PRNGKey(9), (b, 1), 0, cfg.vocab_size)
    return cache, plan, tok, n[:, None]


@pytest.fixture(scope="module")
def folded():
    """The tiny model with its norm weights folded, as `load_model` lays it out."""
    from vegas_jax.params import layout_params
    from tests.tiny import tiny_model

    m = tiny_model(scale=0.3)
    return m._replace(params=layout_params(m.params, PALLAS))


def _run(m, xc, cache, plan, tok, pos):
    from vegas_jax.model import forward

    logits, c, _ = forward(m.params, m.config, xc, tok, pos, cache, plan)
    return np.asarray(logits), np.asarray(c.k), np.asarray(c.v)


def test_fused_draft_step_equals_the_reference(folded):
    """A draft step on the Pallas path (the attention block of each layer in one kernel,
    the input norm's row scale applied inside it, 3 rows carried as 8) gives the XLA
    reference's logits and cache (fp32: to rounding); a verify step too."""
    cache, plan, tok, pos = _draft_inputs(folded.config)
    (lp, kp, vp), (lx, kx, vx) = (_run(folded, xc, cache, plan, tok, pos) for xc in (PALLAS, XLA))
    assert lp.shape == (3, 1, folded.config.vocab_size)
    np.testing.assert_allclose(lp, lx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(kp, kx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(vp, vx, rtol=1e-5, atol=1e-5)
    verify = [_run(folded, xc, cache, AttnPlan(), tok, pos)[0] for xc in (PALLAS, XLA)]
    np.testing.assert_allclose(verify[0], verify[1], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_padded_draft_rows_change_nothing(folded, monkeypatch):
    """A fused draft of 3 sequences carried as 8 rows (`model.ROW_PAD`: 5 padding rows
    through every layer, dropped before the LM head) gives the unpadded draft's logits
    and cache, and the padding rows write no cache entry."""
    from vegas_jax import model as model_mod

    assert model_mod.ROW_PAD == 8
    cache, plan, tok, pos = _draft_inputs(folded.config)
    lp, kp, vp = _run(folded, PALLAS, cache, plan, tok, pos)
    monkeypatch.setattr(model_mod, "ROW_PAD", 1)
    l1, k1, v1 = _run(folded, PALLAS, cache, plan, tok, pos)
    np.testing.assert_allclose(lp, l1, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kp, k1)
    np.testing.assert_array_equal(vp, v1)


def test_draft_mlp_kernel_where_the_model_allows(folded):
    """`draft_mlp_kernel`: the fused draft layer's MLP input (norm row scale, gate/up,
    activation) runs as one kernel on the Pallas path, one device, for a dense MLP whose
    norm weight is folded, small weights and at least `draft_mlp.MIN_ROWS` rows."""
    from pallas_kernels import draft_mlp
    from vegas_jax.model import draft_mlp_kernel
    from tests.tiny import tiny_model

    lp, many = folded.params.layers, draft_mlp.MIN_ROWS  # every layer's, stacked
    assert draft_mlp_kernel(PALLAS, lp, many)
    assert not draft_mlp_kernel(PALLAS, lp, many - 1)  # too few rows: XLA's three kernels
    assert not draft_mlp_kernel(XLA, lp, many)
    assert not draft_mlp_kernel(ExecConfig(backend="pallas", tp=2), lp, many)
    assert not draft_mlp_kernel(PALLAS, tiny_model().params.layers, many)  # norm kept
    assert not draft_mlp_kernel(PALLAS, lp.replace(w_gate_up=None), many)  # MoE
    big = lp.replace(w_gate_up=jnp.zeros((1024, 2 * 2048), jnp.float32))
    assert not draft_mlp_kernel(PALLAS, big, many)  # weights over SMALL_BYTES


@pytest.mark.slow
def test_draft_mlp_kernel_draft_equals_the_reference(folded, monkeypatch):
    """A draft step of MIN_ROWS sequences on the Pallas path runs the draft MLP kernel
    (traced once: the layers run in a loop) and gives the logits and cache of the same
    step with XLA's three MLP kernels (fp32: to rounding; layer 0's K/V, written before
    any MLP, exactly); a verify never runs it."""
    from pallas_kernels import draft_mlp

    b = draft_mlp.MIN_ROWS
    cache, plan, tok, pos = _draft_inputs(folded.config, b)
    calls = []
    kernel = draft_mlp.norm_gate_up
    monkeypatch.setattr(draft_mlp, "norm_gate_up",
                        lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    jax.clear_caches()  # a layer traced before would not call it again
    lk, kk, _ = _run(folded, PALLAS, cache, plan, tok, pos)
    assert calls == [(b, folded.config.hidden_size)]
    calls.clear()
    _run(folded, PALLAS, cache, AttnPlan(), tok, pos)
    assert not calls
    monkeypatch.setattr(draft_mlp, "MIN_ROWS", b + 1)  # the same step without the kernel
    jax.clear_caches()
    lm, km, _ = _run(folded, PALLAS, cache, plan, tok, pos)
    assert not calls
    np.testing.assert_allclose(lk, lm, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(kk[0], km[0])
    np.testing.assert_allclose(kk, km, rtol=1e-5, atol=1e-5)


def test_cudnn_serves_only_fresh_prompts_it_computes_alike():
    """`causal_impl` is the one place the prefill backend is chosen: cuDNN for a fresh
    bf16 prompt on a GPU's Pallas path, nowhere a capture, window, sinks, fp32, exact or a
    decode-sized call needs the kernel."""
    from types import SimpleNamespace

    from vegas_jax.attention import PROMPT, PROMPT_CHUNK, causal_impl

    gpu = SimpleNamespace(pallas=True, exact=False, cudnn_prefill=True, interpret=False)
    q = jnp.zeros((1, 64, 2, 4, 16), jnp.bfloat16)
    assert causal_impl(PROMPT, gpu, q).__name__ == "_cudnn"
    kernel = [causal_impl(AttnPlan(), gpu, q),  # not from position 0
              causal_impl(AttnPlan(fresh=True, capture=Capture((0,))), gpu, q),
              causal_impl(PROMPT, gpu, q, window=jnp.int32(4)),
              causal_impl(PROMPT, gpu, q, sinks=jnp.zeros((2, 4))),
              causal_impl(PROMPT, gpu, q.astype(jnp.float32)),
              causal_impl(PROMPT, gpu, q[:, :8]),  # 8 tokens x 4 heads: one decode program
              causal_impl(PROMPT, SimpleNamespace(**{**vars(gpu), "cudnn_prefill": False}), q)]
    assert all(f.func.__name__ == "verify_attention" for f in kernel)
    from pallas_kernels.verify_attention import INVARIANT, INVARIANT_PREFILL

    exact = SimpleNamespace(**{**vars(gpu), "exact": True})  # the row-invariant plans
    assert causal_impl(PROMPT, exact, q).keywords["blocks"] == INVARIANT_PREFILL
    assert causal_impl(PROMPT_CHUNK, exact, q).keywords["blocks"] == INVARIANT_PREFILL
    assert causal_impl(AttnPlan(), exact, q).keywords["blocks"] == INVARIANT
    xla = SimpleNamespace(pallas=False, exact=False, cudnn_prefill=False, interpret=True)
    assert causal_impl(PROMPT, xla, q).__name__ == "verify_attention_reference"

"""Quantized draft weights (issue 55): `quantize_params` makes an int8 / int4 copy of every
draft matmul and nothing else, the draft forward reads only those, the copy is made once a
model and format, and speculative output stays the target's (greedy: vanilla's tokens for
every method; sampled: the target's law). Bad settings fail in one line."""

import json
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import vegas_jax.model as model_mod
from conftest import SPEC_EOS, SPEC_NEW
from pallas_kernels import quant_matmul as qm
from tests.test_speculative import check_joint_law
from tests.tiny import BENCH_WORKLOAD, tiny_model
from vegas_jax import quant
from vegas_jax.attention import CAUSAL, AttnPlan
from vegas_jax.cache import init_cache
from vegas_jax.config import get_config
from vegas_jax.execution import ExecConfig
from vegas_jax.generate import generate
from vegas_jax.loading import Model
from vegas_jax.model import forward
from vegas_jax.params import layout_params
from vegas_jax.quant import DRAFT_MATMULS, DraftCache, QuantWeight, draft_params, quantize_params
from vegas_jax.sampling import SamplingParams
from vegas_jax.speculative import SpecConfig, speculative_generate

XLA = ExecConfig(backend="xla", layers="scan")
PALLAS = ExecConfig(backend="pallas", layers="scan")
FORMATS = ("int8", "int4")
# every speculative product method (test_speculative.METHODS)
METHODS = ["vegas", "vegas-paper", "last", "stream", "quest", "auto"]


def numpy_quantize(w, fmt):
    """The formats written out in numpy, independently of the kernel file: the weight
    each (q, scale) stands for, [k, n] fp32."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    if fmt == "int8":
        s = np.abs(w).max(axis=0) / np.float32(127)
        q = np.clip(np.round(w / np.where(s == 0, 1, s)), -127, 127)
        return q * s
    g = 128 if k % 128 == 0 else 64
    wg = w.reshape(k // g, g, n)
    s = (np.abs(wg).max(axis=1) / np.float32(7)).astype(ml_dtypes.bfloat16).astype(np.float32)
    q = np.clip(np.round(wg / np.where(s == 0, 1, s)[:, None, :]), -7, 7)
    return (q * s[:, None, :]).reshape(k, n)


def dequantized(w: QuantWeight):
    return np.asarray(qm.dequantize(w.q, w.scale, w.fmt))


def per_layer(params):
    """Each layer's LayerParams, stacked or unrolled alike."""
    layers = params.layers
    if isinstance(layers, tuple):
        return list(layers)
    n = jax.tree.leaves(layers)[0].shape[0]
    return [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n)]


@pytest.fixture(scope="module")
def folded():
    """The tiny model (tied head) laid out as `load_model` lays it out: norms folded."""
    m = tiny_model(scale=0.3)
    return m._replace(params=layout_params(m.params, XLA), exec_config=XLA)


# ---------------------------------------------------------------------------------------
# The copy
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layers,arch", [("scan", "qwen3"), ("unrolled", "llama")])
def test_quantize_params_covers_every_draft_matmul_and_only_them(fmt, layers, arch):
    """Every draft matmul's weight becomes a QuantWeight whose values are the format's
    (numpy reference); a tied head becomes a copy of embed.T; the embedding, norms and
    the model's own params are left as they are (shared, not copied)."""
    m = tiny_model(arch, scale=0.3)
    params = layout_params(m.params, ExecConfig(layers=layers))
    before = jax.tree.map(np.asarray, params)
    draft = quantize_params(params, fmt)
    assert draft.embed is params.embed and draft.final_norm is params.final_norm
    assert params.lm_head is None  # tied: the draft's head is embed.T, quantized
    np.testing.assert_allclose(dequantized(draft.lm_head),
                               numpy_quantize(np.asarray(params.embed).T, fmt), atol=1e-6)
    for lp, dp in zip(per_layer(params), per_layer(draft)):
        for f in DRAFT_MATMULS:
            w = getattr(dp, f)
            assert isinstance(w, QuantWeight) and w.fmt == fmt and w.layer is None
            np.testing.assert_allclose(dequantized(w), numpy_quantize(getattr(lp, f), fmt),
                                       atol=1e-6, err_msg=f)
    # the layers' other fields (norms, biases): the model's own arrays
    ours = params.layers if isinstance(params.layers, tuple) else (params.layers,)
    theirs = draft.layers if isinstance(draft.layers, tuple) else (draft.layers,)
    for lp, dp in zip(ours, theirs):
        for f in lp.__dataclass_fields__:
            if f not in DRAFT_MATMULS:
                assert getattr(dp, f) is getattr(lp, f), f
    # the model's params: untouched
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), before)
    shared = jax.tree.leaves(params)
    assert quant.quantized_bytes(params, fmt) == sum(
        a.nbytes for a in jax.tree.leaves(draft) if not any(a is b for b in shared))


def test_untied_head_is_quantized_from_lm_head():
    m = tiny_model(scale=0.3)
    cfg = m.config
    lm_head = jax.random.normal(jax.random.PRNGKey(5), (cfg.hidden_size, cfg.vocab_size)) * 0.1
    params = m.params.replace(lm_head=lm_head)
    draft = quantize_params(params, "int4")
    np.testing.assert_allclose(dequantized(draft.lm_head), numpy_quantize(lm_head, "int4"),
                               atol=1e-6)


def test_draft_params_hold_no_full_precision_matrix_but_the_embedding(folded):
    """Beside the QuantWeights the draft params hold the shared embedding and per-layer
    vectors (norms) alone: no matrix a draft could read at full precision."""
    for fmt in FORMATS:
        draft = quantize_params(folded.params, fmt)
        leaves = jax.tree.leaves(draft, is_leaf=lambda a: isinstance(a, QuantWeight))
        full = [a for a in leaves if not isinstance(a, QuantWeight) and a is not draft.embed]
        assert full and all(a.ndim <= 2 for a in full)  # [L, h] or [L, d] stacked vectors
        assert sum(isinstance(a, QuantWeight) for a in leaves) == len(DRAFT_MATMULS) + 1


@pytest.mark.parametrize("xc", [XLA, PALLAS], ids=["xla", "pallas"])
def test_draft_forward_reads_only_quantized_weights(folded, monkeypatch, xc):
    """Traced with the int4 draft params, a sparse draft forward runs no matmul of a full
    precision weight (`model.mm`, every such matmul's path) and every projection and the
    head through the quantized matmul; the verify's forward with the model's params
    runs them at full precision."""
    cfg = folded.config
    calls = {"mm": 0, "quant": 0}
    real_mm, real_q = model_mod.mm, quant.linear

    def mm(*a, **k):
        calls["mm"] += 1
        return real_mm(*a, **k)

    def qlinear(*a, **k):
        calls["quant"] += 1
        return real_q(*a, **k)

    monkeypatch.setattr(model_mod, "mm", mm)
    monkeypatch.setattr(quant, "linear", qlinear)
    jax.clear_caches()  # `_layer`'s traces of earlier tests would skip the spies
    b, L = 2, cfg.num_layers
    cache = init_cache(cfg, b, 128, jnp.float32)
    pos = jnp.full((b, 1), 40, jnp.int32)
    tok = jnp.ones((b, 1), jnp.int32)
    plan = AttnPlan(mode="sparse", tail_len=4, idx=jnp.zeros((L, b, 8), jnp.int32),
                    count=jnp.full((L, b), 8, jnp.int32), tail_start=jnp.full((b,), 37))
    draft = quantize_params(folded.params, "int4")
    jax.eval_shape(lambda p: forward(p, cfg, xc, tok, pos, cache, plan), draft)
    # the scanned layers trace their body once: 4 projections, then the head
    assert calls == {"mm": 0, "quant": len(DRAFT_MATMULS) + 1}
    jax.eval_shape(lambda p: forward(p, cfg, xc, tok, pos, cache, CAUSAL), folded.params)
    assert calls["mm"] >= len(DRAFT_MATMULS) + 1 and calls["quant"] == len(DRAFT_MATMULS) + 1


@pytest.mark.parametrize("fmt", ["int4", pytest.param("int8", marks=pytest.mark.slow)])
def test_draft_mlp_kernel_reads_quantized_weights(folded, monkeypatch, fmt):
    """A draft step of `draft_mlp.MIN_ROWS` sequences on the Pallas path runs the draft MLP
    kernel on the quantized gate/up weights (the scanned layer's, sliced) and gives the
    logits of the same step on the XLA path (fp32: to rounding)."""
    from pallas_kernels import draft_mlp

    cfg, b, L = folded.config, draft_mlp.MIN_ROWS, folded.config.num_layers
    draft = quantize_params(folded.params, fmt)
    calls = []
    kernel = draft_mlp.norm_gate_up
    monkeypatch.setattr(draft_mlp, "norm_gate_up",
                        lambda *a, **k: calls.append(k.get("fmt")) or kernel(*a, **k))
    jax.clear_caches()  # a layer traced before would not call it again
    rng = np.random.default_rng(0)
    cache = init_cache(cfg, b, 96, jnp.float32)
    cache = cache.replace(k=jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32),
                          v=jnp.asarray(rng.normal(size=cache.v.shape), jnp.float32))
    n = jnp.full((b,), 60, jnp.int32)
    plan = AttnPlan(mode="sparse", tail_len=5, idx=jnp.asarray(rng.integers(0, 50, (L, b, 12))),
                    count=jnp.full((L, b), 12), tail_start=n - 3)
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 1)), jnp.int32)
    out = {xc.backend: np.asarray(forward(draft, cfg, xc, tok, n[:, None], cache, plan)[0])
           for xc in (PALLAS, XLA)}
    assert calls == [fmt]  # traced once: the layers run in a loop
    np.testing.assert_allclose(out["pallas"], out["xla"], rtol=1e-4, atol=1e-4)


def test_the_copy_is_made_once_per_model_and_format(folded, monkeypatch):
    made = []
    real = quant.quantize_params
    monkeypatch.setattr(quant, "quantize_params", lambda p, f: made.append(f) or real(p, f))
    m = Model(folded.config, folded.params, None, XLA, DraftCache())
    assert draft_params(m, "same", XLA) is None  # the model's own: no copy, no argument
    a = draft_params(m, "int8", XLA)
    assert draft_params(m, "int8", XLA) is a and made == ["int8"]
    c = draft_params(m, "int4", XLA)
    assert c is not a and draft_params(m, "int8", XLA) is a and made == ["int8", "int4"]
    other = m._replace(params=jax.tree.map(lambda x: x * 2, folded.params))
    d = draft_params(other, "int8", XLA)  # other weights: a copy of theirs
    assert made == ["int8", "int4", "int8"]
    np.testing.assert_allclose(dequantized(d.lm_head), 2 * dequantized(a.lm_head), rtol=1e-6)


def test_a_copy_that_cannot_fit_is_refused(folded, monkeypatch):
    import vegas_jax.prefill as pf

    monkeypatch.setattr(pf, "available_bytes", lambda: 1000)
    with pytest.raises(MemoryError, match="int8 draft weights"):
        draft_params(folded, "int8", XLA)


# ---------------------------------------------------------------------------------------
# Bad settings
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["fp8", "INT8", "", None, 8])
def test_bad_draft_weights(bad):
    with pytest.raises(ValueError, match="draft_weights must be one of") as e:
        SpecConfig(draft_weights=bad)
    assert "\n" not in str(e.value)


def test_moe_and_tensor_parallel_are_refused():
    moe = types.SimpleNamespace(config=get_config("qwen3-30b-a3b"), params=None)
    with pytest.raises(ValueError, match="mixture of experts") as e:
        draft_params(moe, "int8", XLA)
    assert "\n" not in str(e.value)
    dense = types.SimpleNamespace(config=get_config("qwen3-8b"), params=None)
    with pytest.raises(ValueError, match="one device: use tp=1"):
        draft_params(dense, "int4", ExecConfig(backend="xla", tp=2))
    assert draft_params(moe, "same", XLA) is None  # the model's own weights: nothing to refuse


def test_cli_flag_reaches_the_spec():
    from vegas_jax.decode import build_parser

    p = build_parser()
    assert p.parse_args([]).draft_weights == "same"
    assert p.parse_args(["--draft-weights", "int4"]).draft_weights == "int4"
    with pytest.raises(SystemExit):
        p.parse_args(["--draft-weights", "fp8"])


# ---------------------------------------------------------------------------------------
# Lossless: greedy
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(spec_model):
    """test_speculative's workload: a ragged batch whose prompt 1 hits EOS mid-round."""
    model, prompts = spec_model
    prompts = prompts[:3]
    vanilla = generate(model, prompts, SPEC_NEW)
    assert [len(t) for t in vanilla.tokens] == [SPEC_NEW, 6, SPEC_NEW]
    assert vanilla.tokens[1][-1] == SPEC_EOS
    return model, prompts, vanilla


def _spec(method, fmt):
    return SpecConfig(method=method, gamma=1 if method == "auto" else 3, min_tokens=8,
                      draft_weights=fmt)


# int4 (the coarser copy: more rejections) for every method, int8 for vegas (a format
# changes the draft's matmuls alone, which every method shares)
@pytest.mark.parametrize("fmt,method", [("int4", "vegas"), ("int4", "quest"), ("int8", "vegas")] + [
    pytest.param("int4", m, marks=pytest.mark.slow) for m in METHODS
    if m not in ("vegas", "quest")])
def test_greedy_with_quantized_drafts_equals_vanilla(setup, fmt, method):
    model, prompts, vanilla = setup
    res = speculative_generate(model, prompts, SPEC_NEW, _spec(method, fmt), exec_config=XLA)
    assert res.tokens == vanilla.tokens
    assert res.stats["method"] == method


@pytest.mark.parametrize("fmt,xc", [
    pytest.param("int4", PALLAS, marks=pytest.mark.slow),
    pytest.param("int8", ExecConfig(backend="xla", layers="unrolled"),
                 marks=pytest.mark.slow)], ids=["pallas-int4", "unrolled-int8"])
def test_greedy_with_quantized_drafts_on_other_paths(setup, fmt, xc):
    """The Pallas kernels (interpreted) and per-layer weight buffers: vanilla's tokens."""
    model, prompts, vanilla = setup
    if xc.layers == "unrolled":
        model = model._replace(params=layout_params(model.params, xc))
    res = speculative_generate(model, prompts, SPEC_NEW, _spec("vegas", fmt), exec_config=xc)
    assert res.tokens == vanilla.tokens


def test_quantized_drafts_are_drafts_of_their_own(setup):
    """The int4 drafts differ from the model's own (else the tests above test nothing):
    their acceptance is lower on this model."""
    model, prompts, _ = setup
    same = speculative_generate(model, prompts, SPEC_NEW, _spec("stream", "same"),
                                exec_config=XLA)
    int4 = speculative_generate(model, prompts, SPEC_NEW, _spec("stream", "int4"),
                                exec_config=XLA)
    assert int4.stats["tau"] < same.stats["tau"]


# ---------------------------------------------------------------------------------------
# Lossless: the sampled law
# ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_sampled_output_with_int4_drafts_has_target_distribution():
    """test_speculative's law test (top-k 5, gamma 2: the draft's q in its sparse form)
    with int4 drafts: the first two tokens after the prompt's own follow the model's
    exact joint law, and drafts were rejected along the way."""
    check_joint_law(SamplingParams(1.0, top_k=5), 2, draft_weights="int4")


# ---------------------------------------------------------------------------------------
# The bench's sweep
# ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_sweeps_draft_weights(capsys):
    from vegas_jax import bench

    rc = bench.main([*BENCH_WORKLOAD, "--gamma", "2", "--sparsity", "0.5", "--methods",
                     "vanilla,vegas", "--draft-weights", "same,int4", "--profile-reps", "0",
                     "--json"], model=tiny_model(scale=0.3))
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["method"], r.get("draft_weights")) for r in rows] == [
        ("vanilla", None), ("vegas", "same"), ("vegas", "int4")]
    assert all(r["equal_sequences"] == 2 for r in rows[1:])
    assert bench.main(["--draft-weights", "same,fp8", *BENCH_WORKLOAD]) == 2
    assert "--draft-weights must be one of" in capsys.readouterr().err


@pytest.mark.slow
def test_draft_weights_benchmark_runs(tmp_path, capsys, monkeypatch):
    """benchmarks/draft_weights.py end to end on the CPU at a tiny registered config: the
    kernel checks pass, one row a (shape, format) with its floors, the JSON in $OUT."""
    from benchmarks import draft_weights
    from tests.tiny import tiny_config
    from vegas_jax import config

    cfg = tiny_config("llama", vocab=256, layers=2)
    monkeypatch.setitem(config.REGISTRY, cfg.name, cfg)
    monkeypatch.setenv("OUT", str(tmp_path))
    rc = draft_weights.main(["--model", cfg.name, "--shapes", "2x300", "--gamma", "2",
                             "--backend", "xla", "--reps", "1", "--ceiling-mib", "16",
                             "--min-tokens", "8", "--formats", "same,int4"])
    assert rc == 0
    assert "| B x context | weights | draft step ms |" in capsys.readouterr().out
    out = json.loads((tmp_path / "draft_weights_2x300.json").read_text())
    assert [(r["batch"], r["draft_weights"]) for r in out["rows"]] == [
        (2, f) for f in ("same", "int4")]
    assert set(out["checks"]) == {"int4"} and max(out["checks"].values()) < 1e-3
    same, int4 = out["rows"][:2]
    assert same["draft_bytes"] > int4["draft_bytes"]
    assert all(r["round_ms"] > 0 and r["draft_floor_ms"] > 0 for r in out["rows"])

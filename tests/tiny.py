"""Tiny random models for fast tests (no checkpoint needed)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from vegas_jax.config import ModelConfig, get_config
from vegas_jax.params import init_params


class TinyModel(NamedTuple):
    config: ModelConfig
    params: Any
    tokenizer: Any = None
    exec_config: Any = None  # how it runs (None: the default ExecConfig)


# The bench and tuner tests' workload (`python -m vegas_jax.bench` / `tune` flags), one
# for both: the programs one run compiles, the next loads from the session's compilation
# cache. Prompts of 50 tokens: a bench profile's 64 new tokens fit them in a cache of 128
# positions, as the profile-only path's synthetic cache of 50 tokens does.
BENCH_WORKLOAD = ["--batch", "2", "--context", "50", "--new-tokens", "16", "--min-tokens", "8",
                  "--backend", "xla"]


def tiny_config(arch="qwen3", vocab=100, layers=2, eos=()):
    base = get_config("qwen3-0.6b" if arch == "qwen3" else "smollm2-135m")
    return dataclasses.replace(
        base, name=f"tiny-{arch}", num_layers=layers, hidden_size=64, intermediate_size=128,
        num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=vocab, eos_token_ids=tuple(eos),
    )


def tiny_model(arch="qwen3", vocab=100, layers=2, scale=0.3, seed=0, eos=(),
               dtype=jnp.float32) -> TinyModel:
    cfg = tiny_config(arch, vocab, layers, eos)
    return TinyModel(cfg, init_params(cfg, jax.random.PRNGKey(seed), dtype, scale=scale))


def tiny_tokenizer():
    """A word-level tokenizer of 11 ids (<unk> <s> </s> and 8 words), no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(
        "hello world the cat sat on a mat".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def with_tokenizer(src, dst):
    """A copy of the checkpoint directory `src` in `dst` with `tiny_tokenizer` saved in it."""
    import shutil

    shutil.copytree(src, dst, dirs_exist_ok=True)
    tiny_tokenizer().save_pretrained(str(dst))
    return dst

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

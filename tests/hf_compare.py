"""What the tests against transformers share: our forward on the XLA path, compiled once
per config, and a Hugging Face model's logits for one sequence."""

from __future__ import annotations

import functools

import jax

from vegas_jax.attention import CAUSAL
from vegas_jax.execution import ExecConfig
from vegas_jax.model import forward

XLA = ExecConfig("xla", "triton", "scan")


@functools.partial(jax.jit, static_argnames=("cfg",))
def xla_forward(params, cfg, tokens, positions, cache):
    """Causal forward (prefill or cached decode) of our model; (logits, cache, scores)."""
    return forward(params, cfg, XLA, tokens, positions, cache, CAUSAL)


def hf_logits(hf_model, ids):
    """fp32 logits [len(ids), v] of a transformers model on one sequence."""
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().numpy()

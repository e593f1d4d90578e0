"""What the tests against transformers share: our forward on the XLA path, compiled once
per config, and a Hugging Face model's logits for one sequence."""

from __future__ import annotations

import functools

import jax

from vegas_jax.attention import CAUSAL
from vegas_jax.execution import ExecConfig
from vegas_jax.model import forward

XLA = ExecConfig(backend="xla", layers="scan")


@functools.partial(jax.jit, static_argnames=("cfg",))
def xla_forward(params, cfg, tokens, positions, cache):
    """Causal forward (prefill or cached decode) of our model; (logits, cache, scores)."""
    return forward(params, cfg, XLA, tokens, positions, cache, CAUSAL)


def hf_logits(hf_model, ids):
    """fp32 logits [len(ids), v] of a transformers model on one sequence."""
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().numpy()


MAX_LEN = 64  # cache positions of the comparison runs


def ragged_prefill(params, cfg, prompts, max_len: int = MAX_LEN):
    """Our prefill of a right-padded ragged batch (padding writes past the cache, dropped)
    into a cache of `max_len` positions.
    Returns (logits [b, width, v], cache with lengths = the prompts')."""
    import jax.numpy as jnp
    import numpy as np

    from vegas_jax.cache import init_cache

    b, width = len(prompts), max(map(len, prompts))
    toks = np.zeros((b, width), np.int32)
    pos = np.full((b, width), max_len, np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
        pos[i, : len(p)] = np.arange(len(p))
    cache = init_cache(cfg, b, max_len, jnp.float32)
    logits, cache, _ = xla_forward(params, cfg, jnp.asarray(toks), jnp.asarray(pos), cache)
    return logits, cache.replace(lengths=jnp.asarray([len(p) for p in prompts], jnp.int32))


def check_prefill_and_decode(model, hf_model, prompts, steps, rng, tol, label=""):
    """Prefill `prompts` (every real position) and then `steps` one-token decode steps at
    each sequence's own position through our cache, each against a full recompute in
    transformers: max abs logit error < tol everywhere."""
    import jax.numpy as jnp
    import numpy as np

    cfg = model.config
    logits, cache = ragged_prefill(model.params, cfg, prompts)
    for i, p in enumerate(prompts):
        err = np.abs(np.asarray(logits[i, : len(p)]) - hf_logits(hf_model, p)).max()
        assert err < tol, f"{label}prefill seq {i}: max abs err {err:.2e}"
    seqs = [list(p) for p in prompts]
    for step in range(steps):
        new = rng.integers(3, cfg.vocab_size, len(prompts))
        logits, cache, _ = xla_forward(model.params, cfg, jnp.asarray(new[:, None], jnp.int32),
                                       cache.lengths[:, None], cache)
        cache = cache.replace(lengths=cache.lengths + 1)
        for i in range(len(prompts)):
            seqs[i].append(int(new[i]))
            err = np.abs(np.asarray(logits[i, 0]) - hf_logits(hf_model, seqs[i])[-1]).max()
            assert err < tol, f"{label}decode step {step} seq {i}: max abs err {err:.2e}"

"""Prompts and limits: prompt encoding and input checks, per-prompt token limits, the
cache length a batch needs and the up-front memory check."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from vegas_jax.cache import cache_bytes
from vegas_jax.config import ModelConfig
from vegas_jax.params import param_bytes, param_dtype
from vegas_jax.prefill import PROMPT_BUCKET, act_bytes, available_bytes, prefill_plan, round_up

LEN_BUCKET = 128  # cache lengths are rounded up to this

def encode_prompts(model, prompts) -> list[list[int]]:
    """Prompts -> lists of token ids, checked. Each prompt is one of
      - a string: its tokens as they are (raw text: no chat template);
      - a conversation, a list of {"role": ..., "content": ...} messages: the model's chat
        template with the generation prompt (the assistant's turn) appended;
      - a list of token ids.
    """
    if isinstance(prompts, (str, bytes, Mapping)) or (
        isinstance(prompts, Sequence) and prompts
        and isinstance(prompts[0], (int, np.integer, Mapping))
    ):
        raise TypeError("prompts must be a list of prompts (each a string, a conversation "
                        "[{'role': ..., 'content': ...}, ...] or a list of token ids)")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("empty batch: pass at least one prompt")
    out = []
    vocab = model.config.vocab_size
    for i, p in enumerate(prompts):
        if isinstance(p, str) or _is_conversation(p):
            if model.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            ids = list(model.tokenizer.encode(p) if isinstance(p, str) else
                       model.tokenizer.encode(chat_text(model.tokenizer, p, i),
                                              add_special_tokens=False))
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
        out.append(ids)
    return out


def _is_conversation(p) -> bool:
    return isinstance(p, Sequence) and bool(p) and all(isinstance(m, Mapping) for m in p)


def chat_text(tokenizer, messages, i: int = 0) -> str:
    """A conversation through the tokenizer's chat template, ready for the assistant's turn
    (the template writes its own special tokens, a BOS included where the model has one)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"prompt {i} is a conversation, but this model's tokenizer has no chat "
                         "template: pass the prompt as a string")
    for m in messages:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"prompt {i}: each message needs a string 'role' and 'content', "
                             f"got {dict(m)!r}")
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=True)


def token_limits(max_new_tokens, n_prompts: int) -> np.ndarray:
    """New tokens allowed per prompt [n_prompts]: one whole number >= 1 for all, or one per
    prompt (a workload of ragged output lengths)."""
    lim = np.asarray(max_new_tokens)
    if lim.ndim > 1 or (lim.ndim == 1 and len(lim) != n_prompts):
        raise ValueError(f"max_new_tokens must be one number or one per prompt ({n_prompts}), "
                         f"got shape {lim.shape}")
    if lim.size == 0 or not np.all(np.mod(lim, 1) == 0) or np.min(lim) < 1:
        raise ValueError(f"max_new_tokens must be whole numbers >= 1, got {max_new_tokens}")
    return np.broadcast_to(lim.astype(np.int64), (n_prompts,)).copy()


def rows_of(limits: np.ndarray, prompts: Sequence[int], rows: int) -> np.ndarray:
    """The limits of a refill group's rows: its prompts', padded with the last one's (the
    padding rows repeat the last prompt)."""
    picked = [int(limits[p]) for p in prompts]
    return np.asarray(picked + picked[-1:] * (rows - len(picked)))


def plan_cache_len(cfg: ModelConfig, prompt_lens, max_new_tokens, extra: int) -> int:
    """Static cache length for this batch; refuses prompts that do not fit the context.
    max_new_tokens: one limit for all prompts or one per prompt."""
    limits = token_limits(max_new_tokens, len(prompt_lens))
    longest = max(prompt_lens)
    totals = np.asarray(prompt_lens) + limits
    worst = int(np.argmax(totals))
    need = int(totals[worst])
    if need > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {prompt_lens[worst]} tokens + {limits[worst]} new tokens = {need} "
            f"exceeds {cfg.name}'s context of {cfg.max_position_embeddings} tokens"
        )
    # Decoding writes a few entries past the last kept token (speculative drafts, finished
    # sequences idling): keep room for them so no write is ever dropped.
    return round_up(max(round_up(longest, PROMPT_BUCKET), need) + extra, LEN_BUCKET)


def check_memory(model, batch: int, max_len: int, prompt_len: int, backend: str = "xla"):
    """Refuse up front, with numbers, when the KV cache and activations cannot fit."""
    cfg = model.config
    kv = cache_bytes(cfg, batch, max_len, param_dtype(model.params))
    # Largest transients: prefill activations and the chunked attention logits.
    width = round_up(prompt_len, PROMPT_BUCKET)
    free = available_bytes()
    q_len, rows = prefill_plan(cfg, batch, width, None if free is None else max(free - kv, 0))
    act = rows * q_len * act_bytes(cfg)
    # The XLA attention path materialises [b, heads, 512 queries, s] logits per chunk; the
    # Pallas kernels keep them on chip.
    att = rows * cfg.num_heads * min(q_len, 512) * max_len * 4 * 3 if backend == "xla" else 0
    logits = batch * cfg.vocab_size * 4 * 4
    need = kv + act + att + logits
    if free is not None and need > 0.9 * free:
        gib = 1 << 30
        raise MemoryError(
            f"not enough memory: KV cache {kv / gib:.2f} GiB (batch {batch} x {max_len} "
            f"positions) + activations ~{(need - kv) / gib:.2f} GiB > 90% of the "
            f"{free / gib:.2f} GiB free (weights {param_bytes(model.params) / gib:.2f} GiB "
            f"already loaded). Use a smaller batch, shorter prompts or fewer new tokens."
        )
    return need


def eos_ids(model) -> tuple[int, ...]:
    ids = set(model.config.eos_token_ids)
    tok = model.tokenizer
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    return tuple(sorted(ids))


def decode_text(model, tokens):
    """Each sequence's text; a character the token limit cut in two (its bytes incomplete:
    U+FFFD) is left off the end, as the command line's stream leaves it."""
    if model.tokenizer is None:
        return None
    return [model.tokenizer.decode(t, skip_special_tokens=True).rstrip("\ufffd")
            for t in tokens]

"""Token processing (temperature, top-k, top-p, min-p), sampling, and the lossless
speculative acceptance rule.

Draft and target distributions go through the same `process_logits`, which is what makes
speculative sampling exact for the processed target distribution.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be a whole number >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


jax.tree_util.register_static(SamplingParams)

# Top-p without top-k ranks this many logits first (a TopK kernel instead of a sort of
# the vocabulary: on the CPU, [64, 49152] took 624 ms sorted).
TOP_P_CANDIDATES = 1024


def process_logits(logits, sp: SamplingParams):
    """fp32 logits [..., v] -> log-probabilities of the processed distribution.

    Order as in Hugging Face: temperature, top-k, top-p, min-p. Filtered tokens get -inf.
    """
    x = logits.astype(jnp.float32) / (sp.temperature if sp.temperature > 0 else 1.0)
    v = x.shape[-1]
    if sp.top_k and sp.top_k < v:
        # The barrier keeps XLA's TopK kernel: sliced directly (the k-th value), XLA
        # rewrites it into a full sort of the vocabulary (CPU: 3.8 ms -> 475 ms at
        # [64, 49152], measured).
        top = lax.optimization_barrier(lax.top_k(x, sp.top_k)[0])  # sorted, descending
        x = jnp.where(x < top[..., -1:], -jnp.inf, x)
    else:
        top = None
    if sp.top_p < 1.0:
        # Keep the smallest prefix of the sorted distribution whose mass reaches top_p.
        def threshold(srt, probs):
            before = jnp.cumsum(probs, axis=-1) - probs
            keep = before < sp.top_p
            return jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)

        if top is not None:
            thresh = threshold(top, jax.nn.softmax(top, axis=-1))
        else:
            lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)

            def full():
                srt = -jnp.sort(-x, axis=-1)
                return threshold(srt, jnp.exp(srt - lse))

            if TOP_P_CANDIDATES < v:
                # The prefix almost always lies in the few largest logits: rank only
                # those, and sort the vocabulary only when some row's candidates fall short.
                cand = lax.optimization_barrier(lax.top_k(x, TOP_P_CANDIDATES)[0])
                probs = jnp.exp(cand - lse)
                thresh = lax.cond(jnp.all(probs.sum(axis=-1) >= sp.top_p),
                                  lambda: threshold(cand, probs), full)
            else:
                thresh = full()
        x = jnp.where(x < thresh, -jnp.inf, x)
    if sp.min_p > 0.0:
        logp = jax.nn.log_softmax(x, axis=-1)
        cut = jnp.max(logp, axis=-1, keepdims=True) + jnp.log(sp.min_p)
        x = jnp.where(logp < cut, -jnp.inf, x)
    return jax.nn.log_softmax(x, axis=-1)


def sample(key, logits, sp: SamplingParams):
    """Next token [...] from logits [..., v]; also returns the processed probabilities
    (None when greedy, which needs none)."""
    if sp.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    logp = process_logits(logits, sp)
    tok = jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
    return tok, jnp.exp(logp)


def draft_sample(key, logits, sp: SamplingParams):
    """A draft token [...] from logits [..., v], and the law q it was drawn from, for
    `accept`.

    With top-k on, only the k largest logits are processed and sampled, and q comes back
    as (indices [..., k], probabilities [..., k]): no vocabulary-sized softmax, random
    draw or [b, gamma, v] buffer per draft step. Acceptance is exact for any q as long as
    it is the law actually sampled, so q need not match the target's processing; it does,
    except when logits tie at the k-th value (the target then keeps every tied token).
    """
    v = logits.shape[-1]
    if sp.greedy or not sp.top_k or sp.top_k >= v:
        return sample(key, logits, sp)
    vals, idx = lax.top_k(logits.astype(jnp.float32), sp.top_k)  # sorted, descending
    logp = process_logits(vals, sp)  # temperature, top-p, min-p over the k values
    j = jax.random.categorical(key, logp, axis=-1)
    tok = jnp.take_along_axis(idx, j[..., None], axis=-1)[..., 0]
    return tok.astype(jnp.int32), (idx.astype(jnp.int32), jnp.exp(logp))


def accept(key, drafts, q_probs, target_logits, sp: SamplingParams):
    """Speculative acceptance.

    drafts [b, G] int32; q_probs [b, G, v] processed draft distributions, or their sparse
    form (indices [b, G, k], probabilities [b, G, k]) from `draft_sample` (None if greedy);
    target_logits [b, G + 1, v] verify logits (row t predicts the token after row t's input).

    Returns (n_accepted [b] in 0..G, next_token [b]): the first `n_accepted` drafts are
    kept and `next_token` follows them (the correction at the first rejection, or the bonus
    token when all G are kept).
    """
    b, gamma = drafts.shape
    if sp.greedy:
        target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [b, G + 1]
        ok = drafts == target[:, :gamma]
        n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
        return n_acc, jnp.take_along_axis(target, n_acc[:, None], axis=1)[:, 0]
    k_accept, k_resid = jax.random.split(key)
    p = jnp.exp(process_logits(target_logits, sp))  # [b, G + 1, v]
    p_d = jnp.take_along_axis(p[:, :gamma], drafts[..., None], axis=-1)[..., 0]
    sparse = isinstance(q_probs, tuple)
    if sparse:
        q_idx, q_val = q_probs  # [b, G, k]
        q_d = jnp.sum(jnp.where(q_idx == drafts[..., None], q_val, 0.0), axis=-1)
    else:
        q_d = jnp.take_along_axis(q_probs, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_accept, (b, gamma))
    ok = u * q_d < p_d  # accept with probability min(1, p/q)
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_a = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]  # [b, v]
    # q is zero after the last draft, which turns the residual at position G into p
    # itself: the bonus token comes from the same expression as a correction.
    if sparse:
        row = jnp.minimum(n_acc, gamma - 1)[:, None, None]
        idx_a = jnp.take_along_axis(q_idx, row, axis=1)[:, 0]  # [b, k]
        val_a = jnp.where((n_acc < gamma)[:, None],
                          jnp.take_along_axis(q_val, row, axis=1)[:, 0], 0.0)
        q_a = jnp.zeros_like(p_a).at[jnp.arange(b)[:, None], idx_a].set(val_a)
    else:
        q_pad = jnp.concatenate([q_probs, jnp.zeros_like(q_probs[:, :1])], axis=1)
        q_a = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]
    nxt = jax.random.categorical(k_resid, jnp.log(residual(p_a, q_a)), axis=-1)
    return n_acc, nxt.astype(jnp.int32)


def residual(p, q):
    """Unnormalised law of the token that replaces a rejected draft: max(p - q, 0)."""
    resid = jnp.maximum(p - q, 0.0)
    # p == q up to rounding leaves no residual mass; then p itself is the right law.
    return jnp.where(resid.sum(-1, keepdims=True) > 0, resid, p)

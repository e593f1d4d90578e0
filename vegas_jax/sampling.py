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

# Top-p without top-k ranks this many logits first (a TopK kernel, then a sort of these
# few instead of the whole vocabulary's).
TOP_P_CANDIDATES = 1024
TOPK_BLOCK = 128


def top_k(x, k: int, block: int = TOPK_BLOCK):
    """The k largest entries of the last axis (values descending, indices): x [..., v].

    Exact up to ties, without sorting a whole row: the winners lie in the k blocks (of
    `block` entries) with the largest maxima, since a block holding a winner has a maximum
    at least the k-th value and at most k blocks can (each maximum is itself an entry). One
    max-reduction over x, then two small top-k's (over the block maxima, over k * block
    candidates); `lax.top_k` over a whole vocabulary runs a slow sort on the GPU."""
    *lead, v = x.shape
    if k * block * 2 >= v:
        return lax.top_k(x, k)
    nb = -(-v // block)
    xb = jnp.pad(x, [(0, 0)] * len(lead) + [(0, nb * block - v)], constant_values=-jnp.inf)
    xb = xb.reshape(*lead, nb, block)  # [..., nb, block]
    _, blocks = lax.top_k(xb.max(axis=-1), k)  # [..., k]
    cand = jnp.take_along_axis(xb, blocks[..., None], axis=-2)  # [..., k, block]
    vals, j = lax.top_k(cand.reshape(*lead, k * block), k)
    idx = jnp.take_along_axis(blocks, j // block, axis=-1) * block + j % block
    return vals, idx.astype(jnp.int32)


def process_logits(logits, sp: SamplingParams):
    """fp32 logits [..., v] -> log-probabilities of the processed distribution.

    Order as in Hugging Face: temperature, top-k, top-p, min-p. Filtered tokens get -inf.
    """
    x = logits.astype(jnp.float32) / (sp.temperature if sp.temperature > 0 else 1.0)
    v = x.shape[-1]
    if sp.top_k and sp.top_k < v:
        top = top_k(x, sp.top_k)[0]  # sorted, descending
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
                # (The barrier keeps XLA's TopK kernel: sliced directly, XLA rewrote it into
                # a full sort of the vocabulary.)
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


def law(logits, sp: SamplingParams):
    """The processed distribution of logits [..., v]: dense probabilities [..., v], or with
    top-k its sparse form (indices [..., k], probabilities [..., k]): only the k largest
    logits are processed, no vocabulary-sized softmax."""
    v = logits.shape[-1]
    if sp.top_k and sp.top_k < v:
        vals, idx = top_k(logits.astype(jnp.float32), sp.top_k)  # sorted, descending
        return idx, jnp.exp(process_logits(vals, sp))  # temperature, top-p, min-p over k
    return jnp.exp(process_logits(logits, sp))


def prob_of(p, tokens):
    """p(tokens) for a law from `law` (dense or sparse) and tokens [...]."""
    if isinstance(p, tuple):
        idx, val = p
        return jnp.sum(jnp.where(idx == tokens[..., None], val, 0.0), axis=-1)
    return jnp.take_along_axis(p, tokens[..., None], axis=-1)[..., 0]


def sample(key, logits, sp: SamplingParams):
    """Next token [...] from logits [..., v], and the law it was drawn from (`law`'s
    form; None when greedy, which needs none). Speculative acceptance is exact for any
    draft law as long as it is the one actually sampled, so drafts use this too."""
    if sp.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    p = law(logits, sp)
    if isinstance(p, tuple):
        idx, val = p
        j = jax.random.categorical(key, jnp.log(val), axis=-1)
        return jnp.take_along_axis(idx, j[..., None], axis=-1)[..., 0], p
    return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32), p



def accept(key, drafts, q, target_logits, sp: SamplingParams):
    """Speculative acceptance.

    drafts [b, G] int32; q the draft laws from `sample` ([b, G, v], or with top-k
    (indices [b, G, k], probabilities [b, G, k]); None if greedy); target_logits
    [b, G + 1, v] verify logits (row t predicts the token after row t's input).

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
    p = law(target_logits, sp)  # [b, G + 1, v] or sparse
    row = lambda law_, r: jax.tree.map(  # noqa: E731  the law at row r [b] of each sequence
        lambda a: jnp.take_along_axis(a, r[:, None, None], axis=1)[:, 0], law_)
    p_d = prob_of(jax.tree.map(lambda a: a[:, :gamma], p), drafts)
    q_d = prob_of(q, drafts)
    u = jax.random.uniform(k_accept, (b, gamma))
    ok = u * q_d < p_d  # accept with probability min(1, p/q)
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    # q is zero after the last draft, which turns the residual at position G into p
    # itself: the bonus token comes from the same expression as a correction.
    p_a = row(p, n_acc)
    q_a = row(q, jnp.minimum(n_acc, gamma - 1))
    live = (n_acc < gamma)[:, None]
    if isinstance(p_a, tuple):  # the residual lives on p's support: evaluate q there
        p_idx, p_val = p_a  # [b, k]
        if isinstance(q_a, tuple):
            q_at = jnp.sum(jnp.where(q_a[0][:, None, :] == p_idx[:, :, None],
                                     q_a[1][:, None, :], 0.0), axis=-1)
        else:
            q_at = jnp.take_along_axis(q_a, p_idx, axis=-1)
        q_at = live * q_at
        j = jax.random.categorical(k_resid, jnp.log(residual(p_val, q_at)), axis=-1)
        nxt = jnp.take_along_axis(p_idx, j[:, None], axis=-1)[:, 0]
    else:
        if isinstance(q_a, tuple):
            q_a = jnp.zeros_like(p_a).at[jnp.arange(b)[:, None], q_a[0]].set(q_a[1])
        nxt = jax.random.categorical(k_resid, jnp.log(residual(p_a, live * q_a)), axis=-1)
    return n_acc, nxt.astype(jnp.int32)


def residual(p, q):
    """Unnormalised law of the token that replaces a rejected draft: max(p - q, 0)."""
    resid = jnp.maximum(p - q, 0.0)
    # p == q up to rounding leaves no residual mass; then p itself is the right law.
    return jnp.where(resid.sum(-1, keepdims=True) > 0, resid, p)

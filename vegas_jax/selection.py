"""Selection strategies: which KV entries each draft step may read.

Every method drives the same model and round; they differ only in what the verify pass
captures, how the next draft's index set is built, and what draft attention mode runs:

  vegas      scores from verify rows 0 and gamma ("Collect-2-Query"), top-k per layer
  vegas-all  scores from all gamma + 1 verify rows
  last       scores from the row of the last accepted token (SpecExtend-style)
  stream     sink of the first tokens + recent window, recomputed each draft step
  quest      pages ranked by the current query against page key bounds, each draft step
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.topk import select_topk_fast

METHODS = ("vegas", "vegas-all", "last", "stream", "quest", "vanilla")
VERIFY_GUIDED = ("vegas", "vegas-all", "last")
SCORES = ("weight", "logit")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Self-speculative decoding settings.

    method: one of METHODS. gamma: draft tokens per round. sparsity: fraction of the
    context each draft step reads, in (0, 1]. min_tokens: floor of that budget.
    score: "weight" (softmax weights, the authors' default) or "logit" (raw logits).
    sink / page_size: the stream and quest baselines' constants.
    """

    method: str = "vegas"
    gamma: int = 6
    sparsity: float = 0.07
    min_tokens: int = 256
    score: str = "weight"
    sink: int = 16
    page_size: int = 16

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if int(self.gamma) != self.gamma or self.gamma < 1:
            raise ValueError(f"gamma must be a whole number >= 1, got {self.gamma}")
        if not 0 < self.sparsity <= 1:
            raise ValueError(f"sparsity must be in (0, 1], got {self.sparsity}")
        if int(self.min_tokens) != self.min_tokens or self.min_tokens < 1:
            raise ValueError(f"min_tokens must be a whole number >= 1, got {self.min_tokens}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")
        if self.page_size < 1 or 128 % self.page_size:
            # cache lengths are multiples of 128, and Quest's pages must tile them
            raise ValueError(f"page_size must divide 128, got {self.page_size}")


jax.tree_util.register_static(SpecConfig)


def capture_plan(spec: SpecConfig):
    """(capture mode, rows) the verify pass must produce for this method."""
    rows = tuple(range(spec.gamma + 1))
    if spec.method == "vegas":
        return "mean", (0, spec.gamma)
    if spec.method == "vegas-all":
        return "mean", rows
    if spec.method == "last":
        return "rows", rows
    return "none", (0,)


# ceil() of a product that should be a whole number can land one above it in floating
# point (0.07 * 10000 = 700.0000000000001): forgive that much.
_CEIL_SLACK = 1e-3


def max_budget(spec: SpecConfig, max_len: int) -> int:
    """Static upper bound of the budget: the padded size of every index list."""
    return min(max(math.ceil(spec.sparsity * max_len - _CEIL_SLACK), spec.min_tokens), max_len)


def _ceil_frac(sparsity, n):
    return jnp.ceil(sparsity * n.astype(jnp.float32) - _CEIL_SLACK).astype(jnp.int32)


def budget(spec: SpecConfig, n, max_len: int):
    """Tokens to select when the ranked range ends at position n (DESIGN §1.3).

    k = clip(ceil(sparsity * (n + gamma + 1)), min_tokens, max_budget), at most n + 1.
    """
    k = jnp.clip(_ceil_frac(spec.sparsity, n + spec.gamma + 1), spec.min_tokens,
                 max_budget(spec, max_len))
    return jnp.minimum(k, n + 1)


def select_topk(scores, r_end, spec: SpecConfig, max_len: int):
    """Per (layer, sequence) top-k over the ranked range 0..r_end.

    scores [L, b, s]; r_end [b]. Returns idx [L, b, K] (order irrelevant; entries past
    count are valid positions that the draft masks) and count [L, b].
    """
    s = scores.shape[-1]
    ranked = jnp.arange(s)[None, None, :] <= r_end[None, :, None]
    scores = jnp.where(ranked, scores, -jnp.inf)
    # Threshold select (exact up to ties, one call for all layers): 2-3x cheaper than
    # lax.top_k on the H200 at these sizes (BENCHMARKS.md, kernels run 3).
    idx = select_topk_fast(scores, max_budget(spec, max_len))  # by position, not score
    # The draft reads the first `count` entries, so they must be the best `count`: order
    # the K winners by score (a sort of K, not of the context).
    _, order = lax.top_k(jnp.take_along_axis(scores, idx, axis=-1), idx.shape[-1])
    idx = jnp.take_along_axis(idx, order, axis=-1)
    count = jnp.broadcast_to(budget(spec, r_end, max_len)[None, :], scores.shape[:2])
    return idx.astype(jnp.int32), count


def pick_rows(scores, n_acc):
    """`last`: keep the score row of the last accepted token. scores [L, b, r, s]."""
    return jnp.take_along_axis(scores, n_acc[None, :, None, None], axis=2)[:, :, 0]


def page_bounds(k_cache, page_size):
    """Element-wise key min/max of every page: [L, b, k, P, d] each."""
    L, b, kh, s, d = k_cache.shape
    pages = k_cache.reshape(L, b, kh, s // page_size, page_size, d)
    return pages.min(axis=4), pages.max(axis=4)


def update_page_bounds(page_min, page_max, k_cache, first_page, n_pages, page_size):
    """Recompute `n_pages` pages per sequence from `first_page` [b] on: the pages that a
    round can complete, so Quest's metadata costs O(gamma) per round, not O(context)."""
    width = n_pages * page_size

    def one(kc, pmin, pmax, p0):  # kc [L, k, s, d], pmin [L, k, P, d]
        chunk = lax.dynamic_slice_in_dim(kc, p0 * page_size, width, axis=2)
        lo, hi = page_bounds(chunk[:, None], page_size)
        return (lax.dynamic_update_slice_in_dim(pmin, lo[:, 0], p0, axis=2),
                lax.dynamic_update_slice_in_dim(pmax, hi[:, 0], p0, axis=2))

    lo, hi = jax.vmap(one, in_axes=(1, 1, 1, 0), out_axes=1)(k_cache, page_min, page_max,
                                                             first_page)
    return lo, hi


def stream_window(spec: SpecConfig, pos, max_len: int):
    """Stream's draft inputs at query positions pos [b]: the sink positions (fewer when
    the window already reaches them) and where the recent window starts."""
    w = jnp.clip(_ceil_frac(spec.sparsity, pos + 1), spec.min_tokens, max_budget(spec, max_len))
    start = jnp.maximum(pos + 1 - w, 0)
    sink_count = jnp.minimum(spec.sink, start)
    return sink_count, start

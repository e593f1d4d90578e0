"""Selection strategies: which KV entries each draft step may read.

Every method drives the same model and round. A strategy is a frozen static object that
owns its whole policy: what the verify pass captures (`capture`), the selection state it
starts from after the prefill (`init`), the draft's attention plan (`draft_plan`), how a
verify updates the state (`update`) and the length of the recent tail (`tail_len`).

  VerifyGuided("pair", decay=0.5)
                        vegas        scores from verify rows 0 and gamma ("Collect-2-Query"),
                                     each entry's best of this verify and half the carried
                                     score (issue 16: tau above the paper's selector)
  VerifyGuided("pair")  vegas-paper  the paper's selector: this verify's rows 0 and gamma
  VerifyGuided("all")   vegas-all    scores from all gamma + 1 verify rows
  VerifyGuided("last")  last         scores from the row of the last accepted token
  VerifyGuided(...)     vegas-heads / -window / -accepted / -pool / -entropy / -prefill /
                        -first / -final: issue 16's other policies (per KV head, a kept
                        window, kept rows only, one budget for all layers, budgets by
                        attention entropy, the first selection from the prompt's last 8
                        queries, one verify row instead of two: half the capture)
  Stream                stream     sink of the first tokens + recent window
  Quest                 quest      pages ranked by the current query against key bounds

Adding a policy = one class with those five members, registered in `METHODS`. `Auto`
wraps one of them and lets the decoding loop choose gamma or plain decoding as it goes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.scipy.special import entr

from pallas_kernels.capture_select import select_from_capture
from pallas_kernels.topk import kth_largest_key, select_topk_fast, sortable_keys
from vegas_jax.attention import AttnPlan, Capture, RawCapture
from vegas_jax.execution import select_impl

# ceil() of a product that should be a whole number can land one above it in floating
# point (0.07 * 10000 = 700.0000000000001): forgive that much.
_CEIL_SLACK = 1e-3


def _ceil_frac(sparsity, n):
    return jnp.ceil(sparsity * n.astype(jnp.float32) - _CEIL_SLACK).astype(jnp.int32)


def max_budget(spec, max_len: int) -> int:
    """Static upper bound of the budget: the padded size of every index list."""
    return min(max(math.ceil(spec.sparsity * max_len - _CEIL_SLACK), spec.min_tokens), max_len)


def budget(spec, n, max_len: int):
    """Tokens to select when the ranked range ends at position n.

    budget = clip(ceil(sparsity * (n + gamma + 1)), min_tokens, max_budget), at most n + 1.
    """
    tokens = jnp.clip(_ceil_frac(spec.sparsity, n + spec.gamma + 1), spec.min_tokens,
                      max_budget(spec, max_len))
    return jnp.minimum(tokens, n + 1)


def _threshold(xc) -> str:
    """The top-k's backend over scores (`ExecConfig.select`; "auto": the fused kernel
    where the attention runs on Pallas; "capture" selects over scores where its kernel
    from the captured logits does not serve)."""
    impl = "xla" if xc is None else select_impl(xc.select, xc.attn)
    return "fused" if impl == "capture" else impl


def select_topk(scores, r_end, spec, max_len: int, xc=None):
    """Per (layer, sequence) top-`budget` over the ranked range 0..r_end.

    scores [L, b, s], or [L, b, k, s] for one selection per KV head; r_end [b]. Returns idx
    [L, b, (k,) K] (the best `count` in the first `count` slots, in position order: the
    draft's gathers walk the cache forwards; the slots after hold position 0, which the
    draft masks) and count [L, b, (k)]. xc: the ExecConfig (None: the XLA threshold).
    """
    s = scores.shape[-1]
    r_end = r_end.reshape((1, -1) + (1,) * (scores.ndim - 2))  # against [L, b, (k,) s]
    ranked = jnp.arange(s) <= r_end
    scores = jnp.where(ranked, scores, -jnp.inf)
    count = jnp.broadcast_to(budget(spec, r_end[..., 0], max_len), scores.shape[:-1])
    # Threshold select of exactly `count` per row (exact up to ties, one call for all
    # layers): 2-3x cheaper than lax.top_k on the H200 at these sizes (BENCHMARKS.md,
    # kernels run 3), and no sort of the winners by score.
    idx = select_topk_fast(scores, max_budget(spec, max_len), counts=count,
                           threshold=_threshold(xc))
    return idx.astype(jnp.int32), count


def _split_budget(scores, r_end, spec, max_len: int, cap: float):
    """What a per-layer budget split starts from: scores [L, b, s] with -inf past the
    ranked range 0..r_end [b], the uniform per-layer budget [b], and the index lists'
    padded size for a layer allowed `cap` times its share."""
    ranked = jnp.arange(scores.shape[-1]) <= r_end[None, :, None]
    k_cap = min(math.ceil(cap * max_budget(spec, max_len)), max_len)
    return jnp.where(ranked, scores, -jnp.inf), budget(spec, r_end, max_len), k_cap


def select_pooled(scores, r_end, spec, max_len: int, cap: float, xc=None):
    """One budget for all layers of a sequence (issue 16): the L * budget entries with the
    largest scores over every layer together, each layer keeping at most `cap` times the
    per-layer budget. With softmax weights (each layer's scores sum to one), that takes
    the entries that cover the most attention mass in total: a layer whose attention is
    spread over many positions gets more entries, a peaked one fewer; the bytes read per
    draft step stay those of `select_topk` (at most: the cap and ties can only lower it).

    scores [L, b, s]; returns idx [L, b, K_cap] and count [L, b] as `select_topk`.
    """
    L, b, s = scores.shape
    scores, per_layer, k_cap = _split_budget(scores, r_end, spec, max_len, cap)
    key = sortable_keys(scores.transpose(1, 0, 2).reshape(b, L * s))  # [b, L * s]
    t = kth_largest_key(key, (L * per_layer)[:, None])  # [b]
    key = key.reshape(b, L, s)
    above = jnp.sum(key > t[:, None, None], axis=2, dtype=jnp.int32)  # [b, L]
    # entries equal to the threshold are ties: the first layers take what is left of the
    # L * budget; every layer keeps at least one entry, at most its cap
    ties = jnp.sum(key == t[:, None, None], axis=2, dtype=jnp.int32)
    left = (L * per_layer)[:, None] - above.sum(1, keepdims=True) - (jnp.cumsum(ties, 1) - ties)
    count = above + jnp.clip(left, 0, ties)
    count = jnp.clip(count, 1, jnp.minimum(k_cap, r_end + 1)[:, None]).T  # [L, b]
    idx = select_topk_fast(scores, k_cap, counts=count, threshold=_threshold(xc))
    return idx.astype(jnp.int32), count


def select_by_entropy(scores, r_end, spec, max_len: int, alpha: float, cap: float, xc=None):
    """Per-layer budgets from each layer's attention entropy (issue 16): layer l of a
    sequence gets a share of the L * budget entries proportional to perplexity_l ** alpha,
    perplexity = exp(entropy) of its scores normalised over the ranked range (the number
    of entries its attention is effectively spread over); at least one entry, at most `cap`
    times the uniform budget. alpha > 0 gives diffuse layers more, alpha < 0 peaked ones.
    Shares are floored: never more entries in total than `select_topk`.

    scores [L, b, s] softmax weights; returns idx [L, b, K_cap] and count [L, b].
    """
    L = scores.shape[0]
    scores, per_layer, k_cap = _split_budget(scores, r_end, spec, max_len, cap)
    w = jnp.maximum(scores, 0.0)  # 0 past the ranked range
    p = w / jnp.maximum(w.sum(-1, keepdims=True), 1e-30)
    ent = entr(p).sum(-1)  # [L, b], -sum p log p (0 log 0 = 0)
    share = jnp.exp(alpha * ent)  # perplexity ** alpha
    share = share / share.sum(0, keepdims=True)
    count = jnp.floor(L * per_layer[None, :] * share).astype(jnp.int32)
    count = jnp.clip(count, 1, jnp.minimum(jnp.minimum(k_cap, jnp.ceil(cap * per_layer)),
                                           r_end + 1).astype(jnp.int32)[None, :])
    idx = select_topk_fast(scores, k_cap, counts=count, threshold=_threshold(xc))
    return idx.astype(jnp.int32), count


class Method:
    """Base of every decoding method. `speculative` is False for plain decoding."""

    name: ClassVar[str]
    speculative: ClassVar[bool] = True

    # the prompt tokens whose queries rank the prompt for the first selection (`init`)
    prefill_rows: ClassVar[int] = 1

    def capture(self, spec) -> Capture | None:
        return None

    def takes_raw(self, spec) -> bool:
        """Whether `update` selects from a `RawCapture` (the verify's logits as they came
        out of its kernel) where the kernels can hand one over (`attention.raw_capture`)."""
        return False

    def check(self, spec) -> None:
        """Raise ValueError for settings that do not go with this SpecConfig."""

    def tail_len(self, spec, max_len: int) -> int:
        raise NotImplementedError

    def init(self, spec, cache, scores, lens, xc) -> Any:
        """The first selection state, from the prefill (`scores` from the last prompt
        token's row when `capture` asks for any). xc: the ExecConfig (kernel backends)."""
        return None

    def draft_plan(self, spec, sel, cache, pos) -> AttnPlan:
        """The draft step's attention at query positions pos [b]; cache.lengths = n."""
        raise NotImplementedError

    def update(self, spec, sel, scores, cache, n, n_acc, xc) -> Any:
        """The next round's selection state after a verify of the round that started at
        n [b] and accepted n_acc [b] drafts (cache: the verified cache, lengths still n)."""
        return sel

    def after_plain(self, spec, sel, n) -> Any:
        """The selection state to draft from after plain decoding steps (auto) grew the
        cache to n [b] tokens without a verify: rounds of any gamma >= spec.gamma follow."""
        return sel


@struct.dataclass
class TopK:
    idx: jax.Array  # [L, b, K] positions, best first ([L, b, k, K]: one list per KV head)
    count: jax.Array  # [L, b] ([L, b, k])
    end: jax.Array  # [b] first position after the ranked range
    acc: jax.Array | None = None  # [L, b, (k,) s] carried scores (decay > 0), else None


@dataclasses.dataclass(frozen=True)
class VerifyGuided(Method):
    """Vegas and its variants: the verify pass's own attention ranks the context, per layer.
    rows: "pair" (rows 0 and gamma, the paper's Collect-2-Query), "all" (every verify row)
    or "last" (the row of the last accepted token, SpecExtend-style).
    heads: one index set per KV head, ranked by that head's query heads only (as SparseSpec
    does), instead of one per layer from all heads; the same entries per head, so the
    same bytes per draft step.
    rows "accepted": the mean of the rows of the tokens that stay (x0 and the accepted
    drafts, rows 0..n_acc), known after acceptance; "pair" and "all" also average the
    queries of rejected drafts, which the next round's tokens never were.
    rows "first" / "final": row 0 (x0, the round's committed token) or row gamma (the last
    draft) alone: half the pair's capture (the verify stores and the selection reads one
    row a query head instead of two), for the carried scores to make up the other.
    sink, recent: the first `sink` positions and the last `recent` of the ranked range are
    always selected, inside the same budget (issue 16: a guaranteed window; the paper's
    selector has none).
    decay: 0 replaces the scores every round (the paper); d in (0, 1) carries them over,
    scores = max(this verify's, d * the carried ones), so an entry that mattered to a
    recent round's queries stays selectable (raw logits: max(new, carried + log d), the
    same rule in log space).
    pool: 0 gives every layer the same budget; c > 0 gives all layers of a sequence one
    budget together (`select_pooled`), each layer at most c times its share.
    entropy: 0 gives every layer the same budget; a > 0 (or < 0) splits the sequence's
    L * budget entries by each layer's attention perplexity ** a (`select_by_entropy`, at
    most 2x a layer's share; softmax weights only).
    prefill_rows: the first selection ranks the prompt by the mean attention of its last
    `prefill_rows` tokens' queries (the paper: the last token's alone). The first rounds
    of a generation draft from it (with decay, their carried scores stay for a few
    rounds)."""

    rows: str = "pair"
    heads: bool = False
    sink: int = 0
    recent: int = 0
    decay: float = 0.0
    pool: float = 0.0
    entropy: float = 0.0
    prefill_rows: int = 1
    NAMES: ClassVar[dict] = {"pair": "vegas", "all": "vegas-all", "last": "last",
                             "accepted": "vegas-accepted", "first": "vegas-first",
                             "final": "vegas-final"}

    def __post_init__(self):
        if self.rows not in self.NAMES:
            raise ValueError(f"rows must be one of {tuple(self.NAMES)}, got {self.rows!r}")
        if self.heads and self.rows in ("last", "accepted"):
            raise ValueError("heads=True needs rows 'pair' or 'all'")
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink and recent must be >= 0, got {self.sink}, {self.recent}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if self.pool < 0 or (self.pool and (self.pool < 1.0 or self.heads)):
            raise ValueError(f"pool must be 0 (off) or >= 1 without heads, got {self.pool}")
        if self.entropy and (self.heads or self.pool):
            raise ValueError("entropy splits one budget a layer: not with heads or pool")
        if int(self.prefill_rows) != self.prefill_rows or self.prefill_rows < 1:
            raise ValueError(f"prefill_rows must be a whole number >= 1, got {self.prefill_rows}")

    @property
    def name(self) -> str:  # type: ignore[override]
        """The registry's name for this policy, else one composed from its options."""
        for key, method in METHODS.items():
            if method == self:
                return key
        window = "-window" if self.sink or self.recent else ""
        return (self.NAMES[self.rows] + ("-heads" if self.heads else "") + window
                + ("-decay" if self.decay else "") + ("-pool" if self.pool else "")
                + ("-entropy" if self.entropy else "")
                + ("-prefill" if self.prefill_rows > 1 else ""))

    def check(self, spec):
        if self.entropy and spec.score != "weight":
            raise ValueError("entropy is of softmax weights: needs score='weight'")

    def _guaranteed(self, scores, r_end):
        """scores [L, b, (r | k,) s] with the sink and the recent window of the ranked range
        0..r_end [b] ranked above everything else (+inf: ties go by position)."""
        if not (self.sink or self.recent):
            return scores
        pos = jnp.arange(scores.shape[-1])
        end = r_end.reshape((1, -1) + (1,) * (scores.ndim - 2))  # against [L, b, ..., s]
        keep = (pos < self.sink) | (pos > end - self.recent)
        return jnp.where(keep, jnp.inf, scores)

    def capture(self, spec):
        fixed = {"pair": (0, spec.gamma), "first": (0,), "final": (spec.gamma,)}
        every = tuple(range(spec.gamma + 1))
        if self.heads:
            return Capture(fixed.get(self.rows, every), "heads", spec.score)
        if self.rows in fixed:
            return Capture(fixed[self.rows], "mean", spec.score)
        return Capture(every, "mean" if self.rows == "all" else "rows", spec.score)

    def takes_raw(self, spec):
        # the kernel sums, carries and selects: no policy that edits the scores between
        return not (self.sink or self.recent or self.pool or self.entropy)

    def _select(self, spec, scores, r_end, max_len, xc):
        scores = self._guaranteed(scores, r_end)
        if self.pool:
            return select_pooled(scores, r_end, spec, max_len, self.pool, xc)
        if self.entropy:
            return select_by_entropy(scores, r_end, spec, max_len, self.entropy, 2.0, xc)
        return select_topk(scores, r_end, spec, max_len, xc)

    def _carry(self, scores, old, r_end, score: str):
        """scores = max(new, decay * old) over the ranked range 0..r_end [b] (raw logits:
        max(new, old + log decay)); -inf past it (positions past it held drafts that may
        have been rejected)."""
        if not self.decay:
            return None
        if old is not None:
            aged = self.decay * old if score == "weight" else old + math.log(self.decay)
            scores = jnp.maximum(scores, aged)
        end = r_end.reshape((1, -1) + (1,) * (scores.ndim - 2))
        return jnp.where(jnp.arange(scores.shape[-1]) <= end, scores, -jnp.inf)

    def tail_len(self, spec, max_len):
        # after a verify the ranked range ends at n; the tail then holds up to gamma
        # accepted tokens + the bonus + gamma - 1 drafts
        return 2 * spec.gamma + 1

    def init(self, spec, cache, scores, lens, xc):
        # The last prompt token's row ranks the whole prompt.
        acc = self._carry(scores, None, lens - 1, spec.score)
        idx, count = self._select(spec, scores if acc is None else acc, lens - 1,
                                  cache.max_len, xc)
        return TopK(idx, count, lens, acc)

    def draft_plan(self, spec, sel, cache, pos):
        return AttnPlan(mode="sparse", tail_len=self.tail_len(spec, cache.max_len),
                        idx=sel.idx, count=sel.count, tail_start=sel.end)

    def update(self, spec, sel, scores, cache, n, n_acc, xc):
        if isinstance(scores, RawCapture):  # scores, carry and top-k in one kernel
            max_len = cache.max_len
            want = budget(spec, n, max_len)  # [b]
            idx, acc = select_from_capture(
                scores.logits, scores.offset, jnp.where(scores.valid, n, -1), want,
                max_budget(spec, max_len), max_len, sel.acc if self.decay else None,
                self.decay)
            return TopK(idx, jnp.broadcast_to(want[None, :], idx.shape[:2]), n + 1, acc)
        if self.rows == "last":  # scores [L, b, r, s]: keep the last accepted token's row
            scores = jnp.take_along_axis(scores, n_acc[None, :, None, None], axis=2)[:, :, 0]
        elif self.rows == "accepted":  # the mean of rows 0..n_acc
            kept = jnp.arange(scores.shape[2])[None, :] <= n_acc[:, None]  # [b, r]
            w = kept / (n_acc[:, None] + 1.0)
            scores = jnp.einsum("lbrs,br->lbs", scores, w)
        acc = self._carry(scores, sel.acc if self.decay else None, n, spec.score)
        idx, count = self._select(spec, scores if acc is None else acc, n, cache.max_len, xc)
        return TopK(idx, count, n + 1, acc)

    def after_plain(self, spec, sel, n):
        # The tail holds tail_len = 2 gamma + 1 entries from `end` on; plain steps moved the
        # query past it, and a draft that cannot see its own position drafts noise (auto at
        # B = 1 saw no draft accepted in the round after plain steps). Start the tail at the
        # last gamma + 1 committed tokens: the drafts of the next round stay inside it; the
        # tokens between the old end and there are unread for one round, until its verify
        # ranks them.
        return sel.replace(end=jnp.maximum(sel.end, n - spec.gamma - 1))


@dataclasses.dataclass(frozen=True)
class Stream(Method):
    """MagicDec-Stream: the first `sink` tokens plus a recent window of the budget's size,
    recomputed at every draft step; query-agnostic."""

    sink: int = 16
    name: ClassVar[str] = "stream"

    def __post_init__(self):
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")

    def tail_len(self, spec, max_len):
        return max_budget(spec, max_len)

    def draft_plan(self, spec, sel, cache, pos):
        max_len = cache.max_len
        w = jnp.clip(_ceil_frac(spec.sparsity, pos + 1), spec.min_tokens,
                     max_budget(spec, max_len))
        start = jnp.maximum(pos + 1 - w, 0)  # the window; the sink shrinks where it reaches
        b = pos.shape[0]
        n_sink = max(self.sink, 1)
        idx = jnp.broadcast_to(jnp.arange(n_sink, dtype=jnp.int32), (1, b, n_sink))
        count = jnp.minimum(self.sink, start)[None, :]
        return AttnPlan(mode="sparse", tail_len=self.tail_len(spec, max_len), layered=False,
                        idx=idx, count=count, tail_start=start)


@struct.dataclass
class PageBounds:
    page_min: jax.Array  # [L, b, k, P, d] element-wise key minimum of each page
    page_max: jax.Array


def page_bounds(k_cache, page_size):
    """Element-wise key min/max of every page: [L, b, k, P, d] each."""
    L, b, kh, s, d = k_cache.shape
    pages = k_cache.reshape(L, b, kh, s // page_size, page_size, d)
    return pages.min(axis=4), pages.max(axis=4)


@dataclasses.dataclass(frozen=True)
class QuestPicker:
    """Quest's per-layer page choice, run inside the draft's attention (it needs the query)."""

    page_size: int
    max_pages: int

    def pick(self, q, inputs, layer, tail_start):
        """q [b, 1, k, g, d]. Page score = sum over the KV head's query heads of
        sum_d max(q_d * kmin_d, q_d * kmax_d), an upper bound of q.k inside the page.
        Returns idx [b, k, max_pages * page_size] and count [b, k]."""
        page_min, page_max, page_budget = inputs
        ready_pages = tail_start // self.page_size  # pages whose keys are all committed
        qf = q[:, 0].astype(jnp.float32)[:, :, :, None, :]  # [b, k, g, 1, d]
        lo = page_min[layer].astype(jnp.float32)[:, :, None]  # [b, k, 1, P, d]
        hi = page_max[layer].astype(jnp.float32)[:, :, None]
        score = jnp.maximum(qf * lo, qf * hi).sum(axis=(2, 4))  # [b, k, P]
        ready = jnp.arange(score.shape[-1])[None, None, :] < ready_pages[:, None, None]
        score = jnp.where(ready, score, -jnp.inf)
        _, pages = lax.top_k(score, self.max_pages)  # [b, k, max_pages]
        idx = pages[..., None] * self.page_size + jnp.arange(self.page_size)
        b, kh = pages.shape[:2]
        count = jnp.minimum(page_budget, ready_pages)[:, None] * self.page_size
        return idx.reshape(b, kh, -1).astype(jnp.int32), jnp.broadcast_to(count, (b, kh))


@dataclasses.dataclass(frozen=True)
class Quest(Method):
    """MagicDec-Quest: per KV head, the top pages by the query against each page's
    element-wise key min/max, recomputed at every draft step (that is its overhead)."""

    page_size: int = 16
    name: ClassVar[str] = "quest"

    def __post_init__(self):
        if self.page_size < 1 or 128 % self.page_size:
            # cache lengths are multiples of 128, and Quest's pages must tile them
            raise ValueError(f"page_size must divide 128, got {self.page_size}")

    def extra_len(self) -> int:
        return self.page_size  # the page refresh reads a page beyond the last write

    def tail_len(self, spec, max_len):
        # from the last complete page's end (< page_size behind n) to the last draft, n + gamma - 1
        return self.page_size + spec.gamma

    def init(self, spec, cache, scores, lens, xc):
        return PageBounds(*page_bounds(cache.k, self.page_size))

    def draft_plan(self, spec, sel, cache, pos):
        n = cache.lengths
        ready = (n // self.page_size) * self.page_size
        max_pages = -(-max_budget(spec, cache.max_len) // self.page_size)
        tokens = budget(spec, pos, cache.max_len)
        return AttnPlan(mode="sparse", tail_len=self.tail_len(spec, cache.max_len),
                        picker=QuestPicker(self.page_size, max_pages), tail_start=ready,
                        picker_inputs=(sel.page_min, sel.page_max, -(-tokens // self.page_size)))

    def update(self, spec, sel, scores, cache, n, n_acc, xc):
        """Recompute the pages a round can complete, from n's page on: O(gamma) per round."""
        p = self.page_size
        width = (-(-(spec.gamma + 2) // p) + 1) * p

        def one(kc, pmin, pmax, p0):  # kc [L, k, s, d], pmin [L, k, P, d]
            chunk = lax.dynamic_slice_in_dim(kc, p0 * p, width, axis=2)
            lo, hi = page_bounds(chunk[:, None], p)
            return (lax.dynamic_update_slice_in_dim(pmin, lo[:, 0], p0, axis=2),
                    lax.dynamic_update_slice_in_dim(pmax, hi[:, 0], p0, axis=2))

        lo, hi = jax.vmap(one, in_axes=(1, 1, 1, 0), out_axes=1)(
            cache.k, sel.page_min, sel.page_max, n // p)
        return PageBounds(lo, hi)


@dataclasses.dataclass(frozen=True)
class Auto(Method):
    """Choose gamma, or plain decoding, while generating: a cost model of the measured time
    of each configuration's device calls and the acceptance seen so far (`speculative.
    AutoController`). Drafts read what `base` selects; the sparsity stays as configured.
    gammas: the candidates (each compiled before decoding); () = the configured gamma and
    gamma +- 2."""

    base: Method = VerifyGuided("pair", decay=0.5)  # `vegas`
    gammas: tuple[int, ...] = ()
    name: ClassVar[str] = "auto"

    def __post_init__(self):
        if not self.base.speculative or isinstance(self.base, Auto):
            raise ValueError("auto needs a speculative base method")
        if self.gammas and min(self.gammas) < 1:
            raise ValueError(f"gammas must be whole numbers >= 1, got {self.gammas}")

    def capture(self, spec):
        return self.base.capture(spec)

    def takes_raw(self, spec):
        return self.base.takes_raw(spec)

    @property
    def prefill_rows(self) -> int:  # type: ignore[override]
        return self.base.prefill_rows

    def check(self, spec):
        self.base.check(spec)

    def candidates(self, gamma: int) -> tuple[int, ...]:
        """The gammas auto chooses among when configured with `gamma`."""
        return tuple(sorted(set(self.gammas or (max(gamma - 2, 1), gamma, gamma + 2))
                            | {gamma}))

    def tail_len(self, spec, max_len):
        # A round follows rounds of any candidate gamma: vegas's tail must hold what the
        # largest accepted (up to its gamma + 1 tokens) and this round's drafts. Sized for
        # the round's own gamma, a gamma 2 round after a gamma 6 one drafted from a tail
        # that could end before its own positions (tests: acceptance 0.90 at position 1
        # where reading everything must give 1.0). `gammas` is resolved (`candidates`) by
        # the controller.
        top = max((*self.gammas, spec.gamma))
        return self.base.tail_len(dataclasses.replace(spec, gamma=top), max_len)

    def init(self, spec, cache, scores, lens, xc):
        return self.base.init(spec, cache, scores, lens, xc)

    def draft_plan(self, spec, sel, cache, pos):
        plan = self.base.draft_plan(spec, sel, cache, pos)
        return plan.replace(tail_len=max(plan.tail_len, self.tail_len(spec, cache.max_len)))

    def update(self, spec, sel, scores, cache, n, n_acc, xc):
        return self.base.update(spec, sel, scores, cache, n, n_acc, xc)

    def after_plain(self, spec, sel, n):
        return self.base.after_plain(spec, sel, n)

    def extra_len(self) -> int:
        return getattr(self.base, "extra_len", lambda: 0)()


@dataclasses.dataclass(frozen=True)
class Vanilla(Method):
    """Plain autoregressive decoding with full attention (no speculation)."""

    name: ClassVar[str] = "vanilla"
    speculative: ClassVar[bool] = False


METHODS: dict[str, Method] = {
    # the default: the paper's pair of verify rows, scores carried over rounds at half
    # weight (issue 16's tau study: +2.4 % at 2K and +4.1 % at 4K over the paper's
    # selector, level at 1K; BENCHMARKS.md)
    "vegas": VerifyGuided("pair", decay=0.5),
    "vegas-paper": VerifyGuided("pair"),  # the paper's selector exactly
    # vegas from one verify row (x0's, or the last draft's): half the capture (issue 16)
    "vegas-first": VerifyGuided("first", decay=0.5),
    "vegas-final": VerifyGuided("final", decay=0.5),
    "vegas-all": VerifyGuided("all"),
    "vegas-heads": VerifyGuided("pair", heads=True),
    # the paper's selector with 4 sink and 64 recent positions always kept (issue 16)
    "vegas-window": VerifyGuided("pair", sink=4, recent=64),
    # issue 16's other policies: rows of the kept tokens only; one budget for all layers
    # of a sequence; budgets by attention entropy
    "vegas-accepted": VerifyGuided("accepted"),
    "vegas-pool": VerifyGuided("pair", pool=2.0),
    "vegas-entropy": VerifyGuided("pair", entropy=0.5),
    # measured no better than vegas (CPU, 1K-2K; worse on 2K chat): BENCHMARKS 2026-12-03 b
    "vegas-prefill": VerifyGuided("pair", decay=0.5, prefill_rows=8),
    "last": VerifyGuided("last"),
    "stream": Stream(),
    "quest": Quest(),
    "vanilla": Vanilla(),
    "auto": Auto(),
}
SCORES = ("weight", "logit")


def method_named(method: str | Method) -> Method:
    """The strategy object for a CLI / API method name (exact lookup), or the object itself."""
    if isinstance(method, Method):
        return method
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return METHODS[method]


for _cls in (VerifyGuided, Stream, Quest, QuestPicker, Auto, Vanilla):
    jax.tree_util.register_static(_cls)

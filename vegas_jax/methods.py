"""Decoding methods: which KV entries each draft step may read.

Every method drives the same model and round. A method is a frozen static object behind
the `Method` protocol that owns its whole policy: what the verify captures (`capture`),
the selection state after the prefill (`init`), the draft's attention plan
(`draft_plan`), how a verify updates the state (`update`) and the recent tail's length
(`tail_len`). Experiments plug in from outside as `Method` subclasses (`benchmarks/`).

  vegas        verify rows 0 and gamma rank the context ("Collect-2-Query"), each entry's
               score the larger of this verify's and half the one carried from before
  vegas-paper  the paper's selector exactly: this verify's rows 0 and gamma alone
  last         the row of the last accepted token (SpecExtend-style)
  stream       sink of the first tokens + recent window (MagicDec-Stream)
  quest        pages ranked by the current query against key bounds (MagicDec-Quest)
  auto         vegas, with gamma or plain decoding chosen while generating (`auto.py`)
  vanilla      no speculation
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from pallas_kernels.capture_select import select_from_capture
from pallas_kernels.topk import select_topk_fast
from pallas_kernels.verify_attention import SCORES  # noqa: F401 (`SpecConfig` takes these)
from vegas_jax.attention import AttnPlan, Capture, RawCapture
from vegas_jax.quant import DRAFT_WEIGHTS

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


def select_topk(scores, r_end, spec, max_len: int, xc=None):
    """Per (layer, sequence) top-`budget` over the ranked range 0..r_end.

    scores [L, b, s]; r_end [b]. Returns idx [L, b, K] (the best `count` in the first
    `count` slots, in position order: the draft's gathers walk the cache forwards; the
    slots after hold position 0, which the draft masks) and count [L, b]. xc: the
    ExecConfig (None: the XLA threshold). A threshold select, not a sort: exact up to ties.
    """
    s = scores.shape[-1]
    ranked = jnp.arange(s) <= r_end[None, :, None]
    scores = jnp.where(ranked, scores, -jnp.inf)
    count = jnp.broadcast_to(budget(spec, r_end, max_len)[None, :], scores.shape[:-1])
    pallas = xc is not None and xc.pallas
    idx = select_topk_fast(scores, max_budget(spec, max_len), counts=count,
                           threshold="fused" if pallas else "xla",
                           interpret=pallas and xc.interpret)
    return idx.astype(jnp.int32), count


class Method:
    """Base of every decoding method. `speculative` is False for plain decoding."""

    name: ClassVar[str]
    speculative: ClassVar[bool] = True

    def capture(self, spec) -> Capture | None:
        """Which verify rows' attention the next selection ranks by (None: none)."""
        return None

    def takes_raw(self, spec) -> bool:
        """Whether `update` selects from a `RawCapture` (the verify's logits as they came
        out of its kernel) where the kernels can hand one over (`attention.raw_capture`)."""
        return False

    def tail_len(self, spec, max_len: int) -> int:
        raise NotImplementedError

    def extra_len(self) -> int:
        """Cache positions needed past a round's last write."""
        return 0

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
    idx: jax.Array  # [L, b, K] positions in position order
    count: jax.Array  # [L, b] leading idx entries that are real
    end: jax.Array  # [b] first position after the ranked range
    acc: jax.Array | None = None  # [L, b, s] carried scores (decay > 0), else None


@dataclasses.dataclass(frozen=True)
class VerifyGuided(Method):
    """The verify pass's own attention ranks the context, per layer.

    rows: "pair" (rows 0 and gamma, the paper's Collect-2-Query) or "last" (the row of the
    last accepted token, SpecExtend-style; every row captured until acceptance is known).
    decay: 0 replaces the scores every round (the paper); d in (0, 1) carries them over,
    scores = max(this verify's, d * the carried ones), so an entry a recent round's
    queries needed stays selectable (raw logits: max(new, carried + log d))."""

    rows: str = "pair"
    decay: float = 0.0
    NAMES: ClassVar[dict] = {"pair": "vegas", "last": "last"}

    def __post_init__(self):
        if self.rows not in self.NAMES:
            raise ValueError(f"rows must be one of {tuple(self.NAMES)}, got {self.rows!r}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")

    @property
    def name(self) -> str:  # type: ignore[override]
        """The registry's name for this policy, else one composed from its options."""
        for key, method in METHODS.items():
            if method == self:
                return key
        return self.NAMES[self.rows] + ("-decay" if self.decay else "")

    def capture(self, spec):
        if self.rows == "pair":
            return Capture((0, spec.gamma), "mean", spec.score)
        return Capture(tuple(range(spec.gamma + 1)), "rows", spec.score)

    def takes_raw(self, spec):
        return True  # `raw_capture` says where the kernels allow it

    def _carry(self, scores, old, r_end, score: str):
        """scores = max(new, decay * old) over the ranked range 0..r_end [b] (raw logits:
        max(new, old + log decay)); -inf past it (positions past it held drafts that may
        have been rejected). None without decay."""
        if not self.decay:
            return None
        if old is not None:
            aged = self.decay * old if score == "weight" else old + math.log(self.decay)
            scores = jnp.maximum(scores, aged)
        return jnp.where(jnp.arange(scores.shape[-1]) <= r_end[None, :, None], scores, -jnp.inf)

    def tail_len(self, spec, max_len):
        # after a verify the ranked range ends at n; the tail then holds up to gamma
        # accepted tokens + the bonus + gamma - 1 drafts
        return 2 * spec.gamma + 1

    def init(self, spec, cache, scores, lens, xc):
        # The last prompt token's row ranks the whole prompt.
        acc = self._carry(scores, None, lens - 1, spec.score)
        idx, count = select_topk(scores if acc is None else acc, lens - 1, spec, cache.max_len,
                                 xc)
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
                self.decay, interpret=xc.interpret)
            return TopK(idx, jnp.broadcast_to(want[None, :], idx.shape[:2]), n + 1, acc)
        if self.rows == "last":  # scores [L, b, r, s]: keep the last accepted token's row
            scores = jnp.take_along_axis(scores, n_acc[None, :, None, None], axis=2)[:, :, 0]
        acc = self._carry(scores, sel.acc if self.decay else None, n, spec.score)
        idx, count = select_topk(scores if acc is None else acc, n, spec, cache.max_len, xc)
        return TopK(idx, count, n + 1, acc)

    def after_plain(self, spec, sel, n):
        # Plain steps moved the query past the tail (2 gamma + 1 entries from `end`), and a
        # draft that cannot see its own position drafts noise: start the tail at the last
        # gamma + 1 committed tokens; the tokens skipped are unread until the next verify.
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
    """Choose gamma and the draft's weights, or plain decoding, while generating
    (`auto.AutoController`): drafts read what `base` selects; the sparsity stays as
    configured. gammas: the candidates; () = the configured gamma and gamma +- 2.
    formats: the draft weights to choose among (`quant.DRAFT_WEIGHTS`), with the
    configured `SpecConfig.draft_weights` (where auto starts); () = the model's own
    weights and that one (`auto_formats.candidate_formats`)."""

    base: Method = VerifyGuided("pair", decay=0.5)  # `vegas`
    gammas: tuple[int, ...] = ()
    formats: tuple[str, ...] = ()
    name: ClassVar[str] = "auto"

    def __post_init__(self):
        if not self.base.speculative or isinstance(self.base, Auto):
            raise ValueError("auto needs a speculative base method")
        if self.gammas and min(self.gammas) < 1:
            raise ValueError(f"gammas must be whole numbers >= 1, got {self.gammas}")
        if isinstance(self.formats, str) or not set(self.formats) <= set(DRAFT_WEIGHTS):
            raise ValueError(f"formats must be draft weights among {DRAFT_WEIGHTS}, got "
                             f"{self.formats!r}")

    def capture(self, spec):
        return self.base.capture(spec)

    def takes_raw(self, spec):
        return self.base.takes_raw(spec)

    def candidates(self, gamma: int) -> tuple[int, ...]:
        """The gammas auto chooses among when configured with `gamma`."""
        return tuple(sorted(set(self.gammas or (max(gamma - 2, 1), gamma, gamma + 2))
                            | {gamma}))

    def candidate_formats(self, start: str) -> tuple[str, ...]:
        """The draft weights auto chooses among when it starts on `start`, in
        `quant.DRAFT_WEIGHTS`'s order (`formats` unresolved: `start` alone)."""
        return tuple(f for f in DRAFT_WEIGHTS if f in {*self.formats, start})

    def tail_len(self, spec, max_len):
        # A round follows rounds of any candidate gamma: the tail must hold what the
        # largest accepted plus this round's drafts (`gammas` is resolved by the controller)
        top = max((*self.gammas, spec.gamma))
        return self.base.tail_len(dataclasses.replace(spec, gamma=top), max_len)

    def extra_len(self) -> int:
        return self.base.extra_len()

    def init(self, spec, cache, scores, lens, xc):
        return self.base.init(spec, cache, scores, lens, xc)

    def draft_plan(self, spec, sel, cache, pos):
        plan = self.base.draft_plan(spec, sel, cache, pos)
        return plan.replace(tail_len=max(plan.tail_len, self.tail_len(spec, cache.max_len)))

    def update(self, spec, sel, scores, cache, n, n_acc, xc):
        return self.base.update(spec, sel, scores, cache, n, n_acc, xc)

    def after_plain(self, spec, sel, n):
        return self.base.after_plain(spec, sel, n)


@dataclasses.dataclass(frozen=True)
class Vanilla(Method):
    """Plain autoregressive decoding with full attention (no speculation)."""

    name: ClassVar[str] = "vanilla"
    speculative: ClassVar[bool] = False


METHODS: dict[str, Method] = {
    "vegas": VerifyGuided("pair", decay=0.5),
    "vegas-paper": VerifyGuided("pair"),
    "last": VerifyGuided("last"),
    "stream": Stream(),
    "quest": Quest(),
    "auto": Auto(),
    "vanilla": Vanilla(),
}
DEFAULT_METHOD = "auto"


def method_named(method: str | Method) -> Method:
    """The strategy object for a method name (exact lookup), or the object itself."""
    if isinstance(method, Method):
        return method
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return METHODS[method]


for _cls in (VerifyGuided, Stream, Quest, QuestPicker, Auto, Vanilla):
    jax.tree_util.register_static(_cls)

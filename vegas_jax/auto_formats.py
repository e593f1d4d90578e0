"""auto's draft weights (`Auto.formats`): which formats it chooses among
(`candidate_formats`), which of them a round can pay in (`auto_bound`) and whose copies
fit beside the cache (`prepare_drafts`), and the copies, each made when first used
(`DraftCopies`): a generation that never builds a format's rounds never quantizes."""

from __future__ import annotations

import dataclasses
import threading

from vegas_jax.auto import AutoController
from vegas_jax.auto_bound import round_bounds
from vegas_jax.auto_choice import SAME
from vegas_jax.driver import refill_group
from vegas_jax.prefill import available_bytes
from vegas_jax.prompts import check_memory, plan_cache_len, token_limits
from vegas_jax.quant import DRAFT_WEIGHTS, check_model, draft_params, quantized_bytes

# why a quantized format is left out of auto's candidates unless asked for (the default's
# reason: RESULTS.md, "Quantized draft weights and exact long-context prefill on the GPU")
UNNAMED = ("quantized drafts join auto's candidates where Auto(formats=...) names them or "
           "auto starts in one (draft_weights, --draft-weights)")


def candidate_formats(spec, model, xc) -> tuple:
    """(auto's spec with its candidate draft formats resolved, {format: why} of those left
    out): the formats named in `Auto.formats`, else the model's own weights and the format
    auto starts in (`SpecConfig.draft_weights`). A candidate the model cannot draft with
    (`quant.check_model`: dense, one device) fails in one line."""
    named, start = spec.method.formats, spec.draft_weights
    formats = named or tuple(f for f in DRAFT_WEIGHTS if f in (SAME, start))
    for f in {*formats, start}:
        check_model(model.config, xc, f)
    refused = {} if named else {f: UNNAMED for f in DRAFT_WEIGHTS if f not in formats}
    return dataclasses.replace(spec, method=dataclasses.replace(
        spec.method, formats=tuple(formats))), refused


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What `driver.launch` will size, known before its cache exists: the slots, the
    cache's length, each prompt's mean context while decoding (its length + half its new
    tokens), and the rows and longest prompt its memory check counts."""

    slots: int
    max_len: int
    contexts: tuple[float, ...]
    checked_rows: int  # the slots and, where prompts wait, a refill group's
    longest: int

    @classmethod
    def plan(cls, model, ids, max_new_tokens, max_batch, extra_len: int) -> "Sizes":
        lens = [len(p) for p in ids]
        slots = max(1, min(len(ids), max_batch or len(ids)))  # launch checks max_batch
        max_len = plan_cache_len(model.config, lens, max_new_tokens, extra_len)
        limits = token_limits(max_new_tokens, len(ids))
        rows = slots + (refill_group(slots) if len(ids) > slots else 0)
        return cls(slots, max_len, tuple(n + lim / 2 for n, lim in zip(lens, limits)), rows,
                   max(lens))


class DraftCopies:
    """The params each candidate format's drafts read (`quant.draft_params`; None: the
    model's own), each made on first use, once: by the first call or the build that runs
    one of its rounds (`auto_build`, maybe in its thread)."""

    def __init__(self, model, xc):
        self.model, self.xc = model, xc
        self.made: dict = {}
        self.lock = threading.Lock()

    def get(self, fmt: str):
        with self.lock:
            if fmt not in self.made:
                self.made[fmt] = draft_params(self.model, fmt, self.xc)
            return self.made[fmt]


def prepare_drafts(model, xc, auto: AutoController, sizes: Sizes) -> DraftCopies | None:
    """Where a round of some candidate could beat plain steps by auto's `min_gain`, from
    what each reads (`auto_bound`), the copies of the formats left (the start's made now:
    before the cache, whose memory check then counts it); else None (auto decodes
    plainly). A format whose copy does not fit beside the cache, the prefill's transients
    (`prompts.check_memory`) and the copies before it is dropped: the start's format
    first, then by the rounds' bound."""
    if not auto.allow_rounds(round_bounds(model, auto.spec, auto.gammas, xc, sizes.slots,
                                          sizes.contexts, sizes.max_len, auto.formats)):
        return None
    top = {f: max(b for c, b in auto.bounds.items() if c.draft_weights == f)
           for f in auto.formats}
    start, room = auto.plan.start.draft_weights, None
    held = getattr(model, "drafts", None)  # `quant.DraftCache`: copies made before
    for f in sorted(auto.formats, key=lambda f: (f != start, -top[f])):
        if f == SAME or (held is not None and held.holds(model.params, f)):
            continue
        if room is None and (free := available_bytes()) is not None:
            room = 0.9 * free - check_memory(model, sizes.checked_rows, sizes.max_len,
                                             sizes.longest, xc.backend)
        need = quantized_bytes(model.params, f)
        if room is not None and need > room:
            gib = 1 << 30
            auto.drop_format(f, f"its copy ({need / gib:.2f} GiB) does not fit beside the "
                                f"cache ({max(room, 0) / gib:.2f} GiB left)")
        elif room is not None:
            room -= need
    if not auto.formats:
        return None
    copies = DraftCopies(model, xc)
    copies.get(auto.plan.start.draft_weights)
    return copies

"""Study methods: selection policies the benchmarks compare beside the library's own
(`vegas_jax.methods.METHODS`), written as `Method` plug-ins.

A plug-in is a frozen dataclass that subclasses `Method` (here: `VerifyGuided`) and
overrides what it changes: `capture` (which verify rows' attention is kept, and whether
averaged or kept per row), `takes_raw` (whether the selection may read the verify
kernel's raw logits), `update` (the next selection from the captured scores and the
acceptance), `init`, `draft_plan`, `tail_len`, `after_plain`. Pass the object wherever a
method name goes:

    from benchmarks.methods import PLUGINS
    speculative_generate(model, prompts, spec=SpecConfig(method=PLUGINS["vegas-all"]))

    PYTHONPATH=. python -m benchmarks.tau_study --methods vegas,vegas-all,vegas-accepted

  vegas-all       the mean of all gamma + 1 verify rows ("pair" takes rows 0 and gamma)
  vegas-accepted  the mean of the rows of the tokens that stay: x0 and the accepted
                  drafts (rows 0..n_acc), known only after acceptance, so every row is
                  captured and the kept ones averaged in `update`
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from vegas_jax.attention import Capture
from vegas_jax.methods import METHODS, Method, VerifyGuided


def _every_row(spec, reduce: str) -> Capture:
    return Capture(tuple(range(spec.gamma + 1)), reduce, spec.score)


@dataclasses.dataclass(frozen=True)
class VegasAll(VerifyGuided):
    """Scores from the mean of every verify row (rows 0..gamma), not the pair's two."""

    @property
    def name(self) -> str:  # type: ignore[override]
        return "vegas-all" + ("-decay" if self.decay else "")

    def capture(self, spec):
        return _every_row(spec, "mean")


@dataclasses.dataclass(frozen=True)
class VegasAccepted(VerifyGuided):
    """Scores from the mean of rows 0..n_acc: the queries of the tokens that stay (a
    rejected draft's query was never the next round's)."""

    @property
    def name(self) -> str:  # type: ignore[override]
        return "vegas-accepted" + ("-decay" if self.decay else "")

    def capture(self, spec):
        return _every_row(spec, "rows")

    def takes_raw(self, spec):
        return False  # the rows are reduced here, after acceptance

    def update(self, spec, sel, scores, cache, n, n_acc, xc):
        # scores [L, b, gamma + 1, s] -> the mean of each sequence's rows 0..n_acc
        kept = jnp.arange(scores.shape[2])[None, :] <= n_acc[:, None]  # [b, r]
        weights = kept / (n_acc[:, None] + 1.0)
        mean = jnp.einsum("lbrs,br->lbs", scores, weights.astype(scores.dtype))
        return super().update(spec, sel, mean, cache, n, n_acc, xc)


PLUGINS: dict[str, Method] = {
    "vegas-all": VegasAll(),
    "vegas-accepted": VegasAccepted(),
}

for _cls in (VegasAll, VegasAccepted):
    jax.tree_util.register_static(_cls)


def method_of(name: str) -> Method:
    """A library method (`METHODS`) or a plug-in (`PLUGINS`) by name."""
    if name in METHODS:
        return METHODS[name]
    if name in PLUGINS:
        return PLUGINS[name]
    raise ValueError(f"unknown method {name!r}; choose one of "
                     f"{', '.join([*METHODS, *PLUGINS])}")

import sys
from vegas_jax import selection as s


class HeadMax(s.VerifyGuided):
    """Run-only policy: the pair's scores per KV head (the "heads" capture), then the max
    over KV heads: one shared selection in which a position that one KV head's query heads
    attend to strongly is not diluted by the others' average."""

    def capture(self, spec):
        return s.Capture((0, spec.gamma), "heads", spec.score)

    def init(self, spec, cache, scores, lens, xc):
        return super().init(spec, cache, scores.max(axis=2) if scores.ndim == 4 else scores,
                            lens, xc)

    def update(self, spec, sel, scores, cache, n, n_acc, xc):
        return super().update(spec, sel, scores.max(axis=2), cache, n, n_acc, xc)


s.METHODS["vegas-headmax"] = HeadMax("pair", decay=0.5)
import benchmarks.tau_study as t  # noqa: E402

t.main(sys.argv[1:])

"""Run-only policy (issue 16): vegas with each position's score raised to at least
`alpha` times its neighbours' (positions p - 1 and p + 1) before the top-k, so a sharply
attended token brings the tokens beside it (the rest of its word, its phrase) at the
same budget. Scores [L, b, s] (the "mean" capture)."""
import sys

import jax.numpy as jnp

from vegas_jax import selection as s

ALPHA = float(sys.argv.pop(1)) if len(sys.argv) > 1 and sys.argv[1][0].isdigit() else 0.5


def spread(x, alpha):
    left = jnp.concatenate([x[..., :1] * 0, x[..., :-1]], axis=-1)  # score of p - 1 at p
    right = jnp.concatenate([x[..., 1:], x[..., :1] * 0], axis=-1)  # score of p + 1 at p
    return jnp.maximum(x, alpha * jnp.maximum(left, right))


class Spread(s.VerifyGuided):
    def init(self, spec, cache, scores, lens, xc):
        return super().init(spec, cache, spread(scores, ALPHA), lens, xc)

    def update(self, spec, sel, scores, cache, n, n_acc, xc):
        return super().update(spec, sel, spread(scores, ALPHA), cache, n, n_acc, xc)


s.METHODS["vegas-spread"] = Spread("pair", decay=0.5)
import benchmarks.tau_study as t  # noqa: E402

t.main(sys.argv[1:])

"""The selection from a verify's captured logits on the GPU: one kernel for all layers
against the path it replaces (an epilogue kernel a layer, the layers' scores stacked and
carried in XLA, then the fused threshold + compaction kernel).

    PYTHONPATH=. python -m benchmarks.tune_capture_select [--batch 128] [--context 7680]

Random fp16 logits in `verify_attention.capture_buffer`'s layout (SmolLM2's 3 KV heads x 2
capture rows x 3 query heads = 18 rows a sequence by default), the carried scores of a
previous round, softmax-like offsets. Checks that both paths select sets of equal scores
(exact up to ties) and prints microseconds a call of each, per warp count of the kernel."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.capture_select import _scores_reference, select_from_capture
from pallas_kernels.topk import select_topk_fast
from pallas_kernels.verify_attention import capture_scores
from vegas_jax.bench import _time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=7680)
    p.add_argument("--rows", type=int, default=18, help="capture rows a sequence")
    p.add_argument("--sparsity", type=float, default=0.07)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    L, b, r = a.layers, a.batch, a.rows
    s = a.context + 256
    kmax = int(np.ceil(a.sparsity * s))
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    logits = (3.0 * jax.random.normal(ks[0], (L * b * r + 128, s))).astype(jnp.float16)
    offset = 12.0 + jax.random.normal(ks[1], (L, b, r))
    end = jnp.full((b,), a.context - 1, jnp.int32)
    want = jnp.full((b,), kmax, jnp.int32).at[0].set(kmax // 2)
    ranked = jnp.arange(s)[None, None, :] <= end[None, :, None]
    old = jnp.where(ranked, jax.random.uniform(ks[2], (L, b, s)) * 1e-3, -jnp.inf)
    score = _scores_reference(logits, offset, end, s, old, 0.5)

    # the replaced path's inputs: one buffer a layer, as each verify call wrote them
    layers = [logits[l * b * r:(l + 1) * b * r + 128] for l in range(L)]

    def before(layers, offset, old):
        """The replaced path: the epilogue a layer (offsets as LSEs with unit weights),
        the layers stacked, carried, then the fused select."""
        rowpos = jnp.broadcast_to(end[:, None], (b, r))
        per = [capture_scores(layers[l], offset[l], rowpos, np.ones((1, r), np.float32),
                              s)[:, 0] for l in range(L)]
        sc = jnp.where(ranked, jnp.maximum(jnp.stack(per), 0.5 * old), -jnp.inf)
        return select_topk_fast(sc, kmax, counts=jnp.broadcast_to(want, (L, b)),
                                threshold="fused"), sc

    def check(idx):
        """Rows whose selected scores are not the top ones (beyond near-ties: summation
        orders differ between the kernels and XLA in the last bits)."""
        idx, sc = np.asarray(idx), np.asarray(score)
        bad = 0
        for l in range(L):
            for bi in range(b):
                w = int(want[bi])
                top = np.sort(sc[l, bi])[::-1][:w]
                got = np.sort(sc[l, bi, idx[l, bi, :w]])[::-1]
                bad += not (len(set(idx[l, bi, :w].tolist())) == w
                            and np.allclose(got, top, rtol=1e-5, atol=0))
        return f"{bad} of {L * b} rows off"

    rows = []
    f = jax.jit(before)
    rows.append(("epilogue x L + stack/carry + fused select", f(layers, offset, old)[0],
                 lambda: f(layers, offset, old)))
    for warps, early in ((8, False), (8, True), (16, True)):
        g = jax.jit(lambda lg, o, od, w=warps, e=early: select_from_capture(
            lg, o, end, want, kmax, s, od, 0.5, num_warps=w, early=e))
        name = f"select_from_capture, {warps} warps" + (", early exit" if early else "")
        try:
            rows.append((name, g(logits, offset, old)[0], lambda g=g: g(logits, offset, old)))
        except Exception as e:  # a plan that does not compile: report, go on
            print(f"{name} failed: {str(e)[:200]}")
    print(f"[L, b, R, s] = [{L}, {b}, {r}, {s}], k = {kmax}")
    for name, idx, fn in rows:
        us = _time(fn, a.reps) * 1e6
        print(f"{name:44s} {us:9.1f} us   top-k of the scores: {check(idx)}")


if __name__ == "__main__":
    main()

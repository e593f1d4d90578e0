"""The selection's threshold on the GPU: XLA count passes against the Pallas kernel.

    PYTHONPATH=. python -m benchmarks.tune_select [--layers 30] [--batch 64] [--context 7680]

`select_topk_fast` finds each row's k-th largest score by 32 / radix_bits count passes;
in XLA each pass reads the [L, b, s] scores again (16 passes, ~250 us of a SmolLM2 round
at B 64 on the H200, BENCHMARKS.md 2026-12-01 d). `kth_largest_key_pallas` holds a row
chunk in registers and reads it once. This checks both against each other (index sets
equal; ties resolve by position in both) and prints microseconds per call for the
threshold alone and for the whole selection, at the sparsity's budget per row."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.topk import (
    kth_largest_key, kth_largest_key_pallas, select_topk_fast, sortable_keys,
)
from vegas_jax.bench import _time


def timed(fn, *args, reps=20):
    """Median microseconds a call, after one warm-up call."""
    return _time(lambda: fn(*args), reps) * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=7680)
    p.add_argument("--sparsity", type=float, default=0.07)
    p.add_argument("--tiles", default="4096,8192,16384", help="kernel tile sizes tried")
    a = p.parse_args(argv)
    s = a.context + 256
    k = int(np.ceil(a.sparsity * s))
    # softmax-weight-like scores: many near-ties at tiny values, a few large ones
    x = jax.nn.softmax(3.0 * jax.random.normal(jax.random.PRNGKey(0), (a.layers, a.batch, s)), -1)
    x = x.at[..., s - 200:].set(-jnp.inf)  # the unranked tail, as the selector masks it
    counts = jnp.full((a.layers, a.batch), k, jnp.int32).at[:, 0].set(k // 2)
    rows = x.reshape(-1, s)
    want = counts.reshape(-1)
    ref_t = jax.jit(lambda x, c: kth_largest_key(sortable_keys(x), c[:, None]))
    out = [("threshold xla", timed(ref_t, rows, want), True)]
    t_ref = ref_t(rows, want)
    sel_x = jax.jit(lambda x, c: select_topk_fast(x, k, counts=c))
    i_ref = sel_x(x, counts)
    out.append(("select xla", timed(sel_x, x, counts), True))
    for tile in [int(t) for t in a.tiles.split(",")]:
        for warps in (4, 8):
            f = jax.jit(lambda x, c, tile=tile, warps=warps: kth_largest_key_pallas(
                x, c, tile=tile, num_warps=warps))
            try:
                ok = bool((f(rows, want) == t_ref).all())
                out.append((f"threshold pallas tile {tile} w{warps}", timed(f, rows, want), ok))
            except Exception as e:  # a plan that does not compile: report, go on
                print(f"tile {tile} w{warps} failed: {str(e)[:200]}")
    for impl, name in (("pallas", "select pallas (default tile)"),
                       ("fused", "select fused (one kernel)")):
        sel = jax.jit(lambda x, c, impl=impl: select_topk_fast(x, k, counts=c, threshold=impl))
        try:
            ok = bool((sel(x, counts) == i_ref).all())
            out.append((name, timed(sel, x, counts), ok))
        except Exception as e:  # a kernel that does not compile: report, go on
            print(f"select {impl} failed: {str(e)[:300]}")
    print(f"[L, b, s] = [{a.layers}, {a.batch}, {s}], k = {k}")
    for name, us, ok in out:
        print(f"{name:34s} {us:9.1f} us   equal to xla: {ok}")
    return out


if __name__ == "__main__":
    main()

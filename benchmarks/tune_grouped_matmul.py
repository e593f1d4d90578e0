"""Tiles of the few-rows expert kernel (`pallas_kernels.grouped_matmul`) at decode sizes.

    PYTHONPATH=. python -m benchmarks.tune_grouped_matmul [--model qwen3-30b-a3b]
        [--tokens 1] [--check-tokens 4,16] [--calls 16] [--reps 10] [--json out.json]

Each call multiplies the rows of `tokens` tokens (each routed to `experts_per_token`
distinct random experts) by one layer's expert gate/up and down weights; `--calls` calls
chained in one jit, on weight sets that differ from call to call (so no call reads
another's weights from L2), timed on the host (median of --reps) and divided by the calls.
Host timing overstates a call: rank tiles here, confirm them in the model's kernel profile.
Every candidate tile is timed at --tokens; the three fastest and the default again at each
--check-tokens. Reported: us a call, the bytes of the experts read, the share of the read
ceiling (--ceiling), and the largest difference from the default tile's output.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.grouped_matmul import GmmTile, grouped_matmul
from vegas_jax.config import get_config

SETS = 4  # distinct weight sets the chained calls cycle through

_D = GmmTile()
# (block_k, block_n, num_warps, num_stages, loop); the first is the library's default
CANDIDATES = [
    (_D.block_k, _D.block_n, _D.num_warps, _D.num_stages, _D.loop),
    (64, 64, 4, 2, False), (128, 64, 4, 2, False), (256, 64, 4, 2, False),
    (128, 128, 4, 2, False), (64, 64, 4, 3, True), (64, 64, 4, 4, True), (128, 64, 4, 4, True),
    (256, 64, 4, 3, True), (128, 128, 4, 3, True), (128, 128, 8, 3, True),
    (64, 128, 4, 4, True), (256, 128, 8, 3, True),
]


def routed_rows(key, tokens: int, per_token: int, experts: int, hidden: int):
    """lhs [tokens * per_token, hidden] sorted by expert and group sizes [experts]: each
    token's rows go to per_token distinct random experts."""
    ke, kx = jax.random.split(key)
    choice = jnp.stack([jax.random.permutation(k, experts)[:per_token]
                        for k in jax.random.split(ke, tokens)])  # [tokens, per_token]
    flat = np.sort(np.asarray(choice).reshape(-1))
    sizes = jnp.asarray(np.bincount(flat, minlength=experts), jnp.int32)
    lhs = jax.random.normal(kx, (flat.size, hidden), jnp.bfloat16)
    return lhs, sizes, len(set(flat.tolist()))


def time_tile(lhs, ws, sizes, tile, calls: int, reps: int):
    bk, bn, warps, stages, loop = tile
    t = GmmTile(block_k=bk, block_n=bn, num_warps=warps, num_stages=stages, loop=loop)
    gmm = lambda x, w: grouped_matmul(x, w, sizes, tile=t)  # noqa: E731

    @jax.jit
    def chain(x, ws):
        outs = [gmm(x, ws[i % SETS]) for i in range(calls)]
        return outs[0], sum(o[0, 0].astype(jnp.float32) for o in outs)

    out, _ = jax.block_until_ready(chain(lhs, ws))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(chain(lhs, ws))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / calls, out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="registered MoE model name")
    p.add_argument("--tokens", type=int, default=1, help="tokens of the sweep")
    p.add_argument("--check-tokens", default="4,16", help="tokens the best tiles re-run at")
    p.add_argument("--calls", type=int, default=16, help="calls chained in one jit")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--ceiling", type=float, default=4.45e12,
                   help="the read ceiling (bytes/s) the shares are reported against")
    a = p.parse_args(argv)
    cfg = get_config(a.model)
    e, k, hd, f = (cfg.num_experts, cfg.experts_per_token, cfg.hidden_size,
                   cfg.moe_intermediate_size)
    key = jax.random.PRNGKey(0)
    mats = {"gate_up": (hd, 2 * f), "down": (f, hd)}
    # separate buffers, not slices of one stacked array (XLA may copy a slice that feeds
    # a custom call)
    weights = {name: tuple(jax.random.normal(jax.random.fold_in(key, SETS * i + j),
                                             (e, kk, n), jnp.bfloat16) * 0.02
                           for j in range(SETS))
               for i, (name, (kk, n)) in enumerate(mats.items())}
    rows = []

    def run(name, tokens, tiles):
        kk, n = mats[name]
        lhs, sizes, used = routed_rows(jax.random.fold_in(key, tokens), tokens, k, e, kk)
        nbytes = used * kk * n * 2
        ref = None
        out_rows = []
        for tile in tiles:
            try:
                s, out = time_tile(lhs, weights[name], sizes, tile, a.calls, a.reps)
            except Exception as exc:  # a tile Triton cannot build: say so, go on
                print(f"{name} tokens {tokens} tile {tile}: failed ({str(exc)[:120]})")
                continue
            out = np.asarray(out, np.float32)
            ref = out if ref is None else ref
            r = {"matmul": name, "tokens": tokens, "tile": list(tile), "us": s * 1e6,
                 "ceiling": nbytes / s / a.ceiling, "max_diff": float(np.abs(out - ref).max())}
            print(f"{name:7s} tokens {tokens:3d} bk {tile[0]:3d} bn {tile[1]:3d} w {tile[2]} "
                  f"st {tile[3]} {'loop' if tile[4] else 'unrolled':8s} {r['us']:8.1f} us  "
                  f"{100 * r['ceiling']:5.1f} % of ceiling  diff {r['max_diff']:.2e}",
                  flush=True)
            out_rows.append(r)
        return out_rows

    for name in mats:
        swept = run(name, a.tokens, CANDIDATES)
        rows += swept
        best = [tuple(r["tile"]) for r in sorted(swept, key=lambda r: r["us"])[:3]]
        check = [CANDIDATES[0]] + [t for t in best if t != CANDIDATES[0]]
        for tokens in [int(t) for t in a.check_tokens.split(",") if t]:
            rows += run(name, tokens, check)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "device": jax.devices()[0].device_kind, "rows": rows},
                      fh, indent=1)


if __name__ == "__main__":
    main()

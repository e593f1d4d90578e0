"""The row-invariant matmul's tiles against cuBLAS (XLA's dot) on a model's decode GEMMs.

    PYTHONPATH=. python -m benchmarks.matmul_tiles --model qwen3-8b --rows 1,64 \\
        --tiles 16x64x64x4x3,16x128x64x4x3 [--json out.json]

For each of the model's weight shapes (qkv, o, gate_up, down, lm_head) and row count, the
median device time of `pallas_kernels.matmul.matmul` with each tile (block_m x block_k x
block_n x warps x stages) beside `jnp.dot`, and the byte floor (weights read once at the
card's bandwidth). Every tile is row-invariant on its own: the choice is one tile for all
calls, so the table's sum over shapes is what to compare."""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul import MatmulBlocks, matmul


def shapes(cfg) -> dict[str, tuple[int, int]]:
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * cfg.intermediate_size),
            "down": (cfg.intermediate_size, h), "lm_head": (h, cfg.vocab_size)}


def timed(f, *args, reps: int = 50) -> float:
    """Median seconds of f(*args) over reps calls, each synchronised."""
    jax.block_until_ready(f(*args))
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        out.append(time.perf_counter() - t)
    return float(np.median(out))


def parse_tile(s: str) -> MatmulBlocks:
    m, k, n, w, st = (int(v) for v in s.split("x"))
    return MatmulBlocks(block_m=m, block_k=k, block_n=n, num_warps=w, num_stages=st)


def main(argv=None) -> int:
    from vegas_jax.config import get_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--rows", default="1,64", help="comma-separated row counts")
    p.add_argument("--tiles", default="16x64x64x4x3",
                   help="comma-separated block_m x block_k x block_n x warps x stages")
    p.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s of the byte floor")
    p.add_argument("--json", default=None, metavar="FILE")
    a = p.parse_args(argv)
    tiles = a.tiles.split(",")
    cfg = get_config(a.model)
    rows = []
    print(f"{a.model} on {jax.devices()[0].device_kind}: µs a call (median)")
    print("| gemm | k x n | rows | floor | cuBLAS | " + " | ".join(tiles) + " |")
    print("|---|---|---|---|---|" + "---|" * len(tiles))
    key = jax.random.PRNGKey(0)
    for name, (k, n) in shapes(cfg).items():
        w = jax.random.normal(key, (k, n), jnp.bfloat16)
        for m in (int(r) for r in a.rows.split(",")):
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            ref = jax.jit(lambda x, w: jnp.dot(x, w))
            row = {"gemm": name, "k": k, "n": n, "rows": m,
                   "floor_us": 2 * k * n / a.bandwidth * 1e6,
                   "cublas_us": timed(ref, x, w) * 1e6}
            want = np.asarray(ref(x, w), np.float32)
            for t in tiles:
                f = jax.jit(lambda x, w, b=parse_tile(t): matmul(x, w, blocks=b))
                got = np.asarray(f(x, w), np.float32)
                err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9))
                row[t] = timed(f, x, w) * 1e6 if err < 2e-2 else float("nan")
            rows.append(row)
            print(f"| {name} | {k} x {n} | {m} | {row['floor_us']:.1f} | {row['cublas_us']:.1f} | "
                  + " | ".join(f"{row[t]:.1f}" for t in tiles) + " |", flush=True)
    for m in sorted({r["rows"] for r in rows}):
        sel = [r for r in rows if r["rows"] == m]
        print(f"| all | | {m} | {sum(r['floor_us'] for r in sel):.1f} | "
              f"{sum(r['cublas_us'] for r in sel):.1f} | "
              + " | ".join(f"{sum(r[t] for r in sel):.1f}" for t in tiles) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "device": jax.devices()[0].device_kind, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

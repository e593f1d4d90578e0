"""Launch plans of the verify attention kernel (`verify_attention`) on the GPU.

    PYTHONPATH=. python -m benchmarks.tune_verify [--batch 64] [--context 7680] [--gamma 6]

Times 30 chained calls (one per layer of a stacked cache, as in a verify forward) with the
paper's capture (rows 0 and gamma, softmax weights averaged over heads, the capture's
reduction kernel included) for each candidate `VerifyBlocks`, and prints microseconds per layer call and the
K/V bytes read per second. SmolLM2 shapes by default (3 KV heads, group 3, head dim 64)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.verify_attention import INVARIANT, CaptureSpec, VerifyBlocks, verify_attention

CANDIDATES = [
    ("default", VerifyBlocks()),
    ("block_k 64", VerifyBlocks(block_k=64)),
    ("8 warps", VerifyBlocks(num_warps=8)),
    ("4 stages", VerifyBlocks(num_stages=4)),
    ("2 stages", VerifyBlocks(num_stages=2)),
    ("no waves", VerifyBlocks(waves=False)),
    ("default again", VerifyBlocks()),
]
_inv = functools.partial(dataclasses.replace, INVARIANT)
# the row-invariant plan (`ExecConfig.exact`): one tile and one split length for every call
INVARIANT_CANDIDATES = [
    ("default", VerifyBlocks()),
    ("invariant", INVARIANT),
    ("inv block_k 128", _inv(block_k=128)),
    ("inv block_k 128, 3 stages", _inv(block_k=128, num_stages=3)),
    ("inv 3 stages", _inv(num_stages=3)),
    ("inv split 2048", _inv(split_keys=2048)),
    ("inv split 512", _inv(split_keys=512)),
    ("inv 16 rows", _inv(max_rows=16, row_block=16)),
    ("invariant again", INVARIANT),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=7680)
    p.add_argument("--gamma", type=int, default=6, help="0: a decode step (one row, no capture)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--invariant", action="store_true",
                   help="the row-invariant plan's candidates (no capture)")
    a = p.parse_args()
    L, b, kh, g, d, t = a.layers, a.batch, a.kv_heads, a.group, a.head_dim, a.gamma + 1
    s = a.context + 128
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    kc = jax.random.normal(ks[0], (L, b, kh, s, d), jnp.bfloat16)
    vc = jax.random.normal(ks[1], (L, b, kh, s, d), jnp.bfloat16)
    q = jax.random.normal(ks[2], (b, t, kh, g, d), jnp.bfloat16)
    pos = a.context - t + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    kv_bytes = 2 * b * kh * a.context * d * 2  # K and V read once per layer

    def chain(blocks, capture):
        def run(q, kc, vc):
            def body(li, c):
                x, acc = c
                o, sc = verify_attention(
                    x, kc, vc, li, pos, blocks=blocks,
                    capture=None if capture == "none" else CaptureSpec((0, a.gamma), capture))
                acc = acc + (0.0 if sc is None else sc[:, :8].sum())
                return x + (o * 0).astype(x.dtype), acc
            return lax.fori_loop(0, L, body, (q, jnp.float32(0)))
        return jax.jit(run)

    print(f"B {b}, context {a.context}, {t} rows x group {g}, {L} layers; "
          + (f"capture rows (0, {a.gamma}), weights" if a.gamma else "decode"))
    if a.invariant:
        rows = [(n, bl, "none") for n, bl in INVARIANT_CANDIDATES]
    else:
        rows = [("default, no capture", VerifyBlocks(), "none")] if a.gamma else []
        rows += [(n, bl, "mean" if a.gamma else "none") for n, bl in CANDIDATES]
    for name, bl, cap in rows:
        run = chain(bl, cap)
        jax.block_until_ready(run(q, kc, vc))
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            jax.block_until_ready(run(q, kc, vc))
            ts.append(time.perf_counter() - t0)
        per = sorted(ts)[3] / L
        print(f"{name:22s} {per * 1e6:8.1f} us per layer call  {kv_bytes / per / 1e12:5.2f} TB/s")


if __name__ == "__main__":
    main()

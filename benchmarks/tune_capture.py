"""Launch plans of the verify capture's epilogue kernel (`capture_scores`) on the GPU.

    PYTHONPATH=. python -m benchmarks.tune_capture [--batch 64] [--context 7680] [--rows 0,6]

The verify kernel stores the capture rows' raw logits (fp16); `capture_scores` turns them
into the selection's scores (softmax weights summed over heads and capture rows). At
SmolLM2 B 64 it measured 27 us a layer for ~18 MB of reads (H200, 2026-12-01 d), ~5x its
bytes. This times 30 chained calls (one per layer) of each candidate `CaptureBlocks` and of
the XLA form (`capture_scores_reference`), checks each against the reference, and prints
microseconds per layer call and the logits read per second. Capture rows "0,6" are vegas
at gamma 6; "0,1,2,3,4,5,6" with --capture rows are `last`'s."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pallas_kernels.verify_attention import (
    CaptureBlocks, _capture_weights, capture_scores, capture_scores_reference,
)
from vegas_jax.bench import _time

CANDIDATES = [
    ("default", CaptureBlocks()),
    ("dot bs512", CaptureBlocks(block_s=512, reduce="dot")),
    ("dot bs256", CaptureBlocks(block_s=256, reduce="dot")),
    ("sum bs512", CaptureBlocks(block_s=512, reduce="sum")),
    ("sum bs128 w2", CaptureBlocks(block_s=128, reduce="sum", num_warps=2)),
    # a program walks several steps: Triton pipelines the loads (num_stages)
    ("sum 256x4 st2", CaptureBlocks(block_s=256, reduce="sum", cols=1024, num_stages=2)),
    ("sum 256x8 st3", CaptureBlocks(block_s=256, reduce="sum", cols=2048, num_stages=3)),
    ("sum 128x8 st3", CaptureBlocks(block_s=128, reduce="sum", cols=1024, num_stages=3)),
    ("sum 128x16 st3 w2", CaptureBlocks(block_s=128, reduce="sum", cols=2048, num_stages=3,
                                        num_warps=2)),
    ("sum 512x4 st2 w8", CaptureBlocks(block_s=512, reduce="sum", cols=2048, num_stages=2,
                                       num_warps=8)),
    ("dot 256x4 st2", CaptureBlocks(block_s=256, cols=1024, num_stages=2)),
    ("default again", CaptureBlocks()),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=7680)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3)
    p.add_argument("--rows", default="0,6", help="capture rows (verify token indices)")
    p.add_argument("--capture", default="mean", choices=("mean", "rows", "heads"))
    p.add_argument("--layers", type=int, default=30)
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    uniq = sorted(set(rows))
    mult = [rows.count(u) / len(rows) for u in uniq]
    b, kh, g, s = a.batch, a.kv_heads, a.group, a.context + 256
    r = kh * len(uniq) * g
    w = _capture_weights(a.capture, kh, g, uniq, rows, mult)
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    # one capture buffer per layer, as the verify forward writes them
    cbufs = (4 * jax.random.normal(ks[0], (a.layers, b * r + 16, s))).astype(jnp.float16)
    lse = 6.0 + jax.random.normal(ks[1], (b, r))
    pos = jnp.full((b, len(uniq)), a.context, jnp.int32) + jnp.asarray(uniq)[None, :]
    rowpos = jnp.tile(jnp.repeat(pos, g, axis=1), (1, kh))
    read = b * r * s * 2  # the logits read per call

    def chain(fn):
        @jax.jit
        def run(cbufs, lse, rowpos):
            return [fn(cbufs[i], lse + 1e-3 * i, rowpos, w, s) for i in range(a.layers)]
        return run

    ref = chain(capture_scores_reference)(cbufs, lse, rowpos)
    rows_out = []
    for name, fn in [("xla", capture_scores_reference)] + [
            (n, lambda *x, c=c: capture_scores(*x, blocks=c)) for n, c in CANDIDATES]:
        run = chain(fn)
        try:
            out = jax.block_until_ready(run(cbufs, lse, rowpos))
        except Exception as e:  # a plan that does not compile: report, go on
            print(f"{name:16s} failed: {str(e)[:120]}")
            continue
        err = max(float(jnp.max(jnp.abs(o - e)) / (jnp.max(jnp.abs(e)) + 1e-30))
                  for o, e in zip(out, ref))
        us = _time(lambda: run(cbufs, lse, rowpos), 10) / a.layers * 1e6
        rows_out.append((name, us, read / us / 1e3, err))
        print(f"{name:16s} {us:8.1f} us a call  {read / us / 1e3:7.1f} GB/s  rel err {err:.1e}")
    return rows_out


if __name__ == "__main__":
    main()

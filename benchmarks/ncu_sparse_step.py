"""One layer's draft kernel (`sparse_step`) under Nsight Compute: the inputs of
`benchmarks.tune_sparse_step` (`step_inputs`: SmolLM2 shapes, sorted random selections),
the default tiles, a few calls so the profiled one is warm.

    XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --clock-control none \\
        -k regex:sparse_step -s 3 -c 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        --section LaunchStats --section SourceCounters \\
        python3 -m benchmarks.ncu_sparse_step --batch 64 [--tile BK,WARPS,STAGES[,split]]

Hardware counters are read only on the device tool's Firecracker machines (KINDS.md).
With XLA's command buffers on (the default), python segfaulted under ncu at start (H100,
2026-12-06); with them off it profiles. `--tile` swaps the whole-pair tile (or, with
`split`, the split path's, all pairs split) to profile a candidate."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.tune_sparse_step import add_shape_args, split_tile, step_inputs, whole_tile
from pallas_kernels.sparse_attention import SparseBlocks, StepBlocks, sparse_step


def blocks_of(tile: str | None) -> StepBlocks:
    """"BK,WARPS,STAGES" (the whole-pair tile) or "BK,WARPS,STAGES,split" (every pair split
    over the default target programs with that tile); None: the default."""
    if not tile:
        return StepBlocks()
    bk, w, st, *rest = tile.split(",")
    if rest == ["split"]:
        return split_tile(SparseBlocks().target_programs, int(bk), int(w), int(st))
    if rest:
        raise ValueError(f"--tile BK,WARPS,STAGES[,split], got {tile!r}")
    return whole_tile(int(bk), int(w), int(st))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--tile", default=None, help="BK,WARPS,STAGES[,split] (default: StepBlocks())")
    a = p.parse_args()
    x = step_inputs(a)
    li = jnp.int32(a.layers // 2)

    @jax.jit
    def one(kc, vc):
        return sparse_step(x.qkv, x.norms[0], x.norms[1], x.rope, kc, vc, li, x.idx, x.count,
                           x.tail_start, x.q_pos, tail_len=a.tail,
                           num_heads=a.kv_heads * a.group, idx_layer=li, x=x.hid,
                           blocks=blocks_of(a.tile))

    kc, vc = x.kc, x.vc
    for _ in range(a.calls):
        o, kc, vc = one(kc, vc)
    jax.block_until_ready(o)
    sel = a.batch * a.kv_heads * (x.K - 8 + a.tail) * a.head_dim * 2 * 2  # K and V rows
    print(f"B {a.batch}: {x.K - 8} selected + {a.tail} tail a (sequence, KV head), "
          f"{sel / 1e6:.1f} MB of K/V rows a call")


if __name__ == "__main__":
    main()

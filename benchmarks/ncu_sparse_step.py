"""One layer's draft kernel (`sparse_step`) under Nsight Compute: the inputs of
`benchmarks.tune_sparse_step` (SmolLM2 shapes, sorted random selections), the default
tiles, a few calls so the profiled one is warm.

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

from pallas_kernels.sparse_attention import SparseBlocks, StepBlocks, rope_halves, sparse_step


def blocks_of(tile: str | None) -> StepBlocks:
    """"BK,WARPS,STAGES" (the whole-pair tile) or "BK,WARPS,STAGES,split" (every pair split
    over the default target programs with that tile); None: the default."""
    if not tile:
        return StepBlocks()
    bk, w, st, *rest = tile.split(",")
    sb = SparseBlocks(block_k=int(bk), num_warps=int(w), num_stages=int(st))
    if rest == ["split"]:
        return StepBlocks(split=sb, split_wide=sb, whole_from=10**9)
    if rest:
        raise ValueError(f"--tile BK,WARPS,STAGES[,split], got {tile!r}")
    return StepBlocks(whole=sb, whole_from=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=7680)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--sparsity", type=float, default=0.07)
    p.add_argument("--tail", type=int, default=13)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--tile", default=None, help="BK,WARPS,STAGES[,split] (default: StepBlocks())")
    a = p.parse_args()
    L, b, kh, g, d = a.layers, a.batch, a.kv_heads, a.group, a.head_dim
    s = a.context + 128
    K = int(a.sparsity * a.context) + 8
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    kc = jax.random.normal(ks[0], (L, b, kh, s, d), jnp.bfloat16)  # [L, b, k, s, d]
    vc = jax.random.normal(ks[1], (L, b, kh, s, d), jnp.bfloat16)
    qkv = jax.random.normal(ks[2], (b, 1, (kh * g + 2 * kh) * d), jnp.bfloat16)
    norms = jnp.ones((2, d), jnp.bfloat16)
    q_pos = jnp.full((b,), a.context + 3, jnp.int32)
    tail_start = q_pos - a.tail + 1
    idx = jnp.sort(jax.random.randint(ks[4], (L, b, K), 0, a.context - a.tail), axis=-1)
    count = jnp.full((L, b), K - 8, jnp.int32)
    rope = rope_halves(jnp.ones((b, 1, d), jnp.float32), jnp.zeros((b, 1, d), jnp.float32))
    hid = jax.random.normal(ks[5], (b, kh * g * d), jnp.bfloat16)

    @jax.jit
    def one(kc, vc):
        o, kc, vc = sparse_step(qkv, norms[0], norms[1], rope, kc, vc, jnp.int32(L // 2),
                                idx.astype(jnp.int32), count, tail_start, q_pos,
                                tail_len=a.tail, num_heads=kh * g,
                                idx_layer=jnp.int32(L // 2), x=hid, blocks=blocks_of(a.tile))
        return o, kc, vc

    for _ in range(a.calls):
        o, kc, vc = one(kc, vc)
    jax.block_until_ready(o)
    sel = b * kh * (K - 8 + a.tail) * d * 2 * 2  # K and V rows read, bytes
    print(f"B {b}: {K - 8} selected + {a.tail} tail a (sequence, KV head), "
          f"{sel / 1e6:.1f} MB of K/V rows a call")


if __name__ == "__main__":
    main()

"""Block sizes of the fused draft attention block (`sparse_step`) on the GPU.

    PYTHONPATH=. python -m benchmarks.tune_sparse_step [--batch 64] [--context 7680]

Times 30 chained calls (one per layer, the cache carried and written in place, as in a
draft step; the layers unrolled, as the model runs them on the GPU) for each candidate
`StepBlocks` and for the plain-XLA `sparse_step_reference`, and prints microseconds per
layer call: the kernels' own time from a profiler trace (what a draft step pays) and the
wall time. Each candidate is first checked on one call against the reference, and for 20
calls giving the same bits. The selected positions are sorted, as the selection hands
them over."""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from benchmarks.kernel_profile import kernel_times
from pallas_kernels.sparse_attention import (
    SparseBlocks, SparseIndex, StepBlocks, StepSpec, rope_halves, sparse_step,
    sparse_step_reference,
)

SPLIT = 10**9


def whole_tile(bk, w, st=3):
    return StepBlocks(whole=SparseBlocks(block_k=bk, num_warps=w, num_stages=st), whole_from=1)


def split_tile(t, bk, w=4, st=2):
    sb = SparseBlocks(block_k=bk, num_warps=w, num_stages=st, target_programs=t)
    return StepBlocks(split=sb, split_wide=sb, whole_from=SPLIT)


CANDIDATES = [
    ("default", StepBlocks()),
    ("whole bk128 w4", whole_tile(128, 4)),
    ("whole bk64 w4", whole_tile(64, 4)),
    ("whole bk64 w2", whole_tile(64, 2)),
    ("whole bk32 w2", whole_tile(32, 2)),
    ("whole bk32 w1", whole_tile(32, 1)),
    ("whole bk64 w1", whole_tile(64, 1)),
    ("split t264 bk64", split_tile(264, 64)),
    ("split t528 bk64", split_tile(528, 64)),
]

# the split path's grid and tiles at wide heads and few sequences (Qwen3-8B, B 4: 32
# (sequence, KV head) pairs over thousands of selected entries)
SPLIT_GRID = [("default", StepBlocks())] + [
    (f"split t{t} bk{bk} w{w} s{st}", split_tile(t, bk, w, st))
    for t in (528, 1056, 2112) for bk in (32, 64) for w in (4, 8) for st in (2, 3)
    if not (bk == 32 and w == 8)]

# many sequences (SmolLM2 B 64 / 128: 192 / 384 pairs of ~550 entries): the whole-pair
# default against lists cut over more programs than the default split aims at
BATCH_GRID = [("default", StepBlocks())] + [
    (f"split t{t} bk{bk} w{w} s3", split_tile(t, bk, w, 3))
    for t in (1056, 2112, 4224) for bk in (32, 64) for w in (2, 4)]
# two or three programs a pair with the whole-pair tile
FEW_GRID = [("default", StepBlocks())] + [
    (f"split t{t} bk{bk} w2 s3", split_tile(t, bk, 2, 3))
    for t in (384, 576, 768) for bk in (64, 32)]
GRIDS = {"default": CANDIDATES, "split": SPLIT_GRID, "batch": BATCH_GRID, "few": FEW_GRID,
         "one": [("default", StepBlocks())]}


def add_shape_args(p) -> None:
    """The draft step's shapes (SmolLM2 at B 64, 7.7K by default)."""
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=7680)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--sparsity", type=float, default=0.07)
    p.add_argument("--tail", type=int, default=13)
    p.add_argument("--positions", default="random",
                   help="the selected positions: 'random' (sorted, uniform), 'runsN' "
                   "(runs of N consecutive positions at random aligned starts) or "
                   "'contiguous' (one run): how much the gathers' DRAM locality matters")


@dataclasses.dataclass
class StepInputs:
    """Random bf16 inputs of `sparse_step` at `add_shape_args`' shapes: K selected sorted
    positions a layer and sequence (count = K - 8 real), the tail before the query."""
    kc: jax.Array  # [L, b, k, s, d]
    vc: jax.Array
    qkv: jax.Array  # [b, 1, (k g + 2 k) d]
    norms: jax.Array  # [2, d]
    rope: jax.Array  # [b, 2, d / 2]
    idx: jax.Array  # [L, b, K]
    count: jax.Array  # [L, b]
    tail_start: jax.Array  # [b]
    q_pos: jax.Array  # [b]
    hid: jax.Array  # [b, k g d]: the layer input whose RMS norm the kernel applies
    K: int


def selected_positions(key, kind: str, lead: tuple, K: int, end: int) -> jax.Array:
    """[*lead, K] sorted positions below `end` (`--positions`)."""
    if kind == "random":
        return jnp.sort(jax.random.randint(key, (*lead, K), 0, end), axis=-1)
    if kind == "contiguous":
        run = K
    elif kind.startswith("runs") and kind[4:].isdigit() and int(kind[4:]) > 0:
        run = int(kind[4:])
    else:
        raise ValueError(f"--positions: random, runsN or contiguous, got {kind!r}")
    n_runs = -(-K // run)
    # distinct aligned starts (the first n_runs of a random permutation of the slots)
    slots = jnp.argsort(jax.random.uniform(key, (*lead, end // run)), axis=-1)[..., :n_runs]
    starts = jnp.sort(slots, axis=-1) * run
    return (starts[..., None] + jnp.arange(run)).reshape(*lead, -1)[..., :K]


def step_inputs(a) -> StepInputs:
    L, b, kh, g, d = a.layers, a.batch, a.kv_heads, a.group, a.head_dim
    s = a.context + 128
    K = int(a.sparsity * a.context) + 8
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    q_pos = jnp.full((b,), a.context + 3, jnp.int32)
    idx = selected_positions(ks[4], a.positions, (L, b), K, a.context - a.tail)
    return StepInputs(
        kc=jax.random.normal(ks[0], (L, b, kh, s, d), jnp.bfloat16),
        vc=jax.random.normal(ks[1], (L, b, kh, s, d), jnp.bfloat16),
        qkv=jax.random.normal(ks[2], (b, 1, (kh * g + 2 * kh) * d), jnp.bfloat16),
        norms=jnp.ones((2, d), jnp.bfloat16),
        rope=rope_halves(jnp.ones((b, 1, d), jnp.float32), jnp.zeros((b, 1, d), jnp.float32)),
        idx=idx.astype(jnp.int32), count=jnp.full((L, b), K - 8, jnp.int32),
        tail_start=q_pos - a.tail + 1, q_pos=q_pos,
        # (hidden size: the query width, SmolLM2's 576 at the defaults)
        hid=jax.random.normal(ks[5], (b, kh * g * d), jnp.bfloat16), K=K)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--candidates", default="default", choices=tuple(GRIDS),
                   help="the candidate set: whole vs split tiles (default), the split "
                   "path's grid sizes, tiles, warps and stages (split), wide splits "
                   "against the whole-pair default at many sequences (batch), two or "
                   "three programs a pair (few), or the default alone (one)")
    a = p.parse_args()
    L, kh, g = a.layers, a.kv_heads, a.group
    x = step_inputs(a)
    kc, vc, qkv, norms, rope, hid, K = x.kc, x.vc, x.qkv, x.norms, x.rope, x.hid, x.K
    idx, count, tail_start, q_pos = x.idx, x.count, x.tail_start, x.q_pos

    spec = StepSpec(tail_len=a.tail, num_heads=kh * g)

    def chain(fn):
        def run(qkv, kc, vc):
            x = qkv
            for li in range(L):
                index = SparseIndex(idx, count, tail_start, q_pos, jnp.int32(li))
                o, kc, vc = fn(x, norms[0], norms[1], rope, kc, vc, jnp.int32(li), index,
                               spec=spec, x=hid)
                x = x + (o.sum() * 0).astype(x.dtype)
            return x, kc, vc
        return jax.jit(run, donate_argnums=(1, 2))

    print(f"B {a.batch}, context {a.context}, {K - 8} selected + tail {a.tail}, {L} layers")
    # one layer's call against the reference, and 20 repeats bit for bit (a race between
    # programs shows as calls that differ)
    def one_args(kc, vc):
        return (qkv, norms[0], norms[1], rope, kc, vc, jnp.int32(L - 1),
                SparseIndex(idx, count, tail_start, q_pos, jnp.int32(L - 1)))

    one_kw = dict(spec=spec, x=hid)
    ref = jax.jit(lambda *x: sparse_step_reference(*x, **one_kw)[0])(*one_args(kc, vc))
    rows = [("reference (XLA)", sparse_step_reference, None)]
    rows += [(n, sparse_step, bl)
             for n, bl in GRIDS[a.candidates]]
    for name, fn, bl in rows:
        f = fn if bl is None else (lambda *x, bl=bl, **k: sparse_step(*x, **k, blocks=bl))
        if bl is not None:
            one = jax.jit(lambda *x, f=f: f(*x, **one_kw)[0])
            outs = [one(*one_args(kc, vc)) for _ in range(20)]
            err = float(jnp.max(jnp.abs(outs[0].astype(jnp.float32) - ref.astype(jnp.float32))))
            same = all(bool(jnp.array_equal(o, outs[0])) for o in outs)
            print(f"{name:20s} check: max |err| vs reference {err:.3e}, 20 calls equal: {same}"
                  f"{'' if err < 5e-2 and same else '  FAIL'}")
        run = chain(f)
        state = [run(qkv, kc, vc)]
        jax.block_until_ready(state[0])

        def call():
            state[0] = run(qkv, *state[0][1:])
            return state[0][1]

        kern = kernel_times(call, n=3)
        sparse = sum(t for n, (_, t) in kern.items() if "sparse_step" in n)
        total = sum(t for _, t in kern.values())
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            ts.append(time.perf_counter() - t0)
        ts.sort()
        kc, vc = state[0][1:]
        print(f"{name:20s} kernel {sparse / L:6.1f} us, all kernels {total / L:6.1f} us, "
              f"wall {ts[3] / L * 1e6:6.1f} us per layer call")


if __name__ == "__main__":
    main()

"""The draft step's projections as row-matmul kernels (`pallas_kernels.rows_matmul`) against
XLA's GEMMs, on the GPU: the kernel checked against its reference, then whole draft steps
timed for each candidate tile.

    PYTHONPATH=. python -m benchmarks.tune_rows_matmul [--batches 1,64,128] [--context 7680]

Random weights of the model's full shapes and a synthetic cache (`benchmarks.kernel_profile`
does the same). Each candidate is a whole draft step (every layer, the LM head, the
sampling) timed end to end by wall clock (`vegas_jax.bench._time`), so what is compared is
what a round pays; jit caches are cleared between candidates (the tiles are read while
tracing)."""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import rows_matmul as rm
from pallas_kernels.rows_matmul import RowsBlocks, rows_matmul, rows_matmul_reference

CANDIDATES = [
    ("rows m64 n64 k64 w4 s3", RowsBlocks()),
    ("rows m64 n32 k64 w4 s3", RowsBlocks(block_n=32)),
    ("rows m64 n32 k128 w4 s3", RowsBlocks(block_n=32, block_k=128)),
    ("rows m32 n32 k64 w4 s3", RowsBlocks(block_m=32, block_n=32)),
    ("rows m64 n16 k128 w2 s3", RowsBlocks(block_n=16, block_k=128, num_warps=2)),
]


def check(dims, ms, dtype=jnp.bfloat16) -> list[str]:
    """Each projection kind of a layer of hidden size h, MLP width f, q|k|v width nq, at
    every m: relative L2 error of the kernel against the fp32 reference."""
    h, f, nq = dims
    kinds = [("norm+qkv", h, nq, True, False, False), ("wo+res", h, h, False, False, True),
             ("norm+gate_up+swiglu", h, 2 * f, True, True, False),
             ("down+res", f, h, False, False, True)]
    lines = []
    for m in ms:
        for name, k, n, norm, swiglu, res in kinds:
            kx, kw, kr = jax.random.split(jax.random.PRNGKey(m + n), 3)
            x = jax.random.normal(kx, (m, k), dtype)
            w = (jax.random.normal(kw, (k, n)) * k**-0.5).astype(dtype)
            out_n = n // 2 if swiglu else n
            r = jax.random.normal(kr, (m, out_n), dtype) if res else None
            got = rows_matmul(x, w, r, norm=norm, swiglu=swiglu).astype(jnp.float32)
            f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
            ref = rows_matmul_reference(f32(x), f32(w), f32(r), norm=norm, swiglu=swiglu)
            err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            ok = "ok" if err < (2e-2 if dtype == jnp.bfloat16 else 1e-5) else "FAIL"
            lines.append(f"check h {h} m {m:4d} {name:20s} rel err {err:.2e} {ok}")
    return lines


def draft_times(model_name, batch, context, gamma, candidates, reps) -> list[tuple]:
    from benchmarks.kernel_profile import wall_ms
    from vegas_jax.bench import Phases, profile_cache
    from vegas_jax.execution import ExecConfig
    from vegas_jax.loading import load_model
    from vegas_jax.sampling import SamplingParams
    from vegas_jax.speculative import SpecConfig

    model = load_model(model_name, random_init=True, exec_config=ExecConfig())
    cache = profile_cache(model.config, batch, context, gamma, jnp.bfloat16)
    spec = SpecConfig(method="vegas", gamma=gamma)
    out = []
    for label, blocks in candidates:
        jax.clear_caches()
        rm.ROWS_BLOCKS = blocks or RowsBlocks()
        xc = dataclasses.replace(model.exec_config, draft_mm="xla" if blocks is None else "pallas")
        ph = Phases(model, cache, spec, SamplingParams(), xc)
        us = wall_ms(ph.draft, reps) / gamma * 1e3
        cache = ph.state.cache
        out.append((model_name, batch, label, us))
        print(f"{model_name} B {batch:4d} {label:26s} draft step {us:8.1f} us", flush=True)
    rm.ROWS_BLOCKS = RowsBlocks()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,64,128")
    p.add_argument("--context", type=int, default=7680)
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--big", default="qwen3-8b:4:32768",
                   help="model:batch:context also timed with the default and first "
                   "candidate only ('' to skip)")
    a = p.parse_args(argv)
    lines = check((576, 1536, 960), (1, 64, 128))
    lines += check((576, 1536, 960), (64,), jnp.float32)
    lines += check((4096, 12288, 6144), (4,))
    print("\n".join(lines), flush=True)
    rows = []
    cands = [("xla (cuBLAS)", None)] + CANDIDATES
    for b in [int(x) for x in a.batches.split(",") if x]:
        rows += draft_times("smollm2-135m", b, a.context, a.gamma, cands, a.reps)
    if a.big:
        name, b, ctx = a.big.split(":")
        rows += draft_times(name, int(b), int(ctx), a.gamma, cands[:2], a.reps)
    print("\n| model | B | draft step | us | vs xla |\n|---|---|---|---|---|")
    base = {}
    for model, b, label, us in rows:
        base.setdefault((model, b), us)
        print(f"| {model} | {b} | {label} | {us:.1f} | {us / base[(model, b)]:.3f} |")
    print("checks failed:", sum("FAIL" in x for x in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a decode step and a speculative round spend device time, kernel by kernel (GPU).

    PYTHONPATH=. python -m benchmarks.kernel_profile --model smollm2-135m --batch 64 --context 7680

Random weights of the model's full shapes and a synthetic cache (`vegas_jax.bench`), a
`jax.profiler` trace of a few calls of each phase (vanilla decode step, the draft phase,
the verify with capture, the whole round), and device kernel times summed by kernel name
and by kind (matmul, attention, copy, scatter, other) from the trace's GPU stream lines.
`--hlo DIR` also writes the optimised HLO of each phase, to map fusion names back to ops.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import tempfile
import time

# XLA's pool is 75 % of the card by default: Qwen3-30B-A3B at B 16, 32K (57 GB of weights
# + 48 GB of cache) ran out of it on the H200 (BENCHMARKS.md 2026-12-03 b). A profile has
# the card to itself; set before jax starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

KINDS = (
    ("attention", re.compile(r"vegas_|attention")),
    ("matmul", re.compile(r"nvjet|gemm|cutlass|sm90_xmma|cublas|triton_gemm|dot")),
    ("copy", re.compile(r"memcpy|copy")),
    ("scatter", re.compile(r"scatter|dynamic_update_slice")),
)


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if pat.search(name):
            return kind
    return "other"


def kernel_times(fn, n: int = 2) -> dict[str, list]:
    """{kernel name: [launches per call, microseconds per call of fn]} over n traced calls."""
    trace_dir = tempfile.mkdtemp()
    jax.block_until_ready(fn())
    with jax.profiler.trace(trace_dir):
        for _ in range(n):
            jax.block_until_ready(fn())
    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    agg: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0])
    for plane in ProfileData.from_file(path).planes:
        if "GPU" not in plane.name:
            continue
        for line in plane.lines:
            if "Stream" not in line.name:
                continue
            for ev in line.events:
                agg[ev.name][0] += 1 / n
                agg[ev.name][1] += ev.duration_ns / 1e3 / n
    return dict(agg)


def wall_ms(fn, reps: int = 5) -> float:
    from vegas_jax.bench import _time

    return _time(fn, reps) * 1e3


def report(agg: dict[str, list], label: str, per: int = 1, top: int = 20, wall=None) -> dict:
    total = sum(v[1] for v in agg.values()) / per
    launches = sum(v[0] for v in agg.values()) / per
    kinds: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (count, us) in agg.items():
        kinds[kind_of(name)][0] += count / per
        kinds[kind_of(name)][1] += us / per
    extra = f", wall {wall:.3f} ms" if wall is not None else ""
    print(f"{label}: {total:.1f} us of kernels in {launches:.0f} launches{extra}")
    print(f"{label} by kind: " + ", ".join(
        f"{k} {us:.1f} us / {c:.0f}" for k, (c, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1])))
    for name, (count, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{label} {us / per:9.1f} us  x{count / per:7.1f}  {name[:100]}")
    return {"kernel_us": total, "launches": launches, "wall_ms": wall,
            "kinds": {k: {"launches": c, "us": us} for k, (c, us) in kinds.items()}}


def build_parser():
    from vegas_jax.execution import add_exec_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b", help="registered model name")
    p.add_argument("--batch", type=int, default=1, help="sequences")
    p.add_argument("--context", type=int, default=32768, help="cached tokens per sequence")
    p.add_argument("--method", default="vegas", help="speculative method of the round")
    p.add_argument("--gamma", type=int, default=6, help="draft tokens per round")
    p.add_argument("--sparsity", type=float, default=0.07, help="draft budget fraction")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    add_exec_args(p)
    p.add_argument("--phases", default="decode,draft,verify,round",
                   help="comma-separated subset of decode,draft,verify,verify0,round")
    p.add_argument("--step-whole-from", type=int, default=None, metavar="N",
                   help="fused draft kernel: one program per (sequence, KV head) from N "
                   "pairs on (default: the library's StepBlocks)")
    p.add_argument("--top", type=int, default=25, help="kernels listed per phase")
    p.add_argument("--label", default="", help="prefix of every printed line")
    p.add_argument("--hlo", default=None, metavar="DIR", help="write the optimised HLO here")
    p.add_argument("--json", default=None, metavar="FILE", help="write the summaries here")
    p.add_argument("--memory", action="store_true",
                   help="print XLA's memory plan of each phase (arguments, outputs, aliased, "
                        "temporaries) before running any; with --memory-only, run none")
    p.add_argument("--memory-only", action="store_true", help="the memory plans alone")
    p.add_argument("--split-wide", default=None, metavar="SPECS",
                   help="time the draft step once per `sparse_step` split tile at head dims "
                   "above 64, each 'block_k,warps,stages,target_programs', ';' between "
                   "them (after the phases; the jit caches are cleared between them)")
    p.add_argument("--gmm-tiles", default=None, metavar="SPECS",
                   help="time the decode and draft steps once per few-rows expert-kernel "
                   "tile (MoE models), each 'block_k,block_n,warps,stages,loop' (loop 0/1)")
    p.add_argument("--whole-tiles", default=None, metavar="SPECS",
                   help="time the draft step and the round once per whole-pair "
                   "`sparse_step` tile, each 'block_k,warps,stages,merge_tail,write_last' "
                   "(0/1), ';' between them")
    p.add_argument("--verify-blocks", default=None, metavar="SPECS",
                   help="time the verify (with capture), the decode step and the round once per "
                   "verify-kernel tile, each 'block_k,warps,stages', ';' between them")
    return p


def memory_line(what: str, tree=None) -> str:
    """Device memory in use and its peak so far (where the backend reports them), and the
    bytes of `tree`'s arrays: where a large model's memory went."""
    stats = jax.devices()[0].memory_stats() or {}
    gib = 2**30
    line = (f"memory after {what}: {stats.get('bytes_in_use', 0) / gib:.1f} GiB in use, "
            f"peak {stats.get('peak_bytes_in_use', 0) / gib:.1f} GiB of "
            f"{stats.get('bytes_limit', 0) / gib:.1f}")
    if tree is not None:
        line += f"; these arrays {sum(a.nbytes for a in jax.tree.leaves(tree)) / gib:.1f} GiB"
    return line


def main(argv=None) -> int:
    from vegas_jax.bench import Phases, profile_cache
    from vegas_jax.execution import exec_from_args
    from vegas_jax.loading import load_model
    from vegas_jax.sampling import SamplingParams
    from vegas_jax.speculative import SpecConfig

    args = build_parser().parse_args(argv)
    if args.step_whole_from is not None:
        import dataclasses

        from pallas_kernels import sparse_attention as sa
        sa.STEP_BLOCKS = dataclasses.replace(sa.STEP_BLOCKS, whole_from=args.step_whole_from)
    phases = args.phases.split(",")
    tag = f"{args.label} " if args.label else ""
    model = load_model(args.model, random_init=True, exec_config=exec_from_args(args))
    xc = model.exec_config
    print(f"{tag}{memory_line('loading the weights', model.params)}")
    cache = profile_cache(model.config, args.batch, args.context, args.gamma, jnp.bfloat16)
    print(f"{tag}{memory_line('making the cache', cache)}")
    sp = SamplingParams(args.temperature, args.top_k, args.top_p)
    spec = SpecConfig(method=args.method, gamma=args.gamma, sparsity=args.sparsity)
    ph = Phases(model, cache, spec, sp, xc)
    print(f"{tag}{memory_line('setting up the phases')}")
    out = {"args": vars(args), "device": jax.devices()[0].device_kind, "exec": str(xc)}
    print(f"{tag}{xc}")

    if args.memory or args.memory_only:
        gib = 2**30
        plans = ph.memory(phases)
        for name, m in plans.items():
            print(f"{tag}{name} memory plan: " + ", ".join(
                f"{k} {v / gib:.2f} GiB" for k, v in m.items()) +
                f"; cache K {cache.k.nbytes / gib:.2f} GiB")
        out["memory"] = plans
        if args.memory_only:
            phases = []
    runs = {
        "decode": (ph.vanilla, 8, "decode step"),
        "draft": (ph.draft, args.gamma, "draft step"),
        "verify": (lambda: ph.verify(True), 1, "verify+capture"),
        "verify0": (lambda: ph.verify(False), 1, "verify, no capture"),
        "round": (ph.round, 1, "round"),
    }
    for name in phases:
        fn, per, label = runs[name]
        t = time.perf_counter()
        jax.block_until_ready(fn())  # compiles
        print(f"{tag}{label}: first call (compile) {time.perf_counter() - t:.1f} s; "
              f"{memory_line('it')}")
        out[name] = report(kernel_times(fn), tag + label, per=per, top=args.top,
                           wall=wall_ms(fn) / per)
    if args.split_wide or args.verify_blocks or args.gmm_tiles or args.whole_tiles:
        import dataclasses

        from pallas_kernels import grouped_matmul as gm
        from pallas_kernels import sparse_attention as sa
        from pallas_kernels import verify_attention as va

        def split_wide(bk, w, st, t):
            sa.STEP_BLOCKS = dataclasses.replace(sa.STEP_BLOCKS, split_wide=sa.SparseBlocks(
                block_k=bk, num_warps=w, num_stages=st, target_programs=t))

        def whole_tile(bk, w, st, merge, late):
            sa.STEP_BLOCKS = dataclasses.replace(sa.STEP_BLOCKS, whole=sa.SparseBlocks(
                block_k=bk, num_warps=w, num_stages=st, merge_tail=bool(merge),
                write_last=bool(late)))

        def verify_blocks(bk, w, st):
            va.VERIFY_BLOCKS = dataclasses.replace(va.VERIFY_BLOCKS, block_k=bk, num_warps=w,
                                                   num_stages=st)

        def gmm_tile(bk, bn, w, st, loop):
            gm.GMM_TILE = dataclasses.replace(gm.GMM_TILE, block_k=bk, block_n=bn, num_warps=w,
                                              num_stages=st, loop=bool(loop))

        sweeps = [(args.split_wide, "split_wide", split_wide,
                   [("draft step", ph.draft, args.gamma)]),
                  (args.verify_blocks, "verify blocks", verify_blocks,
                   [("verify+capture", lambda: ph.verify(True), 1),
                    ("decode step", ph.vanilla, 8), ("round", ph.round, 1)]),
                  (args.gmm_tiles, "gmm tile", gmm_tile,
                   [("decode step", ph.vanilla, 8), ("draft step", ph.draft, args.gamma)]),
                  (args.whole_tiles, "whole tile", whole_tile,
                   [("draft step", ph.draft, args.gamma), ("round", ph.round, 1)])]
        for specs, what, apply, timed in sweeps:
            for spec in (specs.split(";") if specs else []):
                apply(*(int(v) for v in spec.split(",")))
                jax.clear_caches()  # the tiles are read when the kernels are traced
                for name, fn, per in timed:
                    jax.block_until_ready(fn())
                    out[f"{name}, {what} {spec}"] = report(
                        kernel_times(fn), f"{tag}{name}, {what} {spec}", per=per, top=3,
                        wall=wall_ms(fn) / per)
    if args.hlo:
        os.makedirs(args.hlo, exist_ok=True)
        for name, text in ph.hlo_texts(phases).items():
            with open(f"{args.hlo}/{name}.hlo.txt", "w") as f:
                f.write(text)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

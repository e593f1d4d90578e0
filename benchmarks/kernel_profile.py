"""Where a decode step and a speculative round spend device time, kernel by kernel (GPU).

    PYTHONPATH=. python -m benchmarks.kernel_profile --model smollm2-135m --batch 64 \\
        --context 7680 [--method vegas] [--phases decode,draft,verify,round] [--json out.json]

Random weights of the model's full shapes (or a --checkpoint's) and a synthetic cache
(`vegas_jax.bench`), a `jax.profiler` trace of a few calls of each phase (plain decode
steps, the draft phase, the verify with or without capture, the whole round), and device
kernel times summed by kernel name and by kind (matmul, attention, copy, scatter, other)
from the trace's GPU stream lines, beside each phase's wall time. The model runs as the
product does (`--backend`, `--tp`, `--exact`; the kernels' default launch shapes).
`--method` takes the library's names and the study's plug-ins (`benchmarks.methods`).
`--hlo DIR` also writes the optimised HLO of each phase, to map fusion names back to ops;
`--memory` prints XLA's memory plan of each phase.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import tempfile
import time

# XLA's pool is 75 % of the card by default; a profile has the card to itself, and a large
# model's weights and cache need more of it. Set before jax starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

import jax  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

PHASES = ("decode", "draft", "verify", "verify0", "round")
KINDS = (  # first match wins: the row-invariant matmul is a vegas_ kernel too
    ("matmul", re.compile(r"vegas_matmul|nvjet|gemm|cutlass|sm90_xmma|cublas|triton_gemm|dot")),
    ("attention", re.compile(r"vegas_|attention")),
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
    from vegas_jax.cli import add_model_args, add_sampling_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--batch", type=int, default=1, help="sequences")
    p.add_argument("--context", type=int, default=32768, help="cached tokens per sequence")
    p.add_argument("--method", default="vegas", help="speculative method of the round")
    p.add_argument("--gamma", type=int, default=6, help="draft tokens per round")
    p.add_argument("--sparsity", type=float, default=0.07, help="draft budget fraction")
    p.add_argument("--phases", default="decode,draft,verify,round",
                   help="comma-separated subset of " + ",".join(PHASES))
    p.add_argument("--top", type=int, default=25, help="kernels listed per phase")
    p.add_argument("--label", default="", help="prefix of every printed line")
    p.add_argument("--hlo", default=None, metavar="DIR", help="write the optimised HLO here")
    p.add_argument("--json", default=None, metavar="FILE", help="write the summaries here")
    p.add_argument("--memory", action="store_true",
                   help="print XLA's memory plan of each phase (arguments, outputs, aliased, "
                        "temporaries) before running any; with --memory-only, run none")
    p.add_argument("--memory-only", action="store_true", help="the memory plans alone")
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
    from benchmarks.methods import method_of
    from vegas_jax.bench import Phases, profile_cache
    from vegas_jax.cli import load_from_args, sampling_from_args
    from vegas_jax.params import param_dtype
    from vegas_jax.speculative import SpecConfig

    args = build_parser().parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    for name in phases:
        if name not in PHASES:
            raise SystemExit(f"unknown phase {name!r}; choose from {', '.join(PHASES)}")
    try:
        method = method_of(args.method)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    tag = f"{args.label} " if args.label else ""
    model = load_from_args(args, random_init=args.checkpoint is None)
    xc = model.exec_config
    print(f"{tag}{memory_line('loading the weights', model.params)}")
    cache = profile_cache(model.config, args.batch, args.context, args.gamma,
                          param_dtype(model.params))
    print(f"{tag}{memory_line('making the cache', cache)}")
    sp = sampling_from_args(args)
    spec = SpecConfig(method=method, gamma=args.gamma, sparsity=args.sparsity)
    ph = Phases(model, cache, spec, sp, xc)
    print(f"{tag}{memory_line('setting up the phases')}")
    out = {"args": vars(args), "device": jax.devices()[0].device_kind, "exec": str(xc)}
    print(f"{tag}{xc}")

    if args.memory or args.memory_only:
        gib = 2**30
        plans = ph.memory([p for p in phases if p != "verify0"])
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
    if args.hlo:
        os.makedirs(args.hlo, exist_ok=True)
        for name, text in ph.hlo_texts([p for p in phases if p != "verify0"]).items():
            with open(f"{args.hlo}/{name}.hlo.txt", "w") as f:
                f.write(text)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

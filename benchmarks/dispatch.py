"""Host dispatch against device time of a round, per execution variant (GPU).

    PYTHONPATH=. python -m benchmarks.dispatch --model smollm2-135m --batch 64 --context 7680

JAX dispatches asynchronously, but handing a call to the runtime is itself host work: XLA
walks the executable's thunks on the calling thread, and a `while` loop's body (the layer
loop, the draft scan) is walked once per iteration. When that walk takes longer than the
device takes to run the call, the device waits for the host. For each variant (layer
layout + XLA flags, each in its own process: XLA reads its flags once) and each call (a
greedy round, a sampled round, 8 vanilla decode steps), this times `--calls` calls issued
back to back: `dispatch` = host time to issue them, `wall` = time until all are done,
both per call. dispatch close to wall means the call is host bound.
Random weights of the model's shapes and a synthetic cache (`vegas_jax.bench`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = {
    "scan": ("scan", ""),
    "scan+while": ("scan", "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"),
    "unrolled": ("unrolled", ""),
    "unrolled+while": ("unrolled", "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"),
    "unrolled+while+unroll": ("unrolled", "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL "
                              "--xla_gpu_command_buffer_unroll_loops=true"),
    # compile-time probes (the unrolled round compiled in ~30 s on the H200)
    "unrolled-nolhs": ("unrolled", "--xla_gpu_enable_latency_hiding_scheduler=false"),
    "unrolled-autotune0": ("unrolled", "--xla_gpu_autotune_level=0"),
}


def timed_calls(fn, calls: int) -> dict:
    import jax

    t = time.perf_counter()
    jax.block_until_ready(fn())  # compiles
    compile_s = time.perf_counter() - t
    for _ in range(2):
        jax.block_until_ready(fn())
    t0 = time.perf_counter()
    outs = [fn() for _ in range(calls)]
    t1 = time.perf_counter()
    jax.block_until_ready(outs)
    t2 = time.perf_counter()
    return {"compile_s": compile_s, "dispatch_ms": (t1 - t0) / calls * 1e3,
            "wall_ms": (t2 - t0) / calls * 1e3}


def compile_profile(fn, top: int = 40) -> list:
    """Host time of `fn()`'s first call (tracing, lowering, XLA's compile) by traced event
    name (XLA's compiler passes are TraceMe events): [(name, ms, count)], largest first.
    Events nest, so the times overlap."""
    import collections
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData

    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        jax.block_until_ready(fn())
    agg = collections.defaultdict(lambda: [0.0, 0])
    for plane in ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]).planes:
        if "GPU" in plane.name:
            continue
        for line in plane.lines:
            for ev in line.events:
                if ev.name.startswith("$"):  # Python frames: the compiler's own events stay
                    continue
                agg[ev.name][0] += ev.duration_ns / 1e6
                agg[ev.name][1] += 1
    return sorted(((k, v[0], v[1]) for k, v in agg.items()), key=lambda r: -r[1])[:top]


def child(args) -> dict:
    import jax
    import jax.numpy as jnp

    from vegas_jax.bench import Phases, profile_cache
    from vegas_jax.execution import ExecConfig
    from vegas_jax.loading import load_model
    from vegas_jax.sampling import SamplingParams
    from vegas_jax.speculative import SpecConfig

    layers, flags = VARIANTS[args.variant]
    model = load_model(args.model, random_init=True, exec_config=ExecConfig(layers=layers))
    cache = profile_cache(model.config, args.batch, args.context, args.gamma, jnp.bfloat16)
    spec = SpecConfig(method=args.method, gamma=args.gamma)
    out = {"variant": args.variant, "layers": layers, "xla_flags": flags,
           "device": jax.devices()[0].device_kind}
    modes = {"greedy": SamplingParams(), "sampled": SamplingParams(0.6, 20, 0.95)}
    modes = {m: modes[m] for m in args.modes.split(",")}
    for mode, sp in modes.items():
        ph = Phases(model, cache, spec, sp, model.exec_config)
        if args.compile_profile and mode == "greedy":
            out["compile_profile"] = compile_profile(ph.round)
        out[f"round_{mode}"] = timed_calls(ph.round, args.calls)
        if mode == "greedy":
            out["vanilla8"] = timed_calls(ph.vanilla, args.calls)
        cache = ph.state.cache.replace(lengths=ph.n)
        del ph
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=7680)
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--method", default="vegas")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--modes", default="greedy,sampled", help="rounds timed (and vanilla)")
    p.add_argument("--compile-profile", action="store_true",
                   help="also list the host events of the greedy round's compile")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # the child's
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    if args.variant:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    rows = []
    for v in args.variants.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + VARIANTS[v][1]).strip()
        cmd = [sys.executable, "-m", "benchmarks.dispatch", "--variant", v,
               *[f"--{k}={getattr(args, k)}" for k in ("model", "batch", "context", "gamma",
                                                        "method", "calls", "modes")],
               *(["--compile-profile"] if args.compile_profile else [])]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        got = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if not got:
            print(f"{v}: failed\n{r.stderr[-3000:]}", flush=True)
            continue
        row = json.loads(got[0][7:])
        rows.append(row)
        for name, ms, count in row.get("compile_profile", []):
            print(f"{v:24s} compile {ms:9.1f} ms x{count:<6d} {name[:90]}", flush=True)
        for k in ("round_greedy", "round_sampled", "vanilla8"):
            if k not in row:
                continue
            c = row[k]
            print(f"{v:24s} {k:14s} dispatch {c['dispatch_ms']:7.2f} ms  wall "
                  f"{c['wall_ms']:7.2f} ms  compile {c['compile_s']:6.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

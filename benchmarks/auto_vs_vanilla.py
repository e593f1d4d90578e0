"""Wall time of `python -m vegas_jax.decode` with `--method auto` against `--method
vanilla`, from a warm and from a cold compilation cache (issue 57: auto must not cost
plain decoding more than 5 % warm, 25 % cold, where speculation does not pay).

    python benchmarks/auto_vs_vanilla.py                      # SmolLM2 on this machine
    python benchmarks/auto_vs_vanilla.py --reps 5 --max-new-tokens 2000
    python benchmarks/auto_vs_vanilla.py -- --checkpoint /tmp/smol.gguf --backend pallas

Runs alternate (vanilla, auto, vanilla, auto, ...) so that a machine's load drifts over
both alike. Warm: one untimed run of each method fills a cache shared by the timed runs;
cold: each run gets an empty `$VEGAS_JAX_COMPILE_CACHE` of its own. Reported per
(cache, method): the median and each run's command wall time, decode seconds and auto's
calls, the command's CPU seconds (user + system: less moved by other processes than the
wall time), and auto's medians over vanilla's. `--code DIR` runs another checkout's
vanilla and auto (the code before a change). Arguments after `--` go to the command as
they are; `$OUT` set: the rows are also written to `$OUT/auto_vs_vanilla.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(method, cli_args, cache_dir, code=ROOT, timeout=1800) -> dict:
    env = {**os.environ, "VEGAS_JAX_COMPILE_CACHE": str(cache_dir),
           "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]),
           "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    cmd = [sys.executable, "-m", "vegas_jax.decode", "--json", "--method", method, *cli_args]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # run from `code`: `python -m` puts the working directory first on the path
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=code)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    st = json.loads(p.stdout)["stats"]
    auto = st.get("auto") or {}
    return {"wall_s": wall, "cpu_s": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
            "decode_s": st["decode_s"], "prefill_s": st["prefill_s"],
            "tokens": st["decode_tokens"], "first_call_s": st["first_call_s"],
            "calls": auto.get("calls"), "round_bound": auto.get("round_bound"),
            "rounds_allowed": auto.get("rounds_allowed")}


def median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="timed runs per method and cache")
    p.add_argument("--max-new-tokens", type=int, default=300)
    p.add_argument("--prompt", default="Explain how a B-tree works.")
    p.add_argument("--caches", default="warm,cold", help="warm, cold or both")
    p.add_argument("--code", default=str(ROOT),
                   help="the checkout whose vegas_jax runs (an older one: the baseline)")
    a = p.parse_args(argv)
    cli = ["--max-new-tokens", str(a.max_new_tokens), "--prompt", a.prompt, *extra]
    rows = []
    for cache in a.caches.split(","):
        shared = Path(tempfile.mkdtemp(prefix="auto-vs-vanilla-"))
        if cache == "warm":
            for m in ("vanilla", "auto"):
                run_once(m, cli, shared, a.code)
        runs = {"vanilla": [], "auto": []}
        for _ in range(a.reps):
            for m in runs:
                d = shared if cache == "warm" else Path(tempfile.mkdtemp(prefix="auto-cold-"))
                runs[m].append(run_once(m, cli, d, a.code))
                print(f"{cache} {m}: {runs[m][-1]['wall_s']:.2f} s", file=sys.stderr, flush=True)
        for m, rs in runs.items():
            rows.append({"cache": cache, "method": m,
                         "wall_s": median([r["wall_s"] for r in rs]),
                         "cpu_s": median([r["cpu_s"] for r in rs]),
                         "decode_s": median([r["decode_s"] for r in rs]), "runs": rs})
    print("| cache | method | wall s (median) | CPU s (median) | decode s (median) | runs "
          "(wall s) | auto / vanilla (wall, CPU) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["cache"] == r["cache"] and b["method"] == "vanilla")
        print(f"| {r['cache']} | {r['method']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | "
              f"{r['decode_s']:.2f} | " + ", ".join(f"{x['wall_s']:.1f}" for x in r["runs"])
              + f" | {r['wall_s'] / base['wall_s']:.3f}, {r['cpu_s'] / base['cpu_s']:.3f} |")
    auto = [x for r in rows if r["method"] == "auto" for x in r["runs"]]
    print("auto's calls:", [x["calls"] for x in auto][:3], "round bound:", auto[0]["round_bound"])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "auto_vs_vanilla.json"), "w") as f:
            json.dump({"args": vars(a), "extra": extra, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

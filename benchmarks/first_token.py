"""Seconds from the command to its first streamed token, with a cold compilation cache.

    python benchmarks/first_token.py                      # methods auto and vegas, SmolLM2
    python benchmarks/first_token.py --prompt "Hi" --max-new-tokens 64 --methods auto --warm
    python3 benchmarks/first_token.py --log-compiles -- --checkpoint /tmp/smol.gguf

Each run starts `python -m vegas_jax.decode` in a subprocess with an empty
`$VEGAS_JAX_COMPILE_CACHE` of its own (`--warm` runs it again on that cache) and stamps
every chunk of its stdout and stderr as it arrives. Reported per run: `first_token_s` (the
first streamed text: the prefill's token), `first_call_s` (the first text after it: the
first decoding call's tokens), `end_s` (the process's exit), and the command's own
breakdown from its stderr (`load_s`, `prefill_s`, `first_call_compile_s`; for auto what
became of its other candidates, `auto_build`, and their compile seconds,
`auto_compile_s`). Arguments after `--` go to the command as they are (`--checkpoint`,
`--backend`, ...); `--json FILE` keeps the rows.

`--log-compiles` also runs the command with `JAX_LOG_COMPILES=1` and reports, for each
phase (load: up to the command's "loaded" line; prefill: up to the first token; first
call: up to the next text), how many functions were traced, lowered and compiled and in
how many seconds, with the slowest compiles by name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# jax's own log lines with JAX_LOG_COMPILES=1: tracing, lowering to MLIR, XLA's compile
STAGES = {"trace": r"Finished tracing (\S+) for jit in ([0-9.]+) sec",
          "lower": r"Finished jaxpr to MLIR module conversion (\S+) in ([0-9.]+) sec",
          "compile": r"Finished XLA compilation of (\S+) in ([0-9.]+) sec"}


def _pump(pipe, chunks, name, t0):
    while True:
        b = pipe.read1(65536) if hasattr(pipe, "read1") else pipe.read(1)
        if not b:
            return
        chunks.append((time.perf_counter() - t0, name, b.decode(errors="replace")))


def _num(pattern, text):
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def run_once(cli_args, cache_dir, log_compiles=False, timeout=900):
    """One command in a subprocess; returns its timings and breakdown."""
    env = {**os.environ, "VEGAS_JAX_COMPILE_CACHE": str(cache_dir), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    if log_compiles:
        env["JAX_LOG_COMPILES"] = "1"
    cmd = [sys.executable, "-m", "vegas_jax.decode", *cli_args]
    chunks: list = []
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pumps = [threading.Thread(target=_pump, args=(p.stdout, chunks, "out", t0)),
             threading.Thread(target=_pump, args=(p.stderr, chunks, "err", t0))]
    for th in pumps:
        th.start()
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
    for th in pumps:
        th.join()
    end = time.perf_counter() - t0
    out_chunks = [(t, s) for t, n, s in chunks if n == "out" and s.strip()]
    err = "".join(s for _, n, s in chunks if n == "err")
    out = "".join(s for _, n, s in chunks if n == "out")
    loaded_at = next((t for t, n, s in chunks if n == "err" and "] loaded " in s), None)
    return {
        "rc": rc,
        "first_token_s": out_chunks[0][0] if out_chunks else None,
        "first_call_s": out_chunks[1][0] if len(out_chunks) > 1 else None,
        "end_s": end,
        "loaded_line_s": loaded_at,  # when the command printed its load line
        "load_s": _num(r"\] loaded .*? in ([0-9.]+)s", err),
        "prefill_s": _num(r"prefill ([0-9.]+)s", err),
        "first_call_compile_s": _num(r"the first call, compiling, took ([0-9.]+)s", err),
        "auto_compile_s": _num(r"compiled in ([0-9.]+)s", err),
        # auto's other candidates: "not built, ...", "still compiling ...", "compiled ..."
        "auto_build": (re.search(r"the other candidates ([^)]*)\)", err) or [None, None])[1],
        "tokens_per_s": _num(r"([0-9.]+) tok/s after it", err),
        "stderr_tail": [ln for ln in err.splitlines() if "[vegas_jax]" in ln or "rror" in ln][-6:],
        "text": out.strip()[:200],
        **({"compiles": compiles_by_phase(chunks, loaded_at, out_chunks)} if log_compiles else {}),
    }


def compiles_by_phase(chunks, loaded_at, out_chunks) -> dict:
    """jax's compile log lines (stderr chunks stamped on arrival) summed per phase."""
    ends = {"load": loaded_at, "prefill": out_chunks[0][0] if out_chunks else None,
            "first_call": out_chunks[1][0] if len(out_chunks) > 1 else None}
    phases = {ph: {st: [0, 0.0] for st in STAGES} | {"slowest": []} for ph in (*ends, "later")}
    for t, name, text in chunks:
        if name != "err":
            continue
        ph = next((p for p, end in ends.items() if end is not None and t <= end), "later")
        for line in text.splitlines():
            for st, pat in STAGES.items():
                m = re.search(pat, line)
                if m:
                    phases[ph][st][0] += 1
                    phases[ph][st][1] += float(m.group(2))
                    if st == "compile":
                        phases[ph]["slowest"].append((float(m.group(2)), m.group(1)))
    for ph in phases.values():
        ph["slowest"] = [[n, round(s, 3)] for s, n in sorted(ph["slowest"], reverse=True)[:5]]
    return phases


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default=None, help="prompt text (default: the CLI's own)")
    p.add_argument("--methods", default="auto,vegas")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warm", action="store_true",
                   help="also run each method again on its now filled cache")
    p.add_argument("--log-compiles", action="store_true",
                   help="count and time jax's traces, lowerings and compiles per phase")
    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args(argv)

    rows = []
    for method in args.methods.split(","):
        cli = ["--method", method, "--max-new-tokens", str(args.max_new_tokens), *extra]
        if args.prompt is not None:
            cli = ["--prompt", args.prompt, *cli]
        with tempfile.TemporaryDirectory(prefix="vegas-first-token-") as cache:
            for cold in (True, False) if args.warm else (True,):
                r = run_once(cli, cache, args.log_compiles)
                r.update(method=method, cache="cold" if cold else "warm")
                rows.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "text"}), flush=True)
    print(f"\n{'method':8} {'cache':5} {'first token':>11} {'first call':>10} {'end':>7} "
          f"{'load':>6} {'prefill':>7} {'1st call':>8} {'tok/s':>7}  auto's other candidates")
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        print(f"{r['method']:8} {r['cache']:5} {f(r['first_token_s']):>11} "
              f"{f(r['first_call_s']):>10} {f(r['end_s']):>7} {f(r['load_s']):>6} "
              f"{f(r['prefill_s']):>7} {f(r['first_call_compile_s']):>8} "
              f"{f(r['tokens_per_s']):>7}  "
              + (r["auto_build"] or (f"compiled in {r['auto_compile_s']:.2f}s" if
                                     r["auto_compile_s"] is not None else "-"))
              + ("" if r["rc"] == 0 else f"  (exit {r['rc']})"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

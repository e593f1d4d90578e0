"""Greedy speculative output against vanilla, token for token, on real weights: per dtype
and method, how many sequences equal vanilla and where the first difference falls; and
vanilla against itself at another batch size, so that bf16 divergence reads in context (a
different batch shape alone changes bf16 rounding).

    PYTHONPATH=. python -m benchmarks.equality --checkpoint smol.gguf \\
        --prompts-json prompts.json [--dtypes float32,bfloat16] [--exact both] [--json out.json]

Prompts are token ids ({"prompts": [[ids], ...]}), each cut to its last --context tokens
and cut again per sequence to a different length, so the batch is ragged. `--exact`:
`ExecConfig(exact=True)`, the verify row by row as plain decode steps, whose greedy output
should equal vanilla's in every dtype. Methods: the library's and the study's plug-ins
(`benchmarks.methods`), by name."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax.numpy as jnp

METHODS = ("vegas", "vegas-paper", "last", "stream", "quest", "auto")


def first_difference(a, b):
    """Index of the first differing token (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(ref, got):
    diffs = [first_difference(r, g) for r, g in zip(ref, got)]
    parted = [d for d in diffs if d is not None]
    return {"equal": len(diffs) - len(parted), "total": len(diffs),
            "first_difference": min(parted) if parted else None,
            "differences": diffs}


def main(argv=None) -> int:
    from benchmarks.methods import method_of
    from vegas_jax import SpecConfig, generate, speculative_generate
    from vegas_jax.execution import BACKENDS, ExecConfig
    from vegas_jax.loading import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="GGUF / HF directory / orbax")
    p.add_argument("--prompts-json", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048, help="longest prompt, tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--sparsity", type=float, default=0.07)
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--exact", default="no", choices=("no", "yes", "both"),
                   help="ExecConfig(exact=...): the verify row by row as decode steps; "
                   "'both' runs every method each way")
    p.add_argument("--json", default=None, metavar="FILE")
    a = p.parse_args(argv)
    methods = {m: method_of(m) for m in a.methods.split(",") if m}
    with open(a.prompts_json) as f:
        ids = json.load(f)["prompts"]
    # ragged: sequence i keeps a different share of the context
    prompts = [ids[i % len(ids)][-a.context:] for i in range(a.batch)]
    prompts = [q[: max(64, len(q) * (a.batch + i) // (2 * a.batch))] for i, q in
               enumerate(prompts)]
    rows = []
    print(f"batch {a.batch}, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{a.new_tokens} new, gamma {a.gamma}, sparsity {a.sparsity}, greedy")
    print("| dtype | run | equal / total | first difference |")
    print("|---|---|---|---|")
    for dt in a.dtypes.split(","):
        model = load_model(checkpoint=a.checkpoint, dtype=getattr(jnp, dt),
                           exec_config=ExecConfig(backend=a.backend))
        ref = generate(model, prompts, a.new_tokens).tokens
        half = a.batch // 2
        other = (generate(model, prompts[:half], a.new_tokens).tokens
                 + generate(model, prompts[half:], a.new_tokens).tokens)
        runs = [(f"vanilla at batch {half} vs {a.batch}", other)]
        exacts = {"no": (False,), "yes": (True,), "both": (False, True)}[a.exact]
        for m, method in methods.items():
            for exact in exacts:
                t = time.perf_counter()
                xc = dataclasses.replace(model.exec_config, exact=exact)
                res = speculative_generate(model, prompts, a.new_tokens, SpecConfig(
                    method=method, gamma=a.gamma, sparsity=a.sparsity,
                    min_tokens=a.min_tokens), exec_config=xc)
                runs.append((f"{m}{', exact' if exact else ''} (tau {res.stats['tau']:.2f}, "
                             f"{time.perf_counter() - t:.0f} s)", res.tokens))
        for name, toks in runs:
            c = compare(ref, toks)
            fd = "-" if c["first_difference"] is None else c["first_difference"]
            print(f"| {dt} | {name} | {c['equal']} / {c['total']} | {fd} |", flush=True)
            rows.append({"dtype": dt, "run": name, **c})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

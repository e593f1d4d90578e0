"""Greedy speculative output against vanilla, token for token, on real weights: per
execution mode (default / exact), batch, gamma and method, how many sequences equal that
mode's vanilla and where the first difference falls; and vanilla against itself at other
batch shapes (each of the first sequences alone, the batch in two halves), since in bf16
the default mode's rounding follows the batch shape.

    PYTHONPATH=. python -m benchmarks.equality --checkpoint smol.gguf \\
        --prompts-json prompts.json [--batches 1,16,64] [--gammas 6,8,12] \\
        [--exact both] [--alone 8] [--dtypes bfloat16] [--json out.json]

Prompts are token ids ({"prompts": [[ids], ...]}), each cut to its last --context tokens
and cut again per sequence to a different length, so the batch is ragged (sequence i is
the same at every batch size). `--exact yes`: `ExecConfig(exact=True)`, row-invariant
execution, whose greedy output should equal its vanilla at every batch size. Methods: the
library's and the study's plug-ins (`benchmarks.methods`), by name."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax.numpy as jnp
import numpy as np

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


def ragged(ids, batch: int, context: int):
    """Sequence i: prompt i mod len(ids), its last `context` tokens, then a share of those
    that depends on i alone."""
    out = []
    for i in range(batch):
        q = ids[i % len(ids)][-context:]
        out.append(q[: max(64, len(q) * (16 + i % 16) // 32)])
    return out


def main(argv=None) -> int:
    from benchmarks.methods import method_of
    from vegas_jax import SpecConfig, generate, speculative_generate
    from vegas_jax.execution import BACKENDS, ExecConfig
    from vegas_jax.loading import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="GGUF / HF directory / orbax")
    p.add_argument("--prompts-json", required=True)
    p.add_argument("--batches", default="8", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=2048, help="longest prompt, tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--gammas", default="6", help="comma-separated draft lengths")
    p.add_argument("--sparsity", type=float, default=0.07)
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--exact", default="both", choices=("no", "yes", "both"),
                   help="ExecConfig(exact=...); 'both' runs everything each way")
    p.add_argument("--alone", type=int, default=0, metavar="N",
                   help="also decode the first N sequences one at a time (vanilla, B 1) "
                   "and compare them with the largest batch")
    p.add_argument("--b1-prompts", type=int, default=8, metavar="N",
                   help="batch 1 runs the first N prompts each alone, all at --context tokens "
                   "(one cache shape: one compilation per run)")
    p.add_argument("--json", default=None, metavar="FILE")
    a = p.parse_args(argv)
    methods = {m: method_of(m) for m in a.methods.split(",") if m}
    batches = [int(b) for b in a.batches.split(",")]
    gammas = [int(g) for g in a.gammas.split(",")]
    with open(a.prompts_json) as f:
        ids = json.load(f)["prompts"]
    rows = []
    print(f"batches {batches}, gammas {gammas}, prompts up to {a.context} tokens, "
          f"{a.new_tokens} new, sparsity {a.sparsity}, greedy")
    print("| dtype | mode | batch | run | equal / total | first difference |")
    print("|---|---|---|---|---|---|")

    def row(dt, mode, batch, name, ref, toks, **extra):
        c = compare(ref, toks)
        fd = "-" if c["first_difference"] is None else c["first_difference"]
        print(f"| {dt} | {mode} | {batch} | {name} | {c['equal']} / {c['total']} | {fd} |",
              flush=True)
        rows.append({"dtype": dt, "mode": mode, "batch": batch, "run": name, **extra, **c})
        if a.json:  # after every row: a run cut short keeps what it measured
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "rows": rows}, f, indent=1)

    for dt in a.dtypes.split(","):
        model = load_model(checkpoint=a.checkpoint, dtype=getattr(jnp, dt),
                           exec_config=ExecConfig(backend=a.backend))
        for exact in {"no": (False,), "yes": (True,), "both": (False, True)}[a.exact]:
            xc = dataclasses.replace(model.exec_config, exact=exact)
            mode = "exact" if exact else "default"
            for batch in batches:
                if batch == 1:  # each prompt alone: B 1 over several prompts, not one
                    prompts = [q[-a.context:] for q in ids[: a.b1_prompts]]
                    each = lambda run: [run([q])[0] for q in prompts]  # noqa: E731
                else:
                    prompts = ragged(ids, batch, a.context)
                    each = lambda run: run(prompts)  # noqa: E731
                ref = each(lambda qs: generate(model, qs, a.new_tokens, exec_config=xc).tokens)
                if batch == max(batches) and a.alone:
                    alone = [generate(model, [q], a.new_tokens, exec_config=xc).tokens[0]
                             for q in prompts[: a.alone]]
                    row(dt, mode, batch, "vanilla, each sequence alone (B 1)",
                        ref[: a.alone], alone, method="vanilla-alone")
                if batch > 1:
                    half = batch // 2
                    other = (generate(model, prompts[:half], a.new_tokens, exec_config=xc).tokens
                             + generate(model, prompts[half:], a.new_tokens,
                                        exec_config=xc).tokens)
                    row(dt, mode, batch, f"vanilla in two batches of {half}", ref, other,
                        method="vanilla-halves")
                for gamma in gammas:
                    for m, method in methods.items():
                        t = time.perf_counter()
                        spec = SpecConfig(method=method, gamma=gamma, sparsity=a.sparsity,
                                          min_tokens=a.min_tokens)
                        taus = []

                        def run(qs):
                            res = speculative_generate(model, qs, a.new_tokens, spec,
                                                       exec_config=xc)
                            taus.append(res.stats["tau"])
                            return res.tokens
                        toks = each(run)
                        tau = float(np.mean(taus))
                        row(dt, mode, batch, f"{m}, gamma {gamma} (tau {tau:.2f},"
                            f" {time.perf_counter() - t:.0f} s)", ref, toks,
                            method=m, gamma=gamma, tau=tau)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

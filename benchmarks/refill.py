"""Many prompts through a fixed number of slots: refilled slots (`max_batch`) against
static batches run one after another, wall time from call to last token (prefills
included), every configuration run twice and timed the second time (compiled).

    PYTHONPATH=. python -m benchmarks.refill --checkpoint smol.gguf \\
        --prompts-json prompts.json --prompts 256 --slots 64 [--json out.json]

Prompts are token ids ({"prompts": [[ids], ...]}), each cut to a different length up to
--context, repeated to make --prompts of them. Methods: the library's and the study's
plug-ins (`benchmarks.methods`), by name; `--backend` / `--exact` as in the CLI."""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np


def main(argv=None) -> int:
    from benchmarks.methods import method_of
    from vegas_jax import SamplingParams, SpecConfig, speculative_generate
    from vegas_jax.execution import BACKENDS, ExecConfig
    from vegas_jax.loading import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompts-json", required=True)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--context", type=int, default=7680)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--methods", default="vanilla,vegas")
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--exact", action="store_true", help="ExecConfig(exact=True)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--ragged", action="store_true",
                   help="one limit per prompt, drawn uniformly from [new_tokens / 8, "
                   "new_tokens] (seeded): outputs of varied lengths, as in long evaluations")
    p.add_argument("--json", default=None, metavar="FILE")
    a = p.parse_args(argv)
    with open(a.prompts_json) as f:
        base = json.load(f)["prompts"]
    prompts = [base[i % len(base)][-a.context:] for i in range(a.prompts)]
    prompts = [q[: len(q) * (3 + i % 5) // 7] for i, q in enumerate(prompts)]  # 3/7 .. 7/7
    limits = (np.random.default_rng(0).integers(max(1, a.new_tokens // 8), a.new_tokens + 1,
                                                a.prompts).tolist()
              if a.ragged else [a.new_tokens] * a.prompts)
    model = load_model(checkpoint=a.checkpoint,
                       exec_config=ExecConfig(backend=a.backend, exact=a.exact))
    sp = SamplingParams(a.temperature, a.top_k, a.top_p)
    print(f"{a.prompts} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{min(limits)}-{a.new_tokens} new, {a.slots} slots, T {a.temperature}")
    print("| method | static batches tok/s | refilled slots tok/s | refilled / static | tau | "
          "refills in prefills |")
    print("|---|---|---|---|---|---|")
    rows = []
    for m in a.methods.split(","):
        spec = SpecConfig(method=method_of(m), gamma=a.gamma)

        def static():
            toks, taus = 0, []
            for i in range(0, a.prompts, a.slots):
                r = speculative_generate(model, prompts[i:i + a.slots], limits[i:i + a.slots],
                                         spec, sp)
                toks += sum(map(len, r.tokens))
                taus.append(r.stats["tau"])
            return toks, sum(taus) / len(taus), {}

        def refilled():
            r = speculative_generate(model, prompts, limits, spec, sp, max_batch=a.slots)
            n = sorted(map(len, r.tokens))  # ragged when EOS ends texts before the limit
            print(f"  {m}: output lengths min {n[0]}, median {n[len(n) // 2]}, max {n[-1]}, "
                  f"{sum(x < a.new_tokens for x in n)} of {len(n)} shorter than {a.new_tokens}",
                  flush=True)
            return sum(n), r.stats["tau"], dict(r.stats, out_lens=n)

        out = {}
        for name, fn in (("static", static), ("refilled", refilled)):
            fn()  # compiles
            jax.effects_barrier()
            t = time.perf_counter()
            toks, tau, st = fn()
            out[name] = (toks / (time.perf_counter() - t), tau, st)
        s, r = out["static"][0], out["refilled"][0]
        st = out["refilled"][2]
        print(f"| {m} | {s:.0f} | {r:.0f} | {r / s:.2f}x | {out['refilled'][1]:.2f} | "
              f"{st['refills']} in {st['refill_prefills']} |", flush=True)
        rows.append({"method": m, "static_tok_s": s, "refilled_tok_s": r,
                     "tau_static": out["static"][1], "tau_refilled": out["refilled"][1],
                     "refills": st["refills"], "refill_prefills": st["refill_prefills"],
                     "out_lens": st["out_lens"]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "device": jax.devices()[0].device_kind, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

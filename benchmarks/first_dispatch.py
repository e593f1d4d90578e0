"""Where the first call of each `auto` candidate spends its host time (GPU).

    PYTHONPATH=. python -m benchmarks.first_dispatch --batch 1 --context 2048 --repeats 2
    XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=. python -m benchmarks.first_dispatch ...

On the H200 the first call of each auto candidate in decoding held the host 12-17 ms in its
dispatch (against ~1 ms for the calls after it), although every candidate had run before
decoding, on a copy of the state and then on the state's own buffers, once and twice
(BENCHMARKS.md 2026-12-03 b). This runs `speculative_generate` with auto `--repeats` times
in one process (random weights, random prompt tokens: acceptance is not the point) and
prints each run's first calls from auto's trace: configuration, device interval, the host's
wait for the output, its dispatch. A stall that comes back in the second run follows the
run (its state, its buffers); one that does not is a one-time cost per executable that the
warm-up does not reach. Run it once more with XLA's command buffers off (the second
command) to see whether they are what the first dispatch builds.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--calls", type=int, default=12, help="trace entries printed per run")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from vegas_jax.loading import load_model
    from vegas_jax.speculative import SpecConfig, speculative_generate

    model = load_model(args.model, random_init=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, args.context).tolist()
               for _ in range(args.batch)]
    flags = os.environ.get("XLA_FLAGS", "")
    runs = []
    for r in range(args.repeats):
        res = speculative_generate(model, prompts, args.new_tokens, SpecConfig(method="auto"))
        auto = res.stats["auto"]
        runs.append({"trace": auto["trace"], "dispatch_ms": auto["dispatch_ms"],
                     "ms_per_call": res.stats["ms_per_call"]})
        print(f"run {r} (XLA_FLAGS={flags!r}): ms/call {res.stats['ms_per_call']:.2f}, "
              f"median dispatch {auto['dispatch_ms']}")
        print("  config | interval ms | fair | wait ms | dispatch ms")
        prev = None
        for c, t, fair, w, d in auto["trace"][:args.calls]:
            mark = "*" if c != prev else " "
            print(f"  {mark} {c:9s} | {t} | {fair} | {w} | {d}")
            prev = c
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "xla_flags": flags, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

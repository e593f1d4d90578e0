"""Replay a bench run's calls with its batch's tail in plain decoding steps.

The question: once at most batch x sparsity sequences are left (their whole caches then
weigh no more than a full batch's draft step reads), would a fixed method finish faster
with plain steps than with rounds? (Built and tested as `SpecConfig.plain_tail` on
2026-12-05, reverted unmeasured on the GPU when this replay said no: BENCHMARKS.md
2026-12-05 c.) An estimate, not a measurement: from the first call with 0 < active <=
batch x sparsity on, the recorded rounds are replaced by calls of 8 plain steps, as many
as the slowest remaining sequence needs, each step costing --plain-ms plus --per-seq-ms
per further sequence active then (assumed: the bench does not time plain steps at few
active sequences).

  python -m benchmarks.tail_replay benchmarks/results/2026-12-05b/*sampled*.json --plain-ms 1.7
"""

from __future__ import annotations

import argparse
import json

from vegas_jax.speculative import AutoController

STEPS = AutoController.VANILLA_STEPS  # plain steps a call, as auto's plain calls make


def replay(row: dict, sparsity: float, plain_ms: float, per_seq_ms: float) -> dict | None:
    acc, active, ms = row["accepted_by_call"], row["active_by_call"], row["call_ms"]
    batch = len(acc[0])
    tail = int(batch * sparsity)
    start = next((i for i, n in enumerate(active) if 0 < n <= tail and n < batch), None)
    if start is None:
        return None
    left = [0] * batch  # tokens each slot emitted from the tail's start on
    for call in acc[start:]:
        for slot, a in enumerate(call):
            if a >= 0:
                left[slot] += a + 1
    calls = -(-max(left) // STEPS)
    plain = calls * STEPS * (plain_ms + per_seq_ms * (active[start] - 1))
    total = sum(m for m in ms if m is not None)
    rounds = sum(m for m in ms[start:] if m is not None)
    return {"method": row["method"], "gamma": row["gamma"], "tail_from_call": start,
            "active_then": active[start], "tail_rounds": len(acc) - start,
            "tail_ms": rounds, "plain_calls": calls, "plain_ms": plain,
            "speedup": total / (total - rounds + plain)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="bench --save JSON files")
    p.add_argument("--plain-ms", type=float, required=True,
                   help="assumed ms of one plain step with one sequence active")
    p.add_argument("--per-seq-ms", type=float, default=0.1,
                   help="assumed ms a step for each further active sequence")
    args = p.parse_args(argv)
    for f in args.files:
        d = json.load(open(f))
        for row in d["rows"]:
            if row["method"] == "vanilla" or not row.get("accepted_by_call"):
                continue
            r = replay(row, row.get("sparsity") or d["args"]["sparsity"], args.plain_ms,
                       args.per_seq_ms)
            if r is None:
                print(f"{f}: {row['method']} g{row['gamma']}: no call in the tail")
                continue
            print(f"{f}: {r['method']} g{r['gamma']}: tail from call {r['tail_from_call']} "
                  f"({r['active_then']} active), {r['tail_rounds']} rounds {r['tail_ms']:.0f} ms"
                  f" -> {r['plain_calls']} plain calls ~{r['plain_ms']:.0f} ms: "
                  f"{r['speedup']:.3f}x the run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Run-only study (issue 15): would the verify's captured logits survive fp8 storage?

The capture store writes 1.1 GB of fp16 logits a round at SmolLM2 B 128 (5.8-7.4 % of the
verify attention, 2026-12-06 e) and the selection kernel reads them back. Stored as fp8
(e4m3) they would halve both, if the selection they feed is as good. Emulated here on the
XLA path: each capture row's log2-unit logits are stored relative to the row's running max
over 128-key blocks (what the kernel holds when it stores a block: the values are <= 0,
and fp8's relative precision is finest near the max, where the weights that matter are),
rounded to e4m3, and the scores computed from the rounded values. The whole process runs
patched, so its `vegas` rows are the fp8 ones; they are renamed `vegas-fp8cap` in the JSON
written and compared with an unpatched run's `vegas` by `tau_study --from-json`.

    PYTHONPATH=. python benchmarks/results/2026-12-06e/fp8_capture_policy.py \
        --kinds chat-prose,code,prose --contexts 2048 --sparsities 0.07 --gammas 6 \
        --methods vegas --seqs 8 --new-tokens 64 --min-tokens 64 --json OUT.json
"""
import json
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import verify_attention as va

LOG2E = 1.4426950408889634
BLOCK = 128
_scores = va._scores_from_logits


def fp8_relative(logits):
    """logits [..., s] natural-log units (-inf masked) -> the same after the round trip
    through e4m3 storage relative to the running max of BLOCK-key blocks."""
    s = logits.shape[-1]
    nb = -(-s // BLOCK)
    l2 = logits * LOG2E
    pad = jnp.pad(l2, [(0, 0)] * (l2.ndim - 1) + [(0, nb * BLOCK - s)], constant_values=-jnp.inf)
    bm = pad.reshape(*l2.shape[:-1], nb, BLOCK).max(-1)  # [..., nb]
    run = jax.lax.cummax(bm, axis=bm.ndim - 1)
    m = jnp.repeat(run, BLOCK, axis=-1)[..., :s]  # [..., s]
    ok = jnp.isfinite(l2) & jnp.isfinite(m)
    v = jnp.where(ok, jnp.maximum(l2 - m, -448.0), 0.0)
    v8 = v.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return jnp.where(ok, (v8 + m) / LOG2E, logits)


def patched(logits, lse, valid, rows, score, capture):
    return _scores(fp8_relative(logits), lse, valid, rows, score, capture)


va._scores_from_logits = patched

import benchmarks.tau_study as t  # noqa: E402

argv = sys.argv[1:]
rc = t.main(argv)
if "--json" in argv:
    path = argv[argv.index("--json") + 1]
    d = json.load(open(path))
    for r in d["rows"]:
        if r.get("method") == "vegas":
            r["method"] = "vegas-fp8cap"
    json.dump(d, open(path, "w"), indent=1)
sys.exit(rc)

"""Row invariance on the device: is a row's result the same whatever rows are computed
with it? For the default and the exact execution (`ExecConfig.exact`): RMSNorm and each
GEMM alone at several row counts (row 0 against its one-row result, every other row
against itself computed one place earlier), and the whole forward — a verify's gamma + 1
rows (with vegas's capture, as a round runs it) against as many one-row decode steps, and
a batch's decode step against each sequence's step alone.

    PYTHONPATH=. python -m benchmarks.row_invariance --model smollm2-135m --batch 64 \\
        --context 4096 --gamma 6 [--json out.json]

Random weights of the model's shapes and a synthetic cache with ragged lengths; logits are
compared bit for bit (fp32 arrays out of bf16 models)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np


def equal_rows(a, b) -> tuple[int, int, float]:
    """(rows equal bit for bit, rows, max |a - b|) over the leading axis."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    eq = (a == b).reshape(a.shape[0], -1).all(axis=1)
    return int(eq.sum()), len(eq), float(np.abs(a - b).max())


def components(model, xc, sizes):
    """RMSNorm and every GEMM of layer 0: row 0 computed among m rows vs alone."""
    from vegas_jax.attention import AttnPlan
    from vegas_jax.execution import model_jit
    from vegas_jax.model import linear, rms_norm, row_invariant

    cfg, lp = model.config, model.params.layers
    lp = lp[0] if isinstance(lp, tuple) else jax.tree.map(lambda a: a[0], lp)
    h, f = cfg.hidden_size, lp.w_down.shape[0]
    gemms = {"qkv": (h, lp.w_qkv, False), "o": (lp.wo.shape[0], lp.wo, False),
             "gate_up": (h, lp.w_gate_up, False), "down": (f, lp.w_down, False),
             "lm_head": (h, model.params.embed, True) if model.params.lm_head is None
             else (h, model.params.lm_head, False)}

    @model_jit(static_argnames=("xc", "name"))
    def run(x, w, xc, name):
        if name == "rms_norm":
            return rms_norm(x, None, cfg.rms_norm_eps)
        return linear(x, w, row_invariant(xc, AttnPlan()), xc, transpose_w=gemms[name][2])

    rows = []
    key = jax.random.PRNGKey(0)
    for name, (k, w, _) in {"rms_norm": (h, None, False), **gemms}.items():
        x = jax.random.normal(key, (max(sizes) + 1, k), jnp.bfloat16)
        one = run(x[:1], w, xc, name)
        for m in sizes:
            # row 0 as alone, and rows 1.. against the same rows one place earlier
            many, shifted = run(x[:m], w, xc, name), run(x[1:m + 1], w, xc, name)
            eq0, _, d0 = equal_rows(one, many[:1])
            eq, n, d = equal_rows(many[1:], shifted[:-1]) if m > 1 else (0, 0, 0.0)
            rows.append({"part": name, "rows": m, "equal": eq0 + eq, "total": 1 + n,
                         "max_diff": max(d0, d)})
    return rows


def whole_forward(model, xc, batch, context, gamma, uncaptured=True):
    """Verify rows vs decode steps (and, where `uncaptured`, the verify without its capture
    too), and the batch's step vs each sequence alone."""
    from vegas_jax.attention import AttnPlan
    from vegas_jax.bench import synthetic_cache
    from vegas_jax.execution import model_jit
    from vegas_jax.methods import METHODS
    from vegas_jax.model import forward
    from vegas_jax.prefill import round_up
    from vegas_jax.speculative import SpecConfig, round_capture

    cfg = model.config
    max_len = round_up(context + gamma + 1, 128)
    cache = synthetic_cache(cfg, batch, max_len, context, jnp.bfloat16)
    lengths = context - (jnp.arange(batch, dtype=jnp.int32) * 613) % (context // 2)
    cache = cache.replace(lengths=lengths)
    capture = round_capture(SpecConfig(method=METHODS["vegas"], gamma=gamma), cfg, xc, max_len)
    toks = jax.random.randint(jax.random.PRNGKey(1), (batch, gamma + 1), 0, cfg.vocab_size)
    pos = lengths[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)

    @model_jit(static_argnames=("xc", "capture"))
    def fwd(params, xc, toks, pos, cache, capture):
        logits, cache, _ = forward(params, cfg, xc, toks, pos, cache, AttnPlan(capture=capture))
        return logits, cache

    verify, _ = fwd(model.params, xc, toks, pos, cache, capture)  # [b, gamma + 1, v]
    steps, c = [], cache
    for j in range(gamma + 1):
        logits, c = fwd(model.params, xc, toks[:, j:j + 1], pos[:, j:j + 1], c, None)
        steps.append(logits[:, 0])
    steps = jnp.stack(steps, axis=1)  # [b, gamma + 1, v]
    flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
    out = {"verify_vs_steps": equal_rows(flat(verify), flat(steps))}
    if uncaptured:
        bare, _ = fwd(model.params, xc, toks, pos, cache, None)  # the verify, no capture
        out["uncaptured_verify_vs_steps"] = equal_rows(flat(bare), flat(steps))
    alone, short = [], []
    for i in sorted({0, batch // 2, batch - 1}):
        one = cache.replace(k=cache.k[:, i:i + 1], v=cache.v[:, i:i + 1],
                            lengths=cache.lengths[i:i + 1])
        logits, _ = fwd(model.params, xc, toks[i:i + 1, :1], pos[i:i + 1, :1], one, None)
        alone.append(equal_rows(logits[:, 0], steps[i:i + 1, 0]))
        # the cache a batch of one would have: as long as its own sequence needs
        s = round_up(int(lengths[i]) + gamma + 1, 128)
        one = one.replace(k=one.k[:, :, :, :s], v=one.v[:, :, :, :s])
        logits, _ = fwd(model.params, xc, toks[i:i + 1, :1], pos[i:i + 1, :1], one, None)
        short.append(equal_rows(logits[:, 0], steps[i:i + 1, 0]))
    for name, got in (("alone_vs_batch", alone), ("alone_short_cache_vs_batch", short)):
        out[name] = (sum(a[0] for a in got), len(got), max(a[2] for a in got))
    return out


def main(argv=None) -> int:
    from vegas_jax.loading import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--sizes", default="1,7,64,448,4096", help="row counts of the parts")
    p.add_argument("--json", default=None, metavar="FILE")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    model = load_model(a.model, random_init=True, dtype=jnp.bfloat16)
    out = {"args": vars(a), "device": jax.devices()[0].device_kind, "modes": {}}
    print(f"{a.model} on {out['device']}: B {a.batch}, context {a.context}, gamma {a.gamma}")
    print("| mode | check | equal / total | max diff |")
    print("|---|---|---|---|")
    for exact in (False, True):
        xc = dataclasses.replace(model.exec_config, exact=exact)
        mode = "exact" if exact else "default"
        parts = components(model, xc, sizes)
        for r in parts:
            print(f"| {mode} | {r['part']}, {r['rows']} rows vs alone / shifted | "
                  f"{r['equal']} / {r['total']} | {r['max_diff']:.3g} |")
        whole = whole_forward(model, xc, a.batch, a.context, a.gamma)
        for name, (eq, n, diff) in whole.items():
            print(f"| {mode} | forward {name.replace('_', ' ')} | {eq} / {n} | {diff:.3g} |",
                  flush=True)
        out["modes"][mode] = {"parts": parts, "forward": whole}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

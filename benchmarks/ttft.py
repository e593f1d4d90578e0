"""Time to first token: a long prompt's prefill and its first sampled token (GPU).

    PYTHONPATH=. python -m benchmarks.ttft --model qwen3-8b --contexts 8192,32768,131072

Random weights of the model's full shapes (timing only), B prompts of `context` random
tokens, prefilled the way the product runs them (`--backend`, default auto: on a GPU the
Pallas path, whose prompt attention is derived from the card, e.g. cuDNN flash attention)
and timed from the call (token ids on the host) to the first token on the host, cache
allocation included: the first call (compile included) and the best of `--reps` warm
calls. Effective TFLOP/s counts the model's matmul FLOPs (2 x parameters x tokens) plus
causal attention's (2 x 2 x layers x heads x head_dim x T^2 / 2). Before timing, the first
tokens and last-token logits are compared with the XLA reference path's on a shorter
prompt (`--check-len`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def model_flops(cfg, batch: int, t: int) -> float:
    dense = 2.0 * (cfg.num_params() - cfg.vocab_size * cfg.hidden_size) * t  # embed: a lookup
    attn = 2.0 * 2.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * t * t / 2
    return batch * (dense + attn)


def first_token(model, xc, ids, max_len):
    """Prefill `ids` and take the first greedy token (what TTFT waits for)."""
    from vegas_jax.cache import init_cache
    from vegas_jax.params import param_dtype
    from vegas_jax.prefill import prefill_prompts

    cache = init_cache(model.config, len(ids), max_len, param_dtype(model.params))
    logits, cache, _ = prefill_prompts(model.params, model.config, xc, ids, cache, None)
    tok = np.asarray(jnp.argmax(logits, axis=-1))  # to the host: the first token is here
    return tok, logits, cache


def main(argv=None):
    from vegas_jax.driver import exec_config
    from vegas_jax.execution import BACKENDS, ExecConfig
    from vegas_jax.loading import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--contexts", default="8192,32768,131072",
                   help="prompt lengths in tokens, comma-separated")
    p.add_argument("--reps", type=int, default=2, help="warm calls; the best is reported")
    p.add_argument("--check-len", type=int, default=4096,
                   help="prompt length of the check against the XLA path (0: none)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)

    contexts = [int(c) for c in args.contexts.split(",")]
    model = load_model(args.model, random_init=True,
                       exec_config=ExecConfig(backend=args.backend))
    cfg = model.config.with_context(max(contexts) + 128)
    model = model._replace(config=cfg)
    xc = exec_config(model)
    rng = np.random.default_rng(0)
    print(f"{args.model}: {cfg.num_params() / 1e9:.2f} B parameters, "
          f"{jax.devices()[0].device_kind}, {xc}", flush=True)

    rows = []
    if args.check_len and xc.backend != "xla":
        ids = [rng.integers(0, cfg.vocab_size, args.check_len).tolist() for _ in range(args.batch)]
        ref = dataclasses.replace(xc, backend="xla")
        try:
            ref_tok, ref_logits, ref_cache = first_token(model, ref, ids, args.check_len + 128)
            tok, logits, cache = first_token(model, xc, ids, args.check_len + 128)
            err = float(jnp.max(jnp.abs(logits - ref_logits)) / jnp.max(jnp.abs(ref_logits)))
            kerr = float(jnp.max(jnp.abs(cache.k[-1].astype(jnp.float32)
                                         - ref_cache.k[-1].astype(jnp.float32))))
            row = dict(kind="check", backend=xc.backend, against="xla", t=args.check_len,
                       same_first_token=bool((tok == ref_tok).all()),
                       logits_rel_err=err, last_layer_k_max_abs_err=kerr)
            del ref_logits, ref_cache, logits, cache
        except Exception as e:  # report and go on to the timings
            row = dict(kind="check", backend=xc.backend, error=repr(e)[:400])
        rows.append(row)
        print(json.dumps(row), flush=True)

    print("| T | first call (s) | warm (s) | effective TFLOP/s |", flush=True)
    print("|---|---|---|---|", flush=True)
    for t in contexts:
        ids = [rng.integers(0, cfg.vocab_size, t).tolist() for _ in range(args.batch)]
        flops = model_flops(cfg, args.batch, t)
        base = dict(kind="ttft", model=args.model, batch=args.batch, t=t, backend=xc.backend)
        try:
            t0 = time.perf_counter()
            first_token(model, xc, ids, t + 128)
            cold = time.perf_counter() - t0
            warm = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                first_token(model, xc, ids, t + 128)
                warm.append(time.perf_counter() - t0)
            row = dict(base, first_call_s=cold, warm_s=min(warm),
                       tflops=flops / min(warm) / 1e12)
            print(f"| {t} | {cold:.2f} | {min(warm):.2f} | {row['tflops']:.0f} |", flush=True)
        except Exception as e:  # report and go on: a longer prompt may not fit
            row = dict(base, error=repr(e)[:400])
            print(f"| {t} | error: {row['error'][:200]} | | |", flush=True)
        rows.append(row)
        if args.json:  # after every row: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

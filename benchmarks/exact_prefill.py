"""Exact (row-invariant) prefill against the default one on the GPU (issue 56).

    PYTHONPATH=. python -m benchmarks.exact_prefill --quick        # kernels only, ~3 min
    PYTHONPATH=. python -m benchmarks.exact_prefill                # prefill of the model
        [--configs 1x32768,1x32768/8192,1x65536,1x130944,2x130944] [--phases decode,round]
        [--budget-s 560]

--quick runs one layer's kernels at the model's shapes (Qwen3-8B: 8 KV heads of 4 query
heads, head_dim 128, bf16): (1) the exact prefill attention's rows alone, in a batch of
other lengths (a longer cache) and in chunks that cut its query blocks, bit for bit;
(2) its time at one 32K prompt beside cuDNN (the default's prompt attention), the default
Pallas prefill kernel and the old exact plan (key splits combined in XLA); (3) a sweep of
its launch blocks, each checked alone == chunked; (4) the prefill matmul tile against
cuBLAS on the model's prefill GEMMs (8192 rows), a tile sweep, and rows alone == batched.

Without --quick, each (batch x prompt, mode) runs in a fresh process (a clean peak and a
cold compile): random weights, `prefill_prompts` to the first token the first time
(compile included: cold) and again (warm), peak device memory, then the decode step
(8 plain steps) and, with --phases round, a vegas round at gamma 6, wall time per call.
`BxT/C` runs exact only, prefilled in steps of C query tokens (chunks). Each row keeps a
hash of every sequence's last-token logits: exact rows of one prompt (alone, in a batch,
in chunks) must show the same hash. Every config is in its own try, inside a wall-clock
budget (`--budget-s`).

Prints one table; writes JSON to $OUT/exact_prefill.json where OUT is set (or --json).
On a CPU, `--smoke` runs --quick at tiny shapes in interpret mode (the script's own test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np

RESULTS: list = []  # rows of this run (module state of a script, never of the package)
DEADLINE = [float("inf")]  # time.time() past which --quick skips what is left


def out_of_time() -> bool:
    return time.time() > DEADLINE[0]


def log_row(**row):
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# ------------------------------------------------------------------ --quick: kernels
def attention_inputs(key, b, t, s, kh, g, d):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(key, 3)
    kc = jax.random.normal(ks[0], (1, b, kh, s, d), jnp.bfloat16)
    vc = jax.random.normal(ks[1], (1, b, kh, s, d), jnp.bfloat16)
    q = jax.random.normal(ks[2], (b, t, kh, g, d), jnp.bfloat16)
    return q, kc, vc


def attention_rows_check(blocks, t, kh, g, d, interpret, chunks):
    """A prompt's exact prefill rows alone == inside a batch of 3 with a longer cache ==
    prefilled in `chunks` (query tokens a call, cutting its query blocks). Returns
    (alone == batch, alone == chunked)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.verify_attention import verify_attention

    run = jax.jit(lambda q, kc, vc, pos: verify_attention(
        q, kc, vc, jnp.int32(0), pos, blocks=blocks, interpret=interpret)[0])
    wide = t + t // 2  # the batch's longest prompt
    q, kc, vc = attention_inputs(jax.random.PRNGKey(0), 3, wide, wide + 64, kh, g, d)
    pos = jnp.broadcast_to(jnp.arange(wide, dtype=jnp.int32), (3, wide))
    batch = run(q, kc, vc, pos)[1, :t]
    q1, kc1, vc1 = q[1:2, :t], kc[:, 1:2, :, :t + 64], vc[:, 1:2, :, :t + 64]
    alone = run(q1, kc1, vc1, pos[1:2, :t])[0]
    parts, c0 = [], 0
    for c in chunks:
        parts.append(run(q1[:, c0:c0 + c], kc1, vc1, pos[1:2, c0:c0 + c])[0])
        c0 += c
    chunked = jnp.concatenate(parts)
    return same_bits(alone, batch), same_bits(alone, chunked)


def quick_attention(smoke: bool, interpret: bool, sweep: list, impls: bool = True):
    """The rows check and the implementations' times (impls), then the `sweep`."""
    import jax
    import jax.numpy as jnp

    from benchmarks.matmul_tiles import timed
    from pallas_kernels.verify_attention import (
        INVARIANT, INVARIANT_PREFILL, cudnn_attention, verify_attention,
    )

    kh, g, d = (2, 4, 32) if smoke else (8, 4, 128)
    t_check, chunks = (192, (40, 100, 52)) if smoke else (4096, (1000, 2000, 1096))
    if impls:
        eq_b, eq_c = attention_rows_check(INVARIANT_PREFILL, t_check, kh, g, d, interpret,
                                          chunks)
        log_row(kind="attn_rows", blocks=label(INVARIANT_PREFILL), t=t_check, chunks=chunks,
                alone_eq_batch=eq_b, alone_eq_chunked=eq_c)

    t = 256 if smoke else 32768
    q, kc, vc = attention_inputs(jax.random.PRNGKey(1), 1, t, t, kh, g, d)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    flops = 4.0 * kh * g * d * t * t / 2
    timed_impls = {
        "exact prefill (INVARIANT_PREFILL)": lambda q, kc, vc, pos: verify_attention(
            q, kc, vc, jnp.int32(0), pos, blocks=INVARIANT_PREFILL, interpret=interpret)[0],
        "default Pallas prefill": lambda q, kc, vc, pos: verify_attention(
            q, kc, vc, jnp.int32(0), pos, interpret=interpret)[0],
    }
    if not interpret:
        timed_impls["cuDNN (default)"] = lambda q, kc, vc, pos: cudnn_attention(q, kc, vc,
                                                                          jnp.int32(0))
    timed_impls["old exact (splits of 1024)"] = lambda q, kc, vc, pos: verify_attention(
        q, kc, vc, jnp.int32(0), pos, blocks=INVARIANT, interpret=interpret)[0]
    ref = None
    for name, fn in timed_impls.items() if impls else ():
        try:
            f = jax.jit(fn)
            out = f(q, kc, vc, pos)
            ref = out if ref is None else ref
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            sec = timed(f, q, kc, vc, pos, reps=1 if smoke else 5)
            log_row(kind="attn_time", impl=name, t=t, ms=sec * 1e3,
                    tflops=flops / sec / 1e12, max_abs_diff_vs_first=err)
        except Exception as e:  # noqa: BLE001 - report and go on
            log_row(kind="attn_time", impl=name, t=t, error=repr(e)[:300])
    for over in sweep:
        blocks = dataclasses.replace(INVARIANT_PREFILL, **over)
        if out_of_time():
            log_row(kind="attn_sweep", blocks=over, t=t, error="skipped: budget spent")
            continue
        try:
            f = jax.jit(lambda q, kc, vc, pos, b=blocks: verify_attention(
                q, kc, vc, jnp.int32(0), pos, blocks=b, interpret=interpret)[0])
            sec = timed(f, q, kc, vc, pos, reps=1 if smoke else 3)
            _, eq = attention_rows_check(blocks, t_check, kh, g, d, interpret, chunks)
            log_row(kind="attn_sweep", blocks=over, t=t, ms=sec * 1e3,
                    tflops=flops / sec / 1e12, alone_eq_chunked=eq)
        except Exception as e:  # noqa: BLE001
            log_row(kind="attn_sweep", blocks=over, t=t, error=repr(e)[:300])


def quick_matmul(smoke: bool, interpret: bool, model: str, tiles: list):
    import jax
    import jax.numpy as jnp

    from benchmarks.matmul_tiles import timed
    from pallas_kernels.matmul import PREFILL_BLOCKS, MatmulBlocks, matmul
    from vegas_jax.config import get_config

    cfg = get_config(model)
    h, dh = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * dh, cfg.num_kv_heads * dh
    shapes = {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * cfg.intermediate_size),
              "down": (cfg.intermediate_size, h)}
    if smoke:
        shapes = {"qkv": (64, 96), "down": (128, 64)}
    m = 200 if smoke else 8192
    key = jax.random.PRNGKey(5)
    for name, (k, n) in shapes.items():
        x = jax.random.normal(key, (m, k), jnp.bfloat16)
        w = jax.random.normal(key, (k, n), jnp.bfloat16) * 0.05
        flops = 2.0 * m * k * n
        if not interpret:
            sec = timed(jax.jit(lambda x, w: x @ w), x, w, reps=5)
            log_row(kind="mm", shape=name, m=m, k=k, n=n, tile="cuBLAS", ms=sec * 1e3,
                    tflops=flops / sec / 1e12)
        for tile in [PREFILL_BLOCKS] + [MatmulBlocks(**o) for o in tiles]:
            if out_of_time():
                log_row(kind="mm", shape=name, tile=label(tile), error="skipped: budget spent")
                continue
            try:
                f = jax.jit(lambda x, w, b=tile: matmul(x, w, blocks=b, interpret=interpret))
                sec = timed(f, x, w, reps=1 if smoke else 5)
                full = f(x, w)
                rows = f(x[37:37 + 50], w)  # a prompt alone: rows at other tile offsets
                log_row(kind="mm", shape=name, m=m, k=k, n=n, tile=label(tile), ms=sec * 1e3,
                        tflops=flops / sec / 1e12,
                        alone_eq_batch=same_bits(full[37:87], rows))
            except Exception as e:  # noqa: BLE001
                log_row(kind="mm", shape=name, tile=label(tile), error=repr(e)[:300])


def label(blocks) -> str:
    """A launch plan's fields that differ from its class's defaults."""
    base = type(blocks)()
    return " ".join(f"{f.name}={getattr(blocks, f.name)}" for f in dataclasses.fields(blocks)
                    if getattr(blocks, f.name) != getattr(base, f.name)) or "defaults"


ATTN_SWEEP = [  # changes to INVARIANT_PREFILL
    dict(block_k=128), dict(num_stages=3), dict(block_k=128, num_stages=3),
    dict(num_warps=4), dict(row_block=64, num_warps=4), dict(row_block=64, block_k=128),
    dict(unmasked=True), dict(unmasked=True, block_k=128, num_stages=3),
]
MM_SWEEP = [  # prefill matmul tiles besides PREFILL_BLOCKS
    dict(block_m=128, block_k=64, block_n=256, num_warps=8, num_stages=3, group_m=8),
    dict(block_m=128, block_k=64, block_n=128, num_warps=4, num_stages=4, group_m=8),
    dict(block_m=128, block_k=32, block_n=128, num_warps=4, num_stages=4, group_m=8),
    dict(block_m=64, block_k=64, block_n=128, num_warps=4, num_stages=4, group_m=8),
    dict(block_m=128, block_k=64, block_n=128, num_warps=8, num_stages=3, group_m=0),
    dict(block_m=256, block_k=64, block_n=128, num_warps=8, num_stages=3, group_m=8),
]


# ------------------------------------------------------------------ full: the model
def child(batch: int, t: int, mode: str, model_name: str, phases: list, reps: int,
          chunk: int = 0) -> dict:
    """One config in this (fresh) process: cold and warm prefill, peak memory, phases.
    chunk: prefill steps of this many query tokens (0: the default budget)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    import hashlib

    import jax
    import jax.numpy as jnp

    import vegas_jax.prefill as pf

    from benchmarks.ttft import first_token, model_flops
    from vegas_jax.bench import Phases, _time
    from vegas_jax.driver import exec_config
    from vegas_jax.execution import ExecConfig
    from vegas_jax.loading import load_model
    from vegas_jax.sampling import SamplingParams
    from vegas_jax.speculative import SpecConfig

    if chunk:
        pf.PREFILL_TOKENS = chunk  # the budget `prefill_plan` cuts the prompts by
    model = load_model(model_name, random_init=True,
                       exec_config=ExecConfig(exact=mode == "exact"))
    model = model._replace(config=model.config.with_context(t + 128))
    xc = exec_config(model)
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, model.config.vocab_size, t).tolist() for _ in range(batch)]
    row = dict(batch=batch, t=t, mode=mode, chunk=chunk, exec=str(xc),
               device=jax.devices()[0].device_kind)
    t0 = time.perf_counter()
    tok, logits, cache = first_token(model, xc, ids, t + 128)
    row["cold_s"] = time.perf_counter() - t0
    row["first_tokens"] = [int(v) for v in tok]
    row["logits_sha1"] = [hashlib.sha1(np.asarray(r).tobytes()).hexdigest()[:12]
                          for r in logits]
    del cache, logits
    warm = []
    for _ in range(reps):
        t0 = time.perf_counter()
        tok, _, cache = first_token(model, xc, ids, t + 128)
        warm.append(time.perf_counter() - t0)
    row["warm_s"] = min(warm)
    row["tflops"] = model_flops(model.config, batch, t) / row["warm_s"] / 1e12
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
    if phases:
        ph = Phases(model, cache, SpecConfig(method="vegas", gamma=6), SamplingParams(), xc,
                    x0=jnp.asarray(tok, jnp.int32))
        if "decode" in phases:
            row["decode_step_ms"] = _time(ph.vanilla, 3) * 1e3 / 8
        if "round" in phases:
            row["round_ms"] = _time(ph.round, 3) * 1e3
    return row


def run_children(args) -> None:
    t_end = time.time() + args.budget_s
    for cfg in args.configs.split(","):
        shape, _, chunk = cfg.partition("/")
        b, t = (int(v) for v in shape.split("x"))
        for mode in ("exact",) if chunk else ("default", "exact"):
            left = t_end - time.time()
            if left < 30:
                log_row(kind="model", batch=b, t=t, mode=mode, error="skipped: budget spent")
                continue
            cmd = [sys.executable, "-m", "benchmarks.exact_prefill", "--child",
                   f"{b}:{t}:{mode}:{chunk or 0}", "--model", args.model, "--phases",
                   args.phases if not chunk else "", "--reps", str(args.reps)]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=left,
                                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(
                                       __file__))))
                line = [ln for ln in p.stdout.splitlines() if ln.startswith("CHILD ")]
                row = json.loads(line[-1][6:]) if line else dict(
                    batch=b, t=t, mode=mode, error=(p.stderr or p.stdout)[-600:])
            except subprocess.TimeoutExpired:
                row = dict(batch=b, t=t, mode=mode, error=f"timeout after {left:.0f} s")
            log_row(kind="model", **row)


def model_table() -> str:
    rows = [r for r in RESULTS if r["kind"] == "model"]
    out = ["| B | T | mode | cold s | warm s | peak GiB | decode ms | round ms | "
           "warm / default | cold / default | peak / default | logits hash |",
           "|" + "---|" * 12]
    for r in rows:
        mode = r["mode"] + (f" (chunks of {r['chunk']})" if r.get("chunk") else "")
        if "error" in r:
            out.append(f"| {r['batch']} | {r['t']} | {mode} | error: "
                       f"{r['error'][-160:]} |" + " |" * 8)
            continue
        base = next((d for d in rows if d["mode"] == "default" and d["batch"] == r["batch"]
                     and d["t"] == r["t"] and "error" not in d), None)

        def rel(k):
            return f"{r[k] / base[k]:.2f}x" if base and base.get(k) else ""

        def ms(k):
            return f"{r[k]:.2f}" if k in r else ""

        out.append(f"| {r['batch']} | {r['t']} | {mode} | {r['cold_s']:.2f} | "
                   f"{r['warm_s']:.2f} | {r['peak_gib']:.1f} | {ms('decode_step_ms')} | "
                   f"{ms('round_ms')} | {rel('warm_s')} | {rel('cold_s')} | "
                   f"{rel('peak_gib')} | {' '.join(r['logits_sha1'])} |")
    return "\n".join(out)


def quick_table() -> str:
    out = ["| what | variant | shape | ms | TFLOP/s | bits equal |", "|---|---|---|---|---|---|"]
    for r in RESULTS:
        if r["kind"] == "attn_rows":
            out.append(f"| attention rows | {r['blocks']} | T {r['t']} | | | alone=batch "
                       f"{r['alone_eq_batch']}, alone=chunked {r['alone_eq_chunked']} |")
        elif r["kind"] in ("attn_time", "attn_sweep", "mm"):
            what = {"attn_time": "attention", "attn_sweep": "attention sweep", "mm": "matmul"}
            variant = r.get("impl") or r.get("blocks") or r.get("tile")
            shape = f"T {r['t']}" if "t" in r else f"{r.get('shape')} {r.get('m')}x{r.get('k')}" \
                f"x{r.get('n')}"
            if "error" in r:
                out.append(f"| {what[r['kind']]} | {variant} | {shape} | error: "
                           f"{r['error'][:120]} | | |")
                continue
            eq = r.get("alone_eq_chunked", r.get("alone_eq_batch", ""))
            out.append(f"| {what[r['kind']]} | {variant} | {shape} | {r['ms']:.3f} | "
                       f"{r['tflops']:.0f} | {eq} |")
    return "\n".join(out)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="kernels only (module docstring)")
    p.add_argument("--smoke", action="store_true", help="--quick at tiny shapes, interpreted")
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--configs", default="1x32768,1x32768/8192,1x65536,1x130944,2x130944",
                   help="BxT prompts, comma-separated (each run default and exact); BxT/C: "
                        "exact only, prefilled in steps of C query tokens")
    p.add_argument("--phases", default="decode", help="after the prefill: decode,round or ''")
    p.add_argument("--reps", type=int, default=1, help="warm prefills (the best is kept)")
    p.add_argument("--budget-s", type=float, default=560.0)
    p.add_argument("--json", default=None, help="default: $OUT/exact_prefill.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    if args.child:
        b, t, mode, chunk = args.child.split(":")
        print("CHILD " + json.dumps(child(int(b), int(t), mode, args.model, phases,
                                          args.reps, int(chunk))), flush=True)
        return 0
    if args.quick or args.smoke:
        import jax

        DEADLINE[0] = time.time() + args.budget_s
        interpret = args.smoke or jax.default_backend() != "gpu"
        # the checks and the chosen plans first, the sweeps after (the budget may cut them)
        for part in (lambda: quick_attention(args.smoke, interpret, []),
                     lambda: quick_matmul(args.smoke, interpret, args.model,
                                          MM_SWEEP[:1] if args.smoke else MM_SWEEP),
                     lambda: quick_attention(args.smoke, interpret,
                                             ATTN_SWEEP[:2] if args.smoke else ATTN_SWEEP,
                                             impls=False)):
            try:
                part()
            except Exception as e:  # noqa: BLE001 - the table shows what ran
                log_row(kind="error", error=repr(e)[:600])
        table = quick_table()
    else:
        run_children(args)
        table = model_table()
    print(table, flush=True)
    path = args.json or (os.path.join(os.environ["OUT"], "exact_prefill.json")
                         if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(dict(args=vars(args), results=RESULTS, table=table), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

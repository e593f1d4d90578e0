"""Weight-only quantized matmul (`pallas_kernels.quant_matmul`) against bf16 weights
(XLA's dot, cuBLAS) and XLA's dequantize-then-dot, on the draft matmuls of Qwen3-8B and
SmolLM2, one GPU.

    PYTHONPATH=. python3 -m benchmarks.quant_matmul [--models qwen3-8b,smollm2]
        [--rows 1,8,16,64,128,256] [--sweep small] [--budget-s 420] [--tiny]

First a read ceiling (a fused read-only reduction over 4 GiB, in a jitted loop). Then for
each weight shape (k x n), row count M and format: bf16 `jnp.dot`, XLA's dequantize-then-
dot and the kernel with each block config of the sweep (`configs`), every one timed in a
jitted `fori_loop` that walks C copies of the weight (C x the bf16 bytes >= 512 MiB, at
most 16 copies, so L2 holds none but the smallest shapes: their rows say "L2"). Each
kernel run is checked: its checksum (every row, ~64 columns, all iterations) against XLA's
dequantize-then-dot, and the default config against `quant_matmul_reference` at the
smallest and largest M. Prints one table (time, GB/s of the bytes read, fraction of the
read ceiling, speed vs bf16, best config) and the matmul time of a whole draft step (every
layer's four matmuls and the LM head) per M; writes quant_matmul.json to $OUT when set.
--tiny: tiny shapes in Pallas interpret mode, to check the script on a CPU (numbers mean
nothing there)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.quant_matmul import (FORMATS, default_blocks, dequantize, group_size,
                                         quant_matmul,
                                         quant_matmul_reference, quantize)

# k x n of each draft matmul (the weights as the model stores them: x @ w), and the layers
SHAPES = {
    "qwen3-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576),
                 "down": (12288, 4096), "lm_head": (4096, 151936)},
    "smollm2": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072),
                "down": (1536, 576), "lm_head": (576, 49152)},
    "tiny": {"a": (256, 200), "b": (128, 96)},
}
LAYERS = {"qwen3-8b": 36, "smollm2": 30, "tiny": 2}
L2_BYTES = 50 << 20  # H100's L2
COPY_BYTES = 512 << 20  # bf16 bytes the C copies of a weight reach (at most MAX_COPIES)
MAX_COPIES = 16


@dataclasses.dataclass
class Run:
    """The run's settings and results (main() makes one; nothing runs at import)."""

    tiny: bool
    budget_s: float
    t0: float = dataclasses.field(default_factory=time.time)
    results: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)

    def left(self) -> float:
        return self.budget_s - (time.time() - self.t0)


def timeit(run, *args, calls: int) -> float:
    """run is jitted and makes `calls` calls inside; seconds a call (median of 3)."""
    jax.block_until_ready(run(*args))  # compile + warm
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(run(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / calls


def read_ceiling(tiny: bool) -> float:
    """Bytes/s of a fused read-only reduction over 4 GiB of bf16 (1 MiB with --tiny)."""
    x = jax.random.normal(jax.random.PRNGKey(0), ((1 << 20) if tiny else (2 << 30),),
                          jnp.bfloat16).reshape(1024, -1)
    n = 2 if tiny else 20
    f = jax.jit(lambda x: lax.fori_loop(
        0, n, lambda i, a: a + (x + i.astype(x.dtype)).sum(dtype=jnp.float32), 0.0))
    bw = x.nbytes / timeit(f, x, calls=n)
    del x
    return bw


def _checksum(y):
    """Every row, ~64 columns of y (the barrier keeps XLA from computing only those)."""
    y = lax.optimization_barrier(y)
    return jnp.sum(y[:, :: max(1, y.shape[1] // 64)].astype(jnp.float32))


def unrolled_loop(fn, n: int):
    """jit(x, ws) -> checksum: n iterations, each calling fn(x, w) for every w of ws in
    turn. x is made loop-variant (x + 0 * carry) so XLA cannot hoist the calls."""
    @jax.jit
    def run(x, ws):
        def body(i, acc):
            xi = x + (acc * 0).astype(x.dtype)
            return acc + sum(_checksum(fn(xi, w)) for w in ws)
        return lax.fori_loop(0, n, body, jnp.float32(0))
    return run


def kernel_loop(fmt: str, blocks: dict, n: int, copies: int, interpret: bool):
    """jit(x, q, s) -> checksum: n * copies kernel calls, call i on stacked copy i % copies
    (read in place through `layer`): the same weights, in the same order, as
    `unrolled_loop` over the copies."""
    @jax.jit
    def run(x, q, s):
        def body(i, acc):
            xi = x + (acc * 0).astype(x.dtype)
            y = quant_matmul(xi, q, s, fmt=fmt, layer=i % copies, interpret=interpret,
                             **blocks)
            return acc + _checksum(y)
        return lax.fori_loop(0, n * copies, body, jnp.float32(0))
    return run


def xla_dequant_dot(x, qs, fmt):
    """XLA's weight-only matmul: dequantize to x's dtype (a fusion writing the weight),
    then the dot."""
    q, s = qs
    return jnp.dot(x, dequantize(q, s, fmt).astype(x.dtype))


def configs(m: int, k: int, n: int, fmt: str, sweep: str) -> list[dict]:
    """The default block config, then (sweep "small") one-at-a-time variants around it:
    columns, k block, k splits, warps, stages; "full" adds their pairs of columns x splits.
    Only valid ones (k block dividing k and the group, splits dividing the k steps)."""
    d = dataclasses.asdict(default_blocks(m, k, n, fmt))
    out = [d]
    if sweep == "none":
        return out
    g = 128 if k % 128 == 0 else 64
    var = [dict(block_n=bn) for bn in (32, 64, 128, 256) if bn != d["block_n"]]
    var += [dict(block_k=bk) for bk in (d["block_k"] // 2, d["block_k"] * 2)]
    var += [dict(split_k=sk) for sk in (d["split_k"] // 2, d["split_k"] * 2, d["split_k"] * 4)]
    var += [dict(num_warps=8 if d["num_warps"] == 4 else 4),
            dict(num_stages=d["num_stages"] - 1), dict(num_stages=d["num_stages"] + 1)]
    if m > 16:
        var += [dict(block_m=bm) for bm in (16, 32, 64, 128) if bm != d["block_m"]]
    if sweep == "full":
        var += [dict(block_n=bn, split_k=sk) for bn in (64, 256)
                for sk in (d["split_k"] * 2, max(1, d["split_k"] // 2))]
    for v in var:
        c = {**d, **v}
        ok = (c["block_k"] >= 16 and k % c["block_k"] == 0
              and (fmt == "int8" or c["block_k"] % g == 0)
              and c["split_k"] >= 1 and (k // c["block_k"]) % c["split_k"] == 0
              and c["num_stages"] >= 1 and c["block_m"] <= max(16, 2 * m))
        if ok and c not in out:
            out.append(c)
    return out


def bytes_read(fmt: str | None, m: int, k: int, n: int) -> int:
    """The bytes a call must read: weights (packed), scales and x (bf16)."""
    w = {None: 2 * k * n, "int8": k * n + 4 * n,
         "int4": k * n // 2 + 2 * (k // group_size(k)) * n if fmt == "int4" else 0}
    return w[fmt] + 2 * m * k


def check_reference(fmt, x, q, s, interpret) -> float:
    """Max error of the default-config kernel vs `quant_matmul_reference` on copy 0,
    relative to the reference's largest magnitude."""
    f = jax.jit(lambda x, q, s: (quant_matmul(x, q, s, fmt=fmt, interpret=interpret),
                                 quant_matmul_reference(x, q, s, fmt)))
    got, want = (np.asarray(a, np.float32) for a in f(x, q[0], s[0]))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def bench_shape(run: Run, model, name, k, n, rows, sweep, ceil_bw, log):
    """All rows of one weight shape: bf16, XLA dequantize-then-dot and the kernel's
    configs for both formats."""
    copies = max(1, min(MAX_COPIES, -(-COPY_BYTES // (2 * k * n)))) if not run.tiny else 2
    key = jax.random.PRNGKey(k * 7 + n)
    w = (jax.random.normal(key, (copies, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    ws = [w[c] for c in range(copies)]
    quant = {fmt: jax.jit(functools.partial(quantize, fmt=fmt))(w) for fmt in FORMATS}
    qs = {fmt: [(q[c], s[c]) for c in range(copies)] for fmt, (q, s) in quant.items()}
    del w
    n_it = 2 if run.tiny else max(2, min(200, int(4e-3 * ceil_bw / (copies * k * n))))
    for m in rows:
        if run.left() < 0:
            run.skipped.append(f"{model} {name} M {m}")
            continue
        x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
        base = dict(model=model, shape=name, k=k, n=n, m=m, copies=copies)
        t = timeit(unrolled_loop(jnp.dot, n_it), x, ws, calls=n_it * copies)
        bf16 = dict(base, variant="bf16", us=t * 1e6, gbps=bytes_read(None, m, k, n) / t / 1e9)
        run.results.append(bf16)
        for fmt in FORMATS:
            xf = functools.partial(xla_dequant_dot, fmt=fmt)
            sums = {}
            xla = unrolled_loop(xf, n_it)
            t = timeit(xla, x, qs[fmt], calls=n_it * copies)
            sums["xla"] = float(xla(x, qs[fmt]))
            run.results.append(dict(base, variant=f"xla-{fmt}", us=t * 1e6,
                                    gbps=bytes_read(fmt, m, k, n) / t / 1e9))
            err = (check_reference(fmt, x, *quant[fmt], run.tiny)
                   if m in (rows[0], rows[-1]) else None)
            for c in configs(m, k, n, fmt, sweep):
                if run.left() < 0:
                    run.skipped.append(f"{model} {name} M {m} {fmt} {c}")
                    break
                f = kernel_loop(fmt, c, n_it, copies, run.tiny)
                t = timeit(f, x, *quant[fmt], calls=n_it * copies)
                cs = float(f(x, *quant[fmt]))
                ok = abs(cs - sums["xla"]) <= 2e-2 * max(abs(sums["xla"]), 1.0)
                b = bytes_read(fmt, m, k, n)
                run.results.append(dict(
                    base, variant=fmt, config=c, us=t * 1e6, gbps=b / t / 1e9,
                    frac=b / t / ceil_bw, vs_bf16=bf16["us"] / (t * 1e6), ok=bool(ok),
                    ref_err=err, default=c == configs(m, k, n, fmt, "none")[0],
                    l2=copies * b < 2 * L2_BYTES))
                err = None  # checked once, with the default config
        log(run, model, name, m)


def _cfg_str(c: dict) -> str:
    return (f"m{c['block_m']} n{c['block_n']} k{c['block_k']} s{c['split_k']} "
            f"w{c['num_warps']} st{c['num_stages']}")


def log_rows(run: Run, model, name, m):
    """Print the finished (model, shape, M) rows: one a format, its best config."""
    sel = [r for r in run.results if (r["model"], r["shape"], r["m"]) == (model, name, m)]
    bf16 = next(r for r in sel if r["variant"] == "bf16")
    for fmt in FORMATS:
        ks = [r for r in sel if r["variant"] == fmt]
        if not ks:
            continue
        good = [r for r in ks if r["ok"]] or ks
        best = min(good, key=lambda r: r["us"])
        dflt = next((r for r in ks if r["default"]), best)
        xla = next(r for r in sel if r["variant"] == f"xla-{fmt}")
        bad = sum(not r["ok"] for r in ks)
        err = next((r["ref_err"] for r in ks if r["ref_err"] is not None), None)
        print(f"| {model} | {name} | {m} | {fmt} | {bf16['us']:.1f} | {xla['us']:.1f} | "
              f"{dflt['us']:.1f} | {best['us']:.1f} | {best['gbps']:.0f} | "
              f"{best['frac']:.2f}{' L2' if best['l2'] else ''} | "
              f"{bf16['us'] / best['us']:.2f} | {_cfg_str(best['config'])} | "
              f"{'ok' if not bad else f'{bad} BAD'}"
              f"{'' if err is None else f' ref {err:.1e}'} | {time.time() - run.t0:.0f} s |",
              flush=True)


def step_table(run: Run, rows):
    """A draft step's matmuls: every layer's four (qkv, o, gate_up, down) and the LM head,
    per model and M: bf16 vs the best int8 / int4 configs (and the defaults)."""
    print("\n| model | M | bf16 µs | int8 best | int8 default | int4 best | int4 default | "
          "int8 / bf16 | int4 / bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in dict.fromkeys(r["model"] for r in run.results):
        for m in rows:
            sel = [r for r in run.results if r["model"] == model and r["m"] == m]
            tot = {}
            for v in ("bf16", "int8", "int4"):
                for pick in ("best", "default"):
                    s = 0.0
                    for name in SHAPES[model]:
                        rs = [r for r in sel if r["shape"] == name and r["variant"] == v
                              and (pick == "best" or v == "bf16" or r["default"])]
                        if not rs:
                            s = float("nan")
                            break
                        s += min(r["us"] for r in rs) * (1 if name == "lm_head"
                                                          else LAYERS[model])
                    tot[v, pick] = s
            print(f"| {model} | {m} | {tot['bf16', 'best']:.0f} | {tot['int8', 'best']:.0f} | "
                  f"{tot['int8', 'default']:.0f} | {tot['int4', 'best']:.0f} | "
                  f"{tot['int4', 'default']:.0f} | "
                  f"{tot['int8', 'best'] / tot['bf16', 'best']:.2f} | "
                  f"{tot['int4', 'best'] / tot['bf16', 'best']:.2f} |")


def build_parser():
    p = argparse.ArgumentParser(prog="python -m benchmarks.quant_matmul",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3-8b,smollm2",
                   help=f"comma-separated, of {', '.join(SHAPES)} (default: qwen3-8b,smollm2)")
    p.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    p.add_argument("--rows", default="1,8,16,64,128,256", help="comma-separated row counts M")
    p.add_argument("--sweep", default="small", choices=("none", "small", "full"),
                   help="block configs per cell: the default only, one-at-a-time variants "
                        "(default), or those and pairs")
    p.add_argument("--budget-s", type=float, default=420.0, metavar="S",
                   help="stop starting new cells after S seconds (default: 420)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes in Pallas interpret mode (checks the script on a CPU)")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    run = Run(tiny=a.tiny, budget_s=a.budget_s)
    models = ["tiny"] if a.tiny else a.models.split(",")
    rows = [1, 3, 16] if a.tiny else sorted(int(r) for r in a.rows.split(","))
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    ceil_bw = read_ceiling(a.tiny)
    print(f"read ceiling: {ceil_bw / 1e12:.3f} TB/s (fused sum over "
          f"{'1 MiB' if a.tiny else '4 GiB'})")
    print("| model | shape | M | fmt | bf16 µs | XLA deq µs | kernel default µs | best µs | "
          "GB/s | of ceiling | x bf16 | best config | check | at |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for name, (k, n) in SHAPES[model].items():
            if a.shapes and name not in a.shapes.split(","):
                continue
            bench_shape(run, model, name, k, n, rows, a.sweep, ceil_bw, log_rows)
    step_table(run, rows)
    bad = [r for r in run.results if r.get("ok") is False
           or (r.get("ref_err") is not None and r["ref_err"] > 2e-2)]
    print(f"\nchecks: {'PASS' if not bad else f'{len(bad)} FAILED'}; "
          f"skipped (budget): {len(run.skipped)}; total {time.time() - run.t0:.0f} s")
    for s in run.skipped[:20]:
        print("  skipped:", s)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "quant_matmul.json"), "w") as f:
            json.dump({"args": vars(a), "device": jax.devices()[0].device_kind,
                       "jax": jax.__version__, "read_ceiling_bps": ceil_bw,
                       "results": run.results, "skipped": run.skipped}, f, indent=1)
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Weight-only quantized matmul (`pallas_kernels.quant_matmul`) against bf16 weights
(XLA's dot, cuBLAS) and XLA's dequantize-then-dot, on the draft matmuls of Qwen3-8B and
SmolLM2, one GPU.

    PYTHONPATH=. python3 -m benchmarks.quant_matmul [--models qwen3-8b,smollm2]
        [--rows 1,8,16,64,128,256] [--sweep none|small|full] [--budget-s 330] [--tiny]

First a read ceiling (a fused read-only reduction over 4 GiB, in a jitted loop). Then,
for each weight shape (k x n) and row count M: bf16 `jnp.dot`, XLA's dequantize-then-dot
(at M 1, 8, 64) and the kernel in both formats, every one timed in a jitted `fori_loop`
that walks C copies of the weight (C x the bf16 bytes >= 512 MiB, at most 16 copies, so
L2 holds none but the smallest shapes: their rows say "L2"). Pass 1 times every cell's
default config and its other unpack setting; pass 2 the sweep's variants (`configs`:
Qwen3-8B at M 1, 16, 256 with "small"). Checks: every kernel run's checksum (every row,
~64 columns, all iterations) against XLA's dequantize-then-dot or else the default
config's, and the default config against `quant_matmul_reference` at the smallest and
largest M. Prints a row per cell and format (time, GB/s of the bytes read, fraction of
the read ceiling, speed vs bf16, best config), a draft step's matmul time (every layer's
four and the LM head) per M, and per (format, M) the best changes from the default;
writes quant_matmul.json to $OUT when set; starts no kernel config after --budget-s.
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

from benchmarks.kernels import timeit  # jitted loop of n calls: seconds a call
from pallas_kernels.quant_matmul import (FORMATS, default_blocks, dequantize,
                                         group_size, quant_matmul,
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
    sums: dict = dataclasses.field(default_factory=dict)  # checksums kernels must match

    def left(self) -> float:
        return self.budget_s - (time.time() - self.t0)


def read_ceiling(tiny: bool) -> float:
    """Bytes/s of a fused read-only reduction over 4 GiB of bf16 (1 MiB with --tiny)."""
    x = jax.random.normal(jax.random.PRNGKey(0), ((1 << 20) if tiny else (2 << 30),),
                          jnp.bfloat16).reshape(1024, -1)
    n = 2 if tiny else 20
    f = jax.jit(lambda x: lax.fori_loop(
        0, n, lambda i, a: a + (x + i.astype(x.dtype)).sum(dtype=jnp.float32), 0.0))
    bw = x.nbytes / timeit(f, x, n=n)
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
    (read in place through `layer`, which also keeps the calls in the loop: no x + 0 op
    a call): the same weights, in the same order, as `unrolled_loop` over the copies."""
    @jax.jit
    def run(x, q, s):
        def body(i, acc):
            y = quant_matmul(x, q, s, fmt=fmt, layer=i % copies, interpret=interpret,
                             **blocks)
            return acc + _checksum(y)
        return lax.fori_loop(0, n * copies, body, jnp.float32(0))
    return run


def xla_dequant_dot(x, qs, fmt):
    """XLA's weight-only matmul: dequantize to x's dtype (a fusion writing the weight),
    then the dot."""
    q, s = qs
    return jnp.dot(x, dequantize(q, s, fmt).astype(x.dtype))


SWEEP_ROWS = (1, 16, 256)  # the row counts where "small" sweeps (Qwen3-8B's shapes)


def configs(m: int, k: int, n: int, fmt: str, sweep: str, model: str = "") -> list[dict]:
    """The default block config first, then variants: "none" adds none; "small" adds the
    other unpack setting everywhere, and at Qwen3-8B's shapes and M in SWEEP_ROWS a few
    one-at-a-time changes (columns, k block, k splits, warps, stages, row blocks); "full"
    adds those at every shape and M. Invalid ones are dropped."""
    d = dataclasses.asdict(default_blocks(m, k, n, fmt))
    var = [] if sweep == "none" else [dict(unpack="jnp" if d["unpack"] == "asm" else "asm")]
    if sweep == "full" or (sweep == "small" and model == "qwen3-8b" and m in SWEEP_ROWS):
        var += [dict(block_n=64 if d["block_n"] != 64 else 128), dict(block_n=256),
                dict(block_k=d["block_k"] // 2), dict(num_warps=8),
                dict(split_k=d["split_k"] * 2), dict(split_k=max(1, d["split_k"] // 2)),
                dict(num_stages=3)]
        if m > 16:
            var += [dict(block_m=128 if d["block_m"] != 128 else 64)]
    out = [d]
    g = group_size(k) if fmt == "int4" else 16
    for v in var:
        c = {**d, **v}
        ok = (k % c["block_k"] == 0 and c["block_k"] % g == 0 and c["block_k"] >= 16
              and (k // c["block_k"]) % c["split_k"] == 0)
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


XLA_ROWS = (1, 8, 64)  # XLA's dequantize-then-dot is timed at these M (as in issue 55)


def weights_for(k: int, n: int, copies: int):
    """copies bf16 weights [k, n] (~N(0, 0.02)), as a list, and each format's stacked
    (q, scale) of them."""
    w = (jax.random.normal(jax.random.PRNGKey(k * 7 + n), (copies, k, n), jnp.float32)
         * 0.02).astype(jnp.bfloat16)
    quant = {fmt: jax.jit(functools.partial(quantize, fmt=fmt))(w) for fmt in FORMATS}
    return [w[c] for c in range(copies)], quant


def time_kernel(run: Run, fmt, c, x, quant, n_it, copies, want):
    """(seconds a call, checksum) of the kernel with config c; (None, error) if it fails to
    compile or run; want: the checksum to match (XLA's or the default config's), or None."""
    try:
        f = kernel_loop(fmt, c, n_it, copies, run.tiny)
        t = timeit(f, x, *quant, n=n_it * copies)
        cs = float(f(x, *quant))
    except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return t, cs


@dataclasses.dataclass
class Cell:
    """One (model, shape, M) and what its timings need: C weight copies (list of bf16 and
    each format's stacked (q, scale)), x, iterations a timing loop."""

    model: str
    name: str
    k: int
    n: int
    m: int
    ws: list
    quant: dict
    copies: int
    n_it: int

    def base(self) -> dict:
        return dict(model=self.model, shape=self.name, k=self.k, n=self.n, m=self.m,
                    copies=self.copies)


def baselines(run: Run, c: Cell, x):
    """bf16's dot, and XLA's dequantize-then-dot at XLA_ROWS (every M in tiny mode), whose
    checksums the kernel's must match."""
    t = timeit(unrolled_loop(jnp.dot, c.n_it), x, c.ws, n=c.n_it * c.copies)
    run.results.append(dict(c.base(), variant="bf16", us=t * 1e6,
                            gbps=bytes_read(None, c.m, c.k, c.n) / t / 1e9))
    if not (run.tiny or c.m in XLA_ROWS):
        return
    for fmt in FORMATS:
        qs = [(c.quant[fmt][0][i], c.quant[fmt][1][i]) for i in range(c.copies)]
        xla = unrolled_loop(functools.partial(xla_dequant_dot, fmt=fmt), c.n_it)
        t = timeit(xla, x, qs, n=c.n_it * c.copies)
        run.sums[c.model, c.name, c.m, fmt] = float(xla(x, qs))
        run.results.append(dict(c.base(), variant=f"xla-{fmt}", us=t * 1e6,
                                gbps=bytes_read(fmt, c.m, c.k, c.n) / t / 1e9))


def bench_cell(run: Run, c: Cell, cfgs: dict, ceil_bw: float, check: bool):
    """The kernel's configs (cfgs: format -> configs) at one cell; check: the default
    config against `quant_matmul_reference` too."""
    x = jax.random.normal(jax.random.PRNGKey(c.m), (c.m, c.k), jnp.bfloat16)
    bf16 = next(r for r in run.results if r["variant"] == "bf16"
                and (r["model"], r["shape"], r["m"]) == (c.model, c.name, c.m))
    for fmt, fmt_cfgs in cfgs.items():
        b, key = bytes_read(fmt, c.m, c.k, c.n), (c.model, c.name, c.m, fmt)
        err = check_reference(fmt, x, *c.quant[fmt], run.tiny) if check else None
        for cfg in fmt_cfgs:
            if run.left() < 0:
                run.skipped.append(f"{c.model} {c.name} M {c.m} {fmt} {_cfg_str(cfg)}")
                continue
            t, cs = time_kernel(run, fmt, cfg, x, c.quant[fmt], c.n_it, c.copies,
                                run.sums.get(key))
            default = cfg == configs(c.m, c.k, c.n, fmt, "none")[0]
            if t is not None and default:
                run.sums.setdefault(key, cs)  # no XLA run here: later configs match this
            want = run.sums.get(key)
            r = dict(c.base(), variant=fmt, config=cfg, ref_err=err, default=default,
                     l2=c.copies * b < 2 * L2_BYTES,
                     ok=t is not None and abs(cs - want) <= 2e-2 * max(abs(want), 1.0))
            if t is None:
                r.update(us=float("inf"), gbps=0.0, frac=0.0, vs_bf16=0.0, error=cs)
            else:
                r.update(us=t * 1e6, gbps=b / t / 1e9, frac=b / t / ceil_bw,
                         vs_bf16=bf16["us"] / (t * 1e6))
            run.results.append(r)
            err = None  # checked once, with the default config


def bench_shape(run: Run, model, name, rows, sweep, ceil_bw, first: bool):
    """One weight shape at every M of rows (C copies of it, C x bf16 bytes >= COPY_BYTES).
    first pass: the baselines, the default config and its other unpack setting; second:
    the rest of the sweep's configs."""
    k, n = SHAPES[model][name]
    copies = 2 if run.tiny else max(1, min(MAX_COPIES, -(-COPY_BYTES // (2 * k * n))))
    ws, quant = weights_for(k, n, copies)
    n_it = 2 if run.tiny else max(2, min(200, int(4e-3 * ceil_bw / (copies * k * n))))
    for m in rows:
        cfgs = {fmt: configs(m, k, n, fmt, sweep, model) for fmt in FORMATS}
        cfgs = {fmt: cs[:2] if first else cs[2:] for fmt, cs in cfgs.items()}
        if run.left() < 0 or not any(cfgs.values()):
            if run.left() < 0:
                run.skipped.append(f"{model} {name} M {m}")
            continue
        c = Cell(model, name, k, n, m, ws, quant, copies, n_it)
        if first:
            baselines(run, c, jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16))
        bench_cell(run, c, cfgs, ceil_bw, check=first and m in (rows[0], rows[-1]))
        log_rows(run, model, name, m)
    del ws, quant


def _cfg_str(c: dict) -> str:
    return (f"m{c['block_m']} n{c['block_n']} k{c['block_k']} s{c['split_k']} "
            f"w{c['num_warps']} st{c['num_stages']} {c['unpack']}")


def _header():
    print("| model | shape | M | fmt | bf16 µs | XLA deq µs | kernel default µs | best µs | "
          "GB/s | of ceiling | x bf16 | best config | check | at |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def log_rows(run: Run, model, name, m):
    """Print the finished (model, shape, M) rows: one a format, its best config."""
    sel = [r for r in run.results if (r["model"], r["shape"], r["m"]) == (model, name, m)]
    bf16 = next(r for r in sel if r["variant"] == "bf16")
    for fmt in FORMATS:
        ks = [r for r in sel if r["variant"] == fmt]
        if not ks:
            continue
        good = [r for r in ks if r["ok"]] or ks  # errored configs are never ok
        best = min(good, key=lambda r: r["us"])
        dflt = next((r for r in ks if r["default"]), best)
        xla = next((r for r in sel if r["variant"] == f"xla-{fmt}"), None)
        bad = sum(not r["ok"] for r in ks)
        err = next((r["ref_err"] for r in ks if r["ref_err"] is not None), None)
        print(f"| {model} | {name} | {m} | {fmt} | {bf16['us']:.1f} | "
              f"{'-' if xla is None else format(xla['us'], '.1f')} | "
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
                              and r.get("ok", True)
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


def _change(r) -> str:
    """A kernel row's config as its change from that cell's default ("default" if none)."""
    d = dataclasses.asdict(default_blocks(r["m"], r["k"], r["n"], r["variant"]))
    diff = [f"{f}={v}" for f, v in r["config"].items() if d[f] != v]
    return ",".join(diff) or "default"


def variant_table(run: Run):
    """Per (model, format, M): each change from the default, its draft step's matmul time
    (every layer's four and the LM head, where it ran at every shape) vs the default's:
    what a rule for the defaults should pick."""
    print("\n| model | fmt | M | change from the default | step µs | vs default |")
    print("|---|---|---|---|---|---|")
    kern = [r for r in run.results if r["variant"] in FORMATS and r["ok"]]
    for model, fmt, m in dict.fromkeys((r["model"], r["variant"], r["m"]) for r in kern):
        sel = [r for r in kern if (r["model"], r["variant"], r["m"]) == (model, fmt, m)]
        tot: dict[str, float] = {}
        for name in SHAPES[model]:
            for r in sel:
                if r["shape"] == name:
                    w = 1 if name == "lm_head" else LAYERS[model]
                    tot[_change(r)] = tot.get(_change(r), 0.0) + r["us"] * w
        full = {c: v for c, v in tot.items()
                if all(any(r["shape"] == name and _change(r) == c for r in sel)
                       for name in SHAPES[model])}
        base = full.get("default")
        for c, v in sorted(full.items(), key=lambda kv: kv[1])[:4]:
            print(f"| {model} | {fmt} | {m} | {c} | {v:.0f} | "
                  f"{'-' if not base else format(v / base, '.3f')} |")


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
    p.add_argument("--budget-s", type=float, default=330.0, metavar="S",
                   help="start no kernel config after S seconds (default: 330)")
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
    _header()
    for first in (True, False):  # every cell's defaults first, then the sweep's variants
        print("== pass 1: baselines, defaults" if first else "== pass 2: the sweep's variants")
        for model in models:
            for name in SHAPES[model]:
                if not a.shapes or name in a.shapes.split(","):
                    bench_shape(run, model, name, rows, a.sweep, ceil_bw, first)
    print("\n== every cell, best of both passes")
    _header()
    for model, name, m in dict.fromkeys((r["model"], r["shape"], r["m"]) for r in run.results):
        log_rows(run, model, name, m)
    step_table(run, rows)
    variant_table(run)
    bad = [r for r in run.results if (r.get("ok") is False and "error" not in r)
           or (r.get("ref_err") is not None and r["ref_err"] > 2e-2)]
    failed = [r for r in run.results if "error" in r]
    for r in failed[:10]:
        print(f"  did not run: {r['model']} {r['shape']} M {r['m']} {r['variant']} "
              f"{_cfg_str(r['config'])}: {r['error']}")
    print(f"\nchecks: {'PASS' if not bad else f'{len(bad)} FAILED'}; configs that did not "
          f"run: {len(failed)}; "
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

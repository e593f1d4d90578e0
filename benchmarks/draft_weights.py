"""Draft weights on the GPU (issue 55): a draft step, a round and a plain decode step with
the model's own weights and with int8 / int4 draft copies, each beside its byte floor.

    PYTHONPATH=. python -m benchmarks.draft_weights --model qwen3-8b \\
        --shapes 1x32768,8x32768,2x131072 [--formats same,int8,int4] [--gamma 6]

Random weights of the model's full shapes and a synthetic cache (`vegas_jax.bench`), the
round's phases timed on a live state (`bench.Phases`: draft phase / gamma, the jitted
round, plain decode steps). Byte floor of a call: the bytes it must read (matmul weights
in their format, and the KV entries it attends to: a draft the budget and its tail, a plain
step or verify every cached entry) over the card's read rate, measured here by a reduction
over a large buffer. Before timing, each format's quantized matmul (Pallas) is checked
against its reference (dequantize, then dot) on one layer's Q/K/V weights. One table;
JSON in $OUT/draft_weights_<shapes>.json when $OUT is set (or --json FILE).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys

# XLA's pool is 75 % of the card by default; the weights, a draft copy and a long cache
# need more of it. Set before jax starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

CHECK_TOL = 2e-2  # kernel vs reference, relative to the output's largest value


def build_parser():
    from vegas_jax.cli import add_model_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--shapes", default="1x32768,8x32768,2x131072",
                   help="comma-separated BATCHxCONTEXT shapes")
    p.add_argument("--formats", default="same,int8,int4", help="draft weights to time")
    p.add_argument("--method", default="vegas", help="speculative method of the round")
    p.add_argument("--gamma", type=int, default=6, help="draft tokens per round")
    p.add_argument("--sparsity", type=float, default=0.07, help="draft budget fraction")
    p.add_argument("--min-tokens", type=int, default=256, help="draft budget floor")
    p.add_argument("--reps", type=int, default=5, help="timed calls of each phase")
    p.add_argument("--ceiling-mib", type=int, default=4096,
                   help="buffer the read rate is measured on")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the JSON here")
    return p


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        try:
            b, c = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes takes BATCHxCONTEXT items, got {part!r}") from None
        out.append((b, c))
    return out


def read_rate(mib: int, reps: int) -> float:
    """Bytes a second the device reads: a row-max over a `mib` MiB bf16 buffer."""
    from vegas_jax.bench import _time

    cols = 8192
    buf = jnp.ones((mib * 2**20 // 2 // cols, cols), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.max(a, axis=1))
    t = _time(lambda: f(buf), reps)
    return buf.nbytes / t


def matmul_bytes(params, fmt: str) -> int:
    """Bytes of the matmul weights one step reads in `fmt` (the layers' projections and
    the LM head)."""
    from vegas_jax.quant import DRAFT_MATMULS, quantized_bytes

    if fmt != "same":
        return quantized_bytes(params, fmt)
    layers = params.layers if isinstance(params.layers, tuple) else (params.layers,)
    head = params.embed if params.lm_head is None else params.lm_head
    return head.nbytes + sum(getattr(lp, f).nbytes for lp in layers for f in DRAFT_MATMULS)


def kv_bytes(cfg, batch: int, entries: float, itemsize: int) -> float:
    """Bytes of `entries` cached positions a sequence, K and V, every layer."""
    return batch * entries * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def floors(cfg, spec, params, fmt: str, batch: int, n: int, rate: float) -> dict:
    """Byte floors (ms) of a draft step, a round and a plain step at context n."""
    from vegas_jax.params import param_dtype

    item = jnp.dtype(param_dtype(params)).itemsize
    g = spec.gamma
    budget = min(max(math.ceil(spec.sparsity * (n + g + 1)), spec.min_tokens), n + 1)
    # draft step j reads its budget and the j + 1 tail entries since the selection
    draft = matmul_bytes(params, fmt) + kv_bytes(cfg, batch, budget + (g + 1) / 2, item)
    full = matmul_bytes(params, "same")
    verify = full + kv_bytes(cfg, batch, n + g + 1, item)
    plain = full + kv_bytes(cfg, batch, n + 1, item)
    ms = 1e3 / rate
    return {"draft_floor_ms": draft * ms, "round_floor_ms": (g * draft + verify) * ms,
            "vanilla_floor_ms": plain * ms, "draft_bytes": draft, "budget": budget}


def check_kernel(model, fmt: str, rows: int) -> float:
    """max |Pallas - reference| / max |reference| of the quantized Q/K/V matmul of the
    first layer for `rows` rows."""
    import dataclasses

    from pallas_kernels.quant_matmul import quantize
    from vegas_jax import quant

    layers = model.params.layers
    w = layers[0].w_qkv if isinstance(layers, tuple) else layers.w_qkv[0]  # [h, (n+2k)d]
    qw = quant.QuantWeight(*jax.jit(quantize, static_argnums=1)(w, fmt), fmt)
    x = jax.random.normal(jax.random.PRNGKey(0), (rows, 1, w.shape[0]), w.dtype)
    xc = model.exec_config
    got = quant.linear(x, qw, dataclasses.replace(xc, backend="pallas"))
    want = quant.linear(x, qw, dataclasses.replace(xc, backend="xla"))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / np.abs(want).max())


def time_shape(model, spec, sp, batch: int, context: int, formats, reps: int, rate: float):
    """Rows of one (batch, context): every format's draft step and round, and the plain
    step (the model's weights whatever the format) once."""
    import dataclasses

    from vegas_jax.bench import Phases, _time, profile_cache
    from vegas_jax.params import param_dtype
    from vegas_jax.quant import DraftCache

    cfg, xc = model.config, model.exec_config
    cache = profile_cache(cfg, batch, context, spec.gamma, param_dtype(model.params))
    rows, vanilla_ms = [], None
    for fmt in formats:
        s = dataclasses.replace(spec, draft_weights=fmt)
        m = model._replace(drafts=DraftCache())  # this format's copy alone, freed after
        ph = Phases(m, cache, s, sp, xc)
        row = {"batch": batch, "context": context, "draft_weights": fmt,
               "draft_step_ms": _time(ph.draft, reps) * 1e3 / spec.gamma,
               "round_ms": _time(ph.round, reps) * 1e3}
        if vanilla_ms is None:
            vanilla_ms = _time(ph.vanilla, reps) * 1e3 / 8
        row["vanilla_step_ms"] = vanilla_ms
        row.update(floors(cfg, s, model.params, fmt, batch, context, rate))
        row["break_even_tau"] = row["round_ms"] / vanilla_ms
        rows.append(row)
        print(json.dumps(row), flush=True)  # kept if a time limit ends the run
        cache = ph.state.cache.replace(lengths=ph.n)
        del ph, m
        gc.collect()
    del cache
    gc.collect()
    return rows


def format_table(rows) -> str:
    head = ["B x context", "weights", "draft step ms", "floor ms", "floor/measured",
            "round ms", "floor ms", "vanilla step ms", "floor ms", "break-even tau"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            f"{r['batch']} x {r['context']}", r["draft_weights"],
            f"{r['draft_step_ms']:.3f}", f"{r['draft_floor_ms']:.3f}",
            f"{r['draft_floor_ms'] / r['draft_step_ms']:.2f}",
            f"{r['round_ms']:.2f}", f"{r['round_floor_ms']:.2f}",
            f"{r['vanilla_step_ms']:.3f}", f"{r['vanilla_floor_ms']:.3f}",
            f"{r['break_even_tau']:.2f}"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from vegas_jax.cli import load_from_args
    from vegas_jax.quant import check_draft_weights
    from vegas_jax.sampling import SamplingParams
    from vegas_jax.speculative import SpecConfig

    args = build_parser().parse_args(argv)
    shapes = parse_shapes(args.shapes)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    try:
        for f in formats:
            check_draft_weights(f)
        spec = SpecConfig(method=args.method, gamma=args.gamma, sparsity=args.sparsity,
                          min_tokens=args.min_tokens)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    model = load_from_args(args, random_init=args.checkpoint is None)
    rate = read_rate(args.ceiling_mib, args.reps)
    out = {"args": vars(args), "device": jax.devices()[0].device_kind,
           "exec": str(model.exec_config), "read_rate_gb_s": rate / 1e9, "checks": {},
           "rows": []}
    print(f"# {out['device']}, {model.config.name}, {model.exec_config}, read rate "
          f"{rate / 1e9:.0f} GB/s ({args.ceiling_mib} MiB row-max)")
    ok = True
    for fmt in formats:
        if fmt != "same":
            err = check_kernel(model, fmt, max(b for b, _ in shapes))
            out["checks"][fmt] = err
            ok &= err <= CHECK_TOL
            print(f"check {fmt}: quantized Q/K/V matmul, Pallas vs reference: max error "
                  f"{err:.2e} of the largest output ({'ok' if err <= CHECK_TOL else 'FAILED'})")
    for b, c in shapes:
        out["rows"] += time_shape(model, spec, SamplingParams(), b, c, formats, args.reps, rate)
        print(f"done {b} x {c}", file=sys.stderr, flush=True)
        save(out, shapes, args.json)  # after each shape: kept if a time limit ends the run
    print(format_table(out["rows"]))
    return 0 if ok else 1


def save(out: dict, shapes, path: str | None) -> None:
    paths = [path] if path else []
    if os.environ.get("OUT"):
        name = "draft_weights_" + "_".join(f"{b}x{c}" for b, c in shapes) + ".json"
        paths.append(os.path.join(os.environ["OUT"], name))
    for p in paths:
        with open(p, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())

"""What one mixture-of-experts layer costs on the GPU: device memory XLA plans for it and
time per call, for the model's `_moe` (`lax.ragged_dot` over rows sorted by expert) and
for a per-row gather of each (token, expert)'s weights, at decode-, draft- and
verify-sized row counts.

    PYTHONPATH=. python -m benchmarks.moe_memory [--model qwen3-30b-a3b] [--rows 4,28,64,448]

Issue 13: a Qwen3-30B-A3B forward at B 4, 32K ran out of memory in the draft on a 768 MiB
allocation, one layer's [128, 2048, 1536] expert gate/up in bf16. This prints, per
variant and row count, XLA's temp allocation for one layer (`memory_analysis`), the
largest buffers of the optimised HLO, the time per call (random weights), and each
variant's largest difference from XLA's ragged_dot. Variants: "ragged_dot" (XLA),
"gather" (each row's expert weights gathered), "mosaic" (jax's Mosaic-GPU grouped
matmul; Hopper only), "triton" (our few-rows Pallas kernel); `pallas_kernels.grouped_matmul`."""

from __future__ import annotations

import argparse
import functools
import re
import time

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import ragged_dot
from vegas_jax.config import get_config
from vegas_jax.model import LayerParams, _moe, moe_route


def gather_moe(cfg, h, lp: LayerParams):
    """Each (token, expert) row multiplied by its own expert's weights, gathered per row:
    reads k experts' weights per token (no sort), for small row counts."""
    b, t, hd = h.shape
    f = cfg.moe_intermediate_size
    x = h.reshape(b * t, hd)
    weights, experts = moe_route(cfg, x, lp)
    wgu = lp.w_expert_gate_up[experts]  # [T, k, h, 2f]
    gu = jnp.einsum("th,tkhf->tkf", x, wgu)
    act = jax.nn.silu(gu[..., :f]) * gu[..., f:]
    out = jnp.einsum("tkf,tkfh->tkh", act, lp.w_expert_down[experts])
    y = jnp.sum(out.astype(jnp.float32) * weights[..., None], axis=1)
    return y.astype(h.dtype).reshape(b, t, hd)


def biggest_buffers(hlo: str, n: int = 5) -> list[str]:
    """The n largest array shapes named in the optimised HLO, with the op that makes them."""
    sizes = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= (bf16|f16|f32|s32|u32|pred|s8|u8)\[([\d,]*)\][^ ]* (\w[\w-]*)\(", line)
        if not m:
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        nbytes = sizes[m.group(1)]
        for d in dims:
            nbytes *= d
        found.append((nbytes, f"{m.group(1)}[{m.group(2)}] {m.group(3)}"))
    found.sort(reverse=True)
    out, seen = [], set()
    for nbytes, what in found:
        if what not in seen:
            seen.add(what)
            out.append(f"{nbytes / 2**20:9.1f} MiB  {what}")
        if len(out) == n:
            break
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="registered MoE model name")
    p.add_argument("--rows", default="4,28,64,448", help="comma-separated token counts")
    p.add_argument("--reps", type=int, default=20, help="timed calls per variant")
    p.add_argument("--variants", default="ragged_dot,mosaic,triton", help="which to run "
                   "(ragged_dot first: the others are compared with it; also: gather)")
    a = p.parse_args()
    cfg = get_config(a.model)
    e, hd, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    dt = jnp.bfloat16
    lp = LayerParams(
        attn_norm=None, w_qkv=None, wo=None, mlp_norm=None,
        w_router=(0.02 * jax.random.normal(ks[0], (hd, e))).astype(dt),
        w_expert_gate_up=(0.02 * jax.random.normal(ks[1], (e, hd, 2 * f))).astype(dt),
        w_expert_down=(0.02 * jax.random.normal(ks[2], (e, f, hd))).astype(dt))
    print(f"{a.model}: {e} experts, top {cfg.experts_per_token}, hidden {hd}, expert width {f}; "
          f"one layer's experts {2 * e * hd * 3 * f / 2**20:.0f} MiB")
    for rows in [int(r) for r in a.rows.split(",")]:
        h = jax.random.normal(ks[3], (1, rows, hd)).astype(dt)
        outs = {}
        variants = [("ragged_dot", _moe), ("gather", gather_moe),
                    ("mosaic", functools.partial(
                        _moe, ragged_dot=functools.partial(ragged_dot, impl="mosaic"))),
                    ("triton", functools.partial(
                        _moe, ragged_dot=functools.partial(ragged_dot, impl="triton")))]
        for name, fn in [v for v in variants if v[0] in a.variants.split(",")]:
            jf = jax.jit(lambda h, lp, fn=fn: fn(cfg, h, lp))
            try:
                comp = jf.lower(h, lp).compile()
            except Exception as ex:  # noqa: BLE001 - report and go on
                print(f"rows {rows:4d} {name:10s} compile failed: {type(ex).__name__}: "
                      f"{str(ex).splitlines()[0][:200]}")
                continue
            mem = comp.memory_analysis()
            temp = getattr(mem, "temp_size_in_bytes", 0) / 2**20
            out = comp(h, lp)
            jax.block_until_ready(out)
            t0 = time.perf_counter()
            for _ in range(a.reps):
                out = comp(h, lp)
            jax.block_until_ready(out)
            ms = (time.perf_counter() - t0) / a.reps * 1e3
            outs[name] = out.astype(jnp.float32)
            print(f"rows {rows:4d} {name:10s} temp {temp:8.1f} MiB, {ms:7.3f} ms a call")
            for line in biggest_buffers(comp.as_text()):
                print(f"      {line}")
        for name in outs:
            diff = float(jnp.max(jnp.abs(outs["ragged_dot"] - outs[name])))
            print(f"rows {rows:4d} max |ragged_dot - {name}| {diff:.3e} "
                  f"(output scale {float(jnp.max(jnp.abs(outs['ragged_dot']))):.3e})")


if __name__ == "__main__":
    main()

"""A draft step's matmuls at few rows: XLA's cuBLAS (the model's GPU default) against our
Pallas (Triton) row-tile kernel (`grouped_matmul` with one group) over a grid of tiles;
and a draft layer's MLP input (norm row scale, gate/up, silu(gate) * up) as XLA runs it
(a norm fusion, cuBLAS, an activation fusion) against `draft_mlp.norm_gate_up`'s tiles.

    PYTHONPATH=. python -m benchmarks.tune_draft_gemm [--model smollm2-135m] [--rows 64,128]
        [--what gemm,mlp]

Issue 15: at SmolLM2 B 64 a draft step's 121 GEMMs take ~4.1 us each (499 us a step, for
~240 MB of weights that read in ~80 us at the ceiling: H100 kernel profile, BENCHMARKS.md
2026-12-06 b). Each shape is multiplied by `--layers` distinct weight matrices in a chain
(one jit, so no call reads another's weights from L2), its kernels timed from a trace;
reported: us a matmul, its bytes and read rate, and the largest difference from cuBLAS.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.kernel_profile import kernel_times
from pallas_kernels.draft_mlp import MlpTile, norm_gate_up
from pallas_kernels.grouped_matmul import grouped_matmul
from vegas_jax.config import get_config
from vegas_jax.model import rms_norm

# (block_m, block_k, block_n, num_warps, num_stages, loop)
TILES = [
    (64, 64, 64, 4, 3, True), (64, 64, 32, 4, 3, True), (64, 64, 16, 4, 3, True),
    (64, 128, 32, 4, 3, True), (64, 128, 16, 4, 3, True), (64, 64, 32, 4, 4, True),
    (64, 64, 32, 2, 3, True), (64, 64, 16, 2, 3, True), (64, 64, 32, 4, 2, False),
    (64, 64, 16, 4, 2, False), (32, 64, 32, 4, 3, True), (16, 64, 32, 4, 3, True),
]


MLP_TILES = [MlpTile(), MlpTile(block_n=32), MlpTile(num_stages=3), MlpTile(block_k=128),
             MlpTile(num_warps=2), MlpTile(block_m=128), MlpTile(block_m=32),
             MlpTile(block_n=32, num_stages=3)]


def chain(mul, layers, opts):
    """jit of `layers` products x @ w[li], each depending on the last (so none overlaps
    or fuses with another): (one value a layer, the last product)."""
    def run(x, w):
        outs = []
        for li in range(layers):
            y = mul(x, w[li])
            outs.append(y[:1, :1])
            x = x + y[:1, :1].astype(x.dtype) * 0  # a dependency, no fusion
        return jnp.concatenate(outs), y
    return jax.jit(run, compiler_options=opts)


def mlp_rows(cfg, m, layers, opts):
    """The MLP input at m rows: XLA's three kernels against `norm_gate_up`'s tiles (all
    kernels of a layer, the chain's dependency fusion included in both)."""
    h, f, eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
    key = jax.random.PRNGKey(m)
    w = jax.random.normal(key, (layers, h, 2 * f), jnp.bfloat16) * 0.02
    x = jax.random.normal(jax.random.fold_in(key, 1), (m, h), jnp.bfloat16)

    def xla(x, w):  # the model's unfused draft MLP input (norm weight folded into w)
        gu = rms_norm(x, None, eps) @ w
        return jax.nn.silu(gu[:, :f]) * gu[:, f:]

    def per_layer(f_):
        return sum(t for _, t in kernel_times(lambda: f_(x, w), n=3).values()) / layers

    ref_f = chain(xla, layers, opts)
    ref = ref_f(x, w)[1].astype(jnp.float32)
    t_ref = per_layer(ref_f)
    print(f"M {m:4d} MLP input [{h}x{2 * f}]: XLA {t_ref:6.2f} us a layer, all kernels")
    for t in MLP_TILES:
        fn = chain(lambda x, w, t=t: norm_gate_up(x, w, eps=eps, tile=t), layers, opts)
        try:
            err = float(jnp.max(jnp.abs(fn(x, w)[1].astype(jnp.float32) - ref)))
            tt = per_layer(fn)
        except Exception as e:  # noqa: BLE001 - a tile Triton rejects
            print(f"    {t}: {type(e).__name__}")
            continue
        print(f"    m{t.block_m:3d} k{t.block_k:3d} n{t.block_n:3d} w{t.num_warps} "
              f"s{t.num_stages} {tt:6.2f} us ({t_ref / tt:4.2f}x)  max|diff| {err:.2e}")


def shapes(cfg):
    """(name, k, n) of one layer's draft matmuls and the LM head."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    return [("qkv", h, qkv), ("o", cfg.num_heads * d, h), ("gate_up", h, 2 * cfg.intermediate_size),
            ("down", cfg.intermediate_size, h), ("lm_head", h, cfg.vocab_size)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", default="64,128")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--what", default="gemm,mlp",
                   help="gemm: each matmul against grouped_matmul's tiles; mlp: the MLP "
                   "input against norm_gate_up's tiles")
    a = p.parse_args()
    what = a.what.split(",")
    if set(what) - {"gemm", "mlp"}:
        p.error(f"--what takes gemm and/or mlp, got {a.what!r}")
    cfg = get_config(a.model)
    opts = {"xla_gpu_enable_triton_gemm": False}  # as `ExecConfig(gemm="cublas")`
    print(f"{jax.devices()[0].device_kind}, {a.model}, {a.layers} weight sets a shape")
    for m in (int(r) for r in a.rows.split(",")):
        if "mlp" in what:
            mlp_rows(cfg, m, a.layers, opts)
        if "gemm" not in what:
            continue
        for name, k, n in shapes(cfg):
            layers = 2 if name == "lm_head" else a.layers
            key = jax.random.PRNGKey(k * n + m)
            w = jax.random.normal(key, (layers, k, n), jnp.bfloat16) * 0.02
            x = jax.random.normal(jax.random.fold_in(key, 1), (m, k), jnp.bfloat16)
            gs = jnp.array([m], jnp.int32)

            def time_of(f):
                kern = kernel_times(lambda: f(x, w), n=3)
                mm = sum(t for kn, (_, t) in kern.items()
                         if any(s in kn for s in ("nvjet", "gemm", "cutlass", "xmma", "grouped")))
                return mm / layers

            ref_f = chain(lambda x, w: x @ w, layers, opts)
            ref = ref_f(x, w)[1].astype(jnp.float32)
            t_ref = time_of(ref_f)
            gb = k * n * 2 / 1e9
            print(f"M {m:4d} {name:8s} [{k}x{n}] {gb * 1e3:6.2f} MB: cuBLAS {t_ref:6.2f} us "
                  f"({gb / t_ref * 1e-3 * 1e6:5.2f} TB/s)")
            for bm, bk, bn, nw, ns, loop in TILES:
                if k % bk or n % bn:
                    continue
                f = chain(lambda x, w, bm=bm, bk=bk, bn=bn, nw=nw, ns=ns, loop=loop:
                          grouped_matmul(x, w[None], gs, block_m=bm, block_k=bk, block_n=bn,
                                         num_warps=nw, num_stages=ns, loop=loop), layers, opts)
                try:
                    err = float(jnp.max(jnp.abs(f(x, w)[1].astype(jnp.float32) - ref)))
                    t = time_of(f)
                except Exception as e:  # noqa: BLE001 - a tile Triton rejects
                    print(f"    m{bm} k{bk} n{bn} w{nw} s{ns}{' loop' if loop else ''}: "
                          f"{type(e).__name__}")
                    continue
                print(f"    m{bm:3d} k{bk:3d} n{bn:3d} w{nw} s{ns}{' loop' if loop else '     '} "
                      f"{t:6.2f} us ({gb / t * 1e-3 * 1e6:5.2f} TB/s) {t_ref / t:4.2f}x  "
                      f"max|diff| {err:.2e}")


if __name__ == "__main__":
    main()

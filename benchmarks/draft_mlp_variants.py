"""Why `draft_mlp.norm_gate_up` is slower than XLA's three kernels (BENCHMARKS.md
2026-12-06 d: 9.8 us against 6.5 at SmolLM2's 64 rows, while a plain gate/up GEMM tile
reads in 3.3 us). Variants of the kernel, each at the same tile:
  ss    loop: the rows' sum of squares from the x tile of each hidden step (the library);
        pre: a separate walk over x before the matmul walk; none: no norm (r = 1)
  pairs halves: W = [gate | up] (the library); paired: each program's gate and up columns
        adjacent in memory (a column permutation done once, outside the timing)

    PYTHONPATH=. python -m benchmarks.draft_mlp_variants [--rows 64,128] [--model M]

Times: all kernels a layer and the chain's wall time a layer (30 distinct weight sets,
each layer's input depending on the last), kernels from a trace.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from benchmarks.kernel_profile import kernel_times
from benchmarks.tune_draft_gemm import chain
from pallas_kernels.common import dot, pow2_at_least, whole
from pallas_kernels.draft_mlp import norm_gate_up_reference
from vegas_jax.config import get_config
from vegas_jax.model import rms_norm


def _kernel(x_ref, w_ref, o_ref, *, m, h, f, eps, bm, bk, bn, ss_mode, paired):
    # x_ref [m, h]; w_ref [h, 2f]; o_ref [m, f]
    i, j = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * bm, bm)
    ok = (i * bm + jnp.arange(bm) < m)[:, None]  # [bm, 1]
    g0, u0 = (2 * j * bn, 2 * j * bn + bn) if paired else (j * bn, f + j * bn)

    def x_at(k0):
        return pltr.load(x_ref.at[rows, pl.ds(k0, bk)], mask=ok, other=0.0)  # [bm, bk]

    def step(kb, carry):
        acc_g, acc_u, ss = carry
        k0 = kb * bk
        xb = x_at(k0)
        wg = w_ref[pl.ds(k0, bk), pl.ds(g0, bn)]  # [bk, bn]
        wu = w_ref[pl.ds(k0, bk), pl.ds(u0, bn)]
        if ss_mode == "loop":
            xf = xb.astype(jnp.float32)
            ss = ss + jnp.sum(xf * xf, axis=1)
        return acc_g + dot(xb, wg), acc_u + dot(xb, wu), ss

    ss = jnp.zeros((bm,), jnp.float32)
    if ss_mode == "pre":
        def sq(kb, s):
            xf = x_at(kb * bk).astype(jnp.float32)
            return s + jnp.sum(xf * xf, axis=1)
        ss = lax.fori_loop(0, h // bk, sq, ss)
    zero = jnp.zeros((bm, bn), jnp.float32)
    acc_g, acc_u, ss = lax.fori_loop(0, h // bk, step, (zero, zero, ss))
    if ss_mode == "none":
        g, u = acc_g, acc_u
    else:
        r = lax.rsqrt(ss / h + eps)[:, None]  # [bm, 1]
        g, u = acc_g * r, acc_u * r
    out = g / (1.0 + jnp.exp(-g)) * u
    pltr.store(o_ref.at[rows, pl.ds(j * bn, bn)], out.astype(o_ref.dtype),
               mask=jnp.broadcast_to(ok, (bm, bn)))


def variant(x, w, *, eps, bm=64, bk=64, bn=16, nw=4, ns=4, ss_mode="loop", paired=False,
            interpret=False):
    m, h = x.shape
    f = w.shape[-1] // 2
    bm = min(bm, pow2_at_least(m))
    kernel = functools.partial(_kernel, m=m, h=h, f=f, eps=eps, bm=bm, bk=bk, bn=bn,
                               ss_mode=ss_mode, paired=paired)
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(m, bm), f // bn),
        in_specs=[whole(x.shape), whole(w.shape)], out_specs=whole((m, f)),
        out_shape=jax.ShapeDtypeStruct((m, f), x.dtype),
        compiler_params=pltr.CompilerParams(num_warps=nw, num_stages=ns),
        interpret=interpret, name="vegas_draft_mlp")(x, w)


def pair_columns(w, bn):
    """[h, 2f] = [gate | up] -> each bn gate columns followed by the same bn up columns."""
    h, f2 = w.shape[-2], w.shape[-1]
    f = f2 // 2
    g = w[..., :f].reshape(*w.shape[:-1], f // bn, 1, bn)
    u = w[..., f:].reshape(*w.shape[:-1], f // bn, 1, bn)
    return jnp.concatenate([g, u], axis=-2).reshape(*w.shape[:-2], h, f2)


def per_layer(fn, x, w, layers):
    kern = kernel_times(lambda: fn(x, w), n=3)
    total = sum(t for _, t in kern.values()) / layers
    own = sum(t for k, (_, t) in kern.items() if "draft_mlp" in k) / layers
    jax.block_until_ready(fn(x, w))
    t0 = time.perf_counter()
    for _ in range(20):
        out = fn(x, w)
    jax.block_until_ready(out)
    return total, own, (time.perf_counter() - t0) / 20 / layers * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", default="64,128")
    p.add_argument("--layers", type=int, default=30)
    a = p.parse_args()
    cfg = get_config(a.model)
    h, f, eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
    opts = {"xla_gpu_enable_triton_gemm": False}
    print(f"{jax.devices()[0].device_kind}, {a.model}, {a.layers} weight sets")
    for m in (int(r) for r in a.rows.split(",")):
        key = jax.random.PRNGKey(m)
        w = jax.random.normal(key, (a.layers, h, 2 * f), jnp.bfloat16) * 0.02
        x = jax.random.normal(jax.random.fold_in(key, 1), (m, h), jnp.bfloat16)

        def xla(x, w):
            gu = rms_norm(x, None, eps) @ w
            return jax.nn.silu(gu[:, :f]) * gu[:, f:]

        ref = norm_gate_up_reference(x, w[-1], eps=eps).astype(jnp.float32)
        t, _, wall = per_layer(chain(xla, a.layers, opts), x, w, a.layers)
        print(f"M {m}: XLA all kernels {t:6.2f} us, wall {wall:6.2f} us a layer")
        grid = itertools.product(("loop", "pre", "none"), (False, True), (16, 32), (3, 4))
        for ss_mode, paired, bn, ns in grid:
            wv = pair_columns(w, bn) if paired else w
            fn = chain(functools.partial(variant, eps=eps, bn=bn, ns=ns, ss_mode=ss_mode,
                                         paired=paired), a.layers, opts)
            try:
                out = fn(x, wv)[1].astype(jnp.float32)
                err = float(jnp.max(jnp.abs(out - ref))) if ss_mode != "none" else float("nan")
                t2, own, wall2 = per_layer(fn, x, wv, a.layers)
            except Exception as e:  # noqa: BLE001 - a tile Triton rejects
                print(f"    {ss_mode} {paired} n{bn} s{ns}: {type(e).__name__}: {e}"[:200])
                continue
            print(f"    ss {ss_mode:4s} {'paired' if paired else 'halves'} n{bn:2d} s{ns} "
                  f"all {t2:6.2f} us (kernel {own:5.2f}), wall {wall2:6.2f} us "
                  f"({t / t2:4.2f}x, wall {wall / wall2:4.2f}x) max|diff| {err:.1e}")


if __name__ == "__main__":
    main()

"""GPU benchmark for the Pallas kernels (one command, prints a table).

    PYTHONPATH=. python3 -m benchmarks.kernels [full|fast|focus] [--budget-s S] [--quick]
        [--smoke] [--out DIR]

full (the default mode):
1. read ceiling (fused read-only reductions over 4 GiB, in-jit loops);
2. correctness of every kernel vs its jnp reference on the GPU;
3. a small tuning sweep, then verify attention (capture none / mean) at Qwen3-8B shapes
   (Hkv 8, G 4, D 128) vs the XLA reference and cuDNN; bandwidth as % of the ceiling;
4. sparse attention at 7 % vs the dense (decode) kernel; 5. top-k cost; 6. prefill.
fast: the second pass (multi-shape tuning sweep, pallas tables, top-k at 128K/32K; no
XLA / cuDNN / prefill, which the full run already measured). focus: only the
capture-overhead and one-call selection measurements (issue 4 follow-up).
All timings: loops inside one jit, the layer index rotating over a cache of several
layers (>= 2 GiB in all, so L2 cannot hold it), median of 3 timed runs / iterations.
Writes bench_log.txt and bench.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.sparse_attention import SparseIndex
from pallas_kernels.sparse_attention import sparse_attention as _sparse_attention
from pallas_kernels.sparse_attention import sparse_attention_reference
from pallas_kernels.topk import select_topk_fast
from pallas_kernels.verify_attention import (
    CaptureSpec, VerifyBlocks, cudnn_attention, verify_attention_reference,
)
from pallas_kernels.verify_attention import verify_attention as _verify_attention

MODES = {
    "full": "ceiling, GPU correctness, a 10-variant tuning sweep at B=4/S=32K, verify at all "
            "shapes vs XLA and cuDNN, sparse, top-k, prefill",
    "fast": "second pass: a 6-variant tuning sweep at three shapes, then the pallas tables "
            "with its winner and top-k at the two largest S; no XLA / cuDNN / prefill",
    "focus": "only the capture overhead (none / weight / logit) at 8 verify shapes and the "
             "one-call top-k over all layers (issue 4 follow-up)",
}

# The run's state: main() sets all of it (nothing runs at import time).
T0 = 0.0  # start of the run (time.time())
BUDGET = 540.0  # seconds; shapes that would not fit in what is left are skipped
OUT = "/tmp"  # bench_log.txt and bench.json go here
RESULTS = []
LOG = None
SMOKE = False  # tiny shapes, interpret mode, to check the script itself on a CPU machine
GIB = 1024**3  # 1 MiB in smoke mode
FAST = False  # the "fast" mode (second pass)
verify_attention = _verify_attention  # with interpret=True in smoke mode
sparse_attention = _sparse_attention


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


def left():
    return BUDGET - (time.time() - T0)


def record(**kw):
    RESULTS.append(kw)
    log(json.dumps(kw))


def timeit(fn, *args, n):
    """fn is jitted and runs n iterations inside; returns seconds per iteration."""
    jax.block_until_ready(fn(*args))  # compile + warm
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / n


def loop_jit(op, n, n_layers):
    """op(i, layer, *args) -> pytree; returns jit(args) running n iterations."""
    @jax.jit
    def run(*args):
        def body(i, acc):
            res = op(i, (i % n_layers).astype(jnp.int32), *args)
            tot = sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree_util.tree_leaves(res))
            return acc + tot
        return lax.fori_loop(0, n, body, jnp.float32(0))
    return run


def capture_spec(capture, rows, score="weight"):
    """The kernels' capture for a (mode, rows, score) row of these tables ("none": None)."""
    return None if capture == "none" else CaptureSpec(tuple(rows), capture, score)


def cudnn(q, kc, vc, layer, q_pos):
    """cuDNN's prefill in the verify kernel's call shape (rows at 0..t-1; no capture)."""
    del q_pos
    return cudnn_attention(q, kc, vc, layer), None


# ---------------------------------------------------------------- read ceiling
def read_ceiling():
    x = jax.random.normal(jax.random.PRNGKey(0), (2 * GIB,), jnp.bfloat16)  # 4 GiB
    x = x.reshape(16384, -1)
    n = 20
    f1 = jax.jit(lambda x: lax.fori_loop(
        0, n, lambda i, a: a + (x + i.astype(x.dtype)).sum(dtype=jnp.float32), 0.0))
    f2 = jax.jit(lambda x: lax.fori_loop(
        0, n, lambda i, a: a + (x + i.astype(x.dtype)).max(axis=0).astype(jnp.float32).sum(),
        0.0))
    bw = []
    for name, f in (("sum", f1), ("max0", f2)):
        t = timeit(f, x, n=n)
        bw.append(x.nbytes / t)
        record(kind="ceiling", name=name, bytes=x.nbytes, us=t * 1e6, tbps=x.nbytes / t / 1e12)
    del x
    return max(bw)


# ---------------------------------------------------------------- correctness
def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _check_verify(kc, vc, key, cases, finite=False):
    """Verify kernel vs reference for (t, capture, rows, score) cases at ragged positions."""
    _, b, kh, s, d = kc.shape
    g = 4
    ok = True
    for t, cap, rows, score in cases:
        q = jax.random.normal(key, (b, t, kh, g, d), jnp.bfloat16) * 2
        qp = jnp.array([[10], [s // 2], [s - t]], jnp.int32) + jnp.arange(t, dtype=jnp.int32)
        kw = dict(capture=capture_spec(cap, rows, score))
        o1, s1 = jax.jit(functools.partial(verify_attention, **kw))(q, kc, vc, jnp.int32(1), qp)
        o2, s2 = jax.jit(functools.partial(verify_attention_reference, **kw))(
            q, kc, vc, jnp.int32(1), qp)
        e_o = rel(o1, o2)
        e_s = None if s1 is None else rel(s1, s2)
        good = e_o < 1e-2 and (e_s is None or e_s < 1e-2)
        if finite:
            good = good and np.isfinite(np.asarray(o1, np.float32)).all()
        ok &= bool(good)
        record(kind="check", op="verify", t=t, capture=cap, score=score, err_out=e_o,
               err_score=e_s, ok=bool(good))
    return ok


def _check_prefill(kc, vc, key, impls, label):
    """Prefill (query blocks) with capture of the last row, per prefill implementation
    (cuDNN's output only: it captures nothing); cuDNN may be unavailable, which is
    recorded, not failed."""
    t = 700 if not SMOKE else 100
    _, _, kh, _, d = kc.shape
    q = jax.random.normal(key, (2, t, kh, 4, d), jnp.bfloat16)
    kc2, vc2 = kc[:, :2, :, :t + 50], vc[:, :2, :, :t + 50]
    qp = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
    kw = dict(capture=CaptureSpec((t - 1,)))
    o2, s2 = jax.jit(functools.partial(verify_attention_reference, **kw))(q, kc2, vc2, jnp.int32(0), qp)
    ok = True
    for impl in impls:
        try:
            fn = functools.partial(verify_attention, **kw) if impl == "pallas" else cudnn
            o1, s1 = jax.jit(fn)(q, kc2, vc2, jnp.int32(0), qp)
            e_o, e_s = rel(o1, o2), None if s1 is None else rel(s1, s2)
            good = e_o < 1e-2 and (e_s is None or e_s < 1e-2)
        except Exception as e:  # noqa: BLE001
            e_o = e_s = repr(e)[:200]
            good = impl == "cudnn"
        ok &= bool(good)
        record(kind="check", op=label(impl), t=t, err_out=e_o, err_score=e_s, ok=bool(good))
    return ok


def _check_inputs():
    """A 2-layer bf16 cache of odd length (4099) with 3 sequences, and spare keys."""
    ks = jax.random.split(jax.random.PRNGKey(1), 8)
    L, b, kh, d, s = 2, 3, 8, 128, (4099 if not SMOKE else 300)
    kc = jax.random.normal(ks[0], (L, b, kh, s, d), jnp.bfloat16)
    vc = jax.random.normal(ks[1], (L, b, kh, s, d), jnp.bfloat16)
    return ks, kc, vc


def correctness():
    ks, kc, vc = _check_inputs()
    L, b, kh, s, d = kc.shape
    g = 4
    ok = _check_verify(kc, vc, ks[2], [(7, "mean", (0, 6), "weight"), (9, "rows", (0, 8), "logit"),
                                       (1, "none", (0,), "weight"),
                                       (5, "rows", tuple(range(5)), "weight")], finite=True)
    ok &= _check_prefill(kc, vc, ks[3], ("pallas", "cudnn"), lambda impl: f"prefill-{impl}")
    for per_head in (False, True):
        K, W = 300, 16
        ish = (b, kh, K) if per_head else (b, K)
        idx = jax.random.randint(ks[4], ish, 0, s - 100)
        cnt = jnp.full(ish[:-1], 250, jnp.int32)
        q = jax.random.normal(ks[5], (b, 1, kh, g, d), jnp.bfloat16) * 2
        qp = jnp.array([s - 90, s - 20, s - 1], jnp.int32)
        ts_ = qp - 10
        args = (q, kc, vc, jnp.int32(1), SparseIndex(idx, cnt, ts_, qp))
        o1 = jax.jit(functools.partial(sparse_attention, tail_len=W))(*args)
        o2 = jax.jit(functools.partial(sparse_attention_reference, tail_len=W))(*args)
        e = rel(o1, o2)
        ok &= e < 1e-2
        record(kind="check", op="sparse", per_head=per_head, err_out=e, ok=bool(e < 1e-2))
    return ok


# ---------------------------------------------------------------- verify timings
def make_cache(b, s, kh=8, d=128, min_bytes=None):
    min_bytes = 2 * GIB if min_bytes is None else min_bytes  # GIB is set by main()
    per_layer = 2 * b * kh * s * d * 2
    L = max(2, min(64, -(-min_bytes // per_layer)))
    key = jax.random.PRNGKey(b * 7 + s)
    kc = jax.random.normal(key, (L, b, kh, s, d), jnp.bfloat16)
    vc = jax.random.normal(jax.random.fold_in(key, 1), (L, b, kh, s, d), jnp.bfloat16)
    return kc, vc, L, per_layer


def verify_loop(b, s, t, L, kc, vc, per_layer, impl, capture, n, tune=None, score="weight"):
    """tune: VerifyBlocks fields as a dict (recorded as such in bench.json)."""
    g, kh, d = 4, 8, 128
    q = jax.random.normal(jax.random.PRNGKey(3), (b, t, kh, g, d), jnp.bfloat16)
    qp = jnp.broadcast_to(s - t + jnp.arange(t, dtype=jnp.int32), (b, t))
    kw = dict(capture=capture_spec(capture, (0, t - 1), score))
    if impl == "pallas":
        fn = functools.partial(verify_attention, **kw, blocks=VerifyBlocks(**(tune or {})))
    elif impl == "xla":
        fn = functools.partial(verify_attention_reference, **kw)
    else:
        raise ValueError(impl)
    run = loop_jit(lambda i, li, q, kc, vc, qp: fn(q, kc, vc, li, qp), n, L)
    return timeit(run, q, kc, vc, qp, n=n)


def cudnn_loop(b, s, t, n):
    """cuDNN flash attention on a pre-transposed [L, b, s, kh, d] cache (its best case:
    the transpose a [L,b,kh,s,d] cache would need is not counted); key lengths mask only
    (no intra-block causality), so a lower bound on its verify time."""
    g, kh, d = 4, 8, 128
    per_layer = 2 * b * kh * s * d * 2
    L = max(2, min(64, -(-2 * GIB // per_layer)))
    kc = jax.random.normal(jax.random.PRNGKey(5), (L, b, s, kh, d), jnp.bfloat16)
    vc = jax.random.normal(jax.random.PRNGKey(6), (L, b, s, kh, d), jnp.bfloat16)
    q = jax.random.normal(jax.random.PRNGKey(3), (b, t, kh * g, d), jnp.bfloat16)
    lens = jnp.full((b,), s, jnp.int32)

    def op(i, li, q, kc, vc, lens):
        return jax.nn.dot_product_attention(q, kc[li], vc[li], key_value_seq_lengths=lens,
                                            implementation="cudnn")
    run = loop_jit(op, n, L)
    return timeit(run, q, kc, vc, lens, n=n), per_layer


def sweep2(ceil_bw):
    """Tuning at several shapes; picks the config with the lowest geometric-mean time of
    the capture-on verify over them."""
    variants = [dict(), dict(block_k=128), dict(target_programs=1056),
                dict(target_programs=2112), dict(block_k=128, target_programs=1056),
                dict(block_k=256, num_warps=8)]
    if SMOKE:
        variants = variants[:2]
    logt = {i: 0.0 for i in range(len(variants))}
    shapes = [(1, 131072, 7), (4, 131072, 7), (16, 32768, 9)] if not SMOKE else [(1, 512, 7)]
    for b, s, t in shapes:
        kc, vc, L, per_layer = make_cache(b, s)
        n = reps_for(per_layer, 0.8 * ceil_bw)
        for vi, tune in enumerate(variants):
            row = dict(kind="tune2", B=b, S=s, gamma=t - 1, tune=tune)
            for cap in ("none", "mean"):
                try:
                    tt = verify_loop(b, s, t, L, kc, vc, per_layer, "pallas", cap, n, tune)
                    row[f"{cap}_us"] = tt * 1e6
                    row[f"{cap}_frac"] = per_layer / tt / ceil_bw
                except Exception as e:  # noqa: BLE001
                    row[f"{cap}_err"] = repr(e)[:200]
            logt[vi] += math.log(row.get("mean_us", 1e9))
            record(**row)
        del kc, vc
    bi = min(logt, key=logt.get)
    return variants[bi]


def reps_for(bytes_, bw):
    if SMOKE:
        return 2
    est = bytes_ / bw
    return int(max(8, min(400, 0.03 / max(est, 1e-6))))


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="modes:\n" + "\n".join(textwrap.fill(d, 88, initial_indent=f"  {m:7}",
                                                    subsequent_indent=" " * 9)
                                      for m, d in MODES.items()))
    p.add_argument("mode", nargs="?", default="full", choices=tuple(MODES),
                   help="what to measure (default: full; see below)")
    p.add_argument("--budget-s", type=float, default=540.0, metavar="S",
                   help="wall-clock budget in seconds: shapes that would not fit in what is "
                        "left are skipped (default: 540)")
    p.add_argument("--quick", action="store_true",
                   help="full / fast: one verify shape (B=4, S=32K, gamma 6) and no prefill; "
                        "focus ignores it")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and Pallas interpret mode: checks the script itself on a "
                        "CPU machine (the numbers mean nothing)")
    p.add_argument("--out", default="/tmp", metavar="DIR",
                   help="directory for bench_log.txt and bench.json (default: /tmp)")
    return p


def main(argv=None) -> int:
    global T0, BUDGET, OUT, RESULTS, LOG, SMOKE, GIB, FAST, verify_attention, sparse_attention
    args = build_parser().parse_args(argv)
    T0 = time.time()
    BUDGET = args.budget_s
    OUT = args.out
    RESULTS = []
    SMOKE = args.smoke
    GIB = 1024**3 if not SMOKE else 1024**2
    FAST = args.mode == "fast"
    if SMOKE:
        verify_attention = functools.partial(_verify_attention, interpret=True)
        sparse_attention = functools.partial(_sparse_attention, interpret=True)
    else:
        verify_attention, sparse_attention = _verify_attention, _sparse_attention
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "bench_log.txt"), "w") as fh:
        LOG = fh
        try:
            if args.mode == "focus":
                focus_main()
            else:
                full_main(args.quick)
        finally:
            LOG = None
    return 0


def full_main(quick):
    log("device:", jax.devices()[0].device_kind, "jax", jax.__version__)
    ceil_bw = read_ceiling()
    log(f"read ceiling {ceil_bw / 1e12:.2f} TB/s")
    ok = correctness()
    log("correctness:", "PASS" if ok else "FAIL")

    # tuning sweep at one shape
    b, s, t = 4, (32768 if not SMOKE else 512), 7
    kc, vc, L, per_layer = make_cache(b, s)
    n = reps_for(per_layer, 0.8 * ceil_bw)
    best, best_t = {}, None
    sweep = [dict(), dict(block_k=32), dict(block_k=128), dict(num_warps=8),
             dict(num_stages=2), dict(num_stages=4), dict(target_programs=264),
             dict(target_programs=1056), dict(block_k=128, num_warps=8),
             dict(block_k=32, num_stages=4, target_programs=1056)]
    if SMOKE or FAST:
        sweep = [dict()]
    for tune in sweep:
        try:
            tt = verify_loop(b, s, t, L, kc, vc, per_layer, "pallas", "mean", n, tune)
        except Exception as e:  # noqa: BLE001
            record(kind="tune", tune=tune, error=repr(e)[:300])
            continue
        record(kind="tune", tune=tune, us=tt * 1e6, frac=per_layer / tt / ceil_bw)
        if best_t is None or tt < best_t:
            best, best_t = tune, tt
    del kc, vc
    if FAST:
        best = sweep2(ceil_bw)
    log("best verify tuning:", best)

    Bs = (1, 4, 16)
    Ss = (131072, 32768, 8192)  # the targets are at S >= 32K: those first
    gammas = (4, 6, 8)
    if quick:
        Bs, Ss, gammas = (4,), (32768,), (6,)
    if SMOKE:
        Bs, Ss, gammas = (1,), (512,), (6,)
    # top-k over [B, S] with k = 7 %
    for s in (Ss[:2] if FAST else Ss):
        for b in Bs:
            if left() < 40:
                break
            k = int(math.ceil(0.07 * s))
            x = jax.random.normal(jax.random.PRNGKey(11), (b, s), jnp.float32)
            nt = 20 if not SMOKE else 2
            row = dict(kind="topk", B=b, S=s, k=k)
            ref = set(map(tuple, np.argwhere(np.zeros(1))))  # placeholder
            exact = np.asarray(lax.top_k(x, k)[1])
            meths = {"top_k": lambda x: lax.top_k(x, k)[1],
                     "approx_max_k": lambda x: lax.approx_max_k(x, k, recall_target=0.95)[1],
                     "fast": lambda x: select_topk_fast(x, k)}
            for name, f in meths.items():
                try:
                    run = jax.jit(lambda x, f=f: lax.fori_loop(
                        0, nt, lambda i, a: a + f(x + i.astype(jnp.float32) * 1e-30).sum(), 0))
                    tt = timeit(run, x, n=nt)
                    got = np.asarray(jax.jit(f)(x))
                    rec = np.mean([len(set(got[r]) & set(exact[r])) / k for r in range(b)])
                    row[f"{name}_us"] = tt * 1e6
                    row[f"{name}_recall"] = float(rec)
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_err"] = repr(e)[:200]
            record(**row)
            del ref

    dense_decode = {}
    for s in Ss:
        for b in Bs:
            if left() < 120:
                log("time budget: skipping", b, s)
                continue
            kc, vc, L, per_layer = make_cache(b, s)
            n = reps_for(per_layer, 0.8 * ceil_bw)
            for gamma in gammas:
                t = gamma + 1
                row = dict(kind="verify", B=b, S=s, gamma=gamma)
                for impl, cap in [("pallas", "none"), ("pallas", "mean"), ("xla", "none"),
                                  ("xla", "mean")]:
                    if impl == "xla" and (gamma != 6 or FAST):
                        continue
                    try:
                        tt = verify_loop(b, s, t, L, kc, vc, per_layer, impl, cap,
                                         n if impl == "pallas" else max(4, n // 8), best)
                        row[f"{impl}_{cap}_us"] = tt * 1e6
                        row[f"{impl}_{cap}_frac"] = per_layer / tt / ceil_bw
                    except Exception as e:  # noqa: BLE001
                        row[f"{impl}_{cap}_err"] = repr(e)[:200]
                record(**row)
            # dense decode (t = 1) for the sparse comparison
            try:
                dense_decode[(b, s)] = verify_loop(b, s, 1, L, kc, vc, per_layer, "pallas",
                                                   "none", n, best)
            except Exception as e:  # noqa: BLE001
                log("decode err", repr(e)[:200])
            # sparse at 7 %
            K = int(math.ceil(0.07 * s))
            W = 16
            for per_head in (False, True):
                if per_head and ((b, s) != (4, 131072) or FAST) and not (quick or SMOKE):
                    continue
                ish = (b, 8, K) if per_head else (b, K)
                idx = jax.random.randint(jax.random.PRNGKey(9), ish, 0, s - W)
                cnt = jnp.full(ish[:-1], K, jnp.int32)
                q = jax.random.normal(jax.random.PRNGKey(4), (b, 1, 8, 4, 128), jnp.bfloat16)
                qp = jnp.full((b,), s - 1, jnp.int32)
                tsa = qp - W + 1
                sb = 2 * b * 8 * (K + W) * 128 * 2
                ns = reps_for(sb, 0.3 * ceil_bw)
                srow = dict(kind="sparse", B=b, S=s, K=K, per_head=per_head)
                for name, fn in [("pallas", functools.partial(sparse_attention, tail_len=W)),
                                 ("xla", functools.partial(sparse_attention_reference, tail_len=W))]:
                    try:
                        run = loop_jit(lambda i, li, q, kc, vc, idx, cnt, tsa, qp, fn=fn:
                                       fn(q, kc, vc, li, SparseIndex(idx, cnt, tsa, qp)),
                                       ns, L)
                        tt = timeit(run, q, kc, vc, idx, cnt, tsa, qp, n=ns)
                        srow[f"{name}_us"] = tt * 1e6
                        srow[f"{name}_tbps"] = sb / tt / 1e12
                    except Exception as e:  # noqa: BLE001
                        srow[f"{name}_err"] = repr(e)[:200]
                if (b, s) in dense_decode and "pallas_us" in srow:
                    srow["dense_decode_us"] = dense_decode[(b, s)] * 1e6
                    srow["speedup"] = dense_decode[(b, s)] * 1e6 / srow["pallas_us"]
                record(**srow)
            del kc, vc
            # cuDNN comparison (gamma 6)
            if left() > 100 and not FAST:
                try:
                    tc, pl_ = cudnn_loop(b, s, 7, n)
                    record(kind="cudnn", B=b, S=s, gamma=6, us=tc * 1e6,
                           frac=pl_ / tc / ceil_bw)
                except Exception as e:  # noqa: BLE001
                    record(kind="cudnn", B=b, S=s, gamma=6, error=repr(e)[:300])

    # prefill: pallas query-block kernel vs cuDNN (B=1, causal from position 0)
    for t in ((8192, 32768) if not SMOKE else (256,)):
        if left() < 40 or quick or FAST:
            break
        kc = jax.random.normal(jax.random.PRNGKey(12), (1, 1, 8, t, 128), jnp.bfloat16)
        vc = jax.random.normal(jax.random.PRNGKey(13), (1, 1, 8, t, 128), jnp.bfloat16)
        q = jax.random.normal(jax.random.PRNGKey(14), (1, t, 8, 4, 128), jnp.bfloat16)
        qp = jnp.arange(t, dtype=jnp.int32)[None]
        flops = 4 * 32 * 128 * t * t / 2
        row = dict(kind="prefill", T=t)
        for impl in ("pallas", "cudnn"):
            try:
                fn = verify_attention if impl == "pallas" else cudnn
                run = loop_jit(lambda i, li, q, kc, vc, qp, fn=fn: fn(q, kc, vc, li, qp)[0], 3, 1)
                tt = timeit(run, q, kc, vc, qp, n=3)
                row[f"{impl}_ms"] = tt * 1e3
                row[f"{impl}_tflops"] = flops / tt / 1e12
            except Exception as e:  # noqa: BLE001
                row[f"{impl}_err"] = repr(e)[:200]
        record(**row)

    with open(os.path.join(OUT, "bench.json"), "w") as fh:
        json.dump(dict(ceiling_tbps=ceil_bw / 1e12, best_tune=best, results=RESULTS), fh,
                  indent=1)
    table(ceil_bw, best)


def table(ceil_bw, best):
    f = lambda v, p=1: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))  # noqa: E731
    for r in RESULTS:
        if r["kind"] == "tune2":
            log(f"tune2 B={r['B']} S={r['S']} gamma={r['gamma']} {r['tune']}: none "
                f"{f(r.get('none_us'))} ({f(100 * r.get('none_frac', 0))}%)  mean {f(r.get('mean_us'))}"
                f" ({f(100 * r.get('mean_frac', 0))}%)")
    log(f"\n== read ceiling {ceil_bw / 1e12:.2f} TB/s; verify tuning {best}")
    log("verify (us per layer call; % = K+V bytes / time / read ceiling)")
    log(f"{'B':>3} {'S':>7} {'g':>2} | {'pal none':>9} {'%':>5} | {'pal cap':>9} {'%':>5} {'ovh%':>5}"
        f" | {'xla none':>9} {'xla cap':>9}")
    for r in RESULTS:
        if r["kind"] != "verify":
            continue
        a, c = r.get("pallas_none_us"), r.get("pallas_mean_us")
        ovh = None if a is None or c is None else 100 * (c / a - 1)
        log(f"{r['B']:>3} {r['S']:>7} {r['gamma']:>2} | {f(a):>9} {f(100 * r.get('pallas_none_frac', 0) if a else None):>5}"
            f" | {f(c):>9} {f(100 * r.get('pallas_mean_frac', 0) if c else None):>5} {f(ovh):>5}"
            f" | {f(r.get('xla_none_us')):>9} {f(r.get('xla_mean_us')):>9}")
    log("cuDNN (gamma 6, pre-transposed cache, no intra-block causality)")
    for r in RESULTS:
        if r["kind"] == "cudnn":
            log(f"  B={r['B']} S={r['S']}: {f(r.get('us'))} us  {f(100 * r['frac']) if 'frac' in r else r.get('error', '')[:120]}")
    log("sparse 7 % (+16 tail) vs dense decode kernel (us)")
    for r in RESULTS:
        if r["kind"] == "sparse":
            log(f"  B={r['B']:>2} S={r['S']:>6} K={r['K']:>5} per_head={r['per_head']!s:5}: pallas {f(r.get('pallas_us'))}"
                f" ({f(r.get('pallas_tbps'), 2)} TB/s)  xla {f(r.get('xla_us'))}  dense {f(r.get('dense_decode_us'))}"
                f"  speedup {f(r.get('speedup'))}x")
    log("top-k over [B, S], k = 7 % (us per call; recall vs lax.top_k)")
    for r in RESULTS:
        if r["kind"] == "topk":
            log(f"  B={r['B']:>2} S={r['S']:>6}: " + "  ".join(
                f"{m} {f(r.get(m + '_us'))} ({f(r.get(m + '_recall'), 4)})"
                for m in ("top_k", "approx_max_k", "fast")))
    for r in RESULTS:
        if r["kind"] == "prefill":
            log(f"prefill T={r['T']}: pallas {f(r.get('pallas_ms'), 2)} ms ({f(r.get('pallas_tflops'))} TF/s)"
                f"  cudnn {f(r.get('cudnn_ms'), 2)} ms ({f(r.get('cudnn_tflops'))} TF/s) {r.get('pallas_err', '')}{r.get('cudnn_err', '')}")
    log(f"total {time.time() - T0:.0f} s")


# ---------------------------------------------------------------- focused mode
def focus_correctness():
    ks, kc, vc = _check_inputs()
    ok = _check_verify(kc, vc, ks[2], [(7, "mean", (0, 6), "weight"), (7, "mean", (0, 6), "logit"),
                                       (9, "rows", (0, 8), "logit"), (5, "rows", (0, 4, 4), "weight"),
                                       (1, "mean", (0,), "weight"), (1, "none", (0,), "weight")])
    ok &= _check_prefill(kc, vc, ks[3], ("pallas",), lambda impl: "prefill")
    return ok


def focus_main():
    log("device:", jax.devices()[0].device_kind, "jax", jax.__version__, "FOCUS")
    ceil_bw = read_ceiling()
    log(f"read ceiling {ceil_bw / 1e12:.2f} TB/s")
    ok = focus_correctness()
    log("correctness:", "PASS" if ok else "FAIL")

    # selection: one call over all layers, k = 7 %
    shapes = [(36, 4, 131072), (36, 16, 32768), (30, 64, 8192)] if not SMOKE else [(3, 2, 1000)]
    for L, b, s in shapes:
        if left() < 60:
            log("time budget: skipping topk", L, b, s)
            continue
        k = int(math.ceil(0.07 * s))
        key = jax.random.PRNGKey(L * b)
        x = jnp.exp(2.0 * jax.random.normal(key, (L, b, s), jnp.float32)) / s
        # ranked range shorter than s (masked with -inf like select_topk); one short row
        r_end = jnp.full((b,), s - 77, jnp.int32).at[0].set(k // 2)
        x = jnp.where(jnp.arange(s)[None, None, :] <= r_end[None, :, None], x, -jnp.inf)
        nt = 5 if not SMOKE else 2
        row = dict(kind="topk_all", L=L, B=b, S=s, k=k)
        ref_v = jnp.sort(lax.top_k(x, k)[0], axis=-1)
        meths = {"top_k": lambda x: lax.top_k(x, k)[1],
                 "fast": lambda x: select_topk_fast(x, k),
                 "fused": lambda x: select_topk_fast(x, k, threshold="fused",
                                                     interpret=SMOKE)}
        for name, f in meths.items():
            if left() < 30:
                break
            try:
                run = jax.jit(lambda x, f=f: lax.fori_loop(
                    0, nt, lambda i, a: a + f(x + i.astype(jnp.float32) * 1e-38).sum(), 0))
                tt = timeit(run, x, n=nt)
                idx = jax.jit(f)(x)
                got_v = jnp.sort(jnp.take_along_axis(x, idx, axis=-1), axis=-1)
                distinct = jnp.all(jnp.diff(jnp.sort(idx, axis=-1), axis=-1) > 0)
                same = bool(jnp.all(got_v == ref_v)) and bool(distinct)
                row[f"{name}_us"] = tt * 1e6
                row[f"{name}_exact"] = same
            except Exception as e:  # noqa: BLE001
                row[f"{name}_err"] = repr(e)[:200]
        record(**row)
        del x

    # capture overhead: none vs mean(weight) vs mean(logit), gamma 6 (8 at two shapes)
    cfgs = [(4, 131072, (6, 8)), (16, 32768, (6, 8)), (1, 131072, (6,)), (16, 131072, (6,)),
            (4, 32768, (6,)), (1, 32768, (6,))]
    if SMOKE:
        cfgs = [(1, 512, (6,))]
    for b, s, gams in cfgs:
        if left() < 35:
            log("time budget: skipping verify", b, s)
            continue
        kc, vc, L, per_layer = make_cache(b, s)
        n = reps_for(per_layer, 0.8 * ceil_bw)
        for gamma in gams:
            row = dict(kind="verify_focus", B=b, S=s, gamma=gamma)
            for name, cap, score in [("none", "none", "weight"), ("weight", "mean", "weight"),
                                     ("logit", "mean", "logit")]:
                try:
                    tt = verify_loop(b, s, gamma + 1, L, kc, vc, per_layer, "pallas", cap, n,
                                     score=score)
                    row[f"{name}_us"] = tt * 1e6
                    row[f"{name}_frac"] = per_layer / tt / ceil_bw
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_err"] = repr(e)[:200]
            record(**row)
        del kc, vc

    with open(os.path.join(OUT, "bench.json"), "w") as fh:
        json.dump(dict(ceiling_tbps=ceil_bw / 1e12, results=RESULTS), fh, indent=1)
    f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    log(f"\n== FOCUS  read ceiling {ceil_bw / 1e12:.2f} TB/s")
    log("verify: us (% ceiling); overhead vs no capture")
    for r in RESULTS:
        if r["kind"] != "verify_focus":
            continue
        a = r.get("none_us")
        parts = []
        for nm in ("none", "weight", "logit"):
            v = r.get(f"{nm}_us")
            if v is None:
                parts.append(f"{nm} {r.get(nm + '_err', '-')[:60]}")
                continue
            o = "" if nm == "none" or a is None else f" +{100 * (v / a - 1):.1f}%"
            parts.append(f"{nm} {v:.1f} ({100 * r[nm + '_frac']:.0f}%){o}")
        log(f"  B={r['B']:>2} S={r['S']:>6} g={r['gamma']}: " + " | ".join(parts))
    log("selection, one call for all layers, k = 7 % (us; exact = same values as lax.top_k)")
    for r in RESULTS:
        if r["kind"] == "topk_all":
            log(f"  [{r['L']},{r['B']},{r['S']}] k={r['k']}: " + "  ".join(
                f"{m} {f(r.get(m + '_us'))} ({r.get(m + '_exact', r.get(m + '_err', '-'))})"
                for m in ("top_k", "fast", "fused")))
    log(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())

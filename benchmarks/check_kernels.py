"""The Pallas kernels against their jnp references on the GPU (compiled, not interpreted).

    PYTHONPATH=. python -m benchmarks.check_kernels

Fresh random inputs for every case; prints the relative L2 error of each and exits non-zero
when one exceeds its bound (bf16: 2e-2, fp32: 1e-3)."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_attention import (
    SparseIndex, StepBlocks, StepSpec, rope_halves, sparse_attention,
    sparse_attention_reference, sparse_step, sparse_step_reference,
)
from pallas_kernels.verify_attention import (
    CaptureSpec, verify_attention, verify_attention_reference,
)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def sparse_cases(seed=0):
    # (L, b, kh, g, d, s, K, tail, per_head, stacked idx, dtype)
    yield (4, 64, 3, 3, 64, 7808, 547, 13, False, True, jnp.bfloat16)  # SmolLM2 vegas draft
    yield (4, 64, 3, 3, 64, 7808, 16, 547, False, False, jnp.bfloat16)  # SmolLM2 stream draft
    yield (2, 4, 8, 4, 128, 8192, 600, 13, True, True, jnp.float32)
    yield (2, 1, 8, 4, 128, 4099, 300, 100, False, True, jnp.bfloat16)


def check_sparse(case, key):
    L, b, kh, g, d, s, K, W, per_head, stacked, dt = case
    ks = jax.random.split(key, 6)
    kc = jax.random.normal(ks[0], (L, b, kh, s, d), jnp.float32).astype(dt)
    vc = jax.random.normal(ks[1], (L, b, kh, s, d), jnp.float32).astype(dt)
    q = (2 * jax.random.normal(ks[2], (b, 1, kh, g, d), jnp.float32)).astype(dt)
    q_pos = jax.random.randint(ks[3], (b,), s // 2, s)
    tail_start = jnp.maximum(q_pos - W + 3, 0)
    ish = (L, b, kh, K) if per_head else (L, b, K)
    idx = jax.random.randint(ks[4], ish, 0, s // 2)
    count = jax.random.randint(ks[5], ish[:-1], 1, K + 1)
    if not stacked:
        idx, count = idx[0], count[0]
    index = SparseIndex(idx, count, tail_start, q_pos, jnp.int32(L - 2) if stacked else None)
    args = (q, kc, vc, jnp.int32(L - 1), index)
    out = jax.jit(lambda *a: sparse_attention(*a, tail_len=W))(*args)
    ref = jax.jit(lambda *a: sparse_attention_reference(*a, tail_len=W))(*args)
    return rel(out, ref)


def step_cases():
    # (L, b, kh, g, d, s, K, tail, qk_norm, whole_from, dtype)
    yield (4, 64, 3, 3, 64, 7808, 547, 13, False, 128, jnp.bfloat16)  # SmolLM2 B 64: one program
    yield (4, 64, 3, 3, 64, 7808, 547, 13, False, 10**6, jnp.bfloat16)  # split + combine
    yield (4, 64, 3, 3, 64, 7808, 16, 547, False, 128, jnp.bfloat16)  # stream's window
    yield (2, 4, 8, 4, 128, 8192, 600, 13, True, 128, jnp.float32)  # Qwen3, split
    yield (2, 16, 8, 4, 128, 8192, 600, 13, True, 128, jnp.bfloat16)  # Qwen3, one program
    yield (2, 1, 3, 3, 64, 4099, 300, 13, False, 128, jnp.bfloat16)  # B 1


def check_step(case, key):
    """The fused draft block vs its reference: output and both written caches."""
    L, b, kh, g, d, s, K, W, qk_norm, unsplit, dt = case
    ks = jax.random.split(key, 7)
    kc = jax.random.normal(ks[0], (L, b, kh, s, d), jnp.float32).astype(dt)
    vc = jax.random.normal(ks[1], (L, b, kh, s, d), jnp.float32).astype(dt)
    qkv = (2 * jax.random.normal(ks[2], (b, 1, (kh * g + 2 * kh) * d), jnp.float32)).astype(dt)
    norms = (1 + 0.3 * jax.random.normal(ks[6], (2, d), jnp.float32)).astype(dt)
    q_pos = jax.random.randint(ks[3], (b,), s // 2, s)
    tail_start = jnp.maximum(q_pos - W + 3, 0)
    idx = jax.random.randint(ks[4], (L, b, K), 0, s // 2)
    count = jax.random.randint(ks[5], (L, b), 1, K + 1)
    emb = q_pos.astype(jnp.float32)[:, None, None] * (
        10000.0 ** (-jnp.arange(0, d, 2) / d))[None, None, :]
    emb = jnp.concatenate([emb, emb], -1)
    spec = StepSpec(tail_len=W, num_heads=kh * g, qk_norm=qk_norm)
    args = (qkv, norms[0], norms[1], rope_halves(jnp.cos(emb), jnp.sin(emb)), kc, vc,
            jnp.int32(L - 1), SparseIndex(idx, count, tail_start, q_pos, jnp.int32(L - 2)))
    ref = jax.jit(lambda *a: sparse_step_reference(*a, spec=spec))(*args)
    out = jax.jit(lambda *a: sparse_step(*a, spec=spec, blocks=StepBlocks(whole_from=unsplit)),
                  donate_argnums=(4, 5))(*args)
    bi, at = jnp.arange(b), jnp.minimum(q_pos, s - 1)
    rows = [rel(o[L - 1, bi, :, at], r[L - 1, bi, :, at]) for o, r in zip(out[1:], ref[1:])]
    v_exact = bool(jnp.array_equal(out[2], ref[2]))  # V is copied as is; nothing else moves
    return max(rel(out[0], ref[0]), *rows) if v_exact else float("inf")


def check_verify(case, key):
    b, kh, g, d, s, t, capture, rows = case
    ks = jax.random.split(key, 4)
    kc = jax.random.normal(ks[0], (2, b, kh, s, d), jnp.float32).astype(jnp.bfloat16)
    vc = jax.random.normal(ks[1], (2, b, kh, s, d), jnp.float32).astype(jnp.bfloat16)
    q = jax.random.normal(ks[2], (b, t, kh, g, d), jnp.float32).astype(jnp.bfloat16)
    n = jax.random.randint(ks[3], (b,), s // 2, s - t)
    q_pos = n[:, None] + jnp.arange(t)
    kw = dict(capture=None if capture == "none" else CaptureSpec(tuple(rows), capture))
    o1, s1 = jax.jit(lambda *a: verify_attention(*a, **kw))(
        q, kc, vc, jnp.int32(1), q_pos)
    o2, s2 = jax.jit(lambda *a: verify_attention_reference(*a, **kw))(q, kc, vc, jnp.int32(1), q_pos)
    return max(rel(o1, o2), rel(s1, s2) if s1 is not None else 0.0)


def check_window(case, key):
    """gpt-oss: a sliding window (a traced int32, as the model's layer loop hands it) and
    sinks; verify / decode from position n, prefill (n 0) of many query blocks."""
    b, kh, g, d, s, t, n0, window, capture, rows = case
    ks = jax.random.split(key, 5)
    kc = jax.random.normal(ks[0], (2, b, kh, s, d), jnp.float32).astype(jnp.bfloat16)
    vc = jax.random.normal(ks[1], (2, b, kh, s, d), jnp.float32).astype(jnp.bfloat16)
    q = jax.random.normal(ks[2], (b, t, kh, g, d), jnp.float32).astype(jnp.bfloat16)
    n = jax.random.randint(ks[3], (b,), s // 2, s - t) if n0 is None else jnp.full((b,), n0)
    q_pos = n[:, None] + jnp.arange(t)
    sinks = 2 + jax.random.normal(ks[4], (kh, g), jnp.float32)
    kw = dict(capture=None if capture == "none" else CaptureSpec(tuple(rows), capture))
    args = (q, kc, vc, jnp.int32(1), q_pos, jnp.int32(window), sinks)
    o1, s1 = jax.jit(lambda *a: verify_attention(*a[:5], window=a[5], sinks=a[6], **kw))(*args)
    o2, s2 = jax.jit(lambda *a: verify_attention_reference(*a[:5], window=a[5], sinks=a[6],
                                                           **kw))(*args)
    return max(rel(o1, o2), rel(s1, s2) if s1 is not None else 0.0)


def check_sparse_sinks(key):
    """A gpt-oss full layer's draft (a selection, sinks at the combine) and a sliding
    one's (nothing selected, the last 128 positions as the tail)."""
    L, b, kh, g, d, s, K, W = 4, 16, 8, 8, 64, 8192, 574, 128
    ks = jax.random.split(key, 6)
    kc = jax.random.normal(ks[0], (L, b, kh, s, d), jnp.float32).astype(jnp.bfloat16)
    vc = jax.random.normal(ks[1], (L, b, kh, s, d), jnp.float32).astype(jnp.bfloat16)
    q = (2 * jax.random.normal(ks[2], (b, 1, kh, g, d), jnp.float32)).astype(jnp.bfloat16)
    q_pos = jax.random.randint(ks[3], (b,), s // 2, s)
    idx = jax.random.randint(ks[4], (L, b, K), 0, s // 2)
    sinks = 2 + jax.random.normal(ks[5], (kh, g), jnp.float32)
    errs = []
    for count, tail_start in ((jnp.full((L, b), K), q_pos - 12),
                              (jnp.zeros((L, b), jnp.int32), jnp.maximum(q_pos - W + 1, 0))):
        args = (q, kc, vc, jnp.int32(L - 1),
                SparseIndex(idx, count, tail_start, q_pos, jnp.int32(1)))
        kw = dict(tail_len=W, sinks=sinks)
        out = jax.jit(lambda *a: sparse_attention(*a, **kw))(*args)
        ref = jax.jit(lambda *a: sparse_attention_reference(*a, **kw))(*args)
        errs.append(rel(out, ref))
    return max(errs)


def main() -> int:
    key = jax.random.PRNGKey(0)
    bad = 0
    for i, case in enumerate(sparse_cases()):
        err = check_sparse(case, jax.random.fold_in(key, i))
        bound = 2e-2 if case[-1] == jnp.bfloat16 else 1e-3
        bad += err > bound
        print(f"sparse {case[:9]} rel err {err:.2e} {'ok' if err <= bound else 'FAIL'}")
    for i, case in enumerate(step_cases()):
        err = check_step(case, jax.random.fold_in(key, 50 + i))
        bound = 2e-2 if case[-1] == jnp.bfloat16 else 1e-3
        bad += err > bound
        print(f"step {case[:10]} rel err {err:.2e} {'ok' if err <= bound else 'FAIL'}")
    for i, case in enumerate([(64, 3, 3, 64, 7808, 7, "mean", (0, 6)),
                              (4, 8, 4, 128, 8192, 7, "rows", tuple(range(7))),
                              (128, 3, 3, 64, 7808, 7, "mean", (0, 6)),
                              (4, 8, 4, 128, 8192, 9, "rows", (0, 8))]):
        err = check_verify(case, jax.random.fold_in(key, 100 + i))
        bad += err > 2e-2
        print(f"verify {case} rel err {err:.2e} {'ok' if err <= 2e-2 else 'FAIL'}")
    # gpt-oss-20b shapes: 8 KV heads of 8 query heads, head dim 64, window 128
    for i, case in enumerate([(4, 8, 8, 64, 8192, 1, None, 128, "none", (0,)),
                              (16, 8, 8, 64, 8192, 7, None, 128, "mean", (0, 6)),
                              (4, 8, 8, 64, 8192, 7, None, 0, "rows", tuple(range(7))),
                              (2, 8, 8, 64, 2048, 1500, 0, 128, "mean", (1499,))]):
        err = check_window(case, jax.random.fold_in(key, 200 + i))
        bad += err > 2e-2
        print(f"window+sinks {case} rel err {err:.2e} {'ok' if err <= 2e-2 else 'FAIL'}")
    err = check_sparse_sinks(jax.random.fold_in(key, 300))
    bad += err > 2e-2
    print(f"sparse+sinks gpt-oss rel err {err:.2e} {'ok' if err <= 2e-2 else 'FAIL'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

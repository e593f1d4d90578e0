"""Weight-only quantized matmul: the formats against a numpy implementation of the same
formulas, the kernel (interpret mode on the CPU) against its reference, its settings and
errors, and its CUDA lowering."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quant_matmul import (FORMATS, QuantBlocks, default_blocks, dequantize,
                                         group_size, quant_matmul, quant_matmul_reference,
                                         quantize, unpack_int4, unpack_int8, weight_shape)
from tests.cuda import lower_cuda

sd = jax.ShapeDtypeStruct


def np_quantize(w, fmt, stored_scale=None):
    """The formats' formulas in numpy, fp32 arithmetic, on w [..., k, n]: (q values as ints
    [..., k, n], scales as stored). stored_scale: divide by it (XLA may round max / 127 one
    ulp apart)."""
    w = np.asarray(w, np.float32)
    k, n = w.shape[-2:]
    g = k if fmt == "int8" else (128 if k % 128 == 0 else 64)
    wg = w.reshape(*w.shape[:-2], k // g, g, n)
    s = np.abs(wg).max(axis=-2) / np.float32(127 if fmt == "int8" else 7)  # [..., k/g, n]
    if fmt == "int4":
        s = np.asarray(jnp.asarray(s).astype(jnp.bfloat16)).astype(np.float32)  # bf16
    if stored_scale is not None:
        s = np.asarray(stored_scale, np.float32).reshape(s.shape)
    safe = np.where(s == 0, np.float32(1), s)
    lim = 127 if fmt == "int8" else 7
    q = np.clip(np.round(wg / safe[..., None, :]), -lim, lim).reshape(w.shape)
    return q, (s[..., 0, :] if fmt == "int8" else s)


def np_unpack(q, fmt, g=None):
    """Stored q -> values [..., k, n]: transposed ([..., n, k]); int4 two a byte, offset 8,
    byte j of a column's group holding rows j (low nibble) and j + g/2 (high)."""
    b = np.swapaxes(np.asarray(q).astype(np.int64), -1, -2)  # [..., k or k/2, n]
    if fmt == "int8":
        return b
    *lead, k2, n = b.shape
    b = b.reshape(*lead, k2 // (g // 2), g // 2, n)
    return np.concatenate([(b & 15) - 8, (b >> 4) - 8], axis=-2).reshape(*lead, 2 * k2, n)


@pytest.mark.parametrize("fmt,shape", [("int8", (64, 24)), ("int8", (3, 128, 40)),
                                       ("int4", (576, 24)), ("int4", (2, 256, 8))])
def test_quantize_matches_numpy_and_round_trips(fmt, shape):
    w = jax.random.normal(jax.random.PRNGKey(len(shape)), shape) * 0.1
    w = w.at[..., 3].set(0.0)  # a zero column: scale 0, q 0, no NaN
    q, s = jax.jit(functools.partial(quantize, fmt=fmt))(w)
    want_q, want_s = np_quantize(w, fmt, stored_scale=s)
    np.testing.assert_allclose(np.asarray(s, np.float32), np_quantize(w, fmt)[1], rtol=1e-6)
    k, n = shape[-2:]
    g = group_size(k) if fmt == "int4" else None
    if fmt == "int8":
        assert q.dtype == jnp.int8 and q.shape == (*shape[:-2], n, k)
        assert s.shape == (*shape[:-2], n)
    else:
        assert q.dtype == jnp.uint8 and q.shape == (*shape[:-2], n, k // 2)
        assert s.dtype == jnp.bfloat16 and s.shape == (*shape[:-2], k // g, n)
    np.testing.assert_array_equal(np_unpack(q, fmt, g), want_q)
    assert weight_shape(q, fmt) == (k, n)
    # dequantize: q * its column's (group's) scale, exactly; within half a step of w
    back = np.asarray(dequantize(q, s, fmt))
    per_row = (want_s[..., None, :] if fmt == "int8"
               else np.repeat(want_s.astype(np.float32), group_size(k), axis=-2))
    np.testing.assert_array_equal(back, (want_q * per_row).astype(np.float32))
    assert np.all(np.isfinite(back)) and np.all(back[..., 3] == 0)
    assert np.all(np.abs(back - np.asarray(w)) <= 0.5 * per_row * 1.01 + 1e-7)


def test_int4_uses_the_symmetric_range():
    w = jnp.linspace(-1.0, 1.0, 128)[:, None] * jnp.ones((1, 2))
    q, s = quantize(w, "int4")
    vals = np_unpack(q, "int4", 128)
    assert vals.min() == -7 and vals.max() == 7


def test_int4_group_is_a_parameter():
    """A group other than `group_size(k)`'s (a study's) packs and dequantizes by the same
    rules, each group's largest |w| at +-7; the kernel takes the default group only."""
    w = jax.random.normal(jax.random.PRNGKey(5), (192, 8)) * 0.1
    q, s = quantize(w, "int4", group=32)
    assert q.shape == (8, 96) and s.shape == (6, 8)
    vals = np_unpack(q, "int4", 32)
    per_row = np.repeat(np.asarray(s, np.float32), 32, axis=0)
    back = np.asarray(dequantize(q, s, "int4"))
    np.testing.assert_array_equal(back, vals * per_row)
    assert np.all(np.abs(vals.reshape(6, 32, 8)).max(axis=1) == 7)
    assert np.all(np.abs(back - np.asarray(w)) <= 0.5 * per_row * 1.01 + 1e-7)
    with pytest.raises(ValueError, match="scale must be"):
        quant_matmul(jnp.ones((2, 192)), q, s, fmt="int4", interpret=True)
    for fmt, g in (("int4", 40), ("int4", 3), ("int8", 32)):
        with pytest.raises(ValueError, match="group must be"):
            quantize(w, fmt, group=g)


def test_group_size():
    assert [group_size(k) for k in (4096, 12288, 576, 1536, 64)] == [128, 128, 64, 128, 64]
    with pytest.raises(ValueError, match="multiple of 64"):
        group_size(100)


# kernel vs reference: M in {1, 3, 8, 16, 40, 256} (the last at one k only), k in {576,
# 1536, 4096}, n not a multiple of the block; the long ones (interpret mode walks every
# block) in the slow tier
CASES = [pytest.param(m, k, id=f"m{m}-k{k}",
                      marks=[pytest.mark.slow] if m * k > 16 * 1536 else [])
         for m, k in [(m, k) for m in (1, 3, 8, 16, 40) for k in (576, 1536, 4096)]
         + [(256, 576)]]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k", CASES)
def test_kernel_matches_reference(fmt, m, k):
    n = 200
    dtype = jnp.bfloat16 if (m + k) % 2 else jnp.float32  # both dtypes across the cases
    kw, kx = jax.random.split(jax.random.PRNGKey(m * 7 + k))
    q, s = quantize(jax.random.normal(kw, (k, n)) * 0.05, fmt)
    x = jax.random.normal(kx, (m, k)).astype(dtype)
    ref = quant_matmul_reference(x, q, s, fmt)
    out = jax.jit(functools.partial(quant_matmul, fmt=fmt, interpret=True))(x, q, s)
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 1e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)


# block settings: row tiles past m, k splits, several groups a step, both unpack settings
# (interpret mode runs "asm" as its jnp equivalent: `test_asm_*` checks the PTX itself),
# narrow and wide columns
SETTINGS = [dict(block_m=16, split_k=3, unpack="jnp"), dict(block_m=32, block_n=32),
            dict(block_m=16, block_k=192, split_k=3, unpack="asm"),
            dict(block_m=64, block_n=256, num_warps=8, num_stages=2)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kw", SETTINGS, ids=[str(i) for i in range(len(SETTINGS))])
def test_block_settings_keep_the_result(fmt, kw):
    m, k, n = 5, 576, 72
    if fmt == "int8" and kw.get("block_k") == 192:  # int8's k tiles are powers of two
        kw = {**kw, "block_k": 64}
    q, s = quantize(jax.random.normal(jax.random.PRNGKey(1), (k, n)) * 0.05, fmt)
    x = jax.random.normal(jax.random.PRNGKey(2), (m, k))
    ref = quant_matmul_reference(x, q, s, fmt)
    out = jax.jit(functools.partial(quant_matmul, fmt=fmt, interpret=True, **kw))(x, q, s)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_leading_dims_and_stacked_layers():
    """x [b, t, k] is flattened and reshaped back; with layer, the kernel reads that layer
    of stacked weights (a traced index too)."""
    for fmt in FORMATS:
        w = jax.random.normal(jax.random.PRNGKey(3), (3, 128, 48)) * 0.05
        q, s = quantize(w, fmt)
        x = jax.random.normal(jax.random.PRNGKey(4), (2, 3, 128))
        out = jax.jit(lambda x, q, s, li: quant_matmul(x, q, s, fmt=fmt, layer=li,
                                                       interpret=True))(x, q, s, 2)
        ref = quant_matmul_reference(x, q[2], s[2], fmt)
        assert out.shape == (2, 3, 48)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_unpack_helpers_are_exact():
    b = jnp.arange(256, dtype=jnp.uint8).reshape(16, 16)
    lo, hi = unpack_int4(b, jnp.float32, asm=False)
    np.testing.assert_array_equal(np.asarray(lo), (np.arange(256) & 15).reshape(16, 16) - 8)
    np.testing.assert_array_equal(np.asarray(hi), (np.arange(256) >> 4).reshape(16, 16) - 8)
    v = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8).reshape(16, 16)
    np.testing.assert_array_equal(np.asarray(unpack_int8(v, jnp.bfloat16, asm=False),
                                             np.float32), np.asarray(v, np.float32))


def test_default_blocks_fill_the_gpu():
    """Valid tiles; k splits until two waves of programs, unless their fp32 partials would
    pass a quarter of the weight's bytes; shared memory within budget."""
    from pallas_kernels.quant_matmul import SMEM_BUDGET, smem_bytes

    for fmt, (m, k, n) in itertools.product(FORMATS, [(1, 4096, 6144), (16, 4096, 6144),
                                                      (1, 12288, 4096), (64, 4096, 24576),
                                                      (256, 4096, 151936), (8, 576, 576)]):
        b = default_blocks(m, k, n, fmt)
        steps = k // b.block_k
        assert k % b.block_k == 0 and steps % b.split_k == 0
        if fmt == "int4":
            assert b.block_k % group_size(k) == 0 and b.unpack == "asm"
        assert smem_bytes(b, fmt) <= SMEM_BUDGET
        w_bytes = k * n // (2 if fmt == "int4" else 1)
        assert b.split_k == 1 or 8 * b.split_k * m * n <= w_bytes // 4
        programs = -(-m // b.block_m) * -(-n // b.block_n) * b.split_k
        if (m, k, n) == (1, 4096, 6144):
            assert programs >= 2 * 132 and b.split_k == 8
    # M 16 at the same shape: fewer splits (their partials are 16 rows)
    assert default_blocks(16, 4096, 6144, "int4").split_k == 4


def test_bad_inputs_raise():
    x = jnp.zeros((2, 128))
    q8, s8 = quantize(jnp.ones((128, 32)), "int8")
    q4, s4 = quantize(jnp.ones((128, 32)), "int4")
    with pytest.raises(ValueError, match="fmt"):
        quant_matmul(x, q8, s8, fmt="int2")
    with pytest.raises(ValueError, match="q must be"):
        quant_matmul(x, q4, s4, fmt="int8")
    with pytest.raises(ValueError, match="q must be"):
        quant_matmul(jnp.zeros((2, 64)), q8, s8, fmt="int8")
    with pytest.raises(ValueError, match="scale must be"):
        quant_matmul(x, q4, s4[:, :5], fmt="int4")
    with pytest.raises(ValueError, match="block_k"):
        quant_matmul(x, q4, s4, fmt="int4", block_k=64)  # below the group
    with pytest.raises(ValueError, match="split_k"):
        quant_matmul(x, q8, s8, fmt="int8", block_k=64, split_k=3)
    with pytest.raises(ValueError, match="block_m"):
        quant_matmul(x, q8, s8, fmt="int8", block_m=8)
    with pytest.raises(ValueError, match="block_k"):
        quant_matmul(x, q8, s8, fmt="int8", block_k=96)  # int8 tiles: powers of two
    with pytest.raises(ValueError, match="block_n"):
        quant_matmul(x, q8, s8, fmt="int8", block_n=48)
    with pytest.raises(ValueError, match="unpack"):
        quant_matmul(x, q8, s8, fmt="int8", unpack="ptx")
    with pytest.raises(ValueError, match="unknown block settings"):
        quant_matmul(x, q8, s8, fmt="int8", block_size=64)
    assert QuantBlocks(16, 64, 64, 1, 4, 3).unpack == "jnp"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kw", [{}, dict(unpack="asm"), dict(unpack="jnp")])
def test_lowers_for_cuda(fmt, kw):
    k, n = 4096, 6144
    qs = ((sd((n, k), jnp.int8), sd((n,), jnp.float32)) if fmt == "int8"
          else (sd((n, k // 2), jnp.uint8), sd((k // 128, n), jnp.bfloat16)))
    txt = lower_cuda(functools.partial(quant_matmul, fmt=fmt, **kw),
                     sd((1, k), jnp.bfloat16), *qs)
    assert "xla.gpu.triton" in txt


@pytest.mark.slow
def test_benchmark_runs_tiny(capsys, tmp_path, monkeypatch):
    """benchmarks/quant_matmul.py end to end on tiny shapes in interpret mode (numbers
    mean nothing on the CPU): its checks pass, its tables print, its JSON is written."""
    import json

    from benchmarks import quant_matmul as bench

    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench.main(["--tiny", "--sweep", "none"]) == 0
    out = capsys.readouterr().out
    assert "checks: PASS" in out and "| tiny | 16 |" in out and "change from the default" in out
    res = json.loads((tmp_path / "quant_matmul.json").read_text())["results"]
    assert {r["variant"] for r in res} == {"bf16", "xla-int8", "xla-int4", "int8", "int4"}


def run_ptx(code: str, word: int) -> tuple[int, int]:
    """The inline PTX of `quant_matmul` on one packed input register ($2), by the PTX ISA's
    rules for the few instructions it uses: its two output registers ($0, $1)."""
    import ml_dtypes
    import re

    regs: dict[str, int] = {"$2": word}

    def val(tok):
        if tok[0].isdigit():
            return int(tok, 0)
        return regs[tok]

    def bf16x2(v):
        return np.array([v & 0xFFFF, v >> 16], np.uint16).view(ml_dtypes.bfloat16).astype(
            np.float64)

    def f32(v):
        return float(np.array([v], np.uint32).view(np.float32)[0])

    for line in code.splitlines():
        m = re.match(r"(\S+)\s+(.*);$", line.strip())
        if not m or m.group(1) == ".reg":
            continue
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        d, src = args[0], [val(a) for a in args[1:]]
        if op == "mov.b32":
            r = src[0]
        elif op in ("and.b32", "xor.b32"):
            r = src[0] & src[1] if op == "and.b32" else src[0] ^ src[1]
        elif op == "shr.u32":
            r = src[0] >> src[1]
        elif op == "prmt.b32":  # d.byte[i] = byte (selector nibble i) of {b, a}
            pool = src[0] | (src[1] << 32)
            r = sum(((pool >> (8 * ((src[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i)
                    for i in range(4))
        elif op == "fma.rn.bf16x2":
            out = (bf16x2(src[0]) * bf16x2(src[1]) + bf16x2(src[2])).astype(ml_dtypes.bfloat16)
            lanes = out.view(np.uint16).astype(np.int64)
            r = int(lanes[0] | (lanes[1] << 16))
        elif op == "sub.f32":
            r = int(np.array([np.float32(f32(src[0])) - np.float32(f32(src[1]))],
                             np.float32).view(np.uint32)[0])
        else:
            raise AssertionError(f"instruction {op} not emulated")
        regs[d] = r & 0xFFFFFFFF
    return regs["$0"], regs["$1"]


def _ptx_values(code, byte_values):
    """4 values a register, element i in byte i; outputs: bf16 pairs, element 0 low."""
    import ml_dtypes

    out = []
    for w in byte_values.reshape(-1, 4).astype(np.int64):
        r0, r1 = run_ptx(code, int(w[0] | (w[1] << 8) | (w[2] << 16) | (w[3] << 24)))
        out.append(np.array([r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16], np.uint16))
    return np.concatenate(out).view(ml_dtypes.bfloat16).astype(np.float32)


def test_asm_int4_matches_the_jnp_unpacking():
    from pallas_kernels.quant_matmul import ASM_HI, ASM_LO

    b = np.arange(256, dtype=np.uint8)
    lo, hi = unpack_int4(jnp.asarray(b.reshape(16, 16)), jnp.float32, asm=False)
    np.testing.assert_array_equal(_ptx_values(ASM_LO, b), np.asarray(lo).ravel())
    np.testing.assert_array_equal(_ptx_values(ASM_HI, b), np.asarray(hi).ravel())


def test_asm_int8_matches_the_cast():
    from pallas_kernels.quant_matmul import ASM_INT8

    v = np.arange(-128, 128).astype(np.int8)
    np.testing.assert_array_equal(_ptx_values(ASM_INT8, v.view(np.uint8)),
                                  v.astype(np.float32))

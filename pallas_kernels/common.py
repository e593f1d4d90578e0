"""Helpers shared by the Pallas (Triton backend) kernels: padding sizes, block specs,
the split-K combine, and the mask constant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

_dot = getattr(pltr, "dot", None) or pl.dot  # moved to pallas.triton in newer jax


def dot(a, b, trans_a=False, trans_b=False):
    """Triton dot with fp32 accumulation; fp32 operands multiply in full fp32, not TF32
    (fp32 results must match the XLA path's; bf16 operands are unaffected)."""
    return _dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=False)


# A finite "minus infinity" for masked logits: exp(NEG - m) is 0 without inf - inf = NaN.
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def pow2_at_least(n: int, lo: int = 16) -> int:
    """Triton tiles need power-of-two sizes (and >= 16 rows for a dot)."""
    p = lo
    while p < n:
        p *= 2
    return p


SMEM_BYTES = 227 * 1024  # shared memory one SM gives its blocks (Hopper)


def sm_count() -> int:
    """Streaming multiprocessors of the default device (Hopper's 132 where JAX reports
    none, e.g. the CPU in interpret mode)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def key_splits(s: int, j: int, block_k: int) -> tuple[int, int]:
    """s keys cut into about j splits of whole key blocks: (split length, splits made)."""
    split = pl.cdiv(pl.cdiv(s, j), block_k) * block_k
    return split, pl.cdiv(s, split)


def wave_splits(per: int, s: int, block_k: int, j0: int, j_max: int, resident: int) -> int:
    """Key splits of s keys (whole blocks of block_k) for `per` programs per split: from
    j0 (the target grid) to j_max or 1.5 * j0, the count whose grid fills its last wave
    best, `resident` programs running at once (the fewest splits among equals: each costs
    a combine)."""
    best, best_eff = j0, 0.0
    for j in range(j0, min(j_max, -(-3 * j0 // 2)) + 1):
        p = per * key_splits(s, j, block_k)[1]
        eff = p / (-(-p // resident) * resident)
        if eff > best_eff + 1e-9:
            best, best_eff = j, eff
    return best


def whole(shape):
    """The whole array as one block: on the GPU just a pointer (no copy of a cache slab);
    the kernel indexes it itself."""
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def combine_splits(o, m, l, *, base2: bool = False, ordered: bool = False):
    """Merge flash-decoding partial results along axis 2.

    o [b, k, J, R, d] unnormalised outputs, m [b, k, J, R] running maxima, l [b, k, J, R]
    running sums (in log2 units when base2). ordered: the splits are added one after
    another (a row's result then never depends on the other rows or the batch). Returns
    (out [b, k, R, d] fp32, lse [b, k, R] in the same units)."""
    # The barrier stops XLA from fusing the max into every consumer (recomputed per use).
    mx = lax.optimization_barrier(m.max(axis=2))  # [b, k, R]
    w = jnp.exp2(m - mx[:, :, None]) if base2 else jnp.exp(m - mx[:, :, None])
    if ordered:
        lsum, acc = l[:, :, 0] * w[:, :, 0], o[:, :, 0] * w[:, :, 0, :, None]
        for j in range(1, o.shape[2]):
            lsum = lsum + l[:, :, j] * w[:, :, j]
            acc = acc + o[:, :, j] * w[:, :, j, :, None]
    else:
        lsum, acc = (l * w).sum(axis=2), (o * w[..., None]).sum(axis=2)
    lsafe = jnp.where(lsum == 0.0, 1.0, lsum)
    out = acc / lsafe[..., None]
    lse = mx + (jnp.log2(lsafe) if base2 else jnp.log(lsafe))
    return out, lse


def with_sinks(out, lse, sinks, *, base2: bool = False):
    """A finished softmax's output and LSE once one more logit per row joins the
    denominator without a value (gpt-oss's attention sinks): out [..., R, d] scales by
    exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink), and the LSE becomes
    logaddexp(lse, sink). lse [..., R] (log2 units when base2), sinks [..., R] natural-log
    logits broadcastable to it. Rows that saw no key (lse very negative) get out 0 and the
    sink's LSE. Returns (out fp32, lse) in lse's units."""
    s = sinks.astype(jnp.float32) * (1.4426950408889634 if base2 else 1.0)
    lse = lse.astype(jnp.float32)
    new = jnp.logaddexp2(lse, s) if base2 else jnp.logaddexp(lse, s)
    scale = jnp.exp2(lse - new) if base2 else jnp.exp(lse - new)
    return out.astype(jnp.float32) * scale[..., None], new


def _untouched(o_ref):
    del o_ref  # writes nothing: the output keeps whatever its memory held


def empty(shape, dtype):
    """A float array of `shape` whose contents are undefined, for a buffer that kernels
    fill piecewise, where `jnp.zeros` would cost a memset of the whole of it: on the GPU
    one empty kernel; elsewhere (kernels in interpret mode) NaN, so that a read of an
    entry never written shows."""
    if jax.default_backend() != "gpu":
        return jnp.full(shape, jnp.nan, dtype)
    return pl.pallas_call(
        _untouched, grid=(1,), out_specs=whole(shape),
        out_shape=jax.ShapeDtypeStruct(tuple(shape), dtype),
        compiler_params=pltr.CompilerParams(num_warps=1, num_stages=1),
        name="vegas_empty")()

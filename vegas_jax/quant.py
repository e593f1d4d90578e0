"""Quantized draft weights (`SpecConfig.draft_weights`).

A draft only proposes: the verify decides with the model's own weights, so a draft may
read any weights and the output stays the target's (greedy: vanilla's tokens; sampled:
its distribution). A draft step of a large model reads all of its weights while reading
only a few percent of the KV cache; int8 copies halve those bytes, int4 quarter them.

`quantize_params` makes the draft's params once, on the device: every matmul a draft step
runs (w_qkv, wo, w_gate_up, w_down and the LM head; a tied head as a quantized copy of
embed.T) becomes a `QuantWeight`; the embedding, norms and biases are the model's own
arrays, not copies. `model.linear` runs a `QuantWeight` through the Pallas kernel
(`pallas_kernels.quant_matmul`) or, on the XLA path, its dequantize-then-dot reference.
"""

from __future__ import annotations

import functools
import weakref

import jax
import numpy as np
from flax import struct
from jax import lax

from pallas_kernels.quant_matmul import (
    FORMATS, quant_matmul, quant_matmul_reference, quantize, weight_shape,
)
from vegas_jax.params import Params, map_layers

# `SpecConfig.draft_weights`: the model's own weights, or a quantized copy of them
DRAFT_WEIGHTS = ("same",) + FORMATS

# The layer matmuls a draft step runs (a dense layer's; the LM head besides)
DRAFT_MATMULS = ("w_qkv", "wo", "w_gate_up", "w_down")


@struct.dataclass
class QuantWeight:
    """A [..., k, n] weight quantized to `fmt` (`pallas_kernels.quant_matmul.quantize`),
    stored k-contiguous: q int8 [..., n, k] or uint8 [..., n, k/2] (int4, two values a
    byte), scale [..., n] (int8) or [..., k/G, n] (int4). layer: set by `at_layer` on a
    stacked weight [L, ...], whose layer the matmul reads in place (no slice copied),
    else None."""

    q: jax.Array
    scale: jax.Array
    fmt: str = struct.field(pytree_node=False)
    layer: jax.Array | None = None

    def at_layer(self, li) -> "QuantWeight":
        """The stacked weight's layer `li` (int32, traced or not), read in place."""
        return self.replace(layer=li)

    @property
    def k(self) -> int:
        """The weight's input width."""
        return weight_shape(self.q, self.fmt)[0]

    @property
    def n(self) -> int:
        """The weight's output width."""
        return weight_shape(self.q, self.fmt)[1]

    def layer_q(self):
        """q of one layer's weight (the `layer` of a stacked one: sliced)."""
        return self.q if self.layer is None else _at(self.q, self.layer)

    def layer_scale(self):
        return self.scale if self.layer is None else _at(self.scale, self.layer)

    def layer_bytes(self) -> int:
        """Bytes one layer's matmul reads (its q and scales)."""
        q, s = self.q.shape[-2:], self.scale.shape[-2 if self.fmt == "int4" else -1:]
        return (int(np.prod(q)) * self.q.dtype.itemsize
                + int(np.prod(s)) * self.scale.dtype.itemsize)


def _at(a, li):
    return lax.dynamic_index_in_dim(a, li, keepdims=False)


def check_draft_weights(fmt: str) -> None:
    if fmt not in DRAFT_WEIGHTS:
        raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {fmt!r}")


def check_model(cfg, xc, fmt: str) -> None:
    """Quantized drafts run dense models on one device (one clear line otherwise)."""
    if fmt == "same":
        return
    if cfg.is_moe:
        raise ValueError(f"draft_weights={fmt!r} needs a dense model: {cfg.name} is a "
                         f"mixture of experts (use draft_weights='same')")
    if xc.tp > 1:
        raise ValueError(f"draft_weights={fmt!r} runs on one device: use tp=1 or "
                         f"draft_weights='same' (tp={xc.tp})")
    widths = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    if fmt == "int4" and any(k % 64 for k in widths):
        raise ValueError(f"draft_weights='int4' needs input widths that are multiples of 64 "
                         f"(its groups); {cfg.name} has {widths}")


def linear(x, w: QuantWeight, xc):
    """x [..., k] @ w's weight -> [..., n] in x's dtype: the Pallas kernel, or on the XLA
    path the reference (dequantize, then an fp32 dot)."""
    if xc.pallas:
        return quant_matmul(x, w.q, w.scale, fmt=w.fmt, layer=w.layer,
                            interpret=xc.interpret)
    return quant_matmul_reference(x, w.layer_q(), w.layer_scale(), w.fmt)


@functools.partial(jax.jit, static_argnames=("fmt", "stacked", "transpose"))
def _quantize(w, fmt: str, stacked: bool, transpose: bool = False) -> QuantWeight:
    """w [k, n] (transpose: [n, k]) or stacked [L, k, n], one layer at a time (a layer's
    fp32 transients, not the whole stack's)."""
    if transpose:
        w = w.T
    if stacked:
        q, scale = lax.map(lambda a: quantize(a, fmt), w)
    else:
        q, scale = quantize(w, fmt)
    return QuantWeight(q, scale, fmt)


def quantize_params(params: Params, fmt: str) -> Params:
    """The draft's params: `params` with every draft matmul's weight (`DRAFT_MATMULS` and
    the LM head) a `QuantWeight` of `fmt`, made on the device; everything else shared.
    Stacked or unrolled layers alike; the model's params are left as they are."""
    if fmt not in DRAFT_WEIGHTS or fmt == "same":
        raise ValueError(f"draft_weights to quantize must be one of {FORMATS}, got {fmt!r}")

    def layer(lp):
        if lp.w_gate_up is None:
            raise ValueError(f"draft_weights={fmt!r} needs a dense model (this one has experts)")
        stacked = lp.wo.ndim == 3
        return lp.replace(**{f: _quantize(getattr(lp, f), fmt, stacked)
                             for f in DRAFT_MATMULS})

    tied = params.lm_head is None
    head = _quantize(params.embed if tied else params.lm_head, fmt, False, transpose=tied)
    return map_layers(params, layer).replace(lm_head=head)


def quantized_bytes(params: Params, fmt: str) -> int:
    """Bytes `quantize_params(params, fmt)` adds on the device (its QuantWeights)."""
    def shape(w, transpose=False):
        return jax.ShapeDtypeStruct(w.shape[::-1] if transpose else w.shape, w.dtype)

    ws = [shape(getattr(lp, f)) for lp in _layers(params) for f in DRAFT_MATMULS]
    ws.append(shape(params.embed, True) if params.lm_head is None else shape(params.lm_head))
    out = jax.eval_shape(lambda ws: [_quantize(w, fmt, w.ndim == 3) for w in ws], ws)
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(out))


def _layers(params: Params) -> tuple:
    return params.layers if isinstance(params.layers, tuple) else (params.layers,)


class DraftCache:
    """A model's quantized draft params, one copy per format, each made on first use from
    the params it is asked for (other params than last time: the copies are made again,
    the old ones dropped)."""

    def __init__(self):
        self._of = None  # a weak reference to the params the copies were made from
        self._copies: dict[str, Params] = {}

    def get(self, params: Params, fmt: str) -> Params:
        if self._of is None or self._of() is not params:
            self._of, self._copies = weakref.ref(params), {}
        if fmt not in self._copies:
            self._copies[fmt] = make_draft_params(params, fmt)
        return self._copies[fmt]

    def holds(self, params: Params, fmt: str) -> bool:
        """Whether `fmt`'s copy of `params` is made (its bytes are in use already)."""
        return self._of is not None and self._of() is params and fmt in self._copies


# a model's field (`loading.Model.drafts`) and no array: a pytree without leaves, so that
# a model still goes through jax.tree functions and eval_shape
jax.tree_util.register_static(DraftCache)


def make_draft_params(params: Params, fmt: str) -> Params:
    """`quantize_params`, refused up front (with numbers) where the copy cannot fit."""
    from vegas_jax.prefill import available_bytes

    need, free = quantized_bytes(params, fmt), available_bytes()
    if free is not None and need > 0.9 * free:
        gib = 1 << 30
        raise MemoryError(f"not enough memory for the {fmt} draft weights: {need / gib:.2f} "
                          f"GiB > 90% of the {free / gib:.2f} GiB free (use "
                          f"draft_weights='same')")
    return quantize_params(params, fmt)


def draft_params(model, fmt: str, xc) -> Params | None:
    """The params a draft of `fmt` reads: None for "same" (the model's own: the round is
    the one it always was), else the model's quantized copy: made once per model and
    format where the model keeps a `DraftCache` (`load_model`'s do), else each call."""
    check_draft_weights(fmt)
    check_model(model.config, xc, fmt)
    if fmt == "same":
        return None
    cache = getattr(model, "drafts", None)
    return make_draft_params(model.params, fmt) if cache is None else cache.get(model.params, fmt)

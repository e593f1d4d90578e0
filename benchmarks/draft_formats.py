"""Draft weight formats for the studies: the library's (`SpecConfig.draft_weights`: same,
int8, int4) and study-only variants of them, by name.

A variant is a `DraftFormat`: the layer matmuls' format, int4's group and scales, and
the LM head's format. Its draft params are made here with the library's quantizer
(`pallas_kernels.quant_matmul.quantize`) and `QuantWeight`, and handed to a run through
the model's `drafts` (the seam `quant.draft_params` reads), so the library carries no
option for them. Groups other than the library's run on the XLA path only (the reference
dequantizes any group; the kernels take the library's): the CPU studies' path.

  int4-g32     int4 layers and head, groups of 32 along k (the library's: 128, or 64)
  int4-g24     groups of 24: the control of groups of 32 or 16 on the embedded SmolLM2,
               whose GGUF weights are Q4_1 (blocks of 32 along k, with a minimum): those
               fall within the blocks and see each one's own range, groups of 24
               straddle them, as any group does the blocks a bf16 model never had
  int4-h8      int4 layers, the LM head in int8 (per output column, as "int8")
  int4-g32-h8  int4 in groups of 32, the LM head in int8 (likewise int4-g24-h8, int4-g16-h8)
  int4-clip    the library's int4 format and groups, each group's scale from a search
               (clipped at a * max|w|, a from 1 down to 0.7, the least squared error)
               instead of max|w| / 7: other values, the same bytes and kernel (every
               int4 weight: here the head's too; with -h8 the layers' only)
  int4-clip-h8 that, the LM head in int8 (likewise int4-g32-clip-h8, int4-g24-clip-h8)
  int4-hf      int4 layers, the LM head the model's own (full precision) weights
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.quant_matmul import group_size, quantize
from vegas_jax.params import Params, map_layers
from vegas_jax.quant import DRAFT_MATMULS, DRAFT_WEIGHTS, QuantWeight


@dataclasses.dataclass(frozen=True)
class DraftFormat:
    """layers: the layer matmuls' format ("int8" or "int4"); group: int4's group along k
    (None: the library's, `group_size(k)`); head: the LM head's format (None: the layers';
    "same": the model's own head); clip: int4's scales from `clip_search`."""

    layers: str
    group: int | None = None
    head: str | None = None
    clip: bool = False

    @property
    def head_fmt(self) -> str:
        return self.head or self.layers

    def library_name(self) -> str:
        """The `SpecConfig.draft_weights` a run of this format passes (its layers')."""
        return self.layers


LIBRARY = {"int8": DraftFormat("int8"), "int4": DraftFormat("int4")}
VARIANTS = {
    "int4-g32": DraftFormat("int4", group=32),
    "int4-g24": DraftFormat("int4", group=24),
    "int4-h8": DraftFormat("int4", head="int8"),
    "int4-g32-h8": DraftFormat("int4", group=32, head="int8"),
    "int4-g24-h8": DraftFormat("int4", group=24, head="int8"),
    "int4-g16-h8": DraftFormat("int4", group=16, head="int8"),
    "int4-clip": DraftFormat("int4", clip=True),
    "int4-clip-h8": DraftFormat("int4", head="int8", clip=True),
    "int4-g32-clip-h8": DraftFormat("int4", group=32, head="int8", clip=True),
    "int4-g24-clip-h8": DraftFormat("int4", group=24, head="int8", clip=True),
    "int4-hf": DraftFormat("int4", head="same"),
}
NAMES = (*DRAFT_WEIGHTS, *VARIANTS)


def check_name(name: str) -> None:
    if name not in NAMES:
        raise ValueError(f"unknown draft weights {name!r}; choose from {', '.join(NAMES)}")


ALPHAS = tuple(1 - 0.025 * i for i in range(13))  # clip_search's: 1.0 down to 0.7


def clip_search(w, group: int):
    """w [k, n] with each group of `group` rows (and column) clipped at a * max|w|, a from
    ALPHAS the one whose int4 copy (bf16 scale a * max|w| / 7, as `quantize`'s) is
    nearest w in squared error: quantizing the result gives that copy."""
    k, n = w.shape
    wg = w.astype(jnp.float32).reshape(k // group, group, n)
    top = jnp.max(jnp.abs(wg), axis=1, keepdims=True)  # [k/g, 1, n]

    def err(a):  # [k/g, n]
        s = (a * top / 7).astype(jnp.bfloat16).astype(jnp.float32)
        q = jnp.clip(jnp.round(wg / jnp.where(s == 0, 1.0, s)), -7, 7)
        return jnp.sum((q * s - wg) ** 2, axis=1)

    best = jnp.asarray(ALPHAS)[jnp.argmin(jnp.stack([err(a) for a in ALPHAS]), axis=0)]
    lim = best[:, None] * top  # [k/g, 1, n]
    return jnp.clip(wg, -lim, lim).reshape(k, n).astype(w.dtype)


@functools.partial(jax.jit, static_argnames=("f", "fmt", "stacked", "transpose"))
def _quantize(w, f: DraftFormat, fmt: str, stacked: bool, transpose: bool = False):
    """w [k, n] (transpose: [n, k]) or stacked [L, k, n], one layer at a time, in `fmt`
    (the layers' or the head's) with f's group and clipping."""
    if transpose:
        w = w.T
    g = f.group if fmt == "int4" else None

    def one(a):
        if f.clip and fmt == "int4":
            a = clip_search(a, g or group_size(a.shape[0]))
        return quantize(a, fmt, g)

    q, scale = lax.map(one, w) if stacked else one(w)
    return QuantWeight(q, scale, fmt)


def draft_params(params: Params, f: DraftFormat) -> Params:
    """`params` with every draft matmul's weight (`quant.DRAFT_MATMULS` and the LM head; a
    tied head as a copy of embed.T) a `QuantWeight` of `f`; everything else shared."""
    def layer(lp):
        stacked = lp.wo.ndim == 3
        return lp.replace(**{n: _quantize(getattr(lp, n), f, f.layers, stacked)
                             for n in DRAFT_MATMULS})

    tied = params.lm_head is None
    head = params.lm_head if f.head_fmt == "same" else _quantize(
        params.embed if tied else params.lm_head, f, f.head_fmt, False, transpose=tied)
    return map_layers(params, layer).replace(lm_head=head)


class FixedDrafts:
    """A model's `drafts` (`loading.Model.drafts`, read by `quant.draft_params`) that hands
    out one made copy, whatever format is asked: a variant's params."""

    def __init__(self, params: Params):
        self.params = params

    def get(self, params: Params, fmt: str) -> Params:
        return self.params


# a model's field and no array, as the library's DraftCache
jax.tree_util.register_static(FixedDrafts)


def model_for(model, name: str):
    """(the model a run of `name` decodes with, its `SpecConfig.draft_weights`): the
    library's formats as they are, a variant's params made here and put in its drafts."""
    check_name(name)
    if name in DRAFT_WEIGHTS:
        return model, name
    f = VARIANTS[name]
    return model._replace(drafts=FixedDrafts(draft_params(model.params, f))), f.library_name()


def step_bytes(cfg, name: str) -> int:
    """Weight bytes one draft step reads in format `name` of model config `cfg` (the
    layers' matmuls and the LM head; "same": the bf16 weights), from the shapes alone."""
    from vegas_jax.params import init_params

    check_name(name)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    if name != "same":
        f = LIBRARY.get(name) or VARIANTS[name]
        params = jax.eval_shape(lambda p: draft_params(p, f), params)
    ws = [getattr(lp, n) for lp in _layers(params) for n in DRAFT_MATMULS]
    ws.append(params.embed if params.lm_head is None else params.lm_head)  # tied: embed.T
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(ws))


def _layers(params: Params) -> tuple:
    return params.layers if isinstance(params.layers, tuple) else (params.layers,)

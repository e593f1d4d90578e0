"""Draft weight formats for the studies: the library's (`SpecConfig.draft_weights`: same,
int8, int4) and study-only variants of them, by name.

A variant is a `DraftFormat`: the layer matmuls' format and (int4) group, and the LM
head's format. Its draft params are made here with the library's quantizer
(`pallas_kernels.quant_matmul.quantize`) and `QuantWeight`, and handed to a run through
the model's `drafts` (the seam `quant.draft_params` reads), so the library carries no
option for them. Groups other than the library's run on the XLA path only (the reference
dequantizes any group; the kernels take the library's): the CPU studies' path.

  int4-g32     int4 layers and head, groups of 32 along k (the library's: 128, or 64)
  int4-g16     groups of 16
  int4-g24     groups of 24: the control of the two above on the embedded SmolLM2, whose
               GGUF weights are Q4_1 (blocks of 32 along k, with a minimum): groups of 32
               or 16 fall within those blocks and see each one's own range, groups of 24
               straddle them, as any group does the blocks a bf16 model never had
  int4-h8      int4 layers, the LM head in int8 (per output column, as "int8")
  int4-g32-h8  int4 in groups of 32, the LM head in int8 (likewise int4-g24-h8, int4-g16-h8)
  int4-hf      int4 layers, the LM head the model's own (full precision) weights
  int8-hf      int8 layers, the LM head the model's own weights
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax import lax

from pallas_kernels.quant_matmul import quantize
from vegas_jax.params import Params, map_layers
from vegas_jax.quant import DRAFT_MATMULS, DRAFT_WEIGHTS, QuantWeight


@dataclasses.dataclass(frozen=True)
class DraftFormat:
    """layers: the layer matmuls' format ("int8" or "int4"); group: int4's group along k
    (None: the library's, `group_size(k)`); head: the LM head's format (None: the layers';
    "same": the model's own head)."""

    layers: str
    group: int | None = None
    head: str | None = None

    @property
    def head_fmt(self) -> str:
        return self.head or self.layers

    def library_name(self) -> str:
        """The `SpecConfig.draft_weights` a run of this format passes (its layers')."""
        return self.layers


LIBRARY = {"int8": DraftFormat("int8"), "int4": DraftFormat("int4")}
VARIANTS = {
    "int4-g32": DraftFormat("int4", group=32),
    "int4-g16": DraftFormat("int4", group=16),
    "int4-g24": DraftFormat("int4", group=24),
    "int4-h8": DraftFormat("int4", head="int8"),
    "int4-g32-h8": DraftFormat("int4", group=32, head="int8"),
    "int4-g24-h8": DraftFormat("int4", group=24, head="int8"),
    "int4-g16-h8": DraftFormat("int4", group=16, head="int8"),
    "int4-hf": DraftFormat("int4", head="same"),
    "int8-hf": DraftFormat("int8", head="same"),
}
NAMES = (*DRAFT_WEIGHTS, *VARIANTS)


def check_name(name: str) -> None:
    if name not in NAMES:
        raise ValueError(f"unknown draft weights {name!r}; choose from {', '.join(NAMES)}")


@functools.partial(jax.jit, static_argnames=("fmt", "group", "stacked", "transpose"))
def _quantize(w, fmt: str, group: int | None, stacked: bool, transpose: bool = False):
    """w [k, n] (transpose: [n, k]) or stacked [L, k, n], one layer at a time."""
    if transpose:
        w = w.T
    g = group if fmt == "int4" else None
    q, scale = lax.map(lambda a: quantize(a, fmt, g), w) if stacked else quantize(w, fmt, g)
    return QuantWeight(q, scale, fmt)


def draft_params(params: Params, f: DraftFormat) -> Params:
    """`params` with every draft matmul's weight (`quant.DRAFT_MATMULS` and the LM head; a
    tied head as a copy of embed.T) a `QuantWeight` of `f`; everything else shared."""
    def layer(lp):
        stacked = lp.wo.ndim == 3
        return lp.replace(**{n: _quantize(getattr(lp, n), f.layers, f.group, stacked)
                             for n in DRAFT_MATMULS})

    tied = params.lm_head is None
    head = params.lm_head if f.head_fmt == "same" else _quantize(
        params.embed if tied else params.lm_head, f.head_fmt, f.group, False, transpose=tied)
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

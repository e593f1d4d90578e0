"""Tensor parallelism on `jax.sharding`: one 1-D mesh of `tp` devices ("tp" axis).

Attention heads and the MLP width are split across the devices (Megatron style): the
Q/K/V and gate/up projections by columns, the output and down projections by rows (XLA
inserts the all-reduce after them), the KV cache by KV heads. Embeddings, norms and the LM
head are replicated. XLA's SPMD partitioner runs every XLA op on its shards; the Pallas
kernels, which it cannot partition, run per device inside `shard_map` (`attention.py`).

The fused projections are stored per shard: w_qkv's columns as [q_0 | k_0 | v_0 | q_1 |
k_1 | v_1 | ...] (shard i holds the query heads of its KV heads), w_gate_up's as
[gate_0 | up_0 | gate_1 | up_1 | ...], so that each device's column block is a complete,
smaller model layer. With tp = 1 this is the checkpoint layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from vegas_jax.config import ModelConfig
from vegas_jax.params import fused_widths, map_layers

AXIS = "tp"


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """tp must divide the KV heads (and so the query heads); there must be tp devices;
    mixture-of-experts models run on one device."""
    if int(tp) != tp or tp < 1:
        raise ValueError(f"tp must be a whole number >= 1, got {tp}")
    if cfg.is_moe and tp > 1:
        # the experts' weights have no per-shard layout or shardings here yet
        raise ValueError(f"tensor parallel is not supported for mixture-of-experts models "
                         f"({cfg.name}: {cfg.num_experts} experts); run it with tp=1")
    if cfg.num_kv_heads % tp or cfg.intermediate_size % tp:
        raise ValueError(f"tp={tp} must divide {cfg.name}'s {cfg.num_kv_heads} KV heads "
                         f"(and its MLP width {cfg.intermediate_size}); choose one of "
                         f"{[n for n in range(1, cfg.num_kv_heads + 1) if not cfg.num_kv_heads % n]}")
    if tp > len(jax.devices()):
        raise ValueError(f"tp={tp} needs {tp} devices; this machine has {len(jax.devices())} "
                         f"({jax.default_backend()})")


@functools.cache
def mesh(tp: int) -> Mesh:
    """The first `tp` devices as a 1-D mesh."""
    return Mesh(np.array(jax.devices()[:tp]), (AXIS,))


def shard_columns(widths: tuple[int, ...], tp: int) -> np.ndarray:
    """Column order of a fused weight with parts of `widths` (checkpoint layout: part 0,
    part 1, ...) in the per-shard layout: for each shard, its slice of every part."""
    starts = np.cumsum((0,) + tuple(widths))[:-1]
    order = [np.arange(s + i * w // tp, s + (i + 1) * w // tp)
             for i in range(tp) for s, w in zip(starts, widths)]
    return np.concatenate(order)


def split_columns(y, widths: tuple[int, ...], tp: int) -> list:
    """The parts of a fused projection's output y [..., sum(widths)] whose columns are in
    the per-shard layout: part i as [..., widths[i]] in checkpoint column order (on one
    device, a slice; across tp shards, each shard's slice of the part, shard by shard)."""
    lead = y.shape[:-1]
    per = y.reshape(*lead, tp, -1)  # [..., tp, sum(widths) / tp]
    parts, start = [], 0
    for w in widths:
        parts.append(per[..., start:start + w // tp].reshape(*lead, w))
        start += w // tp
    return parts


def to_shard_layout(params, cfg: ModelConfig, tp: int):
    """Params with the fused projections' columns in the per-shard layout (tp = 1: as is)."""
    if tp == 1:
        return params
    widths = fused_widths(cfg)

    def permute(lp):
        return lp.replace(**{f: getattr(lp, f)[..., shard_columns(widths[f], tp)]
                             for f in widths})

    return map_layers(params, permute)


def param_shardings(params, tp: int):
    """NamedSharding of every parameter leaf: columns of w_qkv / w_gate_up and rows of
    wo / w_down split across the mesh, everything else replicated."""
    m = mesh(tp)

    def layer(lp):
        def spec(name, a):
            if a is None:
                return None
            lead = (None,) * (a.ndim - 2)
            if name in ("w_qkv", "w_gate_up"):
                return NamedSharding(m, P(*lead, None, AXIS))
            if name in ("wo", "w_down"):
                return NamedSharding(m, P(*lead, AXIS, None))
            return NamedSharding(m, P())
        return lp.replace(**{f: spec(f, getattr(lp, f)) for f in lp.__dataclass_fields__})

    rep = NamedSharding(m, P())
    return map_layers(params, layer).replace(embed=rep, final_norm=rep,
                                             lm_head=None if params.lm_head is None else rep)


def place_params(params, cfg: ModelConfig, tp: int):
    """Params in the per-shard layout, on the mesh (tp = 1: unchanged)."""
    if tp == 1:
        return params
    params = to_shard_layout(params, cfg, tp)
    return jax.device_put(params, param_shardings(params, tp))


def place_cache(cache, tp: int):
    """The KV cache split by KV heads across the mesh (tp = 1: unchanged)."""
    if tp == 1:
        return cache
    kv = NamedSharding(mesh(tp), P(None, None, AXIS, None, None))
    rep = NamedSharding(mesh(tp), P())
    return jax.device_put(cache, cache.replace(k=kv, v=kv, lengths=rep))


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (None: replicated), as jax-llm-examples' `ShardingRules`:
    a spec is written with the names of an array's axes (`spec`), never as a positional
    tuple that must line up with an argument list. Tensor parallel splits the KV heads
    (with their query heads, sinks and per-head index lists) and a fused projection's
    per-shard columns (`qkv`); everything else is replicated."""

    layers: str | None = None
    batch: str | None = None
    seq: str | None = None  # query tokens of a forward
    kv_heads: str | None = AXIS
    group: str | None = None  # query heads of a KV head
    head_dim: str | None = None
    keys: str | None = None  # cache positions
    selected: str | None = None  # entries of a draft's index list
    qkv: str | None = AXIS  # a fused Q/K/V projection's columns, per-shard layout
    hidden: str | None = None
    rope: str | None = None  # a rotary table's (cos | sin) and frequency axes

    def spec(self, axes: tuple[str, ...]) -> P:
        """The PartitionSpec of an array whose axes are named `axes` (() a scalar)."""
        unknown = [a for a in axes if a not in self.__dataclass_fields__]
        if unknown:
            raise ValueError(f"unknown logical axes {unknown}; known: "
                             f"{list(self.__dataclass_fields__)}")
        return P(*(getattr(self, a) for a in axes))


TP_RULES = ShardingRules()

"""What the checkpoint readers share: dtypes, config (de)serialisation, registry matching,
and assembling per-layer host arrays into a stacked `Params` tree."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np

from vegas_jax.config import REGISTRY, ModelConfig, RopeScaling
from vegas_jax.params import FUSED, LayerParams, Params, fused_widths

_DTYPES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp32": "float32", "f32": "float32", "float32": "float32",
}

# Fields that fix the weights' shapes and meaning: a checkpoint and a registry entry that
# agree on these are the same model.
STRUCTURE_FIELDS = (
    "arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
    "intermediate_size", "vocab_size", "num_experts", "experts_per_token",
    "moe_intermediate_size", "moe_style", "attn_bias", "attn_sinks", "sliding_window",
    "sliding_layers",
)


def dtype_name(dtype: Any) -> str:
    """'bfloat16' or 'float32' from a string ('bf16', 'fp32', ...) or a numpy/jax dtype."""
    if isinstance(dtype, str):
        key = dtype.strip().lower()
    else:
        try:
            key = np.dtype(dtype).name
        except TypeError:
            key = repr(dtype)
    if key not in _DTYPES:
        raise ValueError(
            f"unsupported dtype {dtype!r}: use bfloat16 ('bf16') or float32 ('fp32')"
        )
    return _DTYPES[key]


def np_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype (ml_dtypes.bfloat16 for bf16) for any accepted dtype spelling."""
    return np.dtype(ml_dtypes.bfloat16) if dtype_name(dtype) == "bfloat16" else np.dtype(np.float32)


def config_to_json(cfg: ModelConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    d["sliding_layers"] = list(cfg.sliding_layers)
    return d


def config_from_json(d: dict) -> ModelConfig:
    d = dict(d)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown ModelConfig fields in checkpoint config: {sorted(unknown)}")
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    d["sliding_layers"] = tuple(d.get("sliding_layers") or ())  # a JSON list
    return ModelConfig(**d)


def structure_diff(a: ModelConfig, b: ModelConfig) -> list[str]:
    """Human-readable differences between two configs in the structural fields."""
    return [
        f"{f}: {getattr(a, f)} vs {getattr(b, f)}"
        for f in STRUCTURE_FIELDS
        if getattr(a, f) != getattr(b, f)
    ]


def registry_match(cfg: ModelConfig) -> ModelConfig | None:
    """The registry entry with this config's structure, tying and RoPE base, if any."""
    for entry in REGISTRY.values():
        if (
            not structure_diff(entry, cfg)
            and entry.tie_embeddings == cfg.tie_embeddings
            and entry.qk_norm == cfg.qk_norm
            and entry.norm_topk_prob == cfg.norm_topk_prob
            and np.isclose(entry.rope_theta, cfg.rope_theta)
        ):
            return entry
    return None


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shapes of the checkpoint's projections and norms, in our [in, out] layout
    (what the readers hand to `stack_layers`; `FUSED` says how they become fields)."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    n, k = cfg.num_heads, cfg.num_kv_heads
    shapes = {
        "attn_norm": (h,), "wq": (h, n * d), "wk": (h, k * d), "wv": (h, k * d),
        "wo": (n * d, h), "mlp_norm": (h,),
    }
    if cfg.attn_bias:
        shapes.update({"bq": (n * d,), "bk": (k * d,), "bv": (k * d,), "bo": (h,)})
    if cfg.attn_sinks:
        shapes["sinks"] = (n,)
    if cfg.is_moe:
        e, fe = cfg.num_experts, cfg.moe_intermediate_size
        shapes.update({"w_router": (h, e), "w_expert_gate": (e, h, fe),
                       "w_expert_up": (e, h, fe), "w_expert_down": (e, fe, h)})
        if cfg.moe_style == "gpt-oss":
            shapes.update({"b_router": (e,), "b_expert_gate": (e, fe), "b_expert_up": (e, fe),
                           "b_expert_down": (e, h)})
    else:
        shapes.update({"w_gate": (h, f), "w_up": (h, f), "w_down": (f, h)})
    if cfg.qk_norm:
        shapes["q_norm"] = (d,)
        shapes["k_norm"] = (d,)
    return shapes


def field_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shapes of every LayerParams field (without the leading layer axis)."""
    parts = layer_shapes(cfg)
    out = {k: s for k, s in parts.items() if not any(k in ps for ps in FUSED.values())}
    for name in fused_widths(cfg):
        ps = FUSED[name]
        out[name] = (*parts[ps[0]][:-1], sum(parts[p][-1] for p in ps))
    return out


def split_fused(cfg: ModelConfig, fields: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """LayerParams fields (numpy, fused) -> the checkpoint projections `FUSED` holds."""
    out = dict(fields)
    for name, widths in fused_widths(cfg).items():
        cuts = np.cumsum(widths)[:-1]
        out.update(zip(FUSED[name], np.split(out.pop(name), cuts, axis=-1)))
    return out


def params_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """Nested dict of full shapes, the same keys as `params_to_dict`."""
    L = cfg.num_layers
    out: dict[str, Any] = {
        "embed": (cfg.vocab_size, cfg.hidden_size),
        "final_norm": (cfg.hidden_size,),
        "layers": {k: (L, *s) for k, s in field_shapes(cfg).items()},
    }
    if not cfg.tie_embeddings:
        out["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return out


def _check_shape(name: str, arr: np.ndarray, shape: Sequence[int]):
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(arr.shape)}, the config implies {tuple(shape)}"
        )


def stack_layers(
    cfg: ModelConfig,
    get_layer: Callable[[int], dict[str, np.ndarray]],
    dtype: np.dtype,
    progress: bool = False,
    desc: str = "layers",
    workers: int = 1,
) -> LayerParams:
    """Build stacked `LayerParams` from `get_layer(i)` -> {field: array in OUR layout}.

    The stacked buffers are allocated once in the target dtype and filled layer by layer, so
    peak host memory stays close to the size of the result. workers > 1: that many layers
    are read at once, on threads (`get_layer` must be thread-safe).
    """
    shapes = layer_shapes(cfg)
    L = cfg.num_layers
    stacked = {k: np.empty((L, *s), dtype) for k, s in field_shapes(cfg).items()}
    # Where each checkpoint tensor goes: (field, first column, last column) or (field,).
    where: dict[str, tuple] = {k: (k,) for k in stacked}
    for name, widths in fused_widths(cfg).items():
        start = 0
        for p, w in zip(FUSED[name], widths):
            where[p] = (name, start, start + w)
            start += w

    def fill(i: int):
        got = get_layer(i)
        missing = set(shapes) - set(got)
        if missing:
            raise ValueError(f"layer {i}: checkpoint lacks {sorted(missing)}")
        for k, s in shapes.items():
            _check_shape(f"layer {i} {k}", got[k], s)
            field, *cols = where[k]
            # assignment casts to the buffer's dtype in place (no converted copy first)
            if cols:
                stacked[field][i, ..., cols[0]:cols[1]] = got[k]
            else:
                stacked[field][i] = got[k]

    with ThreadPoolExecutor(workers) as pool:
        done = pool.map(fill, range(L))
        if progress:
            from tqdm.auto import tqdm

            done = tqdm(done, desc=desc, unit="layer", total=L)
        for _ in done:
            pass
    return LayerParams(**stacked)


def assemble(cfg: ModelConfig, embed, layers: LayerParams, final_norm, lm_head, dtype) -> Params:
    shapes = params_shapes(cfg)
    _check_shape("embed", embed, shapes["embed"])
    _check_shape("final_norm", final_norm, shapes["final_norm"])
    if cfg.tie_embeddings:
        lm_head = None
    else:
        if lm_head is None:
            raise ValueError("the config says the LM head is untied, but the checkpoint has none")
        _check_shape("lm_head", lm_head, shapes["lm_head"])
        lm_head = np.ascontiguousarray(lm_head, dtype=dtype)
    return Params(
        embed=np.ascontiguousarray(embed, dtype=dtype),
        layers=layers,
        final_norm=np.ascontiguousarray(final_norm, dtype=dtype),
        lm_head=lm_head,
    )


def params_to_dict(params: Params) -> dict[str, Any]:
    """Params -> nested dict of arrays without the None leaves (what orbax stores).

    Stacked layers only. Norm weights folded into their projections (`fold_norms`, as
    `load_model` lays params out) are written as ones: the same function, a checkpoint."""
    out: dict[str, Any] = {"embed": params.embed, "final_norm": params.final_norm}
    if params.lm_head is not None:
        out["lm_head"] = params.lm_head
    lp = params.layers
    if isinstance(lp, tuple):
        raise ValueError("per-layer weight buffers: stack them first (model.stack_layers)")
    if lp.attn_norm is None:
        ones = np.ones(lp.w_qkv.shape[:-1], lp.w_qkv.dtype)  # [L, h]
        lp = lp.replace(attn_norm=ones, mlp_norm=ones)
    out["layers"] = {
        f.name: getattr(lp, f.name)
        for f in dataclasses.fields(lp)
        if getattr(lp, f.name) is not None
    }
    return out


def params_from_dict(d: dict[str, Any]) -> Params:
    return Params(
        embed=d["embed"], layers=LayerParams(**d["layers"]), final_norm=d["final_norm"],
        lm_head=d.get("lm_head"),
    )

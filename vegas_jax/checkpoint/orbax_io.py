"""vegas_jax checkpoint directories: params in orbax format + our config + tokenizer.

Layout of DIR:
  config.json    {"format": "vegas_jax", "format_version": 1, "dtype": ..., "config": {...}}
  params/        orbax StandardCheckpointer tree (nested dict of arrays, None leaves dropped)
  tokenizer*     the tokenizer's `save_pretrained` files, when there is a tokenizer
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vegas_jax.checkpoint.common import (
    config_from_json, config_to_json, dtype_name, layer_shapes, np_dtype, params_from_dict,
    params_shapes, params_to_dict,
)
from vegas_jax.config import ModelConfig
from vegas_jax.params import FUSED, Params

FORMAT = "vegas_jax"
FORMAT_VERSION = 2  # 2: Q/K/V and gate/up stored fused (model.FUSED); 1: separate


def is_orbax_checkpoint(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("format") == FORMAT
    except (json.JSONDecodeError, AttributeError):
        return False


def save_orbax_checkpoint(
    out: str | Path, cfg: ModelConfig, params: Params, tokenizer=None, overwrite: bool = False
) -> Path:
    """Write params (host or device arrays, stored in their own dtype), config and tokenizer."""
    import orbax.checkpoint as ocp

    out = Path(out).absolute()
    if out.exists():
        if not overwrite and any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --force)")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tree = params_to_dict(params)
    dtypes = {np.dtype(x.dtype).name for x in jax.tree.leaves(tree)}
    with ocp.StandardCheckpointer() as ck:
        ck.save(out / "params", tree)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dtype": dtype_name(dtypes.pop()) if len(dtypes) == 1 else "mixed",
        "config": config_to_json(cfg),
    }
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    # Written last: a directory with our config.json is a finished checkpoint.
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def _read_meta(path: str | Path) -> dict:
    meta = json.loads((Path(path) / "config.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a vegas_jax checkpoint (config.json has no format={FORMAT!r})")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{path} was written by a newer vegas_jax (format_version {meta['format_version']})"
        )
    return meta


def read_orbax_config(path: str | Path) -> ModelConfig:
    return config_from_json(_read_meta(path)["config"])


def _stored_shapes(cfg: ModelConfig, version: int) -> dict:
    """The params tree's shapes as a checkpoint of `version` stores them."""
    shapes = params_shapes(cfg)
    if version < 2:  # separate projections
        L = cfg.num_layers
        parts = layer_shapes(cfg)
        shapes["layers"] = {k: (L, *s) for k, s in parts.items()}
    return shapes


def _fuse_v1(layers: dict, concatenate) -> dict:
    out = dict(layers)
    for name, parts in FUSED.items():
        if parts[0] in out:  # version 1 predates MoE: its layers are dense
            out[name] = concatenate([out.pop(p) for p in parts], axis=-1)
    return out


def load_orbax_checkpoint(
    path: str | Path, dtype: Any = "bfloat16", device: bool = True
) -> tuple[ModelConfig, Params]:
    """Restore (config, params). With `device=True` the leaves come back as jax arrays on
    the default device, cast to `dtype` by orbax on the way; else as numpy arrays."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta = _read_meta(path)
    cfg = config_from_json(meta["config"])
    version = meta.get("format_version", 1)
    dt = np_dtype(dtype)
    shapes = _stored_shapes(cfg, version)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0]) if device else None
    target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dt, sharding=sharding),
        shapes, is_leaf=lambda x: isinstance(x, tuple),
    )
    with ocp.StandardCheckpointer() as ck:
        stored = ck.metadata(path / "params")
        stored_tree = getattr(getattr(stored, "item_metadata", stored), "tree", None)
        if stored_tree is not None:
            got = jax.tree.map(lambda m: tuple(m.shape), dict(stored_tree),
                               is_leaf=lambda x: hasattr(x, "shape"))
            if got != shapes:
                raise ValueError(
                    f"{path}: stored params do not match its config "
                    f"(stored {jax.tree.structure(got)}, config {jax.tree.structure(shapes)})"
                )
        tree = ck.restore(path / "params", target)
    if version < 2:
        tree["layers"] = _fuse_v1(tree["layers"], jnp.concatenate if device else np.concatenate)
    return cfg, params_from_dict(tree)


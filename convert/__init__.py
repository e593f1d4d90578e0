"""Checkpoint conversion: Hugging Face safetensors, llama.cpp GGUF -> vegas_jax params;
vegas_jax params <-> orbax checkpoint directories.

Every reader returns host (numpy) arrays in a `vegas_jax.model.Params` tree;
`vegas_jax.loading.load_model` moves them to the device. Nothing here imports torch.

CLI: `python -m convert --checkpoint HF_DIR_OR_GGUF --out DIR [--dtype bf16]`.

Submodules are imported lazily: reading a GGUF needs neither orbax nor safetensors code.
"""

_EXPORTS = {
    "load_hf_checkpoint": "convert.hf",
    "load_gguf": "convert.gguf",
    "save_orbax_checkpoint": "convert.orbax_io",
    "load_orbax_checkpoint": "convert.orbax_io",
    "is_orbax_checkpoint": "convert.orbax_io",
    "config_to_json": "convert.common",
    "config_from_json": "convert.common",
    "np_dtype": "convert.common",
    "dtype_name": "convert.common",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'convert' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)

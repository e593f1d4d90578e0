"""Checkpoint conversion: Hugging Face safetensors or llama.cpp GGUF -> an orbax
checkpoint directory that `load_model` reads back bit for bit.

CLI: `python -m convert --checkpoint HF_DIR_OR_GGUF --out DIR [--dtype bf16]`.

The readers and writers live in `vegas_jax.checkpoint` (loading a model needs them); this
package depends on `vegas_jax`, never the reverse. Its names are re-exported here,
imported on use.
"""

_EXPORTS = {
    "load_hf_checkpoint": "vegas_jax.checkpoint.hf",
    "load_gguf": "vegas_jax.checkpoint.gguf",
    "save_orbax_checkpoint": "vegas_jax.checkpoint.orbax_io",
    "load_orbax_checkpoint": "vegas_jax.checkpoint.orbax_io",
    "is_orbax_checkpoint": "vegas_jax.checkpoint.orbax_io",
    "config_to_json": "vegas_jax.checkpoint.common",
    "config_from_json": "vegas_jax.checkpoint.common",
    "np_dtype": "vegas_jax.checkpoint.common",
    "dtype_name": "vegas_jax.checkpoint.common",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'convert' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)

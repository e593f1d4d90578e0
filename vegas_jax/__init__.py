"""vegas_jax: self-speculative decoding with verification-guided sparse attention."""

import sys


def _command_starting() -> bool:
    """Whether `python -m vegas_jax.<command>` is importing this package (argv[0] is "-m"
    only while the module is looked up)."""
    argv = getattr(sys, "orig_argv", [])
    return sys.argv[:1] == ["-m"] and any(
        a == "-m" and b.startswith("vegas_jax.") for a, b in zip(argv, argv[1:]))


if _command_starting():  # Ctrl-C exits quietly from the first import on (jax takes a second)
    from vegas_jax.cli import exit_on_interrupt

    exit_on_interrupt()

from vegas_jax.auto_choice import AutoPolicy
from vegas_jax.config import REGISTRY, ModelConfig, get_config
from vegas_jax.execution import ExecConfig
from vegas_jax.generate import generate
from vegas_jax.driver import GenerationResult
from vegas_jax.sampling import SamplingParams
from vegas_jax.methods import METHODS
from vegas_jax.speculative import SpecConfig, speculative_generate


def __getattr__(name):
    # Loading pulls in safetensors / gguf / orbax: import it only when asked for.
    if name in ("load_model", "Model"):
        from vegas_jax import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'vegas_jax' has no attribute {name!r}")


__all__ = [
    "AutoPolicy", "ExecConfig", "GenerationResult", "METHODS", "Model", "ModelConfig",
    "REGISTRY", "SamplingParams", "SpecConfig", "generate", "get_config", "load_model",
    "speculative_generate",
]

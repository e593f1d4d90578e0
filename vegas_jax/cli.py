"""Command-line flags every command shares (decode, bench, tune), written once."""

from __future__ import annotations

import os

DTYPES = ("auto", "bf16", "fp32")
CACHE_ENV = "VEGAS_JAX_COMPILE_CACHE"


def default_compile_cache() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "vegas_jax", "xla")


def enable_compile_cache(path: str | None) -> str | None:
    """JAX's persistent compilation cache in `path` ("off" or None: disabled): a second run
    of the same shapes loads its programs instead of compiling them."""
    import jax

    if not path or path == "off":  # off even where JAX_COMPILATION_CACHE_DIR names one
        jax.config.update("jax_compilation_cache_dir", None)
        return None

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def add_model_args(p) -> None:
    """--model, --checkpoint, --dtype, --max-context and the execution flags."""
    from vegas_jax.config import DEFAULT_MODEL, REGISTRY
    from vegas_jax.execution import BACKENDS

    p.add_argument("--model", default=None,
                   help=f"registered model name (default {DEFAULT_MODEL}): "
                   + ", ".join(sorted(REGISTRY)))
    p.add_argument("--checkpoint", default=None,
                   help="Hugging Face directory, orbax directory (`python -m convert`) or .gguf")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and KV cache dtype (auto: fp32 on a CPU, bf16 on a GPU)")
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="positions to hold; Qwen3 beyond its native 40960 switches to YaRN")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="Pallas kernels or the XLA reference path (auto: pallas on a GPU)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallel over N devices (N divides the model's KV heads)")
    p.add_argument("--exact", action="store_true",
                   help="row-invariant kernels: greedy output bit-equal to plain decoding in bf16")


def add_sampling_args(p) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy decoding")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min-p times the top probability (0: off)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")


def exec_from_args(args):
    from vegas_jax.execution import ExecConfig

    return ExecConfig(backend=args.backend, tp=args.tp, exact=args.exact)


def sampling_from_args(args):
    from vegas_jax.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)


def dtype_from_arg(name: str):
    """--dtype: "auto" is `load_model`'s own rule (`vegas_jax.loading.default_dtype`)."""
    import jax.numpy as jnp

    from vegas_jax.loading import default_dtype

    return default_dtype() if name == "auto" else {"bf16": jnp.bfloat16, "fp32": jnp.float32}[name]


def load_from_args(args, random_init: bool = False):
    """The model the flags describe (with the compilation cache `$VEGAS_JAX_COMPILE_CACHE`
    names, by default ~/.cache/vegas_jax/xla; "off" disables it)."""
    from vegas_jax.loading import load_model

    enable_compile_cache(default_compile_cache())
    model = load_model(args.model, checkpoint=args.checkpoint, random_init=random_init,
                       dtype=dtype_from_arg(args.dtype), exec_config=exec_from_args(args))
    if args.max_context is not None:
        model = model._replace(config=model.config.with_context(args.max_context))
    return model

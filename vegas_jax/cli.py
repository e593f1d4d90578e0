"""What every command (decode, bench, tune) shares, written once: flags, their help, their
errors, and Ctrl-C."""

from __future__ import annotations

import argparse
import os
import re
import sys

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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default, once: argparse's "(default: X)" only where the help names none
    itself and there is one to name (not None, not an off switch's False)."""

    def _get_help_string(self, action):
        if "default" in action.help or any(
                action.default is d for d in (None, False, argparse.SUPPRESS)):
            return action.help
        return super()._get_help_string(action)


def flag_error(message: str, args: argparse.Namespace) -> str:
    """An API error as the command line's user reads it: the parameters it names ("top_p
    must be ...", "exact=True ...: use tp=1") become the flags they typed ("--top-p must be
    ...", "--exact ...: use --tp 1"). `args`: the parsed flags (their names are the API's)."""
    for dest in sorted(vars(args), key=len, reverse=True):
        flag = "--" + dest.replace("_", "-")
        message = re.sub(rf"^{dest}(?= must )", flag, message)
        message = re.sub(rf"\b{dest}=True\b", flag, message)
        message = re.sub(rf"\b{dest}=(?=\w)", flag + " ", message)
    return message


def exit_on_interrupt() -> None:
    """From now on Ctrl-C ends the process at once, whatever it is doing (loading, compiling,
    a background build, decoding): what it printed stays, stderr gets one line, the exit
    code is 130. Nothing is torn down (an XLA compile in flight in another thread aborts or
    crashes the interpreter's shutdown). Python's handler runs only between the main
    thread's bytecodes: a thread woken through the wakeup fd acts while it waits in C++."""
    import signal
    import threading

    once = threading.Lock()

    def leave(*_, wait=False):
        # the first caller exits; the main thread, second, carries on (it may hold stdout's
        # lock, which the thread's flush waits for), the thread, second, waits for the exit
        if not once.acquire(blocking=wait):
            return
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 (interrupted inside a write of its own)
            pass
        os.write(2, b"\ninterrupted\n" if os.isatty(2) else b"interrupted\n")
        os._exit(130)

    def watch(fd):
        while os.read(fd, 1) != bytes([signal.SIGINT]):
            pass
        leave(wait=True)

    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, leave)
    threading.Thread(target=watch, args=(r,), name="vegas_jax ctrl-c", daemon=True).start()


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

"""python -m convert: turn an HF checkpoint directory or a GGUF file into a vegas_jax
orbax checkpoint directory, which `load_model(checkpoint=DIR)` / `--checkpoint DIR` read."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m convert",
        description=(
            "Convert a checkpoint once into a vegas_jax directory (orbax params + config.json "
            "+ tokenizer files) that loads fast: python -m vegas_jax.decode --checkpoint OUT."
        ),
        epilog="Example: python -m convert --checkpoint ~/models/Qwen3-8B --out ckpt/qwen3-8b --dtype bf16",
    )
    p.add_argument(
        "--checkpoint", required=True, metavar="PATH",
        help="source: a Hugging Face directory (config.json + *.safetensors, sharded or not, "
             "+ tokenizer files) or a llama.cpp .gguf file (dequantized)",
    )
    p.add_argument(
        "--out", required=True, metavar="DIR",
        help="destination directory; must not exist or be empty (see --force)",
    )
    p.add_argument(
        "--dtype", default="bf16", metavar="{bf16,fp32}",
        help="dtype the params are stored in (default bf16; loading can still cast)",
    )
    p.add_argument(
        "--model", default=None, metavar="NAME",
        help="optional registry name (e.g. qwen3-8b): checked against the checkpoint's config "
             "and recorded as the model's name",
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty --out directory")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    try:
        from vegas_jax.checkpoint.common import dtype_name

        dtype = dtype_name(args.dtype)
        src = Path(args.checkpoint).expanduser()
        out = Path(args.out).expanduser()
        if not src.exists():
            raise FileNotFoundError(f"checkpoint not found: {src}")
        if out.exists() and any(out.iterdir()) and not args.force:
            raise FileExistsError(f"{out} exists and is not empty (pass --force to replace it)")
        if out.resolve() == src.resolve():
            raise ValueError("--out must differ from --checkpoint")

        from vegas_jax.loading import _check_agrees, checkpoint_kind

        kind = checkpoint_kind(src)
        if kind == "orbax":
            raise ValueError(f"{src} is already a vegas_jax checkpoint")
        t0 = time.perf_counter()
        log(f"reading {kind.upper()} checkpoint {src} as {dtype} ...")
        if kind == "gguf":
            from vegas_jax.checkpoint.gguf import load_gguf

            cfg, params, tok = load_gguf(src, dtype, progress=not args.quiet)
        else:
            from vegas_jax.checkpoint.hf import load_hf_checkpoint, load_hf_tokenizer

            cfg, params = load_hf_checkpoint(src, dtype, progress=not args.quiet)
            tok = load_hf_tokenizer(src)
        if args.model is not None:
            cfg = _check_agrees(args.model, cfg, src)
        from vegas_jax.params import param_bytes

        log(f"  {cfg.name}: {cfg.num_params() / 1e6:.1f}M params, "
            f"{param_bytes(params) / 2**30:.2f} GiB, tokenizer: {'yes' if tok is not None else 'none'}"
            f" ({time.perf_counter() - t0:.1f} s)")
        log(f"writing orbax checkpoint to {out} ...")
        t1 = time.perf_counter()
        from vegas_jax.checkpoint.orbax_io import save_orbax_checkpoint

        save_orbax_checkpoint(out, cfg, params, tok, overwrite=args.force)
        log(f"done in {time.perf_counter() - t1:.1f} s; load it with --checkpoint {out}")
        return 0
    except (FileNotFoundError, FileExistsError, ValueError, NotImplementedError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

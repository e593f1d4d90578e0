"""llama.cpp GGUF file -> `Params` on the host, config and tokenizer. Torch-free.

Tensors are read with the `gguf` package and dequantized with `gguf.quants.dequantize`
(numpy). llama.cpp's converter permutes the rows of `attn_q` / `attn_k` of Llama models
for its RoPE layout; we undo it exactly as transformers' GGUF loader does
(`reverse_permute_weights`). The tokenizer is rebuilt from the file's vocabulary with
transformers' own GGUF tokenizer mapping, wrapped in `PreTrainedTokenizerFast`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from vegas_jax.checkpoint.common import assemble, np_dtype, registry_match, stack_layers
from vegas_jax.config import ModelConfig, RopeScaling
from vegas_jax.params import Params

SUPPORTED_ARCHS = ("llama", "qwen3")


def _reader(path):
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - environment dependent
        raise ImportError(
            "reading .gguf files needs the `gguf` package (pure Python): pip install gguf; "
            "on a machine without a package index, `pip download --no-deps gguf` elsewhere and "
            "`pip install --no-deps` the wheel there"
        ) from e
    return gguf.GGUFReader(str(path))


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. w: [n_head * head_dim, in] (HF [out, in])."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _round_sig(x: float, digits: int = 6) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.999999747e-06.
    return float(f"{float(x):.{digits}g}")


def read_config(reader, path: Path | None = None) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHS})"
        )
    g = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(g("attention.key_length") or g("rope.dimension_count") or hidden // heads)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = g("vocab_size")
    if vocab is None:
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab = int(emb.shape[-1])
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise NotImplementedError(
            f"{path}: this GGUF carries llama3 rope_freqs; convert the HF checkpoint instead"
        )
    scaling = None
    kind = g("rope.scaling.type")
    if kind not in (None, "none", "linear") or (kind == "linear" and float(g("rope.scaling.factor", 1.0)) != 1.0):
        if kind != "yarn":
            raise ValueError(f"{path}: unsupported GGUF rope scaling {kind!r}")
        scaling = RopeScaling(
            "yarn", float(g("rope.scaling.factor")),
            int(g("rope.scaling.original_context_length")),
        )
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        name=Path(path).stem if path is not None else arch,
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=_round_sig(g("rope.freq_base", 10000.0)),
        rms_norm_eps=_round_sig(g("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(g("context_length", 4096)),
        tie_embeddings="output.weight" not in names,
        qk_norm=arch == "qwen3",
        rope_scaling=scaling,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )
    entry = registry_match(cfg)
    if entry is not None:
        cfg = dataclasses.replace(cfg, name=entry.name)
    return cfg


def read_tokenizer(reader):
    """`PreTrainedTokenizerFast` built from the file's tokenizer metadata (no torch), through
    public `tokenizers` / `transformers` APIs (`vegas_jax.checkpoint.gguf_tokenizer`). None
    when the file has no vocabulary, or (with a warning saying why) one we cannot build."""
    from vegas_jax.checkpoint.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(reader)


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` over the file (memory-mapped: cheap until tensors are read)."""
    return _reader(Path(path))


def read_params(reader, cfg: ModelConfig, dtype="bfloat16", progress: bool | None = None,
                path: Path | None = None) -> Params:
    """Dequantize every tensor into host arrays of `dtype`, in our layout."""
    from gguf.quants import dequantize

    dt = np_dtype(dtype)
    tensors = {t.name: t for t in reader.tensors}
    if progress is None:
        progress = cfg.num_params() > 1_000_000_000

    def get(name: str) -> np.ndarray:  # numpy layout, i.e. HF [out, in]
        if name not in tensors:
            raise ValueError(f"{path}: GGUF has no tensor {name!r}")
        t = tensors[name]
        return dequantize(t.data, t.tensor_type)

    # llama.cpp permutes Q/K rows only for the Llama family (not for Qwen3).
    permute = cfg.arch == "llama"

    def layer(i: int):
        p = f"blk.{i}."
        wq, wk = get(p + "attn_q.weight"), get(p + "attn_k.weight")
        if permute:
            wq = reverse_permute(wq, cfg.num_heads)
            wk = reverse_permute(wk, cfg.num_kv_heads)
        out = {
            "attn_norm": get(p + "attn_norm.weight"),
            "wq": wq.T, "wk": wk.T, "wv": get(p + "attn_v.weight").T,
            "wo": get(p + "attn_output.weight").T,
            "mlp_norm": get(p + "ffn_norm.weight"),
            "w_gate": get(p + "ffn_gate.weight").T,
            "w_up": get(p + "ffn_up.weight").T,
            "w_down": get(p + "ffn_down.weight").T,
        }
        if cfg.qk_norm:
            out["q_norm"] = get(p + "attn_q_norm.weight")
            out["k_norm"] = get(p + "attn_k_norm.weight")
        return out

    name = Path(path).name if path is not None else "gguf"
    layers = stack_layers(cfg, layer, dt, progress=progress, desc=f"{name} layers")
    lm_head = None if cfg.tie_embeddings else get("output.weight").T
    return assemble(cfg, get("token_embd.weight"), layers, get("output_norm.weight"), lm_head, dt)


def load_gguf(
    path: str | Path, dtype="bfloat16", progress: bool | None = None, tokenizer: bool = True
) -> tuple[ModelConfig, Params, Any]:
    """Read a GGUF file: (config, host params of `dtype`, tokenizer or None)."""
    path = Path(path)
    reader = open_gguf(path)
    cfg = read_config(reader, path)
    params = read_params(reader, cfg, dtype, progress, path)
    return cfg, params, read_tokenizer(reader) if tokenizer else None

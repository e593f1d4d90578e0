"""llama.cpp GGUF file -> `Params` on the host, config and tokenizer. Torch-free.

`GGUFFile` parses the header and metadata itself and memory-maps the tensors (the `gguf`
package's `GGUFReader` makes numpy views of every vocabulary entry: slow for the default
model's 49K). Tensors dequantize to the numbers `gguf.quants.dequantize` gives: its own
block code over many rows a call, or, for Q4_0 / Q4_1 / Q8_0 matrices, the same arithmetic
on transposed packed bytes, so no float32 matrix is transposed. Layers are read on a thread
per core (numpy releases the GIL). llama.cpp's converter permutes the rows of `attn_q` /
`attn_k` of Llama models for its RoPE layout; we undo it exactly as transformers' GGUF
loader does (`reverse_permute_weights`). The tokenizer is rebuilt from the file's
vocabulary (`read_tokenizer`).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from vegas_jax.checkpoint.common import (
    assemble, layer_shapes, np_dtype, registry_match, stack_layers,
)
from vegas_jax.checkpoint.gguf_tokenizer import field as _field
from vegas_jax.config import ModelConfig, RopeScaling
from vegas_jax.params import Params

SUPPORTED_ARCHS = ("llama", "qwen3")


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - environment dependent
        raise ImportError(
            "reading .gguf files needs the `gguf` package (pure Python): pip install gguf; "
            "on a machine without a package index, `pip download --no-deps gguf` elsewhere and "
            "`pip install --no-deps` the wheel there"
        ) from e
    return gguf


# GGUF metadata value types: numpy dtype of each number type; 8 is a string, 9 an array.
_NUMBERS = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class Field(NamedTuple):
    """A metadata value; `contents()` is what gguf's `ReaderField.contents()` gives."""

    value: Any

    def contents(self) -> Any:
        return list(self.value) if isinstance(self.value, list) else self.value


class Tensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: a matrix is [out, in]
    data: np.ndarray  # the raw bytes, uint8 [*shape[:-1], bytes a row]


class GGUFFile:
    """A GGUF file's metadata (`fields`: key -> `Field`) and tensors (`tensors`: name ->
    `Tensor` over the memory-mapped file), parsed with `struct` (little-endian v2 / v3)."""

    def __init__(self, path: str | Path):
        gguf = _gguf()
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        magic, version = struct.unpack_from("<4sI", buf, 0) if len(buf) >= 24 else (b"", 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file "
                             f"(magic {magic!r}, version {version})")
        n_tensors, n_fields = struct.unpack_from("<QQ", buf, 8)
        self._buf, off = buf, 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key, off = self._string(off)
            (kind,), off = struct.unpack_from("<I", buf, off), off + 4
            value, off = self._value(off, kind)
            self.fields[key] = Field(value)
        infos = []
        for _ in range(n_tensors):
            name, off = self._string(off)
            (n_dims,), off = struct.unpack_from("<I", buf, off), off + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off)
            kind, start = struct.unpack_from("<IQ", buf, off + 8 * n_dims)
            off += 8 * n_dims + 12
            infos.append((name, gguf.GGMLQuantizationType(kind), dims[::-1], start))
        align = int(self.fields.get("general.alignment", Field(32)).value)
        data = np.frombuffer(buf, np.uint8)
        base = -(-off // align) * align
        self.tensors: dict[str, Tensor] = {}
        for name, kind, shape, start in infos:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            row = shape[-1] // block * size  # bytes a row
            n = int(np.prod(shape[:-1], dtype=np.int64)) * row
            if shape[-1] % block or base + start + n > len(data):
                raise ValueError(f"{path}: tensor {name} {kind.name}{list(shape)} does not fit "
                                 f"the file (truncated or corrupt?)")
            raw = data[base + start:base + start + n].reshape(*shape[:-1], row)
            self.tensors[name] = Tensor(name, kind, tuple(shape), raw)

    def _string(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, off)
        return str(self._buf[off + 8:off + 8 + n], "utf-8"), off + 8 + n

    def _value(self, off: int, kind: int) -> tuple[Any, int]:
        if kind == _STRING:
            return self._string(off)
        if kind == _ARRAY:
            item, n = struct.unpack_from("<IQ", self._buf, off)
            off += 12
            if item in _NUMBERS:
                dt = np.dtype(_NUMBERS[item])
                return np.frombuffer(self._buf, dt, n, off).tolist(), off + n * dt.itemsize
            out = []
            for _ in range(n):
                v, off = self._value(off, item)
                out.append(v)
            return out, off
        if kind not in _NUMBERS:
            raise ValueError(f"unknown GGUF metadata value type {kind}")
        dt = np.dtype(_NUMBERS[kind])
        return np.frombuffer(self._buf, dt, 1, off).tolist()[0], off + dt.itemsize


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. w: [n_head * head_dim, ...] (HF [out, in], or
    a quantized tensor's rows of bytes)."""
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
        vocab = len(tokens.value) if tokens is not None else None
    if vocab is None:
        vocab = int(reader.tensors["token_embd.weight"].shape[0])
    names = set(reader.tensors)
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
    """`GGUFTokenizer` built from the file's tokenizer metadata through public `tokenizers` APIs
    (`vegas_jax.checkpoint.gguf_tokenizer`): encode / decode / chat template without importing
    transformers (seconds where it imports torch), the rest through the
    `PreTrainedTokenizerFast` it builds on demand (`.hf`). None when the file has no
    vocabulary, or (with a warning saying why) one we cannot build."""
    from vegas_jax.checkpoint.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(reader)


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and memory-mapped tensors (cheap until tensors are read)."""
    return GGUFFile(Path(path))


# Elements dequantized a call: a large tensor goes in pieces, so temporaries stay small.
_CHUNK = 1 << 22


def _f16(b: np.ndarray, k: int) -> np.ndarray:
    """The float16 at bytes k, k+1 of each block of b [block, byte, row], as float32."""
    bits = b[:, k + 1].astype(np.uint16) << 8 | b[:, k]
    return bits.view(np.float16).astype(np.float32)[:, None]


def _nibbles(b: np.ndarray) -> np.ndarray:
    return np.concatenate([b & 15, b >> 4], axis=1)  # a block's low nibbles, then its high


# gguf.quants' arithmetic for these types, on blocks [block, byte, row]: values come out
# [block, value, row], i.e. already transposed.
_TRANSPOSED = {
    "Q8_0": lambda b: b[:, 2:].view(np.int8).astype(np.float32) * _f16(b, 0),
    "Q4_0": lambda b: _f16(b, 0) * (_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)).astype(
        np.float32),
    "Q4_1": lambda b: _f16(b, 0) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b, 2),
}


def dequantize(t: Tensor, transpose: bool = False) -> np.ndarray:
    """`t` as float32 in numpy layout ([out, in]), or transposed ([in, out]): bit for bit
    what `gguf.quants.dequantize` gives (and `.T`)."""
    gguf = _gguf()
    kernel = _TRANSPOSED.get(t.tensor_type.name) if transpose else None
    if kernel is not None:  # transpose the packed bytes, not the float32 values
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        rows, n = t.shape
        out = np.empty((n, rows), np.float32)
        step = max(1, _CHUNK // (rows * block))  # blocks of each row a call
        for i in range(0, n // block, step):
            b = t.data[:, i * size:(i + step) * size].T.reshape(-1, size, rows)
            out[i * block:(i + step) * block] = kernel(b).reshape(-1, rows)
        return out
    data, n = t.data.reshape(-1, t.data.shape[-1]), t.shape[-1]
    out = np.empty((len(data), n), np.float32)
    step = max(1, _CHUNK // n)
    for i in range(0, len(data), step):  # rows as one long row: gguf runs 16 rows a call
        part = data[i:i + step].reshape(1, -1)
        out[i:i + step] = gguf.quants.dequantize(part, t.tensor_type).reshape(-1, n)
    out = out.reshape(t.shape)
    return out.T if transpose else out


def read_params(reader: GGUFFile, cfg: ModelConfig, dtype="bfloat16",
                progress: bool | None = None, path: Path | None = None) -> Params:
    """Dequantize every tensor into host arrays of `dtype`, in our layout (layers on
    threads: numpy releases the GIL)."""
    dt = np_dtype(dtype)
    if progress is None:
        progress = cfg.num_params() > 1_000_000_000

    def get(name: str, transpose: bool = False, heads: int = 0) -> np.ndarray:
        if name not in reader.tensors:
            raise ValueError(f"{path}: GGUF has no tensor {name!r}")
        t = reader.tensors[name]
        if heads:  # permuting rows commutes with dequantizing: done on the packed bytes
            t = t._replace(data=reverse_permute(t.data, heads))
        return dequantize(t, transpose)

    # llama.cpp permutes Q/K rows only for the Llama family (not for Qwen3).
    permute = cfg.arch == "llama"

    def layer(i: int):
        p = f"blk.{i}."

        def w(kind: str, heads: int = 0) -> np.ndarray:  # a projection, [in, out]
            return get(f"{p}{kind}.weight", True, heads if permute else 0)

        out = {
            "attn_norm": get(p + "attn_norm.weight"),
            "wq": w("attn_q", cfg.num_heads), "wk": w("attn_k", cfg.num_kv_heads),
            "wv": w("attn_v"), "wo": w("attn_output"),
            "mlp_norm": get(p + "ffn_norm.weight"),
            "w_gate": w("ffn_gate"), "w_up": w("ffn_up"), "w_down": w("ffn_down"),
        }
        if cfg.qk_norm:
            out["q_norm"] = get(p + "attn_q_norm.weight")
            out["k_norm"] = get(p + "attn_k_norm.weight")
        return out

    name = Path(path).name if path is not None else "gguf"
    # a layer's float32 temporaries per thread: at most ~2 GiB of them at once
    layer_bytes = 4 * sum(int(np.prod(s)) for s in layer_shapes(cfg).values())
    workers = max(1, min(os.cpu_count() or 1, (2 << 30) // layer_bytes))
    with ThreadPoolExecutor(1) as pool:  # the embedding alongside the layers
        embed = pool.submit(lambda: get("token_embd.weight").astype(dt))
        layers = stack_layers(cfg, layer, dt, progress=progress, desc=f"{name} layers",
                              workers=workers)
        lm_head = None if cfg.tie_embeddings else get("output.weight", True)
        return assemble(cfg, embed.result(), layers, get("output_norm.weight"), lm_head, dt)


def load_gguf(
    path: str | Path, dtype="bfloat16", progress: bool | None = None, tokenizer: bool = True
) -> tuple[ModelConfig, Params, Any]:
    """Read a GGUF file: (config, host params of `dtype`, tokenizer or None)."""
    path = Path(path)
    reader = open_gguf(path)
    cfg = read_config(reader, path)
    params = read_params(reader, cfg, dtype, progress, path)
    return cfg, params, read_tokenizer(reader) if tokenizer else None

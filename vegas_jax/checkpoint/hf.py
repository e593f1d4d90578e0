"""Hugging Face checkpoint directory (config.json + *.safetensors) -> `Params` on the host
(Llama, Qwen3, Qwen3-MoE, gpt-oss with bf16 or MXFP4 experts).

HF `nn.Linear` weights are [out, in]; ours are [in, out]. Layers are stacked on axis 0.
Tensors are read straight from the safetensors files through a memory map (the format is
an 8-byte header length, a JSON header and raw little-endian data), which handles bf16
without torch or a framework round trip, and never holds more than one layer's source
tensors in memory besides the stacked result.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from vegas_jax.checkpoint.common import (
    assemble, field_shapes, np_dtype, params_to_dict, registry_match, split_fused,
    stack_layers,
)
from vegas_jax.config import ModelConfig, from_hf_config
from vegas_jax.params import Params

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}

# Tensors a Llama / Qwen3 checkpoint may carry that the model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class SafetensorsFile:
    """Lazy, zero-copy reader of one .safetensors file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{self.path} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20:
                raise ValueError(f"{self.path} is not a safetensors file (header size {n})")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.header = header
        self._offset = 8 + n
        self._mm = None

    def keys(self):
        return self.header.keys()

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._offset)
        start, end = info["data_offsets"]
        return self._mm[start:end].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


class SafetensorsDir:
    """All tensors of a (possibly sharded) checkpoint directory, by name."""

    def __init__(self, path: Path):
        path = Path(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            bins = sorted(path.glob("*.bin")) + sorted(path.glob("*.pt*"))
            hint = (
                " (it has PyTorch .bin files: re-save it with "
                "`save_pretrained(dir, safe_serialization=True)`)" if bins else ""
            )
            raise FileNotFoundError(f"no *.safetensors files in {path}{hint}")
        self.where: dict[str, SafetensorsFile] = {}
        for fpath in files:
            st = SafetensorsFile(fpath)
            for k in st.keys():
                self.where[k] = st

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return self.where[name].get(name)


def read_config(path: str | Path, name: str | None = None) -> ModelConfig:
    """Our config from an HF directory; EOS ids from generation_config.json are merged in,
    and a checkpoint whose structure matches a registry entry takes that entry's name."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    cfg = from_hf_config(hf, name=name or path.name)
    eos = list(cfg.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text()).get("eos_token_id")
        for e in [g] if isinstance(g, int) else (g or []):
            if e not in eos:
                eos.append(int(e))
    updates = {"eos_token_ids": tuple(eos)}
    if cfg.bos_token_id is None and gen.is_file():  # gpt-oss keeps it there only
        bos = json.loads(gen.read_text()).get("bos_token_id")
        updates["bos_token_id"] = None if bos is None else int(bos)
    if name is None:
        entry = registry_match(cfg)
        if entry is not None:
            updates["name"] = entry.name
    return dataclasses.replace(cfg, **updates)


def layer_names(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """Our LayerParams field -> (HF tensor name inside a layer, stored transposed?); an MoE
    model's experts are in `EXPERT_NAMES`.

    HF `nn.Linear` weights are [out, in]; ours are [in, out]."""
    names = {
        "attn_norm": ("input_layernorm.weight", False),
        "wq": ("self_attn.q_proj.weight", True),
        "wk": ("self_attn.k_proj.weight", True),
        "wv": ("self_attn.v_proj.weight", True),
        "wo": ("self_attn.o_proj.weight", True),
        "mlp_norm": ("post_attention_layernorm.weight", False),
    }
    if cfg.attn_bias:
        names.update({
            "bq": ("self_attn.q_proj.bias", False),
            "bk": ("self_attn.k_proj.bias", False),
            "bv": ("self_attn.v_proj.bias", False),
            "bo": ("self_attn.o_proj.bias", False),
        })
    if cfg.attn_sinks:
        names["sinks"] = ("self_attn.sinks", False)
    if cfg.moe_style == "gpt-oss":  # the experts: `_gpt_oss_experts`
        names["w_router"] = ("mlp.router.weight", True)
        names["b_router"] = ("mlp.router.bias", False)
    elif cfg.is_moe:
        names["w_router"] = ("mlp.gate.weight", True)
    else:
        names.update({
            "w_gate": ("mlp.gate_proj.weight", True),
            "w_up": ("mlp.up_proj.weight", True),
            "w_down": ("mlp.down_proj.weight", True),
        })
    if cfg.qk_norm:
        names["q_norm"] = ("self_attn.q_norm.weight", False)
        names["k_norm"] = ("self_attn.k_norm.weight", False)
    return names


# Our stacked expert projection -> HF tensor name of expert E inside a layer, as Qwen3-MoE
# checkpoints store them: one nn.Linear per expert, [out, in].
EXPERT_NAMES = {
    "w_expert_gate": "mlp.experts.{}.gate_proj.weight",
    "w_expert_up": "mlp.experts.{}.up_proj.weight",
    "w_expert_down": "mlp.experts.{}.down_proj.weight",
}


# gpt-oss: a layer's experts in 3-D tensors [e, in, out] (biases [e, out]), gate and up
# interleaved along the last axis; weights in the model's dtype or MXFP4 blocks + scales.
GPT_OSS_EXPERTS = "mlp.experts."


def _gpt_oss_experts(st: "SafetensorsDir", prefix: str, dtype):
    """One gpt-oss layer's experts as our parts ([e, in, out] weights, [e, out] biases),
    gate and up apart; MXFP4 weights dequantised expert by expert into `dtype`."""
    from vegas_jax.checkpoint.mxfp4 import dequantize_mxfp4

    p = prefix + GPT_OSS_EXPERTS

    def weight(name):  # [e, in, out]
        if p + name in st:
            return st.get(p + name)
        if p + name + "_blocks" not in st:
            raise ValueError(f"checkpoint has neither {p + name!r} nor its MXFP4 form "
                             f"{p + name + '_blocks'!r}")
        blocks, scales = st.get(p + name + "_blocks"), st.get(p + name + "_scales")
        e, rows = blocks.shape[:2]
        out = np.empty((e, blocks.shape[2] * blocks.shape[3] * 2, rows), dtype)
        for i in range(e):  # one expert at a time: fp32 temporaries of one expert only
            out[i] = dequantize_mxfp4(blocks[i], scales[i]).T
        return out

    gate_up, gate_up_bias = weight("gate_up_proj"), st.get(p + "gate_up_proj_bias")
    return {
        "w_expert_gate": gate_up[..., 0::2], "w_expert_up": gate_up[..., 1::2],
        "b_expert_gate": gate_up_bias[..., 0::2], "b_expert_up": gate_up_bias[..., 1::2],
        "w_expert_down": weight("down_proj"), "b_expert_down": st.get(p + "down_proj_bias"),
    }


def _interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[..., n] and [..., n] -> [..., 2n] with a in the even columns, b in the odd."""
    out = np.empty(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    out[..., 0::2], out[..., 1::2] = a, b
    return out


def to_hf_state_dict(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """The inverse of `load_hf_checkpoint`: HF tensor names -> numpy arrays (for running
    the same weights through transformers, e.g. as a benchmark reference). Params laid
    out by `load_model` have their norm weights folded into the projections: they come
    out as ones beside the scaled projections, the same function."""
    out = {"model.embed_tokens.weight": np.asarray(params.embed),
           "model.norm.weight": np.asarray(params.final_norm)}
    layers = params_to_dict(params)["layers"]
    fields = split_fused(cfg, {f: np.asarray(layers[f]) for f in field_shapes(cfg)})
    for ours, (hf, transposed) in layer_names(cfg).items():
        stacked = fields[ours]
        for i in range(cfg.num_layers):
            out[f"model.layers.{i}.{hf}"] = stacked[i].T if transposed else stacked[i]
    oss = cfg.moe_style == "gpt-oss"
    for ours, hf in (EXPERT_NAMES.items() if cfg.is_moe and not oss else ()):
        for i in range(cfg.num_layers):
            for e in range(cfg.num_experts):
                out[f"model.layers.{i}.{hf.format(e)}"] = fields[ours][i, e].T
    for i in range(cfg.num_layers if oss else 0):  # unquantised, as transformers saves it
        p = f"model.layers.{i}.{GPT_OSS_EXPERTS}"
        out[p + "gate_up_proj"] = _interleave(fields["w_expert_gate"][i],
                                              fields["w_expert_up"][i])
        out[p + "gate_up_proj_bias"] = _interleave(fields["b_expert_gate"][i],
                                                   fields["b_expert_up"][i])
        out[p + "down_proj"] = fields["w_expert_down"][i]
        out[p + "down_proj_bias"] = fields["b_expert_down"][i]
    out["lm_head.weight"] = np.asarray(params.embed if params.lm_head is None else params.lm_head.T)
    return out


def to_hf_config(cfg: ModelConfig) -> dict:
    """A transformers config dict for `cfg` (Llama, Qwen3, Qwen3-MoE or gpt-oss)."""
    model_type = {"gpt-oss": "gpt_oss"}.get(cfg.arch, "qwen3_moe" if cfg.is_moe else cfg.arch)
    d = {
        "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if cfg.eos_token_ids else None,
    }
    if cfg.arch == "gpt-oss":
        d.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                 intermediate_size=cfg.moe_intermediate_size, attention_bias=cfg.attn_bias,
                 swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
                 sliding_window=cfg.sliding_window or None,
                 layer_types=["sliding_attention" if w else "full_attention"
                              for w in cfg.layer_windows])
    elif cfg.is_moe:
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                 moe_intermediate_size=cfg.moe_intermediate_size,
                 norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    rs = cfg.rope_scaling
    if rs is not None:
        d["rope_scaling"] = {"rope_type": rs.kind, "factor": rs.factor,
                             "original_max_position_embeddings": rs.original_max_position}
        if rs.kind == "llama3":
            d["rope_scaling"].update(low_freq_factor=rs.low_freq_factor,
                                     high_freq_factor=rs.high_freq_factor)
        if rs.kind == "yarn":
            d["rope_scaling"].update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow,
                                     truncate=rs.truncate)
            if rs.attention_factor is not None:
                d["rope_scaling"]["attention_factor"] = rs.attention_factor
    return d


def load_hf_checkpoint(
    path: str | Path, dtype="bfloat16", name: str | None = None, progress: bool | None = None
) -> tuple[ModelConfig, Params]:
    """Read an HF Llama / Qwen3 / Qwen3-MoE / gpt-oss checkpoint directory into host
    arrays of `dtype` (gpt-oss's MXFP4 experts dequantised)."""
    path = Path(path)
    cfg = read_config(path, name=name)
    dt = np_dtype(dtype)
    st = SafetensorsDir(path)
    prefix = "model." if "model.embed_tokens.weight" in st else ""
    if progress is None:
        progress = cfg.num_params() > 1_000_000_000

    def layer(i: int):
        p = f"{prefix}layers.{i}."
        out = {
            ours: st.get(p + hf).T if transposed else st.get(p + hf)
            for ours, (hf, transposed) in layer_names(cfg).items()
        }
        if cfg.moe_style == "gpt-oss":
            out.update(_gpt_oss_experts(st, p, dt))
            return out
        for ours, hf in (EXPERT_NAMES.items() if cfg.is_moe else ()):
            # one layer's experts as [e, in, out]: a copy of one layer, not of the model
            out[ours] = np.stack([st.get(p + hf.format(e)).T for e in range(cfg.num_experts)])
        return out

    layers = stack_layers(cfg, layer, dt, progress=progress, desc=f"{path.name} layers")
    lm_head = None
    if not cfg.tie_embeddings:
        if "lm_head.weight" not in st:
            raise ValueError(
                f"{path}: config.json says tie_word_embeddings=false but there is no lm_head.weight"
            )
        lm_head = st.get("lm_head.weight").T
    params = assemble(
        cfg, st.get(prefix + "embed_tokens.weight"), layers, st.get(prefix + "norm.weight"),
        lm_head, dt,
    )
    return cfg, params


def load_hf_tokenizer(path: str | Path):
    """The directory's tokenizer, or None when it has no tokenizer files."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception:
        if (path / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
        raise

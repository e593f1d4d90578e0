"""Model configurations: frozen dataclasses in one registry keyed by CLI names.

Hugging Face key names appear only in `from_hf_config`, the one place that reads a
checkpoint's `config.json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "llama3" or "yarn"."""

    kind: str
    factor: float
    original_max_position: int
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = 0.1 * ln(factor) + 1
    # yarn: round the ramp's ends to whole dimensions (floor / ceil), as the YaRN paper's
    # code does; gpt-oss turns it off and ramps between the exact (fractional) ends
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    arch: str  # "llama" | "qwen3" | "gpt-oss" (the attention; the MLP is dense or MoE, `num_experts`)
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width; an MoE model's is the checkpoint's, unused
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_embeddings: bool
    qk_norm: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Qwen3-MoE): 0 experts is a dense model. Every layer's MLP is
    # then the MoE block; layouts mixing dense and MoE layers are refused on reading.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # one expert's MLP width
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    # How an MoE layer routes and what its experts compute: "qwen3" (softmax over every
    # router logit, then the top k; SwiGLU experts without biases) or "gpt-oss" (router
    # with a bias; the top k logits, then a softmax over them; experts with biases and
    # the clamped SwiGLU (up + 1) * g * sigmoid(alpha * g), g = min(gate, limit), up
    # clipped to +-limit).
    moe_style: str = "qwen3"
    swiglu_limit: float = 0.0  # gpt-oss experts only
    swiglu_alpha: float = 0.0  # gpt-oss experts only
    # gpt-oss attention: biases on the q, k, v and o projections; a learned logit per
    # query head that joins every softmax's denominator and carries no value ("sink");
    # the `sliding_layers` attend to the last `sliding_window` positions only (the query's
    # own included), the other layers to everything before the query.
    attn_bias: bool = False
    attn_sinks: bool = False
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.moe_style not in MOE_STYLES:
            raise ValueError(f"{self.name}: moe_style must be one of {MOE_STYLES}, "
                             f"got {self.moe_style!r}")
        if self.moe_style == "gpt-oss" and not (
                self.is_moe and self.swiglu_limit > 0 and self.swiglu_alpha > 0):
            raise ValueError(
                f"{self.name}: gpt-oss experts need num_experts > 0, swiglu_limit > 0 and "
                f"swiglu_alpha > 0; got num_experts={self.num_experts}, swiglu_limit="
                f"{self.swiglu_limit}, swiglu_alpha={self.swiglu_alpha}")
        layers = self.sliding_layers
        if layers != tuple(sorted(set(layers))) or any(
                not 0 <= i < self.num_layers for i in layers):
            raise ValueError(f"{self.name}: sliding_layers must be distinct layer indices "
                             f"in increasing order below {self.num_layers}, got {layers}")
        if bool(layers) != (self.sliding_window > 0) or self.sliding_window < 0:
            raise ValueError(
                f"{self.name}: sliding layers need a window and a window needs sliding "
                f"layers; got sliding_window={self.sliding_window}, sliding_layers={layers}")
        if len(layers) == self.num_layers:
            # speculative drafting selects over the full-attention layers: none to select
            raise ValueError(f"{self.name}: every layer is a sliding-window layer; "
                             f"vegas_jax needs at least one full-attention layer")
        if self.num_experts < 0 or (self.num_experts and not (
                1 <= self.experts_per_token <= self.num_experts
                and self.moe_intermediate_size > 0)):
            raise ValueError(
                f"{self.name}: a mixture of experts needs 1 <= experts_per_token <= "
                f"num_experts and moe_intermediate_size > 0; got num_experts="
                f"{self.num_experts}, experts_per_token={self.experts_per_token}, "
                f"moe_intermediate_size={self.moe_intermediate_size}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The layers that attend to every position before the query: the ones sparse
        drafting reads a selection in, whose verify scores are captured."""
        return tuple(i for i in range(self.num_layers) if i not in self.sliding_layers)

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's window (0: a full-attention layer)."""
        return tuple(self.sliding_window if i in self.sliding_layers else 0
                     for i in range(self.num_layers))

    @property
    def selection_slots(self) -> tuple[int, ...]:
        """Each layer's index among the full layers (its row of the captured scores and of
        the selection); a sliding layer gets the slot of the full layer before it (or the
        first), whose row it leaves as it is."""
        full = self.full_layers
        return tuple(max(sum(f <= i for f in full) - 1, 0) for i in range(self.num_layers))

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def with_yarn(self, factor: float = 4.0) -> "ModelConfig":
        """Qwen3's documented long-context switch: YaRN over the native 32K window."""
        original = 32768 if self.arch == "qwen3" else self.max_position_embeddings
        return dataclasses.replace(
            self,
            rope_scaling=RopeScaling("yarn", factor, original),
            max_position_embeddings=int(original * factor),
        )

    def with_context(self, tokens: int) -> "ModelConfig":
        """This config limited to `tokens` positions (prompt + new tokens), which it must be
        able to hold: as it is when they fit; Qwen3 beyond its native window switches to
        YaRN with the model card's factor 4 (up to 131072 positions); anything else is
        refused with the model's limit."""
        if int(tokens) != tokens or tokens < 1:
            raise ValueError(f"context must be a whole number >= 1, got {tokens}")
        if tokens <= self.max_position_embeddings:
            return dataclasses.replace(self, max_position_embeddings=int(tokens))
        if self.arch == "qwen3" and self.rope_scaling is None:
            long = self.with_yarn(4.0)
            if tokens <= long.max_position_embeddings:
                return dataclasses.replace(long, max_position_embeddings=int(tokens))
            limit = long.max_position_embeddings
        else:
            limit = self.max_position_embeddings
        raise ValueError(f"{self.name} supports at most {limit} positions, asked for {tokens}")

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attn_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads) + h
        if self.attn_sinks:
            attn += self.num_heads
        if self.is_moe:  # router + every expert (all of them are held, k are run)
            mlp = h * self.num_experts * (1 + 3 * self.moe_intermediate_size)
            if self.moe_style == "gpt-oss":  # router and expert biases
                mlp += self.num_experts * (1 + 2 * self.moe_intermediate_size + h)
        else:
            mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h + (2 * d if self.qk_norm else 0)
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + self.vocab_size * h + h + head


MOE_STYLES = ("qwen3", "gpt-oss")

# A frozen dataclass is hashable: it can be a static argument of jit.
jax.tree_util.register_static(ModelConfig)
jax.tree_util.register_static(RopeScaling)


def _qwen3(name, hidden, inter, layers, heads, tie):
    return ModelConfig(
        name=name, arch="qwen3", vocab_size=151936, hidden_size=hidden,
        intermediate_size=inter, num_layers=layers, num_heads=heads, num_kv_heads=8,
        head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_embeddings=tie, qk_norm=True,
        bos_token_id=151643, eos_token_ids=(151645, 151643),
    )


# Values from the official config.json of each checkpoint.
REGISTRY: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        ModelConfig(
            name="smollm2-135m", arch="llama", vocab_size=49152, hidden_size=576,
            intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
            head_dim=64, rope_theta=100_000.0, rms_norm_eps=1e-5,
            max_position_embeddings=8192, tie_embeddings=True, qk_norm=False,
            bos_token_id=1, eos_token_ids=(2,),
        ),
        _qwen3("qwen3-0.6b", 1024, 3072, 28, 16, True),
        _qwen3("qwen3-1.7b", 2048, 6144, 28, 16, True),
        _qwen3("qwen3-4b", 2560, 9728, 36, 32, True),
        _qwen3("qwen3-8b", 4096, 12288, 36, 32, False),
        _qwen3("qwen3-14b", 5120, 17408, 40, 40, False),
        _qwen3("qwen3-32b", 5120, 25600, 64, 64, False),
        dataclasses.replace(
            _qwen3("qwen3-30b-a3b", 2048, 6144, 48, 32, False), num_kv_heads=4,
            num_experts=128, experts_per_token=8, moe_intermediate_size=768,
            norm_topk_prob=True,
        ),
        ModelConfig(
            name="llama-3.1-8b", arch="llama", vocab_size=128256, hidden_size=4096,
            intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
            head_dim=128, rope_theta=500_000.0, rms_norm_eps=1e-5,
            max_position_embeddings=131072, tie_embeddings=False, qk_norm=False,
            rope_scaling=RopeScaling("llama3", 8.0, 8192, 1.0, 4.0),
            bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
        ),
        ModelConfig(
            name="gpt-oss-20b", arch="gpt-oss", vocab_size=201088, hidden_size=2880,
            intermediate_size=2880, num_layers=24, num_heads=64, num_kv_heads=8,
            head_dim=64, rope_theta=150_000.0, rms_norm_eps=1e-5,
            max_position_embeddings=131072, tie_embeddings=False, qk_norm=False,
            rope_scaling=RopeScaling("yarn", 32.0, 4096, beta_fast=32.0, beta_slow=1.0,
                                     truncate=False),
            # bos and the eos list from its generation_config.json
            bos_token_id=199998, eos_token_ids=(200002, 199999, 200012),
            num_experts=32, experts_per_token=4, moe_intermediate_size=2880,
            moe_style="gpt-oss", swiglu_limit=7.0, swiglu_alpha=1.702,
            attn_bias=True, attn_sinks=True, sliding_window=128,
            sliding_layers=tuple(range(0, 24, 2)),
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"


def get_config(name: str) -> ModelConfig:
    """Exact-name lookup; a near miss is an error that lists the known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def from_hf_config(hf: dict[str, Any] | str | Path, name: str | None = None) -> ModelConfig:
    """Build a config from a Hugging Face `config.json` (dict, file or directory)."""
    if not isinstance(hf, dict):
        path = Path(hf)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        hf = json.loads(path.read_text())
    model_type = hf.get("model_type", "llama")
    if model_type not in ("llama", "qwen3", "qwen3_moe", "mistral", "gpt_oss"):
        raise ValueError(
            f"unsupported model_type {model_type!r}: vegas_jax supports llama, qwen3, "
            f"qwen3_moe and gpt_oss checkpoints"
        )
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if quant is not None and not (quant == "mxfp4" and model_type == "gpt_oss"):
        raise ValueError(
            f"unsupported quantization {quant!r}: vegas_jax reads unquantised checkpoints "
            f"(and gpt-oss's MXFP4 experts, dequantised on load)"
        )
    arch = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "gpt_oss": "gpt-oss"}.get(model_type, "llama")
    if model_type == "gpt_oss":
        extra = _gpt_oss_fields(hf)
    else:
        extra = _moe_fields(hf) if model_type == "qwen3_moe" else {}
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("checkpoints with attention or MLP biases are not supported")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    scaling = None
    rs = hf.get("rope_scaling") or hf.get("rope_parameters")
    theta = hf.get("rope_theta")
    if isinstance(rs, dict):
        theta = rs.get("rope_theta", theta)
        kind = rs.get("rope_type", rs.get("type"))
        max_pos = hf.get("max_position_embeddings", 0)
        if kind == "llama3":
            scaling = RopeScaling(
                "llama3", float(rs["factor"]), int(rs["original_max_position_embeddings"]),
                low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            )
        elif kind == "yarn":
            scaling = RopeScaling(
                "yarn", float(rs["factor"]),
                int(rs.get("original_max_position_embeddings") or max_pos),
                beta_fast=float(rs.get("beta_fast", 32.0)),
                beta_slow=float(rs.get("beta_slow", 1.0)),
                attention_factor=rs.get("attention_factor"),
                truncate=bool(rs.get("truncate", True)),
            )
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope scaling {kind!r}")
    return ModelConfig(
        name=name or hf.get("_name_or_path") or model_type,
        arch=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=head_dim,
        rope_theta=float(theta if theta is not None else 10000.0),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=arch == "qwen3",
        rope_scaling=scaling,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_tuple(hf.get("eos_token_id")),
        **extra,
    )


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's MoE fields from a Qwen3-MoE config.json. A layer is MoE unless it is
    in `mlp_only_layers` or (index + 1) is not a multiple of `decoder_sparse_step`; only
    all-MoE layouts (those of Qwen3-30B-A3B and Qwen3-235B-A22B) are supported. 0 experts
    makes every layer dense: a Qwen3 model."""
    experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)) or 0)
    if not experts:
        return {}
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense_layers = sorted(set(hf.get("mlp_only_layers") or ()) | {
        i for i in range(hf["num_hidden_layers"]) if (i + 1) % step})
    if dense_layers:
        raise ValueError(
            f"unsupported Qwen3-MoE layout: layers {dense_layers} have a dense MLP "
            f"(decoder_sparse_step={step}, mlp_only_layers={hf.get('mlp_only_layers')}); "
            f"vegas_jax supports only models whose every layer is a mixture of experts"
        )
    return dict(
        num_experts=experts,
        experts_per_token=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


def _gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's gpt-oss fields from its config.json: every layer a mixture of
    experts of `intermediate_size` width, q/k/v/o biases (`attention_bias`, on unless
    it says otherwise), sinks in every layer, and each layer's attention from
    `layer_types` (absent: sliding on even layers, full on odd ones, as transformers
    fills it in)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if len(types) != n or unknown:
        raise ValueError(
            f"unsupported gpt-oss layer_types: {len(types)} entries for {n} layers"
            + (f", unknown kinds {unknown}" if unknown else "")
            + " (each must be 'sliding_attention' or 'full_attention')"
        )
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = int(hf.get("sliding_window") or 0) if sliding else 0
    if sliding and window < 1:
        raise ValueError(f"gpt-oss layers {list(sliding)} are sliding_attention but "
                         f"sliding_window is {hf.get('sliding_window')!r}")
    return dict(
        num_experts=int(hf.get("num_local_experts", hf.get("num_experts", 0)) or 0),
        experts_per_token=int(hf.get("num_experts_per_tok", hf.get("experts_per_token", 0))),
        moe_intermediate_size=int(hf["intermediate_size"]),
        moe_style="gpt-oss",
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        attn_bias=bool(hf.get("attention_bias", True)),
        attn_sinks=True,
        sliding_window=window,
        sliding_layers=sliding,
    )


def rope_inv_freq(cfg: ModelConfig):
    """Inverse frequencies [head_dim // 2] and the attention scale factor for cos/sin."""
    import numpy as np

    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv, 1.0
    if rs.kind == "llama3":
        low_wl = rs.original_max_position / rs.low_freq_factor
        high_wl = rs.original_max_position / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wl, inv / rs.factor, inv)
        smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return np.where(medium, smoothed, scaled), 1.0
    if rs.kind == "yarn":
        def corr_dim(rot):
            return (d * math.log(rs.original_max_position / (rot * 2 * math.pi))) / (
                2 * math.log(cfg.rope_theta)
            )

        low, high = corr_dim(rs.beta_fast), corr_dim(rs.beta_slow)
        if rs.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = (inv / rs.factor) * (1 - extrapolation) + inv * extrapolation
        att = rs.attention_factor
        if att is None:
            att = 0.1 * math.log(rs.factor) + 1.0 if rs.factor > 1 else 1.0
        return inv, float(att)
    raise ValueError(f"unknown rope scaling {rs.kind!r}")

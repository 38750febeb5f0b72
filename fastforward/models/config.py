"""Architecture hyper-parameters, read from an HF ``config.json``-style dict.

Both real HF directories (``rope_theta`` / ``rope_scaling``) and configs written by newer
transformers (``rope_parameters``, possibly per layer type) are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # FULL or SLIDING per layer
    rope: dict[str, RopeConfig] = field(default_factory=dict)  # per layer type
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window_of(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING else None


def _rope_from_dict(d: dict[str, Any] | None, default_theta: float) -> RopeConfig:
    d = dict(d or {})
    rope_type = d.get("rope_type", d.get("type", "default")) or "default"
    known = {"default", "linear", "llama3"}
    if rope_type not in known:
        raise ValueError(
            f"RoPE scaling type {rope_type!r} is not supported (known: {sorted(known)})"
        )
    return RopeConfig(
        theta=float(d.get("rope_theta", default_theta)),
        rope_type=rope_type,
        factor=float(d.get("factor", 1.0)),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
        partial_rotary_factor=float(d.get("partial_rotary_factor", 1.0)),
    )


def _rope_configs(d: dict[str, Any], model_type: str) -> dict[str, RopeConfig]:
    params = d.get("rope_parameters")
    theta = float(d.get("rope_theta", 10000.0))
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        return {k: _rope_from_dict(v, theta) for k, v in params.items() if v is not None}
    if isinstance(params, dict):
        full = _rope_from_dict(params, theta)
    else:
        full = _rope_from_dict(d.get("rope_scaling"), theta)
    if model_type.startswith("gemma3"):
        # Older Gemma 3 configs: local layers use rope_local_base_freq and no scaling.
        local = RopeConfig(theta=float(d.get("rope_local_base_freq", 10000.0)))
        return {FULL: full, SLIDING: local}
    return {FULL: full, SLIDING: full}


def _layer_types(d: dict[str, Any], model_type: str, num_layers: int) -> list[str]:
    if d.get("layer_types"):
        types = list(d["layer_types"])
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        return types
    window = d.get("sliding_window")
    if model_type.startswith("gemma3"):
        pattern = int(d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6)))
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if model_type == "qwen2" or model_type == "qwen3":
        # Qwen configs carry a sliding_window that only applies with use_sliding_window.
        if not d.get("use_sliding_window", False):
            return [FULL] * num_layers
        first_full = int(d.get("max_window_layers", num_layers))
        return [SLIDING if i >= first_full else FULL for i in range(num_layers)]
    return [SLIDING if window else FULL] * num_layers


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """Build a ``ModelConfig`` from an HF config dict (text config for multimodal wrappers)."""
    if "text_config" in d and "hidden_size" not in d:
        d = {**d["text_config"], "architectures": d.get("architectures")}
    archs = d.get("architectures") or []
    model_type = d.get("model_type", "")
    if not archs:
        raise ValueError("config has no 'architectures' entry")
    try:
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        num_layers = int(d["num_hidden_layers"])
        cfg = ModelConfig(
            architecture=archs[0],
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "silu",
            sliding_window=d.get("sliding_window"),
            layer_types=_layer_types(d, model_type, num_layers),
            rope=_rope_configs(d, model_type),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )
    except KeyError as e:
        raise ValueError(f"model config lacks required field {e.args[0]!r}") from None
    if SLIDING in cfg.layer_types and not cfg.sliding_window:
        raise ValueError("layer_types has sliding layers but sliding_window is not set")
    return cfg

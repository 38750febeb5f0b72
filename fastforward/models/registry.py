"""Checkpoint architecture name -> model class."""

from __future__ import annotations

from torch import nn

from fastforward.models.config import ModelConfig
from fastforward.models.gemma3 import Gemma3ForCausalLM
from fastforward.models.llama import LlamaForCausalLM
from fastforward.models.mistral import MistralForCausalLM
from fastforward.models.qwen2 import Qwen2ForCausalLM
from fastforward.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # text part only
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"architecture {cfg.architecture!r} is not supported (supported: {known})"
        ) from None

"""The weight formats by name: what ``quantization=`` accepts, and the module classes a
checkpoint's ``quantization_config`` refers to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fastforward.quant.base import ConcatLinear, QuantizedLinear
from fastforward.quant.codebook import CodebookLinear
from fastforward.quant.int4 import Int4Linear
from fastforward.quant.int5 import Int5Linear
from fastforward.quant.int8 import Int8GroupLinear, Int8Linear


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """A weight quantization method with its parameters."""

    name: str  # canonical name, e.g. "int4-g64"
    method: str  # int8 | int4 | codebook | gguf | mix (quant/mix.py)
    group_size: int = 0  # int4
    num_centroids: int = 0  # codebook (group_size: inputs per scale)
    gptq: bool = False  # int4 codes chosen by GPTQ on calibration text (quant/gptq.py)
    awq: bool = False  # activation-aware input scales before the codes are chosen (quant/awq.py)

    @property
    def calibrated(self) -> bool:
        """Whether loading runs the float model over calibration text first."""
        return self.gptq or self.awq


METHODS: dict[str, QuantSpec] = {
    "int8": QuantSpec("int8", "int8"),
    "int4": QuantSpec("int4", "int4", group_size=32),
    "int4-g32": QuantSpec("int4", "int4", group_size=32),
    "int4-g64": QuantSpec("int4-g64", "int4", group_size=64),
    "int4-g128": QuantSpec("int4-g128", "int4", group_size=128),
    "int4-gptq": QuantSpec("int4-gptq", "int4", group_size=32, gptq=True),
    "int4-g64-gptq": QuantSpec("int4-g64-gptq", "int4", group_size=64, gptq=True),
    "int4-g128-gptq": QuantSpec("int4-g128-gptq", "int4", group_size=128, gptq=True),
    "int4-awq": QuantSpec("int4-awq", "int4", group_size=32, awq=True),
    "int4-awq-gptq": QuantSpec("int4-awq-gptq", "int4", group_size=32, gptq=True, awq=True),
    "int4-g64-awq": QuantSpec("int4-g64-awq", "int4", group_size=64, awq=True),
    "int4-g64-awq-gptq": QuantSpec("int4-g64-awq-gptq", "int4", group_size=64, gptq=True, awq=True),
    "int4-mix": QuantSpec("int4-mix", "mix", group_size=32, gptq=True),
    "codebook4": QuantSpec("codebook4", "codebook", group_size=32, num_centroids=16),
    "codebook4-g64": QuantSpec("codebook4-g64", "codebook", group_size=64, num_centroids=16),
    "codebook8": QuantSpec("codebook8", "codebook", group_size=128, num_centroids=256),
    "gguf": QuantSpec("gguf", "gguf"),
}


def parse_quantization(name: str | None) -> QuantSpec | None:
    """``None``/``"none"`` -> no quantization; otherwise one of ``METHODS``."""
    if name is None or name.lower() in ("", "none"):
        return None
    spec = METHODS.get(name.lower())
    if spec is None:
        raise ValueError(
            f"quantization {name!r} is not supported (choose none, {', '.join(METHODS)})"
        )
    return spec


MODULES: dict[str, type[QuantizedLinear]] = {
    cls.format: cls
    for cls in (Int8Linear, Int8GroupLinear, Int4Linear, Int5Linear, CodebookLinear, ConcatLinear)
}


def module_from_packed(
    tensors: dict[str, torch.Tensor], config: dict[str, Any], bias: torch.Tensor | None
) -> QuantizedLinear:
    """Rebuild a quantized linear from a checkpoint's packed tensors and its config entry."""
    cls = MODULES.get(config.get("format", ""))
    if cls is None:
        raise ValueError(f"unknown quantized format {config.get('format')!r} in checkpoint")
    module = cls.from_packed(tensors, config, bias)
    if (module.in_features, module.out_features) != (config["in_features"], config["out_features"]):
        raise ValueError(f"packed tensors do not match the declared shape {config}")
    return module

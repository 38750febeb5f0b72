"""Open a checkpoint (GGUF file or HF directory) and build the model and tokenizer from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fastforward.loader.gguf_weights import GGUFCheckpoint
from fastforward.loader.hf_weights import HFCheckpoint
from fastforward.loader.tokenizer import Tokenizer
from fastforward.models.config import ModelConfig, model_config_from_dict
from fastforward.models.registry import model_class
from fastforward.quant import parse_quantization
from fastforward.quant.apply import QuantReport
from fastforward.quant.loading import is_quantized_checkpoint, load_quantized_model


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    quantization: QuantReport | None = None  # what was packed, what was left in float


def open_checkpoint(path: str | Path) -> GGUFCheckpoint | HFCheckpoint:
    path = Path(path)
    if path.is_dir():
        return HFCheckpoint(path)
    if path.is_file():
        return GGUFCheckpoint(path)
    raise ValueError(f"model path {str(path)!r} does not exist")


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    return Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
) -> LoadedModel:
    """Build the architecture on the meta device (no random init), then fill it from the
    checkpoint, converting each tensor to ``dtype`` as it is copied in. With ``quantization``
    (or a checkpoint written by ``fastforward quantize``) the linears are packed modules."""
    ckpt = open_checkpoint(path)
    config = model_config_from_dict(ckpt.hf_config())
    if isinstance(ckpt, GGUFCheckpoint):
        tokenizer = Tokenizer.from_gguf(ckpt.metadata)
    else:
        tokenizer = Tokenizer.from_hf_dir(path)
    with torch.device("meta"):
        model = model_class(config)(config)
    spec = parse_quantization(quantization)
    report = None
    if spec is not None or is_quantized_checkpoint(ckpt):
        model, report = load_quantized_model(model, ckpt, spec, dtype, device, tokenizer)
    else:
        model = model.to(dtype=dtype).to_empty(device=device)
        model.load_weights(ckpt.tensors())
    model.eval()
    return LoadedModel(
        model=model, config=config, tokenizer=tokenizer, path=Path(path), quantization=report
    )

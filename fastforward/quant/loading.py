"""The three ways a quantized model comes to be at load time."""

from __future__ import annotations

import torch
from torch import nn

from fastforward.calibration import Encoder, calibration_windows
from fastforward.loader.gguf_weights import GGUFCheckpoint
from fastforward.loader.hf_weights import HFCheckpoint
from fastforward.quant.apply import QuantReport, quantize_model
from fastforward.quant.awq import awq_scale_model
from fastforward.quant.checkpoint import load_quantized, stored_quantization
from fastforward.quant.formats import QuantSpec
from fastforward.quant.gguf_load import load_gguf_packed
from fastforward.quant.gptq import GPTQ_TOKENS, GPTQ_WINDOW, collect_hessians


def is_quantized_checkpoint(ckpt: GGUFCheckpoint | HFCheckpoint) -> bool:
    return isinstance(ckpt, HFCheckpoint) and stored_quantization(ckpt.config) is not None


def load_quantized_model(
    model: nn.Module,
    ckpt: GGUFCheckpoint | HFCheckpoint,
    spec: QuantSpec | None,
    dtype: torch.dtype,
    device: torch.device,
    tokenizer: Encoder | None = None,
) -> tuple[nn.Module, QuantReport]:
    """Fill ``model`` (built on the meta device) quantized: from a checkpoint written by
    ``fastforward quantize``, from a GGUF file's own blocks (``gguf``), or by quantizing the
    float32 weights as loaded (every other method; GPTQ first runs the float model over
    calibration text with ``tokenizer``)."""
    if device.type != "cpu":
        raise ValueError("quantized weights run on the CPU kernels only (device='cpu')")
    if is_quantized_checkpoint(ckpt):
        stored = stored_quantization(ckpt.config)["method"]
        if spec is not None and spec.name != stored:
            raise ValueError(
                f"{ckpt.path} is already quantized ({stored}); cannot make it {spec.name}"
            )
        model = model.to(dtype=dtype).to_empty(device=device)
        return model, load_quantized(model, ckpt, dtype)
    assert spec is not None
    if spec.method == "gguf":
        if not isinstance(ckpt, GGUFCheckpoint):
            raise ValueError("quantization='gguf' keeps a GGUF file's blocks: give a .gguf model")
        model = model.to(dtype=dtype).to_empty(device=device)
        return model, load_gguf_packed(model, ckpt, dtype)
    model = model.to(dtype=torch.float32).to_empty(device=device)
    model.load_weights(ckpt.tensors())
    hessians = None
    if spec.calibrated:
        if tokenizer is None:
            raise ValueError(f"{spec.name} needs the tokenizer for its calibration text")
        windows = calibration_windows(tokenizer, GPTQ_TOKENS, GPTQ_WINDOW)
        hessians = collect_hessians(model, windows)
        if spec.awq:
            awq_scale_model(model, hessians, spec.group_size)
    return model, quantize_model(model, spec, dtype, hessians)

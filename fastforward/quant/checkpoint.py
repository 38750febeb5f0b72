"""Quantized checkpoints: an HF-style directory that loads back bit for bit.

``model.safetensors`` holds every quantized module's packed tensors (CPU-independent layouts)
under the module's name in our model (fused layers as one matrix: ``layers.0.self_attn.
qkv_proj.codes``) and every remaining float parameter under its own name. ``config.json`` is the
model's HF config plus a ``quantization_config`` naming each packed module and its format;
``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` carry the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from fastforward.loader.hf_weights import HFCheckpoint
from fastforward.loader.tokenizer import Tokenizer
from fastforward.quant.apply import QuantReport
from fastforward.quant.base import QuantizedEmbedding, QuantizedLinear
from fastforward.quant.formats import module_from_packed

QUANT_METHOD = "fastforward"
FORMAT_VERSION = 1


def packed_modules(model: nn.Module) -> dict[str, tuple[QuantizedLinear, bool]]:
    """Top-level quantized modules by name -> (linear, is an embedding)."""
    found: dict[str, tuple[QuantizedLinear, bool]] = {}
    for name, m in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer in found):
            continue  # inside one already found (a ConcatLinear part, an embedding's linear)
        if isinstance(m, QuantizedEmbedding):
            found[name] = (m.linear, True)
        elif isinstance(m, QuantizedLinear):
            found[name] = (m, False)
    return found


def save_quantized(
    model: nn.Module,
    hf_config: dict[str, Any],
    tokenizer: Tokenizer,
    method: str,
    out_dir: str | Path,
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict[str, Any]] = {}
    for name, (linear, is_embedding) in packed_modules(model).items():
        modules[name] = linear.config() | ({"embedding": True} if is_embedding else {})
        for key, t in linear.packed_state().items():
            tensors[f"{name}.{key}"] = t.detach().contiguous().cpu()
    for name, p in model.named_parameters():
        tensors[name] = p.detach().contiguous().cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = dict(hf_config) | {
        "quantization_config": {
            "quant_method": QUANT_METHOD,
            "format_version": FORMAT_VERSION,
            "method": method,
            "modules": modules,
        }
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_tokenizer(tokenizer, out)
    return out


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """What ``Tokenizer.from_hf_dir`` reads back into the same tokenizer."""
    tokenizer.backend.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": tokenizer.add_eos_token,
    }
    for key, tid in (("pad_token", tokenizer.pad_token_id), ("unk_token", tokenizer.unk_token_id)):
        if tid is not None:
            config[key] = tokenizer.id_to_token(tid)
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": sorted(tokenizer.eos_token_ids)}
    if tokenizer.bos_token_id is not None:
        generation["bos_token_id"] = tokenizer.bos_token_id
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def stored_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """A checkpoint config's ``quantization_config`` if it is one of ours."""
    qcfg = config.get("quantization_config")
    if qcfg is None:
        return None
    if qcfg.get("quant_method") != QUANT_METHOD:
        raise ValueError(
            f"quantization_config with quant_method {qcfg.get('quant_method')!r} is not "
            f"supported (only {QUANT_METHOD!r} checkpoints written by `fastforward quantize`)"
        )
    return qcfg


def load_quantized(model: nn.Module, ckpt: HFCheckpoint, dtype: torch.dtype) -> QuantReport:
    """Swap in the packed modules a quantized checkpoint names, then fill every float parameter."""
    qcfg = stored_quantization(ckpt.config)
    tensors = dict(ckpt.tensors())
    report = QuantReport(qcfg["method"])
    used: set[str] = set()
    for name, cfg in qcfg["modules"].items():
        prefix = f"{name}."
        own = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
        used.update(prefix + k for k in own)
        bias = own.pop("bias", None)
        module = module_from_packed(own, cfg, None if bias is None else bias.to(dtype))
        model.set_submodule(
            name, QuantizedEmbedding(module, dtype) if cfg.get("embedding") else module
        )
        report.quantized.append(name)
    for name, p in model.named_parameters():
        if name not in tensors:
            raise ValueError(f"{ckpt.path}: quantized checkpoint lacks {name!r}")
        with torch.no_grad():
            p.copy_(tensors[name])
        used.add(name)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{ckpt.path}: unexpected tensors in checkpoint, e.g. {extra[:3]}")
    return report

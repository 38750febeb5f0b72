"""``fastforward quantize MODEL --method M --out DIR``: write a quantized HF-style directory
(``model.safetensors`` with the packed tensors, ``config.json`` with a ``quantization_config``,
the tokenizer files) that ``LLM(DIR)`` loads back bit for bit."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def quantize_to_dir(model: str, method: str, out: str | Path) -> Path:
    """Quantize ``model`` (catalog name, .gguf file or HF directory) with ``method``.

    Float parameters that stay unquantized (norms, biases) are stored in float32, so loading
    the directory with any ``dtype`` gives what ``LLM(model, quantization=method, dtype=...)``
    gives."""
    from fastforward.hub import resolve_model
    from fastforward.loader.model_loader import load_model, open_checkpoint
    from fastforward.quant import parse_quantization
    from fastforward.quant.checkpoint import save_quantized

    spec = parse_quantization(method)
    if spec is None:
        raise ValueError("give a --method to quantize with")
    path = resolve_model(model)
    loaded = load_model(path, torch.float32, torch.device("cpu"), spec.name)
    hf_config = open_checkpoint(path).hf_config()
    return save_quantized(loaded.model, hf_config, loaded.tokenizer, spec.name, out)


def add_parser(sub) -> None:
    from fastforward.quant import METHODS

    p = sub.add_parser("quantize", help="write a quantized copy of a model to a directory")
    p.add_argument("model", help="catalog name, .gguf file or HF directory")
    p.add_argument("--method", required=True, choices=sorted(METHODS), help="weight format")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(ns: argparse.Namespace) -> int:
    out = quantize_to_dir(ns.model, ns.method, ns.out)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB)")
    return 0

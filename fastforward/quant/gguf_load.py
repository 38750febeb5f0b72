"""``quantization="gguf"``: a GGUF model's block-quantized matrices go straight into packed
modules, never expanded to floats.

Q4_0/Q4_1/Q4_K (4-bit codes, groups of 32) -> ``Int4Linear`` on the int4 kernel; Q5_0 ->
``Int5Linear`` (its own grid: 5.5 bits, where int8 codes took 8.5); Q8_0/Q6_K (codes that fit
int8) -> ``Int8GroupLinear``. A fused layer whose parts share a kind is
packed as one matrix (mixed group sizes of 8-bit codes are unified by repeating scales, which
is exact); parts of different kinds become a ``ConcatLinear``. Other types (F32, F16, Q5_1,
Q5_K, ...) are dequantized as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as QT
from torch import nn

from fastforward.loader.gguf_weights import GGUFCheckpoint
from fastforward.quant import int4pack, int5
from fastforward.quant.apply import QuantReport
from fastforward.quant.base import ConcatLinear, QuantizedEmbedding, QuantizedLinear
from fastforward.quant.gguf_blocks import EIGHT_BIT, FOUR_BIT, BlockCodes
from fastforward.quant.int4 import Int4Linear, int4_from_codes
from fastforward.quant.int5 import Int5Linear, Int5Weights
from fastforward.quant.int8 import Int8GroupLinear
from fastforward.quant.rtn import Int4Weights


@dataclass(slots=True)
class _Target:
    module: nn.Module
    shards: dict[int, str]  # shard index (0 for plain layers) -> GGUF tensor name


def load_gguf_packed(model: nn.Module, ckpt: GGUFCheckpoint, dtype: torch.dtype) -> QuantReport:
    """Fill a freshly built model from a GGUF file, packed where the blocks allow it."""
    report = QuantReport("gguf")
    packed_names: set[str] = set()
    for name, target in _plan(model, ckpt).items():
        new = _pack(target, ckpt)
        if isinstance(new, str):
            report.skipped[name] = new
            continue
        if isinstance(target.module, nn.Embedding):
            new = QuantizedEmbedding(new, dtype)
        model.set_submodule(name, new)
        report.quantized.append(name)
        packed_names.update(target.shards.values())
    model.load_weights(ckpt.tensors(skip=packed_names))
    return report


def _plan(model: nn.Module, ckpt: GGUFCheckpoint) -> dict[str, _Target]:
    """Module name -> the GGUF tensors that make up its weight."""
    targets: dict[str, _Target] = {}
    for gguf_name in ckpt.file.tensors:
        hf = ckpt.hf_name(gguf_name)
        mapped = model.map_name(hf) if hf is not None else None
        if mapped is None or not mapped[0].endswith(".weight"):
            continue
        module_name = mapped[0].removesuffix(".weight")
        module = model.get_submodule(module_name)
        if not isinstance(module, nn.Linear | nn.Embedding):
            continue
        target = targets.setdefault(module_name, _Target(module, {}))
        target.shards[mapped[1] or 0] = gguf_name
    return targets


def _pack(target: _Target, ckpt: GGUFCheckpoint) -> QuantizedLinear | str:
    infos = {s: ckpt.file.tensors[n] for s, n in target.shards.items()}
    kinds = {s: _kind(info.qtype) for s, info in infos.items()}
    if None in kinds.values():
        types = sorted({i.qtype.name for i in infos.values()})
        return f"no packed form for {', '.join(types)}"
    out_sizes = getattr(target.module, "out_sizes", None)
    bias = target.module.bias if isinstance(target.module, nn.Linear) else None
    parts = [ckpt.packed(target.shards[s]) for s in sorted(target.shards)]
    if len(set(kinds.values())) == 1:
        return _module(parts, bias, out_sizes, next(iter(kinds.values())))
    modules = [
        _module([p], None, None, kinds[s]) for s, p in zip(sorted(kinds), parts, strict=True)
    ]
    if any(isinstance(m, str) for m in modules):
        return next(m for m in modules if isinstance(m, str))
    return ConcatLinear(modules, bias, out_sizes)


def _kind(qtype) -> int | None:
    if qtype == QT.Q5_0:
        return 5
    return 4 if qtype in FOUR_BIT else 8 if qtype in EIGHT_BIT else None


def _module(parts: list[BlockCodes], bias, out_sizes, kind: int) -> QuantizedLinear | str:
    n = sum(p.codes.shape[0] for p in parts)
    k = parts[0].codes.shape[1]
    if kind == 5 and int5.shape_ok(n, k):
        codes = torch.cat([p.codes for p in parts]).to(torch.int16) + 16
        scales = torch.cat([p.scales for p in parts]).to(torch.float16)  # fp16 in the file
        return Int5Linear(Int5Weights(codes.to(torch.uint8), scales, 32), bias, out_sizes)
    if parts[0].bits == 4:
        if not int4pack.int4_shape_ok(n, k, 32):
            return f"int4 kernel needs out % 16 == 0, got [{n}, {k}]"
        q = [int4_from_codes(p) for p in parts]
        cat = Int4Weights(
            *(torch.cat([getattr(x, f) for x in q]) for f in ("codes", "scales", "zeros")), 32
        )
        return Int4Linear(cat, bias, out_sizes)
    group = min(p.group_size for p in parts)
    scales = torch.cat([p.scales.repeat_interleave(p.group_size // group, dim=1) for p in parts])
    return Int8GroupLinear(torch.cat([p.codes for p in parts]), scales, bias, out_sizes)

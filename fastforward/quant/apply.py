"""Quantization as swapping modules: every ``nn.Linear`` (fused ones as one matrix) and the
token embedding of a loaded float model are replaced by packed modules with the same forward
contract (gpt-fast's approach). With tied embeddings the packed embedding is also the output
projection."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain

import torch
from torch import nn

from fastforward.quant import int4pack
from fastforward.quant.base import ConcatLinear, QuantizedEmbedding, QuantizedLinear
from fastforward.quant.codebook import CodebookLinear
from fastforward.quant.formats import QuantSpec
from fastforward.quant.gptq import gptq_int4
from fastforward.quant.int4 import Int4Linear
from fastforward.quant.int8 import Int8Linear
from fastforward.quant.kmeans import quantize_codebook
from fastforward.quant.mix import quantize_mixed
from fastforward.quant.rtn import group_for, quantize_int4, quantize_int8

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class QuantReport:
    """Which modules were quantized, and which were left in float and why."""

    method: str
    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def quantize_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_sizes: list[int] | None,
    spec: QuantSpec,
    hessian: torch.Tensor | None = None,
) -> QuantizedLinear | str:
    """A quantized module for a float ``[N, K]`` weight, or the reason it cannot be one.
    With a GPTQ ``spec``, ``hessian`` (of the layer's inputs) picks the int4 codes; without
    one the weight is rounded to nearest (with an AWQ ``spec``, each group's clipping is chosen
    for the output error under ``hessian``)."""
    n, k = weight.shape
    w = weight.detach().float()
    if spec.method == "int8":
        return Int8Linear(quantize_int8(w), bias, out_sizes)
    if spec.method in ("int4", "codebook"):
        group = group_for(k, spec.group_size)
        if spec.method == "codebook":
            if k % group or k % 2:
                return f"input width {k} is not a multiple of {group}"
            return CodebookLinear(quantize_codebook(w, spec.num_centroids, group), bias, out_sizes)
        if not int4pack.int4_shape_ok(n, k, group):
            return f"int4 kernel needs out % 16 == 0 and in % 32 == 0, got [{n}, {k}]"
        if spec.gptq and hessian is not None:
            return Int4Linear(gptq_int4(w, hessian, group), bias, out_sizes)
        # AWQ rounds to nearest, clipping each group for its output error (the Hessian's block)
        h = hessian if spec.awq else None
        return Int4Linear(quantize_int4(w, group, hessian=h), bias, out_sizes)
    raise ValueError(f"quantization method {spec.method!r} needs the checkpoint (see load_model)")


def quantize_model(
    model: nn.Module,
    spec: QuantSpec,
    dtype: torch.dtype,
    hessians: dict[str, torch.Tensor] | None = None,
) -> QuantReport:
    """Swap the linears and embeddings of a float model (ideally float32, as loaded) for packed
    ones, then cast the remaining float parameters to ``dtype``. ``hessians`` (GPTQ and AWQ; by
    module name, from ``gptq.collect_hessians``) are consumed as their modules are quantized."""
    hessians = {} if hessians is None else hessians
    report = QuantReport(spec.name)
    targets = [
        (name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)
    ]
    tied = getattr(model, "lm_head", "absent") is None
    for name, module in targets:
        bias = module.bias if isinstance(module, nn.Linear) else None
        out_sizes = getattr(module, "out_sizes", None)
        hessian = hessians.pop(name, None)
        if spec.method == "mix":
            new = quantize_mixed(name, module, hessian, tied)
        else:
            new = quantize_linear(module.weight, bias, out_sizes, spec, hessian)
        if isinstance(new, str):
            report.skipped[name] = new
            continue
        if isinstance(module, nn.Embedding):
            new = QuantizedEmbedding(new, dtype)
        model.set_submodule(name, new)
        report.quantized.append(name)
    if report.skipped:
        logger.info("left in float: %s", report.skipped)
    cast_float_params(model, dtype)
    return report


def cast_float_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters (not the packed buffers, whose dtypes the kernels fix) to ``dtype``."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


@dataclass(frozen=True, slots=True)
class WeightStats:
    bytes: int  # memory of the weights, each once in the format it is stored in
    num_weights: int  # weights of the model they stand for

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.bytes / max(self.num_weights, 1)


def weight_stats(model: nn.Module) -> WeightStats:
    """Parameters and quantized layers' packed buffers, each storage once. A bf16 layer on the
    native kernels (``PackedLinear``) keeps copies for different batch sizes (packed rows, AMX
    tiles or oneDNN's blocks, sometimes the dense weight): its weight counts once, as bf16; a
    tied output layer reads the embedding, which counts already."""
    from fastforward.kernels.linear import PackedLinear  # lazy: the kernels import quant

    seen: set[tuple[int, int]] = set()
    nbytes = 0
    # by storage: a tied output layer may hold its own Parameter over the embedding's data
    count = sum(
        p.numel() for p in {(p.data_ptr(), p.numel()): p for p in model.parameters()}.values()
    )
    copies: set[int] = set()  # PackedLinear buffers: stand-ins for a weight counted elsewhere
    for m in model.modules():
        if isinstance(m, PackedLinear):
            copies.update(id(b) for b in m.buffers(recurse=False))
            if m.dense is None and not m.tied:  # else a parameter's (counted below)
                nbytes += 2 * m.num_weights
                count += m.num_weights
    for t in chain(model.parameters(), model.buffers()):
        key = (t.data_ptr(), t.numel())
        if id(t) not in copies and key not in seen:
            seen.add(key)
            nbytes += t.numel() * t.element_size()
    count += sum(
        m.num_weights
        for m in model.modules()
        if isinstance(m, QuantizedLinear) and not isinstance(m, ConcatLinear)
    )
    return WeightStats(nbytes, count)

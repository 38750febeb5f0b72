"""``int4-mix``: a 4/5/8-bit recipe at int4's bytes, in the spirit of llama.cpp's Q4_K_M -- each
weight matrix takes the format its role can afford:

- MLP gate/up and attention q/k/o: int5 in groups of 32 (``Int5Linear``, 5.5 bits);
- attention v: int8 per output channel (a few rows, 8 bits);
- MLP down and the output layer: int4 in groups of 32 with GPTQ codes (5 bits);
- a token embedding that is not also the output layer: int4 in groups of 64 (4.5 bits; a
  lookup reads only its rows, and its rounding costs the least).

On Qwen2.5-Coder-0.5B that is 5.11 bits a weight (int4-g32: 5.00) for under a third of
int4-gptq's perplexity loss, +2.72% against +9.75% (docs/quantization.md): the loss of int4 sits in the MLP's gate/up projections
and in v, and 5-bit codes there are worth more than the fine groups of the embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from fastforward.quant.base import ConcatLinear, QuantizedLinear
from fastforward.quant.formats import METHODS
from fastforward.quant.int5 import Int5Linear, quantize_int5, shape_ok
from fastforward.quant.int8 import Int8Linear
from fastforward.quant.rtn import quantize_int8

INT4 = METHODS["int4-gptq"]  # down, the output layer (and a tied embedding)
EMBEDDING = METHODS["int4-g64"]  # an untied embedding
INT4_ROLES = ("down_proj", "lm_head")


def quantize_mixed(
    name: str, module: nn.Module, hessian: torch.Tensor | None, tied: bool
) -> QuantizedLinear | str:
    """The packed module for ``module`` (named ``name``) under the recipe, or why it cannot be
    one. ``tied``: the embedding is also the output layer."""
    from fastforward.quant.apply import quantize_linear  # apply dispatches here

    w = module.weight.detach().float()
    if isinstance(module, nn.Embedding):
        return quantize_linear(w, None, None, INT4 if tied else EMBEDDING, hessian)
    bias, out_sizes = module.bias, getattr(module, "out_sizes", None)
    role = name.rsplit(".", 1)[-1]
    if role in INT4_ROLES:
        return quantize_linear(w, bias, out_sizes, INT4, hessian)
    n, k = w.shape
    if not shape_ok(n, k):
        return f"int5 needs out % 16 == 0 and in % 32 == 0, got [{n}, {k}]"
    if role == "qkv_proj" and out_sizes is not None and len(out_sizes) == 3:
        qk = out_sizes[0] + out_sizes[1]
        if qk % 16 == 0:
            parts = [Int5Linear(quantize_int5(w[:qk])), Int8Linear(quantize_int8(w[qk:]))]
            return ConcatLinear(parts, bias, out_sizes)
    return Int5Linear(quantize_int5(w), bias, out_sizes)

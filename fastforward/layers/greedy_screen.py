"""Greedy tokens without reading the whole output projection (``csrc/greedy_screen.cpp``).

Decoding a few sequences reads every weight once a token, and the output projection of a large
vocabulary is a good part of that: SmolLM2-135M's tied 49,152 x 576 embedding is 21% of its
bf16 bytes, Gemma 3 270M's 63%. For a step whose every token is a plain greedy pick
(``sampler.plain_greedy``: the argmax of the raw logits), the screen reads an int8 copy of the
projection instead (half the bytes), bounds every logit by a proven radius around its int8
estimate, and computes in bf16 only the rows that could still be the largest -- with the same
instruction chain as the full projection, so the token is the argmax of the very logits the full
path would give: the same token, to the bit, or the full path where the screen cannot decide
(non-finite inputs, too many candidates).

Kept where the full projection is ``linear_amx``'s sequential ``vdpbf16ps`` sums on its tiles
(AVX512-BF16: one row always, several rows where there is no AMX, whose tiles sum in another
order). Costs a second, int8, copy of the projection (+28 MB on SmolLM2).
"""

from __future__ import annotations

import torch
from torch import nn

from fastforward import kernels
from fastforward.kernels.linear import PackedLinear

# rows (sequences) a screened step may have: decode of one or two sequences, where the
# projection is read from memory once a step (at 4 rows the int8 estimate's two vpdpbusd a row
# per 64 codes cost as much as the bf16 products they save: docs/cpu.md)
SCREEN_ROWS_MAX = 2
# rows left to the full projection when more than this many could hold the maximum
MAX_CANDIDATES = 512
# greedy_screen_pack's tensors, in its order
PACKED = ("codes", "rowsum", "scales", "radius", "qnorm")


class GreedyScreen(nn.Module):
    """An output projection's int8 copy: codes in blocks of 16 rows, and per row the codes'
    sum, a scale, a radius and the copy's norm (the bf16 tiles come with each call)."""

    def __init__(self, head: PackedLinear, rows_max: int) -> None:
        super().__init__()
        self.rows_max = rows_max
        self.out_features = head.out_features
        ops = kernels.ops()
        # the bf16 weight the projection multiplies (a tied one's embedding, else its tiles
        # unpacked for the while)
        weight = head.weight.to(torch.bfloat16)
        # codes [blocks, K / 4, 16, 4] int8, then per row: the codes' sum, the scale, the
        # radius (|w - w^| and the rounding terms) and |w^|
        for name, t in zip(PACKED, ops.greedy_screen_pack(weight), strict=True):
            self.register_buffer(name, t, persistent=False)

    @property
    def packed(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in PACKED]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed)

    def takes(self, rows: int) -> bool:
        return 1 <= rows <= self.rows_max

    def __call__(self, hidden: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor | None:
        """Each row's greedy token ``[rows]`` for the projection's input ``hidden``, or None
        where the screen leaves some row to the full projection. ``tiles``: the projection's
        (``PackedLinear.tiles``, read at the call: the huge-page gather may have moved them)."""
        tokens = kernels.ops().greedy_screen(
            hidden, self.packed, tiles, self.out_features, MAX_CANDIDATES
        )
        return None if bool((tokens < 0).any()) else tokens

    def extra_repr(self) -> str:
        return f"out_features={self.out_features}, rows_max={self.rows_max}"


def build_greedy_screen(model: nn.Module) -> tuple[GreedyScreen | None, str]:
    """The screen for ``model``'s output projection, or None and why it has none. Call after
    the native kernels are applied (the projection must be a ``PackedLinear`` on tiles)."""
    from fastforward.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        return None, f"{type(model).__name__} is not a Llama-family model"
    if type(model).compute_logits is not LlamaForCausalLM.compute_logits:
        return None, f"{type(model).__name__} computes its logits its own way"
    if getattr(model.config, "final_logit_softcapping", None):
        # tanh can round two different logits to one value: the first maximum may move
        return None, "final logit softcapping"
    head = model.lm_head
    if not isinstance(head, PackedLinear) or head.tiles is None:
        return None, "the output projection is not bf16 on the native tiles"
    if head.bias is not None or not head.fp32_out or head.fp32_rows_min is not None:
        return None, "the output projection has a bias or no fp32 logits"
    ops = kernels.ops()
    if not ops.greedy_screen_native():
        return None, "the kernels were built without AVX512-BF16"
    # AMX tiles sum several rows in their own order; one row is linear_amx's vdpbf16ps chain
    rows_max = 1 if ops.amx_native() else min(SCREEN_ROWS_MAX, head.tiles_rows_max)
    try:
        return GreedyScreen(head, rows_max), ""
    except RuntimeError as e:  # a non-finite weight: no radius bounds its logit
        return None, str(e).splitlines()[0]

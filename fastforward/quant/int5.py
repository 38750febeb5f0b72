"""int5 group-wise weights: ``w = (code - 16) * scale``, codes 0..31, one float16 scale per
group of 32 inputs -- GGUF's Q5_0 grid (5.5 bits a weight), which ``quantize_int5`` reproduces
exactly on weights that lie on it (a Q5_0 checkpoint's).

Kernel: ``torch.ops.fastforward.linear_q5`` (``kernels/csrc/linear_q5.cpp``, AVX512-VNNI) for
batches of a few rows; larger ones expand the weight for a dense matmul. The codes' low four
bits use the int4 kernel's packed layout (``q4pack``), their fifth bits a 64-bit mask per tile
of 16 outputs and quad of inputs (``pack_high``), side by side in one stream per tile
(``pack``); the same layout on every CPU, so checkpoints store it as it is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fastforward.quant import q4pack
from fastforward.quant.base import QuantizedLinear, expand_dtype, few_row_kernel_limit
from fastforward.quant.rtn import KERNEL_DTYPE

TILE = q4pack.TILE
GROUP = 32
# The fraction of each group's largest magnitude the grid's end (-16 steps) is put at; each
# group keeps the one with the lowest squared error (1.0 first: exact on Q5_0 weights).
_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8)
_ROWS = 4096  # rows quantized at a time


@dataclass(slots=True)
class Int5Weights:
    codes: torch.Tensor  # [N, K] uint8 in 0..31
    scales: torch.Tensor  # [N, K/g] float16; w ~= (codes - 16) * scales
    group_size: int


def shape_ok(out_features: int, in_features: int, group_size: int = GROUP) -> bool:
    return out_features % TILE == 0 and in_features % group_size == 0 and group_size % 4 == 0


def quantize_int5(weight: torch.Tensor, group_size: int = GROUP) -> Int5Weights:
    """Symmetric int5 per group, as Q5_0: the group's value of largest magnitude ``m`` sets the
    scale ``m / -16`` (so it lands on code 0 exactly), rounded to float16 before the codes are
    chosen; a search over shrinking that end keeps the lowest-error grid per group."""
    parts = [
        _quantize_rows(weight[i : i + _ROWS], group_size) for i in range(0, len(weight), _ROWS)
    ]
    return Int5Weights(
        torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), group_size
    )


def _quantize_rows(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    end = w.gather(2, w.abs().argmax(dim=2, keepdim=True))  # signed, [n, G, 1]
    best = None
    for shrink in _SHRINK:
        scales = (end * (shrink / -16)).to(torch.float16)
        s = scales.float()
        safe = torch.where(s == 0, torch.ones_like(s), s)
        codes = torch.round(w / safe).clamp(-16, 15)
        err = ((codes * s - w) ** 2).sum(dim=2, keepdim=True)
        if best is None:
            best = (codes, scales, err)
            continue
        better = err < best[2]
        best = tuple(
            torch.where(better, t, b) for t, b in zip((codes, scales, err), best, strict=True)
        )
    codes, scales, _ = best
    return (codes + 16).to(torch.uint8).view(n, k), scales.view(n, -1)


def dequantize_int5(q: Int5Weights) -> torch.Tensor:
    n, k = q.codes.shape
    g = q.group_size
    codes = q.codes.float().view(n, k // g, g) - 16
    return (codes * q.scales.float()[..., None]).view(n, k)


def pack_high(codes: torch.Tensor) -> torch.Tensor:
    """The fifth bits of ``[N, K]`` codes -> ``[N/16, K/4, 8]`` uint8, a little-endian 64-bit
    mask per tile and quad: bit ``2i+j`` for code ``[16t+i, 4p+j]``, bit ``32+2i+j`` for
    ``[16t+i, 4p+2+j]`` (j = 0, 1), the word order of the low bits unpacked (q4pack)."""
    n, k = codes.shape
    h = (codes >> 4).to(torch.uint8).view(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3)
    bits = torch.cat((h[..., :2].flatten(2), h[..., 2:].flatten(2)), dim=2)  # [T, P, 64]
    weights = (1 << torch.arange(8, dtype=torch.uint8)).view(1, 1, 1, 8)
    t, p, _ = bits.shape
    return (bits.view(t, p, 8, 8) * weights).sum(dim=3, dtype=torch.uint8).contiguous()


def unpack_high(high: torch.Tensor) -> torch.Tensor:
    """``pack_high`` undone: ``[N/16, K/4, 8]`` -> ``[N, K]`` fifth bits (0/1)."""
    t, p, _ = high.shape
    bits = (high[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [T, P, 8, 8]
    bits = bits.view(t, p, 2, TILE, 2)  # [.., low/high half, row i, j]
    per_row = torch.cat((bits[:, :, 0], bits[:, :, 1]), dim=-1)  # [T, P, 16, 4]
    return per_row.permute(0, 2, 1, 3).reshape(t * TILE, p * 4)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` codes in 0..31 -> the kernel's ``[N/16, K/4, 40]`` uint8: per tile and quad
    the 32 bytes of low bits (``q4pack``), then the 8 of fifth bits (``pack_high``)."""
    return torch.cat((q4pack.pack(codes & 15), pack_high(codes)), dim=2)


def unpack(packed: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """``pack`` undone: ``[N, K]`` codes (or ``[R, K]`` of rows ``index``, reading only their
    tiles)."""
    tiles = packed if index is None else packed[index // TILE]
    low = q4pack.unpack(tiles[..., :32].contiguous())
    codes = low | (unpack_high(tiles[..., 32:].contiguous()) << 4)
    if index is None:
        return codes
    return codes[torch.arange(len(index)) * TILE + index % TILE]


def pack_scales(scales: torch.Tensor) -> torch.Tensor:
    """``[N, G]`` float16 -> ``[N/16, G, 16]``: one 32-byte read per tile and group."""
    n, g = scales.shape
    return scales.to(torch.float16).view(n // TILE, TILE, g).transpose(1, 2).contiguous()


def unpack_scales(packed: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """``[N/16, G, 16]`` -> ``[N, G]`` (or ``[R, G]`` of rows ``index``, reading only those)."""
    if index is None:
        return packed.transpose(1, 2).reshape(packed.shape[0] * TILE, -1)
    return packed[index // TILE, :, index % TILE]


class Int5Linear(QuantizedLinear):
    """5-bit group-wise weights (``Int5Weights``) kept packed. Once the engine switches to
    fastforward's kernels, batches of up to ``native_rows_max`` rows run ``linear_q5`` (CPUs with
    AVX512-VNNI) and larger ones a dense matmul on the weight expanded per call by
    ``dequantize_q5`` in bf16, where the CPU multiplies bf16 natively; where it does not, the
    kernel takes every batch (float32 expansion only if ``native_rows_max`` is lowered). Without
    the kernels, every batch takes the dense bf16 matmul on the weight unpacked in PyTorch."""

    format = "int5"
    # with native bf16 (not measured: the AVX512-VNNI int8 kernels' figure); without, every
    # batch (base.few_row_kernel_limit)
    native_rows_max = 16

    def __init__(self, q: Int5Weights, bias=None, out_sizes=None) -> None:
        n, k = q.codes.shape
        super().__init__(k, n, bias, out_sizes)
        if not shape_ok(n, k, q.group_size):
            raise ValueError(
                f"int5 needs out % 16 == 0 and in % {q.group_size} == 0, got [{n}, {k}]"
            )
        self.group_size = q.group_size
        self.native = False  # linear_q5 in use
        self.expand_dtype: torch.dtype | None = None  # dequantize_q5 in use, the dense dtype
        self.register_buffer("codes", pack(q.codes))  # [N/16, K/4, 40]
        self.register_buffer("scales", pack_scales(q.scales))  # [N/16, G, 16] float16

    def use_native_kernel(self) -> None:
        from fastforward import kernels

        self.native = bool(kernels.ops().int8_rows_native())
        self.expand_dtype = expand_dtype()
        self.native_rows_max = few_row_kernel_limit(type(self).native_rows_max)

    @property
    def kernel_rows_max(self) -> int:
        return self.native_rows_max if self.native else 0

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.kernel_rows_max:
            return torch.ops.fastforward.linear_q5(x, self.codes, self.scales, self.group_size)
        if self.expand_dtype is None:
            return F.linear(x, self.dense_bf16())
        expand = functools.partial(torch.ops.fastforward.dequantize_q5, self.codes, self.scales)
        return self.expanded_matmul(x, expand, self.expand_dtype)

    def _weights(self, index: torch.Tensor | None = None) -> torch.Tensor:
        codes = unpack(self.codes, index)
        r, g = codes.shape[0], self.group_size
        s = unpack_scales(self.scales, index).float()
        return ((codes.float().view(r, -1, g) - 16) * s[..., None]).view(r, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self._weights()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        if self.expand_dtype is None:  # fastforward's kernels not in use
            return self._weights(index)
        out = torch.empty(index.shape[0], self.in_features)
        torch.ops.fastforward.dequantize_q5(self.codes, self.scales, out, index.long())
        return out

    def dense_bf16(self) -> torch.Tensor:
        return self._weights().to(KERNEL_DTYPE)

    def packed_state(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales}

    def config(self) -> dict[str, Any]:
        return super().config() | {"group_size": self.group_size}

    @classmethod
    def from_packed(cls, tensors, config, bias):
        codes = unpack(tensors["codes"])
        q = Int5Weights(codes, unpack_scales(tensors["scales"]), config["group_size"])
        return cls(q, bias, config.get("out_sizes"))

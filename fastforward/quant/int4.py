"""int4 group-wise weights: ``w = (code - 8) * scale + zero`` per group of 32/64/128 inputs,
scales and zeros in bf16. Our ``int4`` quantizer and the GGUF Q4_0/Q4_1/Q4_K blocks both land
here.

Two kernels, one set of values: PyTorch's ``aten._weight_int4pack_mm_for_cpu`` (its own
CPU-dependent packing, ``int4pack.py``), and, once the engine switches the model onto
fastforward's kernels, ``torch.ops.fastforward.linear_q4`` (``q4pack.py``; faster, and its cost
grows more slowly with the rows)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from fastforward.quant import int4pack, q4pack
from fastforward.quant.base import QuantizedLinear, expand_dtype
from fastforward.quant.gguf_blocks import BlockCodes
from fastforward.quant.rtn import KERNEL_DTYPE, Int4Weights


class Int4Linear(QuantizedLinear):
    format = "int4"
    packed_rows_max = 256  # unpacking the ATen layout costs about its kernel at 256 rows
    native_rows_max = 256  # its cost grows with the rows; dequantizing for a dense matmul does not

    def __init__(self, q: Int4Weights, bias=None, out_sizes=None) -> None:
        n, k = q.codes.shape
        super().__init__(k, n, bias, out_sizes)
        if not int4pack.int4_shape_ok(n, k, q.group_size):
            raise ValueError(
                f"int4 kernel cannot take a [{n}, {k}] weight in groups of {q.group_size}"
            )
        self.group_size = q.group_size
        self.native = False  # which kernel's layout ``packed`` and ``scales_and_zeros`` hold
        self.register_buffer("packed", int4pack.to_kernel_layout(q.codes))  # [N, K/2] uint8
        sz = torch.stack((q.scales, q.zeros), dim=-1).to(KERNEL_DTYPE)  # [N, K/g, 2]
        self.register_buffer("scales_and_zeros", sz.transpose(0, 1).contiguous())  # [K/g, N, 2]
        self.register_buffer("levels", None)
        self.expand_dtype = KERNEL_DTYPE  # native: large batches' dense weight (dequantize_q4)

    def use_native_kernel(self) -> None:
        """Repack the same codes, scales and zeros for ``torch.ops.fastforward.linear_q4`` (the
        int4 table's integer path: CPUs with AVX512-VNNI)."""
        from fastforward import kernels

        if self.native or not kernels.ops().int8_rows_native():
            return
        codes, (s, z) = self.unpacked_codes(), self._scales_zeros()
        self.packed = q4pack.pack(codes)  # [N/16, K/4, 32]
        self.scales_and_zeros = q4pack.pack_scales(s, z)  # [N/16, K/g, 2, 16]
        self.levels = (torch.arange(16) - 8).to(KERNEL_DTYPE)
        self.native = True
        self.native_rows_max = q4pack.kernel_rows_max(type(self).native_rows_max)
        self.expand_dtype = expand_dtype()

    @property
    def kernel_rows_max(self) -> int:
        return self.native_rows_max if self.native else self.packed_rows_max

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.shape[0] <= self.native_rows_max:
            return torch.ops.fastforward.linear_q4(
                x, self.packed, self.scales_and_zeros, self.levels, self.group_size
            )
        if not self.native and x.shape[0] <= self.packed_rows_max:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.packed, self.group_size, self.scales_and_zeros
            )
        if not self.native:
            return F.linear(x, self.dense_bf16())
        # one expansion in C++ per call (dense_bf16's PyTorch ops took 86 ms for Qwen2.5-0.5B's
        # gate/up, dequantize_q4 10 ms), in float32 where the CPU has no native bf16 matmul
        # (there few_row_kernel_limit keeps every batch on linear_q4 unless lowered)
        op, sz = torch.ops.fastforward.dequantize_q4, self.scales_and_zeros
        expand = functools.partial(op, self.packed, sz, self.levels)
        return self.expanded_matmul(x, expand, self.expand_dtype)

    def unpacked_codes(self) -> torch.Tensor:
        """``[N, K]`` uint8 codes in 0..15."""
        if self.native:
            return q4pack.unpack(self.packed)
        return int4pack.from_kernel_layout(self.packed, self.in_features)

    def _scales_zeros(self, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales and zeros of all rows (or rows ``index``), ``[R, K/g]`` each (bf16); a lookup
        reads only its rows."""
        if self.native:
            sz = self.scales_and_zeros
            s, z = q4pack.unpack_scales(sz) if index is None else q4pack.scale_rows(sz, index)
            return s, z
        sz = self.scales_and_zeros if index is None else self.scales_and_zeros[:, index]
        return sz[..., 0].t(), sz[..., 1].t()

    def _affine(self, codes: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        s, z = self._scales_zeros(index)
        r, g = codes.shape[0], self.group_size
        w = (codes.float().view(r, -1, g) - 8) * s.float()[..., None] + z.float()[..., None]
        return w.view(r, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self._affine(self.unpacked_codes())

    def dense_bf16(self) -> torch.Tensor:
        # in bf16 throughout (code - 8 is exact): faster than the float32 path for prefill
        n, g = self.out_features, self.group_size
        codes = self.unpacked_codes().view(n, -1, g).to(KERNEL_DTYPE) - 8
        s, z = self._scales_zeros()
        return (codes * s[..., None] + z[..., None]).view(n, self.in_features)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        if self.native:  # one C++ call (the PyTorch ops below took ~80 us for one decode row)
            out = torch.empty(index.shape[0], self.in_features)
            sz = self.scales_and_zeros
            torch.ops.fastforward.dequantize_q4(self.packed, sz, self.levels, out, index.long())
            return out
        codes = int4pack.kernel_layout_rows(self.packed, self.in_features, index)
        return self._affine(codes, index)

    def packed_state(self) -> dict[str, torch.Tensor]:
        s, z = self._scales_zeros()
        return {
            "codes": int4pack.pack_plain(self.unpacked_codes()),
            "scales_and_zeros": torch.stack((s, z), dim=-1).transpose(0, 1).contiguous(),
        }

    def config(self) -> dict[str, Any]:
        return super().config() | {"group_size": self.group_size}

    @classmethod
    def from_packed(cls, tensors, config, bias):
        sz = tensors["scales_and_zeros"].transpose(0, 1)  # [N, K/g, 2]
        codes = int4pack.unpack_plain(tensors["codes"])
        q = Int4Weights(codes, sz[..., 0], sz[..., 1], config["group_size"])
        return cls(q, bias, config.get("out_sizes"))


def int4_from_codes(q: BlockCodes) -> Int4Weights:
    """GGUF 4-bit blocks: codes kept as they are; ``(q - shift) * s + o`` becomes the kernel's
    ``(q - 8) * s + z`` with ``z = o + (8 - shift) * s`` (rounded to bf16 by ``Int4Linear``)."""
    if q.bits != 4:
        raise ValueError("int4 needs 4-bit codes")
    zeros = (8 - q.shift) * q.scales
    if q.offsets is not None:
        zeros = zeros + q.offsets
    return Int4Weights(q.codes, q.scales, zeros, q.group_size)

"""int8 weights: per output channel (our ``int8``), and per group of 16/32 (GGUF Q8_0, Q5_0 and
Q6_K blocks, whose codes all fit in int8)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fastforward.quant.base import EVERY_BATCH, QuantizedLinear, few_row_kernel_limit
from fastforward.quant.rtn import KERNEL_DTYPE, Int8Weights


def to_blocks(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int8 codes as the native kernels' blocks ``[N/16, K/2, 16, 2]``: per block of
    16 output rows and input pair, the 16 rows' two codes side by side."""
    n, k = codes.shape
    return codes.view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()


def from_blocks(blocks: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """``to_blocks`` undone: ``[N, K]`` codes, or ``[R, K]`` of rows ``index`` (reading only
    those rows). Works the same on per-block scales ``[N/16, G, 16]``."""
    if index is None:
        return blocks.transpose(1, 2).reshape(blocks.shape[0] * 16, -1)
    return blocks[index // 16, :, index % 16].reshape(len(index), -1)


class Int8Linear(QuantizedLinear):
    """Weight-only int8 with one bf16 scale per output row: ``w = codes * scales``. Small
    batches run ``aten._weight_int8pack_mm``, or, once the engine moves the model onto
    fastforward's kernels on a CPU with AVX512-VNNI, ``torch.ops.fastforward.linear_i8_rows``
    (the codes in blocks of 16 rows, integer dot products with each row of x held as int16 per
    32 inputs); large ones multiply by the int8 codes in bf16 (exact: |code| <= 127) and scale
    the output rows."""

    format = "int8"
    native_rows_max = 16  # linear_i8_rows beats ATen's kernel up to 16 rows and more (below)

    def __init__(self, q: Int8Weights, bias=None, out_sizes=None) -> None:
        n, k = q.codes.shape
        super().__init__(k, n, bias, out_sizes)
        self.native = False  # codes as [N/16, K/2, 16, 2] for linear_i8_rows, else [N, K]
        self.tile_scales: torch.Tensor | None = None  # [N/16, 1, 16] fp32: linear_i8g_amx
        self.register_buffer("codes", q.codes.contiguous())
        self.register_buffer("scales", q.scales.to(KERNEL_DTYPE).contiguous())

    def use_native_kernel(self) -> None:
        """Repack the codes for ``linear_i8_rows``. ATen's int8 kernel is bound by its
        arithmetic at a few rows: a single-stream SmolLM2 decode step took 11.3 ms, as long as
        the bf16 model's with half the bytes; on ``linear_i8_rows`` 5.4 ms. SmolLM2's 120 layer
        matrices from memory: 1 row 9.5 -> 4.6 ms, 8 rows 21.5 -> 8.2, 16 rows 35.6 -> 13.6
        (AMX Xeon, 2 threads, throwaway timing scripts)."""
        from fastforward import kernels

        n, k = self.out_features, self.in_features
        if self.native or n % 16 or k % 32 or not kernels.ops().int8_rows_native():
            return
        self.codes = to_blocks(self.codes)
        self.native = True
        self.native_rows_max = few_row_kernel_limit(type(self).native_rows_max)
        if kernels.ops().bf16_tiles_native():  # AMX builds have them too
            # larger batches: linear_i8g_amx with one group of K inputs (a scale per output
            # row), the codes times the scale expanded to bf16 tiles once per call; before,
            # the codes went back to [N, K] and through a bf16 matmul every call (SmolLM2
            # int8 at batch 64 on the Zen 4 EPYC: 209 tok/s, 496 in bf16)
            self.tile_scales = self.scales.float().view(n // 16, 1, 16).contiguous()

    @property
    def kernel_rows_max(self) -> int:
        return self.native_rows_max if self.native else self.packed_rows_max

    def plain_codes(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, K]`` (or ``[R, K]`` for rows ``index``) int8 codes, whatever the layout."""
        if self.native:
            return from_blocks(self.codes, index)
        return self.codes if index is None else self.codes[index]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.kernel_rows_max:
            if self.native:
                return torch.ops.fastforward.linear_i8_rows(x, self.codes, self.scales)
            return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)
        if self.tile_scales is not None and x.dtype == torch.bfloat16:
            k = self.in_features
            return torch.ops.fastforward.linear_i8g_amx(x, self.codes, self.tile_scales, k)
        return F.linear(x, self.plain_codes().to(KERNEL_DTYPE)) * self.scales

    def dequantize(self) -> torch.Tensor:
        return self.plain_codes().float() * self.scales.float()[:, None]

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.plain_codes(index).float() * self.scales[index].float()[:, None]

    def packed_state(self) -> dict[str, torch.Tensor]:
        return {"codes": self.plain_codes().contiguous(), "scales": self.scales}

    @classmethod
    def from_packed(cls, tensors, config, bias):
        q = Int8Weights(tensors["codes"], tensors["scales"])
        return cls(q, bias, config.get("out_sizes"))


# Up to this many groups a small batch makes one int8 kernel call per group (fastest where the
# groups are few and long rows of output); beyond it one batched bf16 matmul over the groups.
_MAX_KERNEL_CALLS = 48


class Int8GroupLinear(QuantizedLinear):
    """int8 codes with a scale per group of ``group_size`` inputs: ``w = codes * scales``.

    No PyTorch CPU kernel takes group scales on int8, so a small batch multiplies each group's
    codes by that group's inputs (``_weight_int8pack_mm`` per group, or one batched matmul when
    the groups are many) and sums the partial products times their scales; large batches
    dequantize to bf16. Scales are stored in float16 when that
    is exact (Q8_0, Q5_0), else float32 (Q6_K: fp16 * int8 products)."""

    format = "int8_group"
    native_rows_max = 16  # linear_i8g_rows (csrc/ops.h kI8gRowsMax)

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, bias=None, out_sizes=None
    ) -> None:
        n, k = codes.shape
        super().__init__(k, n, bias, out_sizes)
        self.group_size = k // scales.shape[1]
        half = scales.to(torch.float16)
        exact = torch.equal(half.float(), scales.float())
        self.scale_dtype = torch.float16 if exact else torch.float32  # what checkpoints store
        self.native = False  # codes and scales in linear_i8g_amx's (and _rows') layout
        # native: linear_i8g_amx at every batch where the kernels multiply bf16 tiles (AMX,
        # or vdpbf16ps), else linear_i8g_rows (few rows)
        self.tiles = False
        g = self.group_size
        # group-major [B, N, g] so each group's codes are one contiguous matrix for bmm
        self.register_buffer("codes", codes.view(n, k // g, g).transpose(0, 1).contiguous())
        store = scales.to(self.scale_dtype)
        self.register_buffer("scales", store.t().contiguous().unsqueeze(-1))  # [B, N, 1]
        self.register_buffer("_ones", torch.ones(n, dtype=KERNEL_DTYPE), persistent=False)

    def use_native_kernel(self) -> None:
        """Repack the same codes and scales in blocks of 16 rows for fastforward's kernels. On
        an AMX CPU ``torch.ops.fastforward.linear_i8g_amx`` expands them to bf16 tiles once
        per call: faster than the per-group ATen calls at every batch size (Q8_0 [49152, 576],
        2 threads: 1 row 3.0 -> 1.7 ms, 64 rows 120 -> 3.2). Up to 16 rows the codes are
        multiplied in place instead (``linear_i8g_rows``: int16 rows, AVX512-VNNI; from memory
        1 row 3.3 -> 1.3 ms), which is all a CPU with AVX512-VNNI but no AMX gets: larger
        batches multiply the dequantized bf16 weight there, or, where the CPU has no native
        bf16 either, stay on ``linear_i8g_rows`` (``few_row_kernel_limit``)."""
        from fastforward import kernels

        n, g = self.out_features, self.group_size
        ops = kernels.ops()
        if self.native or n % 16 or g % 2 or not ops.int8_rows_native():
            return
        codes, scales = self._plain()
        self.codes = to_blocks(codes)
        self.scales = scales.float().view(n // 16, 16, -1).transpose(1, 2).contiguous()
        self._ones = None
        self.native = True
        self.tiles = bool(ops.bf16_tiles_native())  # AMX builds have them too
        rows = type(self).native_rows_max
        self.native_rows_max = EVERY_BATCH if self.tiles else few_row_kernel_limit(rows)

    @property
    def kernel_rows_max(self) -> int:
        return self.native_rows_max if self.native else self.packed_rows_max

    def _plain(self, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes ``[R, K]`` int8 and scales ``[R, K/g]`` (as stored) of all rows or rows
        ``index``; a lookup reads only its rows."""
        k = self.in_features
        if self.native:
            codes, scales = from_blocks(self.codes, index), from_blocks(self.scales, index)
            return codes, scales.to(self.scale_dtype)
        codes = self.codes if index is None else self.codes[:, index]  # [B, R, g]
        scales = self.scales if index is None else self.scales[:, index]  # [B, R, 1]
        return codes.transpose(0, 1).reshape(codes.shape[1], k), scales.squeeze(-1).t()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m > self.kernel_rows_max:
            return F.linear(x, self.dense_bf16())
        if self.native:
            op = torch.ops.fastforward
            kernel = op.linear_i8g_amx if self.tiles else op.linear_i8g_rows
            return kernel(x, self.codes, self.scales, self.group_size)
        b, g = self.codes.shape[0], self.group_size
        if b <= _MAX_KERNEL_CALLS:
            xg = x.view(m, b, g).transpose(0, 1).contiguous()  # [B, M, g]
            # one int8 kernel call per group (unit scales), scaled and summed in float32
            acc = torch.zeros(m, self.out_features)
            for i in range(b):
                part = torch.ops.aten._weight_int8pack_mm(xg[i], self.codes[i], self._ones)
                acc += part.float() * self.scales[i].float().t()
            return acc
        partial = torch.bmm(
            self.codes.to(KERNEL_DTYPE), x.view(m, b, g).permute(1, 2, 0)
        )  # [B, N, M]
        return (partial.float() * self.scales.float()).sum(0).t()

    def dequantize(self) -> torch.Tensor:
        return self._weights(*self._plain())

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return self._weights(*self._plain(index))

    def _weights(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        r, g = codes.shape[0], self.group_size
        return (codes.float().view(r, -1, g) * scales.float()[..., None]).view(r, -1)

    def packed_state(self) -> dict[str, torch.Tensor]:
        codes, scales = self._plain()
        return {"codes": codes.contiguous(), "scales": scales.contiguous()}

    def config(self) -> dict[str, Any]:
        return super().config() | {"group_size": self.group_size}

    @classmethod
    def from_packed(cls, tensors, config, bias):
        return cls(tensors["codes"], tensors["scales"], bias, config.get("out_sizes"))

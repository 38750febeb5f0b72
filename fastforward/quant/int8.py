"""int8 weights: per output channel (our ``int8``), and per group of 16/32 (GGUF Q8_0, Q5_0 and
Q6_K blocks, whose codes all fit in int8)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fastforward.quant.base import QuantizedLinear
from fastforward.quant.rtn import KERNEL_DTYPE, Int8Weights


class Int8Linear(QuantizedLinear):
    """Weight-only int8 with one bf16 scale per output row: ``w = codes * scales``. Small
    batches run ``aten._weight_int8pack_mm``; large ones multiply by the int8 codes in bf16
    (exact: |code| <= 127) and scale the output rows."""

    format = "int8"

    def __init__(self, q: Int8Weights, bias=None, out_sizes=None) -> None:
        n, k = q.codes.shape
        super().__init__(k, n, bias, out_sizes)
        self.register_buffer("codes", q.codes.contiguous())
        self.register_buffer("scales", q.scales.to(KERNEL_DTYPE).contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.packed_rows_max:
            return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)
        return F.linear(x, self.codes.to(KERNEL_DTYPE)) * self.scales

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.codes[index].float() * self.scales[index].float()[:, None]

    def packed_state(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales}

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

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, bias=None, out_sizes=None
    ) -> None:
        n, k = codes.shape
        super().__init__(k, n, bias, out_sizes)
        self.group_size = k // scales.shape[1]
        g, b = self.group_size, k // self.group_size
        # group-major [B, N, g] so each group's codes are one contiguous matrix for bmm
        self.register_buffer("codes", codes.view(n, b, g).transpose(0, 1).contiguous())
        half = scales.to(torch.float16)
        exact = torch.equal(half.float(), scales.float())
        store = half if exact else scales.float()
        self.register_buffer("scales", store.t().contiguous().unsqueeze(-1))  # [B, N, 1]
        self.register_buffer("_ones", torch.ones(n, dtype=KERNEL_DTYPE), persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        b, g = self.codes.shape[0], self.group_size
        if m > self.packed_rows_max:
            return F.linear(x, self.dense_bf16())
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
        w = self.codes.float() * self.scales.float()  # [B, N, g]
        return w.transpose(0, 1).reshape(self.out_features, self.in_features)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        w = self.codes[:, index].float() * self.scales[:, index].float()  # [B, R, g]
        return w.transpose(0, 1).reshape(len(index), self.in_features)

    def packed_state(self) -> dict[str, torch.Tensor]:
        n, k = self.out_features, self.in_features
        return {
            "codes": self.codes.transpose(0, 1).reshape(n, k),
            "scales": self.scales.squeeze(-1).t().contiguous(),
        }

    def config(self) -> dict[str, Any]:
        return super().config() | {"group_size": self.group_size}

    @classmethod
    def from_packed(cls, tensors, config, bias):
        return cls(tensors["codes"], tensors["scales"], bias, config.get("out_sizes"))

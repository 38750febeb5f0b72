"""RMS normalisation in the two flavours real checkpoints use."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: normalise in fp32, cast back, then scale by ``weight``.

    With ``unit_offset`` (Gemma) the scale is ``1 + weight`` and is applied in fp32 before the
    cast, as Gemma's reference does; the two differ only below fp32 precision.
    """

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.use_kernel = False  # fastforward's fused C++ kernel (fastforward.kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and x.stride(-1) == 1:
            return torch.ops.fastforward.rms_norm(x, self.weight, self.eps, self.unit_offset)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)

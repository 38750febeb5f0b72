"""Gated activations over a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedActivation(nn.Module):
    """``act(gate) * up`` where the input is ``[..., 2 * d]`` = gate then up."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        self.use_kernel = False  # fastforward's fused C++ kernel (fastforward.kernels)
        self.gelu_tanh = hidden_act in ("gelu_pytorch_tanh", "gelu_tanh")
        self.kernel_ok = hidden_act == "silu" or self.gelu_tanh
        if hidden_act == "silu":
            self.act = F.silu
        elif self.gelu_tanh:
            self.act = lambda x: F.gelu(x, approximate="tanh")
        elif hidden_act == "gelu":
            self.act = F.gelu
        else:
            raise ValueError(f"activation {hidden_act!r} is not supported")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and self.kernel_ok:
            return torch.ops.fastforward.gated_act(x, self.gelu_tanh)
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up

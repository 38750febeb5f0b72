"""Rotary position embedding (rotate-half / NeoX layout, as HF checkpoints store q and k)."""

from __future__ import annotations

import math

import torch
from torch import nn

from fastforward.models.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Per-pair frequencies ``[rotary_dim // 2]`` with the checkpoint's scaling rule."""
    dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q ``[T, H, D]`` and k ``[T, KVH, D]`` at integer ``positions [T]``."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.max_positions = max_positions
        self._cos_sin: torch.Tensor | None = None  # [max_positions, rotary_dim] fp32, built lazily
        self.use_kernel = False  # rotate in place with fastforward's C++ kernel

    def table(self, device: torch.device, needed: int) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device or len(self._cos_sin) < needed:
            n = max(needed, self.max_positions)
            inv_freq = inverse_frequencies(self.head_dim, self.rope)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
            self._cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
        return self._cos_sin

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions``, each ``[T, 1, rotary_dim]`` in ``dtype``."""
        table = self.table(positions.device, int(positions.max()) + 1 if positions.numel() else 1)
        cos, sin = table[positions].chunk(2, dim=-1)  # [T, rot/2] each
        cos = torch.cat([cos, cos], dim=-1).unsqueeze(1).to(dtype)
        sin = torch.cat([sin, sin], dim=-1).unsqueeze(1).to(dtype)
        return cos, sin

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_sin`` may be passed in when several layers share positions and RoPE."""
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_in_place(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, num_positions: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The C++ kernel's RoPE: q and k (views of a fused qkv allowed) rotated in place.
        ``num_positions`` bounds ``positions`` (the step's longest sequence); the kernel
        checks every position against the table."""
        table = self.table(positions.device, num_positions)
        torch.ops.fastforward.rope_(q, positions, table)
        torch.ops.fastforward.rope_(k, positions, table)
        return q, k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out

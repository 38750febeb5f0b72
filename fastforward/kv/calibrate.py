"""Per-channel key scales for the int8 KV cache, from one pass over a real text.

Keys of some models have a few channels far larger than the rest (Qwen2's k_proj biases:
keys of Qwen2.5-Coder-0.5B reach hundreds in some channels, units in others). An int8 vector
with one scale per token spends its 255 levels on those channels and rounds the others to a few
levels: perplexity +9% on Qwen2.5-Coder-0.5B. KIVI quantizes keys per channel for this reason.

Here each layer gets a static scale ``m`` per KV head and channel: the largest ``|k|`` seen in
that channel over a calibration text (the first of ``fastforward.calibration``'s: the Apache
License 2.0 as Debian ships it; not the GPL-3 that ``fastforward eval`` scores), made equal within each RoPE pair so that it commutes with
the rotation. The cache stores ``k / m`` (quantized per token as before) and attention multiplies
queries by ``m``: ``(q * m) . (k / m) = q . k`` exactly, and the per-token scale now sees
channels of similar size. One forward pass at engine start, no change to the kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from fastforward.scoring import score_tokens

CALIBRATION_TOKENS = 512


def pair_rotary(amax: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """``amax [KVH, D]`` with channels ``i`` and ``i + rotary_dim / 2`` (``i < rotary_dim / 2``)
    both set to the larger of the two: RoPE mixes them, a shared scale commutes with it."""
    out = amax.clone()
    half = rotary_dim // 2
    if half:
        pair = torch.maximum(amax[:, :half], amax[:, half : 2 * half])
        out[:, :half] = pair
        out[:, half : 2 * half] = pair
    return out


@torch.inference_mode()
def calibrate_key_scales(
    model: nn.Module, token_ids: list[int], dtype: torch.dtype, block_size: int
) -> None:
    """Run ``token_ids`` through ``model`` (a private cache of ``dtype``), then give every
    attention layer its per-channel key scale."""
    layers = model.attention_layers()
    for a in layers:
        a.set_key_channel_scale(None)
        a.key_absmax, a.calibrating = None, True
    try:
        score_tokens(model, token_ids, dtype, block_size)
    finally:
        for a in layers:
            a.calibrating = False
    for a in layers:
        m = pair_rotary(a.key_absmax, a.rotary_dim)
        # channels that stayed (nearly) zero keep a scale of their head's largest / 1000
        m = m.maximum(m.amax(dim=-1, keepdim=True) * 1e-3).clamp(min=1e-6)
        a.set_key_channel_scale(m)
        a.key_absmax = None

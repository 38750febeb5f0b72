"""Gemma 3 (text): interleaved sliding-window (local) and global layers with their own RoPE
bases, RMSNorm with a unit offset (scale = 1 + weight), norms after attention and MLP as well
as before, q/k norms, a sqrt(hidden) embedding scale and tanh-GELU gating."""

from __future__ import annotations

import torch
from torch import nn

from fastforward.attention.metadata import AttentionMetadata
from fastforward.layers.norm import RMSNorm
from fastforward.models.config import ModelConfig
from fastforward.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Gemma3Attention(LlamaAttention):
    qk_norm = True

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, unit_offset=True)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, unit_offset=True)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer

    def make_norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim, self.config.rms_norm_eps, unit_offset=True)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The reference rounds the scale to the weight dtype before multiplying.
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x * scale

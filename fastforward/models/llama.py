"""The Llama family: Llama 2/3, SmolLM2, and the relatives that differ only by options
(Mistral: sliding window; Qwen2: q/k/v biases; Qwen3: q/k RMSNorm), see their own files."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from fastforward.attention.metadata import AttentionMetadata
from fastforward.kernels.decoder import FusedDecoder
from fastforward.layers.activation import GatedActivation
from fastforward.layers.attention import Attention
from fastforward.layers.linear import MergedLinear
from fastforward.layers.norm import RMSNorm
from fastforward.layers.rotary import RotaryEmbedding
from fastforward.models.config import ModelConfig

# checkpoint projection name -> (fused module name, shard index)
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    qk_norm = False  # Qwen3 turns this on

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.qkv_proj = MergedLinear(cfg.hidden_size, [h * d, kvh * d, kvh * d], cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        if self.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        layer_type = cfg.layer_types[layer_idx]
        self.rotary = RotaryEmbedding(d, cfg.rope[layer_type], cfg.max_position_embeddings)
        self.attn = Attention(
            h,
            kvh,
            d,
            cfg.attention_scale,
            cfg.window_of(layer_idx),
            cfg.attn_logit_softcapping,
            rotary_dim=int(d * cfg.rope[layer_type].partial_rotary_factor),
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.out_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = self.rotary
        key = ("rope", rope.rope, rope.head_dim)  # layers with equal RoPE share the table
        if rope.use_kernel:  # in place, no per-step tables
            q, k = rope.rotate_in_place(positions, q, k, meta.max_seq_len)
        else:
            cos_sin = meta.cached(key, lambda: rope.cos_sin(positions, q.dtype))
            q, k = rope(positions, q, k, cos_sin)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [inter, inter], bias=False)
        self.act = GatedActivation(cfg.hidden_act)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer over a flat batch of tokens with a paged KV cache."""

    layer_cls = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # nn.Embedding would draw its own normal init; on the meta device, where load_model
        # builds the model, a process's first normal_ costs ~1 s of PyTorch's lazy set-up, for
        # values the checkpoint replaces anyway
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = self.make_norm(cfg.hidden_size)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, False)
        )
        # the layers as one C++ call per step (fastforward/kernels/decoder.py), set by the
        # runner once the native kernels and the KV cache are in place
        self.fused_decoder: FusedDecoder | None = None

    def make_norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim, self.config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        layer_ids: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions ``[T]`` -> final hidden states ``[T, hidden]``. ``layer_ids``
        runs only those layers, in order (a self-speculative draft skipping the others)."""
        x = self.embed(input_ids)
        fused = self.fused_decoder
        if fused is not None and fused.usable(meta, x.shape[0]):
            return self.norm(fused(x, positions, meta, layer_ids))
        layers = self.layers if layer_ids is None else [self.layers[i] for i in layer_ids]
        for layer in layers:
            x = layer(x, positions, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif isinstance(self.embed_tokens, nn.Embedding):
            logits = hidden @ self.embed_tokens.weight.t()
        else:  # a quantized tied embedding: its packed matrix is the output projection
            logits = self.embed_tokens.linear(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of parameters that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self.map_name(name)
            if target is None:
                continue
            pname, shard = target
            if pname not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            if shard is None:
                _copy_checked(params[pname], tensor, name)
            else:
                module_name, attr = pname.rsplit(".", 1)
                self.get_submodule(module_name).load_shard(shard, attr, tensor)
            loaded.add(f"{pname}#{shard}")
        self._check_complete(params, loaded)
        return loaded

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        """Checkpoint tensor name -> (parameter name, shard of a fused layer), None to skip."""
        name = name.removeprefix("model.").removeprefix("language_model.")
        if "rotary_emb" in name or name.startswith(("vision_tower", "multi_modal_projector")):
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding serves as output projection
        for ckpt, (fused, shard) in STACKED.items():
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{fused}."), shard
        return name, None

    def _check_complete(self, params: dict[str, torch.Tensor], loaded: set[str]) -> None:
        missing = []
        for pname in params:
            module_name = pname.rsplit(".", 1)[0]
            module = self.get_submodule(module_name) if "." in pname else self
            if getattr(module, "out_sizes", None) is not None:  # fused (maybe quantized)
                shards = range(len(module.out_sizes))
                if any(f"{pname}#{s}" not in loaded for s in shards):
                    missing.append(pname)
            elif f"{pname}#None" not in loaded:
                missing.append(pname)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)

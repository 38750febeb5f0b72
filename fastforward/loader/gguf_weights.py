"""GGUF checkpoints (llama.cpp's format, read with the ``gguf`` package) -> an HF-style config
and HF-named tensors. Weights are dequantized to float32 at load, or (``packed``) kept as
block codes for the quantized linears of ``quantization="gguf"``.

Two llama.cpp conversions are undone here: Llama q/k rows were permuted for llama.cpp's
interleaved RoPE, and Gemma norm weights were stored as ``1 + w``.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from fastforward.loader.gguf_file import GGUFFile
from fastforward.quant.gguf_blocks import PACKABLE, BlockCodes, decode_blocks

# architecture in GGUF -> (HF architecture, model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFCheckpoint:
    """An opened GGUF file: metadata, config and (lazily dequantized) tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        self.metadata = self.file.metadata
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"{self.path}: GGUF architecture {self.arch!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )

    def field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def hf_config(self) -> dict[str, Any]:
        """The metadata as an HF ``config.json`` dict."""
        hf_arch, model_type = ARCHITECTURES[self.arch]
        names = set(self.file.tensors)
        heads = int(self.arch_field("attention.head_count"))
        hidden = int(self.arch_field("embedding_length"))
        if "token_embd.weight" not in names:
            raise ValueError(f"{self.path}: no token_embd.weight tensor")
        embd = self.file.tensors["token_embd.weight"]
        cfg: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "vocab_size": int(self.arch_field("vocab_size", embd.shape[0])),
            "hidden_size": hidden,
            "intermediate_size": int(self.arch_field("feed_forward_length")),
            "num_hidden_layers": int(self.arch_field("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.arch_field("attention.head_count_kv", heads)),
            "head_dim": int(self.arch_field("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(self.arch_field("context_length", 2048)),
            "rope_theta": float(self.arch_field("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }
        if "rope_freqs.weight" in names:
            raise ValueError(
                "GGUF files with a rope_freqs tensor (Llama 3.1 scaling) are not supported yet"
            )
        scaling = self.arch_field("rope.scaling.type")
        if scaling == "linear":
            cfg["rope_scaling"] = {
                "rope_type": "linear",
                "factor": float(self.arch_field("rope.scaling.factor")),
            }
        window = self.arch_field("attention.sliding_window")
        if window:
            cfg["sliding_window"] = int(window)
        if self.arch == "gemma3":
            cfg |= {
                "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": cfg["head_dim"],
                "rope_local_base_freq": 10000.0,
            }
        return cfg

    def tensors(self, skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named float32 tensors, dequantized one at a time (but none of the GGUF names in
        ``skip``: those are loaded packed, see ``packed``)."""
        cfg = self.hf_config()
        for info in self.file.tensors.values():
            name = self.hf_name(info.name)
            if name is None or info.name in skip:
                continue
            try:
                data = self._dequantize(info)
            except Exception as e:
                raise ValueError(f"{self.path}: cannot decode tensor {info.name} ({e})") from None
            yield name, torch.from_numpy(self._undo_conversion(info.name, data, cfg))

    def _dequantize(self, info) -> np.ndarray:
        """A tensor as float32: 2-D block types through our decoder (gguf's numbers bit for
        bit, gguf_blocks.py; SmolLM2's file 1.05 -> 0.45 s), the rest through gguf's."""
        raw = self.file.raw(info)
        if info.qtype in PACKABLE and len(info.shape) == 2:
            return decode_blocks(raw, info.qtype, tuple(info.shape)).dequantize().numpy()
        return dequantize(raw, info.qtype).reshape(info.shape)

    def packed(self, name: str) -> BlockCodes:
        """A block-quantized matrix as codes and scales, not expanded to floats, rows in HF
        order (the Llama q/k permutation undone on the rows)."""
        info = self.file.tensors[name]
        codes = decode_blocks(self.file.raw(info), info.qtype, info.shape)
        if self.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            cfg = self.hf_config()
            heads = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
            order = _unpermute_rope(np.arange(info.shape[0])[:, None], heads)[:, 0]
            codes = codes.rows(torch.from_numpy(order))
        return codes

    def hf_name(self, name: str) -> str | None:
        """The HF name of a GGUF tensor (None: not a model weight)."""
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        m = _LAYER_RE.match(name)
        if not m:
            return None
        layer, part, kind = m.groups()
        if part == "ffn_norm":
            hf = (
                "pre_feedforward_layernorm" if self.arch == "gemma3" else "post_attention_layernorm"
            )
        elif part in _LAYER_NAMES:
            hf = _LAYER_NAMES[part]
        else:
            raise ValueError(f"{self.path}: unexpected tensor {name!r}")
        return f"model.layers.{layer}.{hf}.{kind}"

    def _undo_conversion(self, name: str, w: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
        w = np.array(w, dtype=np.float32)  # a writable copy: the mmap is read-only
        if self.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
            return _unpermute_rope(w, heads)
        if self.arch == "gemma3" and name.endswith("norm.weight"):
            return w - 1.0
        return w


def _unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (pairs interleaved -> halves)."""
    dim = w.shape[0] // heads // 2
    return np.ascontiguousarray(
        w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )

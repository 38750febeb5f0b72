"""The decoder stack in one C++ call per step (``csrc/decoder.cpp``).

A decode step of SmolLM2-135M spends ~25% of its time in Python between the kernels: ~25 ops
per layer, 30 layers. ``build_fused_decoder`` hands the loaded model's layers (their packed
weights, norms, RoPE tables and KV cache slots) to a ``torch.classes.fastforward.DecoderStack``
once; steps the attention kernel takes (every query run at most ``KERNEL_MAX_QUERY_LEN``
tokens, or any step where its bf16 path serves every layer, or an int8 cache's steps of prompt
chunks only, which its layers hand to a prompt kernel over the blocks dequantized) then run all
layers in one call, through the same kernels in the same order as the modules, so the result is
the same to the bit. Everything else (other long prefills, steps mixing an int8 cache's prompt
chunks with short runs, weight formats without a native kernel) keeps the module path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastforward.attention.metadata import AttentionMetadata
from fastforward.kernels.linear import PackedLinear
from fastforward.layers.attention import KERNEL_MAX_QUERY_LEN, Attention
from fastforward.layers.linear import MergedLinear
from fastforward.quant.base import ConcatLinear
from fastforward.quant.codebook import CodebookLinear
from fastforward.quant.int4 import Int4Linear
from fastforward.quant.int5 import Int5Linear
from fastforward.quant.int8 import Int8GroupLinear, Int8Linear

# csrc/decoder.cpp LinearKind (kConcat comes from add_concat)
LINEAR_BF16, LINEAR_Q4, LINEAR_INT8, LINEAR_DENSE, LINEAR_Q5, LINEAR_I8G = 0, 1, 2, 3, 4, 6
NO_LIMIT = 1 << 62


@dataclass(slots=True)
class FusedDecoder:
    """A model's decoder layers as one ``DecoderStack``, and when it may run."""

    stack: Any  # torch.classes.fastforward.DecoderStack
    attentions: list[Attention]
    # each layer's (kv_cache, kv_scales, group, key_mult) the stack was built with
    bound: list[tuple[torch.Tensor, torch.Tensor | None, int, torch.Tensor | None]]
    rows_max: int  # largest batch every linear's packed kernel takes
    max_positions: int  # context the RoPE tables cover
    long_queries: bool  # every layer's attention takes prefills too (bf16 / int8 paths)
    # some layer takes steps of prompt chunks only on a prompt kernel (DecoderStack.
    # set_prompt_kernel: an int8 cache's blocks dequantized, or a bf16 cache as it is where
    # paged_attention's long-query path would take them); the module path splits steps that
    # mix them with short runs, as the stack does not
    prompt_kernels: bool = False

    def usable(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        long = meta.max_query_len > KERNEL_MAX_QUERY_LEN
        if (
            (long and not self.long_queries)
            or num_tokens > self.rows_max
            or meta.max_seq_len > self.max_positions
        ):
            return False
        if long and self.prompt_kernels and int(meta.query_lens.min()) <= KERNEL_MAX_QUERY_LEN:
            return False
        for a, (cache, scales, group, key_mult) in zip(self.attentions, self.bound, strict=True):
            # rebound (one-off scoring passes swap in a cache of their own) or set after the
            # build (KV-cache calibration's key scales): the module path serves those
            if a.kv_cache is not cache or a.kv_scales is not scales or a.group != group:
                return False
            if a.calibrating or a.key_mult is not key_mult:
                return False
        return True

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        layer_ids: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The embedded tokens ``[T, hidden]`` -> hidden states after the last layer run."""
        return self.stack.forward(
            x,
            positions,
            [g.block_tables for g in meta.groups],
            [g.slot_mapping for g in meta.groups],
            meta.query_start_loc,
            meta.seq_lens,
            [] if layer_ids is None else list(layer_ids),
        )


def build_fused_decoder(model: nn.Module) -> tuple[FusedDecoder | None, str]:
    """The model's layers as one stack, or None and the reason it cannot be (the model keeps
    its module path). Call after the native kernels are applied and the KV cache is bound."""
    from fastforward.models.llama import LlamaAttention, LlamaDecoderLayer

    layers = getattr(model, "layers", None)
    if layers is None or not len(layers):
        return None, "the model has no decoder layers"
    for layer in layers:  # subclasses that change only options (Qwen3's q/k norms) are in
        plain = isinstance(layer, LlamaDecoderLayer) and isinstance(layer.self_attn, LlamaAttention)
        if (
            not plain
            or type(layer).forward is not LlamaDecoderLayer.forward
            or (type(layer.self_attn).forward is not LlamaAttention.forward)
        ):
            return None, f"{type(layer).__name__} layers are not the Llama layer"
    for i, layer in enumerate(layers):
        why = _layer_unsupported(layer)
        if why:
            return None, f"layer {i}: {why}"
    stack = torch.classes.fastforward.DecoderStack()  # the kernels are loaded: checked above
    rows_max = NO_LIMIT
    for i, layer in enumerate(layers):
        attn_mod, mlp = layer.self_attn, layer.mlp
        attn = attn_mod.attn
        linears = []
        for name, lin in (
            ("qkv_proj", attn_mod.qkv_proj),
            ("o_proj", attn_mod.o_proj),
            ("gate_up_proj", mlp.gate_up_proj),
            ("down_proj", mlp.down_proj),
        ):
            added = _add_linear(stack, lin)
            if added is None:
                return None, f"layer {i} {name}: {type(lin).__name__} has no native kernel"
            index, limit = added
            linears.append(index)
            rows_max = min(rows_max, limit)
        rope = attn_mod.rotary
        q_norm = attn_mod.q_norm if attn_mod.qk_norm else None
        k_norm = attn_mod.k_norm if attn_mod.qk_norm else None
        table = rope.table(attn.kv_cache.device, rope.max_positions)
        stack.add_layer(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            linears,
            [
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
                attn.sliding_window or 0,
                attn.group,
                int(mlp.act.gelu_tanh),
            ],
            [
                layer.input_layernorm.eps,
                layer.post_attention_layernorm.eps,
                attn.scale,
                attn.softcap or 0.0,
                q_norm.eps if q_norm is not None else 0.0,
            ],
            table,
            attn.kv_cache,
            attn.kv_scales,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            attn.query_mult,
            attn.key_mult,
        )
    attentions = [layer.self_attn.attn for layer in layers]
    bound = [(a.kv_cache, a.kv_scales, a.group, a.key_mult) for a in attentions]
    # the activations are in the model's dtype, the norms' weights'
    dtype = layers[0].input_layernorm.weight.dtype
    # prompt chunks on a prompt kernel where the module path takes them there
    # (Attention.prompts_split: an int8 cache's blocks dequantized, or a bf16 cache as it is)
    prompt_kernels = False
    for i, a in enumerate(attentions):
        if a.prompts_split(dtype):
            stack.set_prompt_kernel(i, 2 if a.prompts_on_amx(dtype) else 1, KERNEL_MAX_QUERY_LEN)
            prompt_kernels = True
    long_queries = dtype == torch.bfloat16 and all(
        a.takes_long_queries(dtype) or a.prompts_dequantized(dtype) for a in attentions
    )
    fused = FusedDecoder(
        stack, attentions, bound, rows_max, stack.max_positions(), long_queries, prompt_kernels
    )
    return fused, ""


def _layer_unsupported(layer: nn.Module) -> str:
    attn_mod, mlp = layer.self_attn, layer.mlp
    attn = attn_mod.attn
    if attn_mod.qk_norm and not all(
        n.use_kernel and not n.unit_offset and n.eps == attn_mod.q_norm.eps
        for n in (attn_mod.q_norm, attn_mod.k_norm)
    ):
        return "q/k norms not on the native kernel"
    if attn.kv_cache is None:
        return "no KV cache bound"
    if not (attn.use_kernel and attn_mod.rotary.use_kernel):
        return "attention or RoPE not on the native kernels"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(n.use_kernel and not n.unit_offset for n in norms):
        return "norms not on the native kernel"
    if not (mlp.act.use_kernel and mlp.act.kernel_ok):
        return "activation not on the native kernel"
    return ""


def _add_linear(stack: Any, lin: nn.Module) -> tuple[int, int] | None:
    """Register one linear layer; (its index, the rows its packed kernel takes), or None."""
    if isinstance(lin, PackedLinear):
        index = stack.add_linear(
            LINEAR_BF16, lin.tiles if lin.packed is None else lin.packed, lin.large_batch_weight,
            None, lin.out_features, 0,
            lin.packed_rows_max, lin.bias,
        )  # fmt: skip
        if lin.fp32_rows_min is not None:  # no native bf16: larger batches take the module path
            return index, lin.fp32_rows_min - 1
        return index, NO_LIMIT  # larger batches take the large-batch copy inside the stack
    bias = lin.bias
    if type(lin) in (nn.Linear, MergedLinear):  # float32 engines: F.linear, as the module
        return stack.add_linear(LINEAR_DENSE, lin.weight, None, None, 0, 0, 0, bias), NO_LIMIT
    if isinstance(lin, Int4Linear | CodebookLinear) and lin.native:
        if isinstance(lin, Int4Linear):  # codes, scales (and zeros), the 16 levels
            codes, scales, table = lin.packed, lin.scales_and_zeros, lin.levels
        else:
            codes, scales, table = lin.indices, lin.scales, lin.centroids
        index = stack.add_linear(
            LINEAR_Q4, codes, scales, table, lin.out_features, lin.group_size,
            lin.native_rows_max, bias,
        )  # fmt: skip
        return index, lin.native_rows_max
    if isinstance(lin, Int5Linear | Int8GroupLinear) and lin.native:  # codes, group scales
        kind = LINEAR_Q5 if isinstance(lin, Int5Linear) else LINEAR_I8G
        index = stack.add_linear(
            kind, lin.codes, lin.scales, None, lin.out_features, lin.group_size,
            lin.kernel_rows_max, bias,
        )  # fmt: skip
        return index, lin.kernel_rows_max
    if isinstance(lin, ConcatLinear):  # its parts, then their outputs side by side
        added = [_add_linear(stack, part) for part in lin.parts]
        if any(a is None for a in added):
            return None
        return stack.add_concat([i for i, _ in added], bias), min(r for _, r in added)
    if type(lin) is Int8Linear:  # ATen's layout, or linear_i8_rows' blocks (lin.native)
        index = stack.add_linear(
            LINEAR_INT8, lin.codes, lin.scales, None, lin.out_features, 0,
            lin.kernel_rows_max, bias,
        )  # fmt: skip
        return index, lin.kernel_rows_max
    return None

"""What each attention layer needs from the KV cache, and how layers are grouped onto one pool.

Every layer declares a spec. Layers with the same spec form KV cache *groups* of equal size;
all groups draw blocks from one shared pool. Slot ``s`` of every group shares one tensor of
``num_blocks`` pages, so a block id allocated by one group addresses memory nobody else uses:
sliding-window layers that give blocks back make room for full-attention layers, without a
second pool (the idea of vLLM's hybrid allocator). Adding a kind of cache (MLA latent, shared
across layers, quantized) means a new spec class and a manager for it, not a new scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastforward.kv.quant import scale_bytes


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Causal attention over the whole history: one K and one V vector per token and kv head."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block holds for one layer (K and V, and their scales if quantized)."""
        per_vector = self.head_dim * self.dtype.itemsize + scale_bytes(self.dtype)
        return 2 * self.block_size * self.num_kv_heads * per_vector

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Attention over the last ``sliding_window`` tokens (including the query token itself);
    blocks that fall wholly behind the window are given back to the pool."""

    sliding_window: int = 0


KVSpec = FullAttentionSpec  # base class of every spec


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    spec: KVSpec
    layer_indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """How many blocks the pool has (block 0 is the reserved null block) and which layer reads
    which group's block table and which slot tensor."""

    num_blocks: int
    block_size: int
    groups: tuple[KVCacheGroup, ...]

    @property
    def num_slots(self) -> int:
        return len(self.groups[0].layer_indices)

    def layer_location(self, layer_idx: int) -> tuple[int, int]:
        """(group index, slot index) of a layer."""
        for g, group in enumerate(self.groups):
            if layer_idx in group.layer_indices:
                return g, group.layer_indices.index(layer_idx)
        raise KeyError(f"layer {layer_idx} has no KV cache group")

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id across all slots (what one block id costs the pool)."""
        return self.num_slots * self.groups[0].spec.page_size_bytes

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence can hold if it had every usable block of every group."""
        return (self.num_blocks - 1) // len(self.groups) * self.block_size


def group_layers(layer_specs: list[KVSpec]) -> tuple[KVCacheGroup, ...]:
    """Split layers into groups of equal size, each group holding layers of one spec."""
    if not layer_specs:
        raise ValueError("a model needs at least one attention layer")
    pages = {spec.page_size_bytes for spec in layer_specs}
    if len(pages) != 1:
        raise ValueError(f"layers with different KV page sizes are not supported yet: {pages}")
    by_spec: dict[KVSpec, list[int]] = {}
    for idx, spec in enumerate(layer_specs):
        by_spec.setdefault(spec, []).append(idx)
    size = math.gcd(*(len(v) for v in by_spec.values()))
    groups = []
    for spec, layers in by_spec.items():
        for start in range(0, len(layers), size):
            groups.append(KVCacheGroup(spec, tuple(layers[start : start + size])))
    return tuple(groups)


def make_kv_cache_config(
    layer_specs: list[KVSpec], *, memory_bytes: int | None = None, num_blocks: int | None = None
) -> KVCacheConfig:
    """Size the pool from a memory budget or an explicit block count (which includes null)."""
    groups = group_layers(layer_specs)
    block_size = layer_specs[0].block_size
    per_block = len(groups[0].layer_indices) * groups[0].spec.page_size_bytes
    if num_blocks is None:
        if memory_bytes is None:
            raise ValueError("give memory_bytes or num_blocks")
        num_blocks = memory_bytes // per_block
    if num_blocks < 2:
        raise ValueError(f"KV cache too small: {num_blocks} blocks of {per_block} bytes")
    return KVCacheConfig(num_blocks=num_blocks, block_size=block_size, groups=groups)

"""The attention front-end every model uses: stores new K/V into the paged cache, then asks the
backend for attention over the whole cached context."""

from __future__ import annotations

import torch
from torch import nn

from fastforward.attention.metadata import AttentionMetadata
from fastforward.attention.reference import paged_attention, write_kv

# Steps whose longest query run is at most this many tokens (decode, small chunks) use the
# native kernel; longer prefills go to the reference path, whose SDPA is a tiled matmul and
# beats the kernel's per-key scoring there (512-token prefill of SmolLM2: ~900 tok/s with the
# kernel, benchmarks/bench_cpu.py).
KERNEL_MAX_QUERY_LEN = 16


class Attention(nn.Module):
    """Paged causal attention of one layer. The runner binds ``kv_cache`` (this layer's slot
    tensor ``[2, num_blocks, block_size, KVH, D]``) and ``group`` (its KV cache group)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.kv_cache: torch.Tensor | None = None
        self.group = 0
        # fastforward's C++ paged attention (fastforward.kernels) instead of the reference
        self.use_kernel = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q ``[T, H, D]``, k and v ``[T, KVH, D]`` -> ``[T, H * D]``."""
        if self.kv_cache is None:
            raise RuntimeError("attention layer has no KV cache bound (runner not initialised)")
        group = meta.groups[self.group]
        write_kv(self.kv_cache, k, v, group.slot_mapping)
        if self.use_kernel and meta.max_query_len <= KERNEL_MAX_QUERY_LEN:
            out = torch.ops.fastforward.paged_attention(
                q.contiguous(),
                self.kv_cache,
                group.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                self.scale,
                self.sliding_window or 0,
                self.softcap or 0.0,
            )
        else:
            out = paged_attention(
                q,
                self.kv_cache,
                meta,
                group,
                scale=self.scale,
                window=self.sliding_window,
                softcap=self.softcap,
            )
        return out.flatten(1)

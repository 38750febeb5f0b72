"""What attention needs to know about the batch, built once per step by the runner and passed
explicitly down the model (no global context)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class GroupMetadata:
    """Per KV cache group: where each sequence's blocks are and where new K/V go."""

    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with the null block 0
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token


@dataclass(slots=True)
class AttentionMetadata:
    """A batch of B sequences flattened to T tokens; sequence b owns tokens
    ``query_start_loc[b]:query_start_loc[b+1]``, the last ``query_lens[b]`` of its
    ``seq_lens[b]`` tokens of context."""

    query_start_loc: torch.Tensor  # [B + 1] int64
    query_lens: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, context length including this step's tokens
    max_query_len: int
    max_seq_len: int
    block_size: int
    groups: list[GroupMetadata]
    # Tensors derived from the above that every layer would otherwise rebuild (masks, RoPE
    # tables at these positions): computed by the first layer that needs them, this step only.
    derived: dict[Any, torch.Tensor] = field(default_factory=dict)

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        if key not in self.derived:
            self.derived[key] = build()
        return self.derived[key]

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.shape[0])

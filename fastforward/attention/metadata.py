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


@dataclass(slots=True)
class BatchPart:
    """Some of a batch's sequences as a batch of their own: ``rows`` [T'] are their query
    tokens' rows in the whole batch, ``meta`` their metadata (slot mappings of those rows)."""

    rows: torch.Tensor
    meta: AttentionMetadata


def batch_part(meta: AttentionMetadata, seqs: torch.Tensor) -> BatchPart:
    """The sequences ``seqs`` [B'] (indices in increasing order) of ``meta`` as a BatchPart."""
    starts = meta.query_start_loc[:-1][seqs]  # [B']
    qlens = meta.query_lens[seqs]  # [B']
    seq_lens = meta.seq_lens[seqs]
    qsl = torch.zeros(len(seqs) + 1, dtype=meta.query_start_loc.dtype, device=seqs.device)
    torch.cumsum(qlens, 0, out=qsl[1:])
    # row of token i of the part: its sequence's start in the batch + its offset in the sequence
    total = int(qsl[-1])
    offsets = torch.arange(total, device=seqs.device) - torch.repeat_interleave(qsl[:-1], qlens)
    rows = torch.repeat_interleave(starts, qlens) + offsets
    groups = [GroupMetadata(g.block_tables[seqs], g.slot_mapping[rows]) for g in meta.groups]
    part = AttentionMetadata(
        query_start_loc=qsl,
        query_lens=qlens,
        seq_lens=seq_lens,
        max_query_len=int(qlens.max()) if len(seqs) else 0,
        max_seq_len=int(seq_lens.max()) if len(seqs) else 0,
        block_size=meta.block_size,
        groups=groups,
    )
    return BatchPart(rows, part)


def split_by_query_len(
    meta: AttentionMetadata, max_short: int
) -> tuple[BatchPart, BatchPart] | None:
    """The batch's sequences with query runs up to ``max_short`` tokens (decode, short chunks)
    and the longer ones (prefill chunks), or None when every run is on one side."""
    short = meta.query_lens <= max_short
    n_short = int(short.sum())
    if n_short in (0, meta.num_seqs):
        return None
    seqs = torch.arange(meta.num_seqs, device=meta.query_lens.device)
    return batch_part(meta, seqs[short]), batch_part(meta, seqs[~short])

"""Scoring a token window: log-probabilities of every next token, for perplexity.

Generation only computes logits of the last position of each sequence; scoring needs all of
them. ``score_tokens`` runs the model once over the window with a KV allocation of its own
(a private cache tensor per layer, bound for the call and unbound after), so it neither reads
nor disturbs the engine's paged cache, scheduler or prefix cache.
"""

from __future__ import annotations

import torch
from torch import nn

from fastforward.attention.metadata import AttentionMetadata, GroupMetadata
from fastforward.kv.quant import allocate_kv_cache


@torch.inference_mode()
def score_tokens(
    model: nn.Module,
    token_ids: list[int] | torch.Tensor,
    kv_dtype: torch.dtype,
    block_size: int = 16,
) -> torch.Tensor:
    """``log p(token[i+1] | token[:i+1])`` for i in ``0..T-2``, float32 ``[T - 1]``."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    t = ids.shape[0]
    if t < 2:
        raise ValueError("scoring needs at least two tokens")
    layers = model.attention_layers()
    num_blocks = 1 + -(-t // block_size)  # block 0 is the null block
    table = torch.arange(1, num_blocks, dtype=torch.long)[None, :]
    slots = torch.arange(t, dtype=torch.long) + block_size  # blocks 1, 2, ... in order
    groups = [GroupMetadata(block_tables=table, slot_mapping=slots)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, t]),
        query_lens=torch.tensor([t]),
        seq_lens=torch.tensor([t]),
        max_query_len=t,
        max_seq_len=t,
        block_size=block_size,
        groups=groups * (1 + max(a.group for a in layers)),
    )
    saved = [(a.kv_cache, a.kv_scales, a.group) for a in layers]
    try:
        for a in layers:
            shape = (2, num_blocks, block_size, a.num_kv_heads, a.head_dim)
            a.kv_cache, a.kv_scales = allocate_kv_cache(shape, kv_dtype)
        hidden = model(ids, torch.arange(t), meta)
        logits = model.compute_logits(hidden[:-1]).float()
    finally:
        for a, (cache, scales, group) in zip(layers, saved, strict=True):
            a.kv_cache, a.kv_scales, a.group = cache, scales, group
    return torch.log_softmax(logits, dim=-1).gather(1, ids[1:, None]).squeeze(1)

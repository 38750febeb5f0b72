"""Log-probabilities of given tokens at many positions: prompt logprobs and scoring.

Sampling needs the logits of one position per sequence; scoring a prompt needs them at every
position. ``score_positions`` computes them for a batch of hidden states in slices of
``chunk_rows`` rows, so a long prompt never holds ``[T, vocab]`` float32 logits at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TokenLogprob:
    """The logprob of one known token, its rank (1 + tokens more likely) and the top-N."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


def score_positions(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    top_n: int,
    chunk_rows: int = 256,
) -> list[TokenLogprob]:
    """Row ``i`` of ``hidden`` [R, H] predicts ``targets[i]``; returns its logprob under
    ``log_softmax(compute_logits(hidden[i]))`` (float32) with the ``top_n`` alternatives."""
    if hidden.shape[0] != len(targets):
        raise ValueError("hidden rows and targets must have the same length")
    out: list[TokenLogprob] = []
    for lo in range(0, len(targets), chunk_rows):
        hi = min(lo + chunk_rows, len(targets))
        lp = torch.log_softmax(compute_logits(hidden[lo:hi]).float(), dim=-1)  # [r, V]
        tgt = torch.tensor(targets[lo:hi], device=lp.device)
        picked = lp.gather(1, tgt[:, None])  # [r, 1]
        ranks = ((lp > picked).sum(dim=-1) + 1).tolist()
        n = min(top_n, lp.shape[1])
        top_lp, top_ids = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
        top_lp, top_ids, picked = top_lp.tolist(), top_ids.tolist(), picked[:, 0].tolist()
        for j in range(hi - lo):
            top = list(zip(top_ids[j], top_lp[j], strict=True))
            out.append(TokenLogprob(targets[lo + j], picked[j], ranks[j], top))
    return out

"""DRY ("don't repeat yourself") sampling, as llama.cpp, koboldcpp and text-generation-webui
have it: a token that would extend a sequence already seen in the context is penalized by
``multiplier * base ** (length - allowed_length)`` when the repeated sequence it extends is at
least ``allowed_length`` tokens long. It breaks the loops small models fall into (a digit pair
repeated until ``max_tokens``, a sentence said again and again) without touching text that
repeats single tokens, as repetition penalties do.

A match never crosses a sequence breaker: a token whose text contains one of the breaker
strings (llama.cpp's defaults: newline, ``:``, ``"``, ``*``), so that structure which must
repeat (the keys of JSON objects, lines of a list) is left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

# Matches are followed this far back: past it the penalty has long saturated any logit.
MAX_MATCH = 64
MAX_EXPONENT = 40.0


def repeat_lengths(ctx: np.ndarray, breaker: np.ndarray, max_match: int = MAX_MATCH) -> dict:
    """``{next token: the longest repeated sequence it would extend}`` for context ``ctx``
    (token ids, oldest first) and ``breaker`` (a bool per vocabulary id). The sequence is the
    end of ``ctx`` after its last breaker; each earlier place where that end also occurs
    proposes the token that followed it there."""
    n = len(ctx)
    if n < 2 or breaker[ctx[-1]]:
        return {}
    breaks = np.flatnonzero(breaker[ctx])
    cap = min(n - 1 - (int(breaks[-1]) if len(breaks) else -1), max_match)
    cand = np.flatnonzero(ctx[:-1] == ctx[-1])  # earlier ends of a 1-token match
    if not len(cand):
        return {}
    length = np.ones(len(cand), dtype=np.int64)
    alive = np.arange(len(cand))
    for k in range(1, cap):
        pos = cand[alive] - k
        ok = pos >= 0
        ok[ok] = ctx[pos[ok]] == ctx[n - 1 - k]
        alive = alive[ok]
        if not len(alive):
            break
        length[alive] += 1
    out: dict[int, int] = {}
    for tok, ln in zip(ctx[cand + 1].tolist(), length.tolist(), strict=True):
        if ln > out.get(tok, 0):
            out[tok] = ln
    return out


class DryPenalty:
    """Applies DRY to the rows of a logits batch whose requests ask for it
    (``SamplingParams.dry_multiplier > 0``). ``token_texts`` gives the text of every vocabulary
    id (read once, when a request first needs its breakers)."""

    def __init__(self, token_texts: Callable[[], Sequence[str]] | None = None) -> None:
        self._token_texts = token_texts
        self._texts: Sequence[str] | None = None
        self._masks: dict[tuple[str, ...], np.ndarray] = {}

    def breaker_mask(self, breakers: Sequence[str], vocab: int) -> np.ndarray:
        key = tuple(breakers)
        mask = self._masks.get(key)
        if mask is None or len(mask) != vocab:
            mask = np.zeros(vocab, dtype=bool)
            if key:
                if self._texts is None and self._token_texts is not None:
                    self._texts = self._token_texts()
                for i, text in enumerate((self._texts or [])[:vocab]):
                    mask[i] = any(b in text for b in key)
            self._masks[key] = mask
        return mask

    @staticmethod
    def applies(p) -> bool:
        """Whether DRY can change a request's logits (``p``: its sampling params)."""
        return p.dry_multiplier > 0 and p.dry_penalty_last_n != 0

    def __call__(self, logits: torch.Tensor, requests: Sequence) -> None:
        """In place on ``logits [B, V]``; ``requests[i]`` has ``sampling_params``,
        ``prompt_token_ids`` and ``output_token_ids``."""
        rows, cols, amounts = [], [], []
        vocab = logits.shape[1]
        for i, r in enumerate(requests):
            p = r.sampling_params
            if not self.applies(p):
                continue
            ctx = np.asarray(list(r.prompt_token_ids) + list(r.output_token_ids), dtype=np.int64)
            if p.dry_penalty_last_n > 0:
                ctx = ctx[-p.dry_penalty_last_n :]
            ctx = ctx[(ctx >= 0) & (ctx < vocab)]
            mask = self.breaker_mask(p.dry_sequence_breakers, vocab)
            for tok, length in repeat_lengths(ctx, mask).items():
                if length >= p.dry_allowed_length:
                    exponent = min(length - p.dry_allowed_length, MAX_EXPONENT)
                    rows.append(i)
                    cols.append(tok)
                    amounts.append(p.dry_multiplier * p.dry_base**exponent)
        if rows:
            device = logits.device
            logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] -= (
                torch.tensor(amounts, dtype=logits.dtype, device=device)
            )

"""What every proposer returns, and the n-gram prompt-lookup proposer (no model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fastforward.request import Request


@dataclass(slots=True)
class Draft:
    """Tokens proposed to follow a request, and the ``[k, V]`` distribution each was sampled
    from (``None``: chosen deterministically, i.e. a point mass on each token)."""

    token_ids: list[int]
    probs: Any = None


class Proposer(Protocol):
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        """Up to ``num_tokens[i]`` draft tokens to follow each request's ``all_token_ids``."""

    def release(self, keep: set[str]) -> None:
        """Forget the state of every request whose id is not in ``keep``."""


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` (``max_n`` down to ``min_n`` tokens long); ``[]`` when no suffix recurs."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        # Windows starting at 0 .. total - n - 1: every occurrence before the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    """Prompt lookup decoding: copy what followed the last occurrence of the recent tokens.

    Pays off where the output repeats its input (editing code, extracting or summarizing a
    given text) and costs only a scan of the request's tokens.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        out = []
        for req, k in zip(requests, num_tokens, strict=True):
            tokens = np.asarray(req.all_token_ids, dtype=np.int64)
            out.append(Draft(ngram_lookup(tokens, k, self.min_n, self.max_n)))
        return out

    def release(self, keep: set[str]) -> None:
        pass

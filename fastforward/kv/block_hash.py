"""Chained hashes that name full KV blocks for prefix caching.

The KV of a token depends on every token before it, so a block's hash covers its own tokens and,
through its parent's hash, all earlier ones: equal hashes mean equal prefixes, and block ``i`` of
two requests can be shared exactly when their first ``(i + 1) * block_size`` tokens agree. The
``extra_key`` folds in whatever else changes the KV (model, dtype, KV cache dtype, later an
adapter); the engine chooses it.

SHA-256 rather than Python's ``hash``: a collision would silently serve one request another
request's KV, and ``hash`` of integers is easy to collide on purpose.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes  # a 32-byte SHA-256 digest

_ROOT = bytes(32)  # the "parent" of block 0


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b""
) -> BlockHash:
    """Hash of one full block: its parent's hash, its token ids and the extra key."""
    h = hashlib.sha256(_ROOT if parent is None else parent)
    # Length-prefixed, so no (extra key, tokens) pair can be read as another.
    h.update(len(extra_key).to_bytes(8, "little"))
    h.update(extra_key)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    extra_key: bytes = b"",
) -> list[BlockHash]:
    """Append hashes to ``hashes`` (the chain of ``token_ids``' first full blocks) until it has
    ``num_blocks`` entries or the tokens run out of full blocks; returns ``hashes``."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else None
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block, extra_key))
    return hashes

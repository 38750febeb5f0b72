"""The pool of KV cache blocks shared by every KV cache group: ids, ref counts, a free queue.

Block ids index the page dimension of every slot tensor, so the pool only does bookkeeping.
Block 0 is the null block: it is never handed out, and block tables put it where a block was
given back (sliding window) so that entry ``i`` still covers token positions
``[i * block_size, (i + 1) * block_size)``.

The free queue is ordered: a freed block goes to the tail, allocation takes the head. Prefix
caching keeps a freed block's contents and its ``cache_key`` until allocation reaches it at the
head, which makes the queue an LRU of cached blocks: a block is evicted (its key dropped from the
lookup table) only when it is handed out again, and a block in use is never in the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from fastforward.kv.block_hash import BlockHash

NULL_BLOCK_ID = 0

# What a computed full block is cached under: (KV cache group, chained hash of its tokens). The
# group is part of the key because every group keeps its own copy of a prefix's KV.
CacheKey = tuple[int, BlockHash]


class OutOfBlocksError(RuntimeError):
    """Raised by ``BlockPool.allocate`` when fewer blocks are free than asked for."""


@dataclass(slots=True, eq=False)
class Block:
    """One page of KV cache. ``ref_cnt`` counts the block tables holding it."""

    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and computed and in the prefix cache; cleared on eviction.
    cache_key: CacheKey | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID


class BlockPool:
    """``num_blocks`` blocks, of which block 0 is the reserved null block.

    A fresh pool hands out ids 1, 2, 3, ... in order.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs the null block and one more, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # block_id -> Block; insertion order is eviction order (head first).
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        # The prefix cache: held blocks and free ones not yet evicted.
        self._cached: dict[CacheKey, Block] = {}

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, in use or not."""
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free block ids in allocation order (head first); for tests and debugging."""
        return list(self._free)

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the head of the free queue, each with ``ref_cnt`` 1."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self.evict(block)  # its old contents are about to be overwritten
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def evict(self, block: Block) -> None:
        """Drop ``block`` from the prefix cache (a no-op if it is not cached)."""
        if block.cache_key is not None:
            if self._cached.get(block.cache_key) is block:
                del self._cached[block.cache_key]
            block.cache_key = None

    def get_cached_block(self, key: CacheKey) -> Block | None:
        """The block cached under ``key``, if it has not been evicted."""
        return self._cached.get(key)

    def cache_block(self, block: Block, key: CacheKey) -> bool:
        """Enter a full, computed block into the prefix cache under ``key``.

        Returns False, changing nothing, when another block already holds ``key`` (two requests
        computed the same prefix in one step: the first one cached stays the shared copy) or the
        block is already cached.
        """
        if block.is_null or block.ref_cnt <= 0:
            raise ValueError(f"only a block in use can be cached, not block {block.block_id}")
        if block.cache_key is not None or key in self._cached:
            return False
        block.cache_key = key
        self._cached[key] = block
        return True

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add one reference to each block (sharing); a free block leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, given in sequence order.

        They are released in reverse so that the tail of a sequence, the part least likely to be
        shared as a prefix, sits nearer the head of the queue and is reused first.
        """
        for block in reversed(list(blocks)):
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

"""Block tables of every request, one manager per KV cache group, all over one ``BlockPool``.

A manager knows one attention kind (from its group's spec): which blocks a request needs for its
next tokens and which it can give back. ``KVCacheManager`` makes allocation all-or-nothing across
groups, so a request either gets room in every group or in none.
"""

from __future__ import annotations

from fastforward.kv.block_pool import Block, BlockPool
from fastforward.kv.spec import FullAttentionSpec, KVCacheConfig, KVSpec, SlidingWindowSpec
from fastforward.request import Request


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group: ``request_id -> [Block]``, entry ``i`` covering token
    positions ``[i * block_size, (i + 1) * block_size)`` (the null block where nothing is kept)."""

    def __init__(self, spec: KVSpec, pool: BlockPool) -> None:
        self.spec = spec
        self.pool = pool
        self.req_to_blocks: dict[str, list[Block]] = {}

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back blocks no future query can attend to. Full attention keeps everything."""

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int) -> int:
        """New blocks needed so the table covers ``num_tokens`` tokens."""
        have = len(self.req_to_blocks.get(request_id, ()))
        return max(0, self.spec.blocks_for(num_tokens) - have)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> None:
        n = self.num_blocks_to_allocate(request_id, num_tokens)
        self.req_to_blocks.setdefault(request_id, []).extend(self.pool.allocate(n))

    def free(self, request_id: str) -> None:
        self.pool.free(self.req_to_blocks.pop(request_id, []))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def blocks_for_fresh(self, num_tokens: int) -> int:
        """Blocks a request holding none needs to cover ``num_tokens`` tokens in one step."""
        return self.spec.blocks_for(num_tokens)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Causal attention over the whole history: a block is kept until the request ends."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Attention over the last ``sliding_window`` tokens: blocks wholly behind the window of the
    next query are swapped for the null block and given back to the pool."""

    def __init__(self, spec: KVSpec, pool: BlockPool) -> None:
        if not isinstance(spec, SlidingWindowSpec) or spec.sliding_window < 1:
            raise ValueError(f"SlidingWindowManager needs a sliding_window >= 1, got {spec}")
        super().__init__(spec, pool)
        self.sliding_window = spec.sliding_window

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        # The next query sits at position num_computed_tokens; the earliest key it sees:
        first_visible = num_computed_tokens - self.sliding_window + 1
        num_skipped = max(0, first_visible) // self.spec.block_size
        removed = []
        # Walk back from the last skipped block; earlier ones were nulled on an earlier step.
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            blocks[i] = self.pool.null_block
        self.pool.free(reversed(removed))


# Spec class -> manager class. A new kind of cache registers a manager here instead of adding a
# branch; lookup walks the spec's MRO, so a subclass of a spec inherits its manager.
MANAGER_REGISTRY: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def manager_class_for(spec: KVSpec) -> type[SingleTypeKVCacheManager]:
    for cls in type(spec).__mro__:
        if cls in MANAGER_REGISTRY:
            return MANAGER_REGISTRY[cls]
    raise TypeError(f"no KV cache manager registered for {type(spec).__name__}")


class KVCacheManager:
    """Block tables of every request in every KV cache group, drawn from one shared pool.

    The scheduler talks only to this class: ``allocate_slots`` before a step, ``free`` when a
    request finishes or is preempted, ``get_block_ids`` for the runner's block tables.
    """

    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks)
        self.managers = [manager_class_for(g.spec)(g.spec, self.pool) for g in config.groups]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for tokens ``[0, num_computed_tokens + num_new_tokens)`` in every group.

        Blocks behind a sliding window are given back first (they are dead whatever happens).
        Returns False, allocating nothing, if the pool cannot cover every group.
        """
        rid = request.request_id
        for m in self.managers:
            m.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_tokens = request.num_computed_tokens + num_new_tokens
        needed = sum(m.num_blocks_to_allocate(rid, num_tokens) for m in self.managers)
        if needed > self.pool.num_free_blocks:
            return False
        for m in self.managers:
            m.allocate_new_blocks(rid, num_tokens)
        return True

    def free(self, request: Request) -> None:
        """Give back every block of ``request``; a no-op for a request holding none."""
        for m in self.managers:
            m.free(request.request_id)

    def get_block_ids(self, request: Request) -> tuple[list[int], ...]:
        """One block table per group (fresh lists, safe to keep)."""
        return tuple(m.block_ids(request.request_id) for m in self.managers)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request holding none needs to cover ``num_tokens`` tokens in one step.

        This is also the most any request of ``num_tokens`` tokens holds at once (a sliding
        window only ever holds fewer), so admission control can rely on it.
        """
        return sum(m.blocks_for_fresh(num_tokens) for m in self.managers)

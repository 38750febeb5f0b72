"""Block tables of every request, one manager per KV cache group, all over one ``BlockPool``.

A manager knows one attention kind (from its group's spec): which blocks a request needs for its
next tokens, which it can give back, and which cached blocks a new request can start from.
``KVCacheManager`` makes allocation all-or-nothing across groups, so a request either gets room in
every group or in none, and finds one prefix-cache hit length that is valid for every group.

Prefix caching: a block enters the cache (``BlockPool.cache_block``) only after the step that
fills it has run (``cache_blocks``, called from ``Scheduler.update``), so no request ever reads a
block that is still being written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastforward.kv.block_hash import BlockHash, extend_block_hashes
from fastforward.kv.block_pool import Block, BlockPool
from fastforward.kv.spec import FullAttentionSpec, KVCacheConfig, KVSpec, SlidingWindowSpec
from fastforward.request import Request


@dataclass(slots=True)
class CacheHit:
    """The longest cached prefix of a request: ``num_tokens`` tokens (whole blocks), and per
    group the blocks that start its block table (the null block where a sliding window needs no
    KV)."""

    blocks: tuple[list[Block], ...]
    num_tokens: int = 0


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group: ``request_id -> [Block]``, entry ``i`` covering token
    positions ``[i * block_size, (i + 1) * block_size)`` (the null block where nothing is kept)."""

    def __init__(self, spec: KVSpec, pool: BlockPool, group_id: int = 0) -> None:
        self.spec = spec
        self.pool = pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[Block]] = {}
        # Leading table entries already looked at by cache_full_blocks (cached, a hit or null).
        self.num_cached: dict[str, int] = {}

    def find_cache_hit(self, hashes: Sequence[BlockHash]) -> list[Block]:
        """The longest usable prefix of ``hashes`` as table entries; every query attends to
        every earlier token here, so that is the run of cached blocks from block 0."""
        hit = []
        for h in hashes:
            block = self.pool.get_cached_block((self.group_id, h))
            if block is None:
                break
            hit.append(block)
        return hit

    def add_hit(self, request_id: str, blocks: list[Block]) -> None:
        """Start the table of a request holding nothing with a hit (one more user each)."""
        if self.req_to_blocks.get(request_id):
            raise RuntimeError(f"request {request_id!r} already holds blocks")
        self.pool.touch(blocks)
        self.req_to_blocks[request_id] = list(blocks)
        self.num_cached[request_id] = len(blocks)

    def cache_full_blocks(self, request_id: str, hashes: Sequence[BlockHash]) -> None:
        """Enter the request's blocks ``0 .. len(hashes) - 1`` (full and computed) into the
        prefix cache, each under its hash. A block already cached or null is left alone."""
        blocks = self.req_to_blocks.get(request_id, ())
        end = min(len(hashes), len(blocks))
        for i in range(self.num_cached.get(request_id, 0), end):
            if not blocks[i].is_null:
                self.pool.cache_block(blocks[i], (self.group_id, hashes[i]))
        self.num_cached[request_id] = max(end, self.num_cached.get(request_id, 0))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back blocks no future query can attend to. Full attention keeps everything."""

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, num_hit: int = 0) -> int:
        """New blocks needed so the table covers ``num_tokens`` tokens, ``num_hit`` of which
        come from a cache hit not yet in the table."""
        have = len(self.req_to_blocks.get(request_id, ())) + num_hit
        return max(0, self.spec.blocks_for(num_tokens) - have)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> None:
        n = self.num_blocks_to_allocate(request_id, num_tokens)
        self.req_to_blocks.setdefault(request_id, []).extend(self.pool.allocate(n))

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past those covering ``num_tokens`` tokens (slots reserved
        for draft tokens that were rejected; never cached, since they were never computed)."""
        blocks = self.req_to_blocks.get(request_id)
        keep = self.spec.blocks_for(num_tokens)
        if blocks and len(blocks) > keep:
            self.pool.free(blocks[keep:])
            del blocks[keep:]

    def free(self, request_id: str) -> None:
        self.num_cached.pop(request_id, None)
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

    def __init__(self, spec: KVSpec, pool: BlockPool, group_id: int = 0) -> None:
        if not isinstance(spec, SlidingWindowSpec) or spec.sliding_window < 1:
            raise ValueError(f"SlidingWindowManager needs a sliding_window >= 1, got {spec}")
        super().__init__(spec, pool, group_id)
        self.sliding_window = spec.sliding_window
        # A query at a block boundary k * block_size sees the keys of the blocks before it from
        # (k * block_size - window + 1) // block_size on: always the last `window_blocks`.
        self.window_blocks = -(-(self.sliding_window - 1) // spec.block_size)

    def find_cache_hit(self, hashes: Sequence[BlockHash]) -> list[Block]:
        """The longest prefix whose last ``window_blocks`` blocks are cached; the blocks before
        them are null (no query from the hit on attends to them)."""
        null = self.pool.null_block
        if self.window_blocks == 0:
            return [null] * len(hashes)
        run: list[Block] = []  # cached blocks right to left, ending where the scan is
        for i in range(len(hashes) - 1, -1, -1):
            block = self.pool.get_cached_block((self.group_id, hashes[i]))
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == self.window_blocks:
                return [null] * i + run[::-1]
        # A run starting at block 0 shorter than the window: the window reaches back to token 0.
        return run[::-1]

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
    """Block tables of every request in every KV cache group, drawn from one shared pool, and
    the prefix cache over them.

    The scheduler talks only to this class: ``find_cached_prefix`` and ``allocate_slots`` before
    a step, ``cache_blocks`` after it, ``free`` when a request finishes or is preempted,
    ``get_block_ids`` for the runner's block tables.

    ``extra_key`` goes into every block hash: anything besides the tokens that changes the KV
    (model, dtype, KV cache dtype). With ``enable_caching=False`` no block is ever shared.
    """

    def __init__(
        self, config: KVCacheConfig, *, enable_caching: bool = True, extra_key: str | bytes = b""
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks)
        self.managers = [
            manager_class_for(g.spec)(g.spec, self.pool, i) for i, g in enumerate(config.groups)
        ]
        self.enable_caching = enable_caching
        self.extra_key = extra_key.encode() if isinstance(extra_key, str) else extra_key
        self._hashes: dict[str, list[BlockHash]] = {}  # request id -> its full blocks' hashes
        # Hashes of blocks that the step being scheduled fills (see waits_for_pending).
        self._pending: set[BlockHash] = set()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    # ---- prefix cache ------------------------------------------------------------------------

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first ``num_blocks`` full blocks (fewer if its tokens do
        not fill that many), computed once per request and extended as it grows."""
        hashes = self._hashes.setdefault(request.request_id, [])
        extend_block_hashes(
            hashes, request.all_token_ids, self.block_size, num_blocks, self.extra_key
        )
        # The memo may already reach further (a lookup covers all but the last token), but
        # callers must see only the blocks they asked about: caching the rest would cache
        # blocks not yet computed.
        return hashes[:num_blocks]

    def find_cached_prefix(self, request: Request) -> CacheHit:
        """The longest prefix of a request holding no blocks that every group has cached.

        At least the last token is left to compute: its logits pick the next token. Groups
        disagree when a sliding window lost blocks a full-attention group kept, so the length
        shrinks to what every group can serve until they all agree (each group returns its
        longest hit no longer than the current length, so this ends).
        """
        no_hit = CacheHit(tuple([] for _ in self.managers))
        if not self.enable_caching or request.needs_prompt_logprobs:
            return no_hit
        hashes = self.block_hashes(request, (request.num_tokens - 1) // self.block_size)
        num_blocks = len(hashes)
        while num_blocks:
            hits = [m.find_cache_hit(hashes[:num_blocks]) for m in self.managers]
            shortest = min(len(h) for h in hits)
            if shortest == num_blocks:
                return CacheHit(tuple(hits), num_blocks * self.block_size)
            num_blocks = shortest
        return no_hit

    def waits_for_pending(self, request: Request, hit: CacheHit) -> bool:
        """True when the block right after ``hit`` is being filled by this step (another
        request computing the same prefix, e.g. a sibling of ``n > 1``): waiting one step turns
        it into a hit instead of computing it twice."""
        hashes = self._hashes.get(request.request_id, ())
        k = hit.num_tokens // self.block_size
        return k < len(hashes) and hashes[k] in self._pending

    def begin_step(self) -> None:
        """Forget the blocks the previous step was filling (they are cached or dropped now)."""
        self._pending.clear()

    def cache_blocks(self, request: Request) -> None:
        """Enter the request's full blocks below ``num_computed_tokens`` into the prefix cache;
        called once the step that computed them has run."""
        if not self.enable_caching:
            return
        hashes = self.block_hashes(request, request.num_computed_tokens // self.block_size)
        for m in self.managers:
            m.cache_full_blocks(request.request_id, hashes)

    # ---- allocation -------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit: CacheHit | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` tokens after the computed ones in every group.

        ``hit`` (for a request holding no blocks) is taken as already computed: its blocks
        start the tables and the new tokens follow it. Blocks behind a sliding window are given
        back first (they are dead whatever happens). Returns False, changing nothing else, if
        the pool cannot cover every group.
        """
        rid = request.request_id
        for m in self.managers:
            m.remove_skipped_blocks(rid, request.num_computed_tokens)
        hit = hit or CacheHit(tuple([] for _ in self.managers))
        start = request.num_computed_tokens + hit.num_tokens
        num_tokens = start + num_new_tokens
        needed = sum(
            m.num_blocks_to_allocate(rid, num_tokens, len(blocks))
            for m, blocks in zip(self.managers, hit.blocks, strict=True)
        )
        # A hit on a cached block nobody holds takes it out of the free queue.
        needed += sum(
            1 for blocks in hit.blocks for b in blocks if b.ref_cnt == 0 and not b.is_null
        )
        if needed > self.pool.num_free_blocks:
            return False
        # Hits first: allocating could otherwise evict a hit block from the free queue.
        for m, blocks in zip(self.managers, hit.blocks, strict=True):
            if blocks:
                m.add_hit(rid, blocks)
        for m in self.managers:
            m.allocate_new_blocks(rid, num_tokens)
        if self.enable_caching:
            hashes = self.block_hashes(request, num_tokens // self.block_size)
            self._pending.update(hashes[start // self.block_size :])
        return True

    def free(self, request: Request) -> None:
        """Give back every block of ``request``; a no-op for a request holding none.

        Computed full blocks stay in the prefix cache until the pool needs them, so a request
        preempted here finds its own blocks again when it is readmitted.
        """
        self._hashes.pop(request.request_id, None)
        for m in self.managers:
            m.free(request.request_id)

    def trim(self, request: Request) -> None:
        """Keep only the blocks the request's known tokens need (its next step computes the
        last of them); the rest held slots for rejected draft tokens."""
        for m in self.managers:
            m.trim(request.request_id, request.num_tokens)

    def get_block_ids(self, request: Request) -> tuple[list[int], ...]:
        """One block table per group (fresh lists, safe to keep)."""
        return tuple(m.block_ids(request.request_id) for m in self.managers)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request holding none needs to cover ``num_tokens`` tokens in one step.

        This is also the most any request of ``num_tokens`` tokens holds at once (a sliding
        window only ever holds fewer), so admission control can rely on it.
        """
        return sum(m.blocks_for_fresh(num_tokens) for m in self.managers)

"""Exact, model-free tests of the per-attention-kind managers and the KV cache manager."""

from dataclasses import dataclass

import pytest
import torch

from fastforward.kv.manager import (
    MANAGER_REGISTRY,
    FullAttentionManager,
    KVCacheManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from fastforward.kv.spec import FullAttentionSpec, SlidingWindowSpec, make_kv_cache_config
from fastforward.request import Request
from fastforward.sampling_params import SamplingParams

BS = 4


def full(block_size=BS):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_dim=8, dtype=torch.float32)


def sliding(window, block_size=BS):
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.float32,
        sliding_window=window,
    )


def manager(specs, num_blocks):
    return KVCacheManager(make_kv_cache_config(specs, num_blocks=num_blocks))


def req(rid, num_tokens):
    return Request(rid, list(range(num_tokens)), SamplingParams())


def gemma_like_specs(num_layers=12, window=8):
    """Gemma 3's pattern: five sliding-window layers, then one global layer."""
    return [full() if (i + 1) % 6 == 0 else sliding(window) for i in range(num_layers)]


# ---- full attention --------------------------------------------------------------------------


def test_full_attention_allocates_per_block_boundary():
    kv = manager([full()], num_blocks=10)
    r = req("a", 10)
    assert kv.allocate_slots(r, 10)
    assert kv.get_block_ids(r) == ([1, 2, 3],)
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2)  # 12 tokens still fit 3 blocks
    assert kv.get_block_ids(r) == ([1, 2, 3],)
    r.num_computed_tokens = 12
    assert kv.allocate_slots(r, 1)
    assert kv.get_block_ids(r) == ([1, 2, 3, 4],)
    assert kv.num_free_blocks == 5


def test_interleaved_requests_and_free_give_exact_ids():
    kv = manager([full()], num_blocks=8)  # 7 usable
    a, b = req("a", 8), req("b", 5)
    assert kv.allocate_slots(a, 8)  # 1 2
    assert kv.allocate_slots(b, 5)  # 3 4
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 1)  # 5
    assert kv.get_block_ids(a) == ([1, 2, 5],)
    assert kv.get_block_ids(b) == ([3, 4],)
    kv.free(a)  # queue: 6 7 | 5 2 1
    c = req("c", 16)
    assert kv.allocate_slots(c, 16)
    assert kv.get_block_ids(c) == ([6, 7, 5, 2],)
    assert kv.get_block_ids(a) == ([],)
    kv.free(b)
    kv.free(c)
    assert kv.num_free_blocks == 7
    assert kv.usage == 0.0


def test_allocation_is_all_or_nothing_across_groups():
    kv = manager([full(), sliding(100)], num_blocks=6)  # 5 usable, 2 groups
    a = req("a", 8)
    assert kv.allocate_slots(a, 8)  # 2 + 2 blocks
    assert kv.get_block_ids(a) == ([1, 2], [3, 4])
    b = req("b", 5)
    assert not kv.allocate_slots(b, 5)  # needs 2 + 2, one free
    assert kv.get_block_ids(b) == ([], [])
    assert kv.num_free_blocks == 1
    kv.free(a)  # queue: 5 | 2 1 | 4 3
    assert kv.allocate_slots(b, 5)
    assert kv.get_block_ids(b) == ([5, 2], [1, 4])


def test_allocation_is_all_or_nothing_needs_every_group():
    kv = manager([full(), sliding(100)], num_blocks=6)
    a = req("a", 8)
    assert kv.allocate_slots(a, 8)
    b = req("b", 4)
    assert not kv.allocate_slots(b, 4)  # one block per group, only one free
    assert kv.get_block_ids(b) == ([], [])
    assert kv.num_free_blocks == 1


def test_free_of_unknown_request_is_a_noop():
    kv = manager([full()], num_blocks=4)
    kv.free(req("nobody", 3))
    assert kv.num_free_blocks == 3


def test_num_blocks_needed_sums_groups():
    kv = manager([full(), sliding(4)], num_blocks=20)
    assert kv.num_blocks_needed(1) == 2
    assert kv.num_blocks_needed(4) == 2
    assert kv.num_blocks_needed(9) == 6


# ---- sliding window --------------------------------------------------------------------------


def test_sliding_window_nulls_blocks_behind_the_window():
    kv = manager([sliding(4)], num_blocks=10)  # window 4, block size 4
    r = req("a", 10)
    assert kv.allocate_slots(r, 10)
    assert kv.get_block_ids(r) == ([1, 2, 3],)
    # Next query at 10 sees keys 7..10: block 0 (0-3) is dead, block 1 (4-7) still needed.
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 1)
    assert kv.get_block_ids(r) == ([0, 2, 3],)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 1]
    # Query at 11 sees 8..11: block 1 (4-7) is dead.
    r.num_computed_tokens = 11
    assert kv.allocate_slots(r, 1)
    assert kv.get_block_ids(r) == ([0, 0, 3],)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 1, 2]
    # Query at 12 sees 9..12: needs a new block for position 12, block 2 (8-11) still needed.
    r.num_computed_tokens = 12
    assert kv.allocate_slots(r, 1)
    assert kv.get_block_ids(r) == ([0, 0, 3, 4],)
    kv.free(r)
    assert kv.num_free_blocks == 9


def test_sliding_window_release_as_num_computed_advances():
    # Window 6, block size 4: at query position p the table keeps blocks from (p - 5) // 4 on.
    kv = manager([sliding(6)], num_blocks=40)
    r = req("a", 1)
    released = []
    for p in range(0, 40):
        r.num_computed_tokens = p
        free_before = set(kv.pool.free_block_ids())
        assert kv.allocate_slots(r, 1)
        table = kv.get_block_ids(r)[0]
        first_live = max(0, p - 5) // 4
        assert table[:first_live] == [0] * first_live
        assert 0 not in table[first_live:]
        assert len(table) == p // 4 + 1
        released += sorted(set(kv.pool.free_block_ids()) - free_before)
    # Block i (positions 4i..4i+3) dies when p - 5 >= 4i + 4, i.e. at p = 4i + 9.
    assert released == list(range(1, 9))  # blocks 1..8 = table entries 0..7, in order
    assert kv.num_free_blocks == 39 - 2


def test_sliding_window_prefill_holds_whole_chunk_then_releases():
    kv = manager([sliding(4)], num_blocks=10)
    r = req("a", 17)
    assert kv.allocate_slots(r, 17)  # keys of the whole chunk are written: 5 blocks
    assert kv.get_block_ids(r) == ([1, 2, 3, 4, 5],)
    r.num_computed_tokens = 17  # query at 17 sees 14..17: blocks 0-2 are dead
    assert kv.allocate_slots(r, 1)
    assert kv.get_block_ids(r) == ([0, 0, 0, 4, 5],)
    assert kv.pool.free_block_ids() == [6, 7, 8, 9, 3, 2, 1]


def test_sliding_window_release_makes_room_before_checking_free_blocks():
    kv = manager([sliding(4)], num_blocks=4)  # 3 usable
    r = req("a", 12)
    assert kv.allocate_slots(r, 12)
    assert kv.num_free_blocks == 0
    # Query at 12 sees 9..12: blocks 0 and 1 die first, which makes room for block 3.
    r.num_computed_tokens = 12
    assert kv.allocate_slots(r, 1)
    assert kv.get_block_ids(r) == ([0, 0, 3, 2],)


def test_sliding_window_manager_rejects_a_spec_without_window():
    with pytest.raises(ValueError):
        manager([sliding(0)], num_blocks=4)


# ---- hybrid: Gemma-3-like -------------------------------------------------------------------


def test_gemma_like_config_groups_and_one_pool():
    specs = gemma_like_specs(num_layers=12, window=8)
    config = make_kv_cache_config(specs, num_blocks=64)
    kv = KVCacheManager(config)
    assert len(config.groups) == 6  # 5 sliding groups of 2 layers + 1 full group of 2
    kinds = [type(m) for m in kv.managers]
    assert kinds == [SlidingWindowManager] * 5 + [FullAttentionManager]
    assert config.groups[5].layer_indices == (5, 11)
    r = req("a", 9)
    assert kv.allocate_slots(r, 9)  # 3 blocks in each of 6 groups, one pool
    assert kv.get_block_ids(r) == tuple(list(range(3 * g + 1, 3 * g + 4)) for g in range(6))
    assert kv.num_blocks_needed(9) == 18
    assert kv.num_free_blocks == 63 - 18


def test_gemma_like_release_is_kept_when_allocation_fails():
    kv = manager(gemma_like_specs(num_layers=6, window=4), num_blocks=13)  # 6 groups, 12 usable
    a = req("a", 8)
    assert kv.allocate_slots(a, 8)  # 2 blocks x 6 groups: every usable block
    assert kv.num_free_blocks == 0
    a.num_computed_tokens = 8  # query at 8 sees 5..8: block 0 dies in each sliding group
    assert not kv.allocate_slots(a, 1)  # 5 released, 6 needed (one per group)
    # The dead blocks stay released (no query can use them again); nothing was allocated.
    assert kv.get_block_ids(a) == ([0, 2], [0, 4], [0, 6], [0, 8], [0, 10], [11, 12])
    assert kv.pool.free_block_ids() == [1, 3, 5, 7, 9]


def test_gemma_like_all_or_nothing_after_release():
    kv = manager(gemma_like_specs(num_layers=6, window=4), num_blocks=14)  # 13 usable
    a = req("a", 8)
    assert kv.allocate_slots(a, 8)  # ids 1..12
    assert kv.num_free_blocks == 1
    a.num_computed_tokens = 8
    # Query at 8 sees 5..8: each sliding group releases its block 0 (ids 1, 3, 5, 7, 9),
    # then every group needs a block for position 8: 6 needed, 1 + 5 free.
    assert kv.allocate_slots(a, 1)
    tables = kv.get_block_ids(a)
    assert tables[:5] == ([0, 2, 13], [0, 4, 1], [0, 6, 3], [0, 8, 5], [0, 10, 7])
    assert tables[5] == [11, 12, 9]  # the full group keeps everything, gets a sliding block
    assert kv.num_free_blocks == 0
    kv.free(a)
    assert kv.num_free_blocks == 13


# ---- registry --------------------------------------------------------------------------------


def test_registry_picks_manager_by_spec_class(monkeypatch):
    @dataclass(frozen=True, slots=True)
    class LatentSpec(FullAttentionSpec):
        pass

    class LatentManager(SingleTypeKVCacheManager):
        pass

    # A subclass without its own manager inherits its parent's.
    kv = manager([LatentSpec(BS, 1, 8, torch.float32)], num_blocks=4)
    assert type(kv.managers[0]) is FullAttentionManager
    monkeypatch.setitem(MANAGER_REGISTRY, LatentSpec, LatentManager)
    kv = manager([LatentSpec(BS, 1, 8, torch.float32)], num_blocks=4)
    assert type(kv.managers[0]) is LatentManager

"""Exact, model-free tests of the block pool: ids, ref counts, free-queue order."""

import pytest

from fastforward.kv.block_pool import NULL_BLOCK_ID, BlockPool, OutOfBlocksError


def ids(blocks):
    return [b.block_id for b in blocks]


def test_fresh_pool_hands_out_ids_in_order_and_never_the_null_block():
    pool = BlockPool(6)
    assert pool.num_usable_blocks == 5
    assert pool.num_free_blocks == 5
    assert ids(pool.allocate(2)) == [1, 2]
    assert ids(pool.allocate(3)) == [3, 4, 5]
    assert pool.num_free_blocks == 0
    assert pool.null_block.block_id == NULL_BLOCK_ID
    assert pool.null_block.is_null


def test_allocate_sets_ref_count_one():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert ids(pool.allocate(1)) == [3]


def test_free_goes_to_tail_in_reverse_sequence_order():
    pool = BlockPool(8)
    a = pool.allocate(3)  # 1 2 3
    b = pool.allocate(2)  # 4 5
    pool.free(a)
    # Untouched blocks first, then a's blocks tail first.
    assert pool.free_block_ids() == [6, 7, 3, 2, 1]
    pool.free(b)
    assert pool.free_block_ids() == [6, 7, 3, 2, 1, 5, 4]
    assert ids(pool.allocate(4)) == [6, 7, 3, 2]
    assert ids(pool.allocate(3)) == [1, 5, 4]


def test_freed_block_ref_count_is_zero():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.free(blocks)
    assert [b.ref_cnt for b in blocks] == [0, 0]


def test_shared_block_returns_only_after_last_reference():
    pool = BlockPool(4)
    blocks = pool.allocate(2)  # 1 2
    pool.touch(blocks[:1])
    assert [b.ref_cnt for b in blocks] == [2, 1]
    pool.free(blocks)
    assert pool.free_block_ids() == [3, 2]
    assert blocks[0].ref_cnt == 1
    pool.free(blocks[:1])
    assert pool.free_block_ids() == [3, 2, 1]


def test_touch_of_a_free_block_takes_it_out_of_the_queue():
    # What prefix caching does on a hit on a block that sits in the LRU queue.
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    pool.free(blocks)
    assert pool.free_block_ids() == [4, 3, 2, 1]
    pool.touch([blocks[1]])  # block 2
    assert blocks[1].ref_cnt == 1
    assert pool.free_block_ids() == [4, 3, 1]
    assert ids(pool.allocate(3)) == [4, 3, 1]


def test_null_block_is_ignored_by_free_and_touch():
    pool = BlockPool(3)
    blocks = pool.allocate(1)
    pool.free([pool.null_block, *blocks, pool.null_block])
    pool.touch([pool.null_block])
    assert pool.free_block_ids() == [2, 1]
    assert pool.null_block.ref_cnt == 0


def test_double_free_raises():
    pool = BlockPool(3)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.free(blocks)


def test_allocate_evicts_a_cached_block():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    key = (0, b"h" * 32)
    assert pool.cache_block(block, key)
    pool.free([block])
    # Kept while free: prefix caching may still hit it.
    assert block.cache_key == key and pool.get_cached_block(key) is block
    assert pool.allocate(1)[0] is block
    assert block.cache_key is None and pool.get_cached_block(key) is None
    assert pool.num_cached_blocks == 0


def test_usage():
    pool = BlockPool(5)
    assert pool.usage == 0.0
    blocks = pool.allocate(3)
    assert pool.usage == pytest.approx(0.75)
    pool.free(blocks)
    assert pool.usage == 0.0


def test_pool_needs_a_usable_block():
    with pytest.raises(ValueError):
        BlockPool(1)

"""Prefix caching, model-free: exact block ids, ref counts, LRU eviction, hash chains, sliding
windows, preemption, and a randomized simulation that checks the (fake) KV every request reads
is the KV of its own tokens."""

import math
import random

import pytest
import torch

from fastforward.config import SchedulerConfig
from fastforward.kv.block_hash import extend_block_hashes, hash_block_tokens
from fastforward.kv.manager import KVCacheManager, SlidingWindowManager
from fastforward.kv.spec import FullAttentionSpec, SlidingWindowSpec, make_kv_cache_config
from fastforward.request import Request, RequestStatus
from fastforward.sampling_params import SamplingParams
from fastforward.scheduler import Scheduler

BS = 4
TOKEN = 7


def full(block_size=BS):
    return FullAttentionSpec(block_size, 1, 8, torch.float32)


def sliding(window, block_size=BS):
    return SlidingWindowSpec(block_size, 1, 8, torch.float32, sliding_window=window)


def manager(specs=None, num_blocks=16, **kwargs):
    return KVCacheManager(make_kv_cache_config(specs or [full()], num_blocks=num_blocks), **kwargs)


def req(rid, tokens, max_tokens=16):
    return Request(rid, list(tokens), SamplingParams(), max_tokens=max_tokens)


def compute(kv, r, n=None):
    """Admit ``r`` with its cache hit and "compute" ``n`` tokens (default: the rest of the
    prompt), as the scheduler and runner would. Returns the hit length."""
    hit = kv.find_cached_prefix(r)
    n = r.num_tokens - hit.num_tokens if n is None else n
    assert kv.allocate_slots(r, n, hit)
    r.num_computed_tokens = hit.num_tokens + n
    kv.cache_blocks(r)
    return hit.num_tokens


def ref_cnts(kv, ids):
    return [kv.pool.blocks[i].ref_cnt for i in ids]


def assert_pool_full(kv):
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


# ---- block hashes ----------------------------------------------------------------------------


def test_hash_chain_depends_on_all_previous_tokens_and_the_extra_key():
    tokens = list(range(12))
    chain = extend_block_hashes([], tokens, BS, 10)
    assert len(chain) == 3
    assert chain[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert chain[2] == hash_block_tokens(chain[1], [8, 9, 10, 11])
    # Same last block, different earlier token: every later hash changes.
    other = extend_block_hashes([], [0, 99, *tokens[2:]], BS, 10)
    assert other[0] != chain[0] and other[1] != chain[1] and other[2] != chain[2]
    # Same tokens, another model/dtype: nothing is shared.
    keyed = extend_block_hashes([], tokens, BS, 10, b"model=x|dtype=bf16")
    assert all(a != b for a, b in zip(chain, keyed, strict=True))
    # Same everything: same hashes; a partial block has none.
    assert extend_block_hashes([], tokens + [5, 6], BS, 10) == chain
    assert extend_block_hashes([], tokens, BS, 2) == chain[:2]


def test_extra_key_separates_caches():
    a = manager(extra_key="model=a")
    b = manager(extra_key="model=b")
    for kv in (a, b):
        compute(kv, req("x", range(9)))
    assert a.find_cached_prefix(req("y", range(9))).num_tokens == 8
    hashes_a = a.block_hashes(req("z", range(9)), 2)
    hashes_b = b.block_hashes(req("z", range(9)), 2)
    assert hashes_a != hashes_b


# ---- sharing, partial blocks, ref counts -----------------------------------------------------


def test_shared_prefix_reuses_full_blocks_and_computes_the_rest():
    kv = manager(num_blocks=16)
    a = req("a", range(10))  # blocks [0-3] [4-7] [8-9 partial]
    assert compute(kv, a) == 0
    assert kv.get_block_ids(a) == ([1, 2, 3],)
    b = req("b", [*range(8), 50, 51, 52])
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 8
    assert kv.allocate_slots(b, 3, hit)
    assert kv.get_block_ids(b) == ([1, 2, 4],)
    assert ref_cnts(kv, [1, 2, 3, 4]) == [2, 2, 1, 1]
    kv.free(a)
    kv.free(b)
    assert_pool_full(kv)


def test_partial_block_is_never_shared():
    kv = manager(num_blocks=16)
    a = req("a", range(10))
    compute(kv, a)
    # Same 10 tokens: block 2 holds only 2 tokens, it is not cached, so c writes its own.
    c = req("c", range(10))
    assert compute(kv, c) == 8
    assert kv.get_block_ids(c) == ([1, 2, 4],)
    assert kv.pool.blocks[3].cache_key is None
    assert kv.pool.num_cached_blocks == 2
    # Once a fills block 2 (two decode tokens), it is cached and a later request hits it.
    a.all_token_ids += [10, 11]
    assert kv.allocate_slots(a, 2)
    a.num_computed_tokens = 12
    kv.cache_blocks(a)
    assert compute(kv, req("d", range(13))) == 12


def test_a_chunk_caches_only_the_blocks_it_completed():
    kv = manager(num_blocks=16)
    a = req("a", range(13))
    assert kv.find_cached_prefix(a).num_tokens == 0  # hashes the first 3 blocks
    assert kv.allocate_slots(a, 11)  # chunked prefill: tokens 0-10, block 2 not full
    a.num_computed_tokens = 11
    kv.cache_blocks(a)
    assert kv.pool.num_cached_blocks == 2
    assert kv.find_cached_prefix(req("b", range(13))).num_tokens == 8


def test_the_last_token_is_always_computed():
    kv = manager(num_blocks=16)
    compute(kv, req("a", range(8)))
    b = req("b", range(8))  # both blocks cached, but b needs the logits of token 7
    assert compute(kv, b) == 4
    assert kv.get_block_ids(b) == ([1, 3],)
    assert compute(kv, req("c", range(9))) == 8


def test_a_block_being_written_is_not_a_hit():
    kv = manager(num_blocks=16)
    a = req("a", range(9))
    assert kv.allocate_slots(a, 9, kv.find_cached_prefix(a))  # scheduled, not yet computed
    b = req("b", range(9))
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 0
    assert kv.waits_for_pending(b, hit)  # a fills b's first block in this step
    kv.begin_step()
    assert not kv.waits_for_pending(b, hit)
    a.num_computed_tokens = 9
    kv.cache_blocks(a)
    assert kv.find_cached_prefix(b).num_tokens == 8


def test_hit_on_a_free_cached_block_takes_it_out_of_the_queue():
    kv = manager(num_blocks=8)  # 7 usable
    a = req("a", range(9))
    compute(kv, a)  # 1 2 3
    kv.free(a)  # queue: 4 5 6 7 | 3 2 1 (cached: 1 2)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    b = req("b", range(9))
    hit = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hit.blocks[0]] == [1, 2]
    assert kv.allocate_slots(b, 1, hit)
    assert kv.get_block_ids(b) == ([1, 2, 4],)
    assert ref_cnts(kv, [1, 2, 4]) == [1, 1, 1]
    assert kv.pool.free_block_ids() == [5, 6, 7, 3]
    kv.free(b)
    assert_pool_full(kv)


def test_free_cached_hit_blocks_count_against_free_space():
    kv = manager(num_blocks=6)  # 5 usable
    a = req("a", range(12))
    compute(kv, a)  # 1 2 3, all full and cached
    kv.free(a)  # queue: 4 5 | 3 2 1
    compute(kv, req("o", range(50, 54)))  # takes 4: free are 5 3 2 1
    b = req("b", [*range(8), *range(60, 72)])  # 20 tokens; 1 2 are a hit
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 8
    # 3 new blocks would fit the 4 free ones, but taking the hits out of the queue leaves 2.
    assert not kv.allocate_slots(b, 12, hit)
    assert kv.get_block_ids(b) == ([],)
    assert kv.num_free_blocks == 4 and ref_cnts(kv, [1, 2]) == [0, 0]
    assert kv.allocate_slots(b, 8, hit)  # 2 hits + 2 new: every free block
    assert kv.get_block_ids(b) == ([1, 2, 5, 3],)
    assert kv.num_free_blocks == 0


# ---- eviction ---------------------------------------------------------------------------------


def test_eviction_is_lru_and_drops_the_hash():
    kv = manager(num_blocks=7)  # 6 usable
    a, b = req("a", range(9)), req("b", range(100, 109))
    compute(kv, a)  # 1 2 | 3
    compute(kv, b)  # 4 5 | 6
    kv.free(a)  # queue: 3 2 1
    kv.free(b)  # queue: 3 2 1 6 5 4
    assert kv.pool.free_block_ids() == [3, 2, 1, 6, 5, 4]
    assert kv.pool.num_cached_blocks == 4
    # Touch a's prefix again: its blocks become the most recently used.
    c = req("c", [*range(8), 77])
    compute(kv, c)  # hits 1 2, new block 3
    kv.free(c)  # queue: 6 5 4 3 2 1
    assert kv.pool.free_block_ids() == [6, 5, 4, 3, 2, 1]
    # 3 new blocks: b's, least recently used, go first (6 was never cached, then 5 and 4).
    d = req("d", range(200, 212))
    compute(kv, d)
    assert kv.get_block_ids(d) == ([6, 5, 4],)
    assert kv.find_cached_prefix(req("b2", range(100, 109))).num_tokens == 0
    assert kv.find_cached_prefix(req("a2", range(9))).num_tokens == 8
    assert kv.pool.num_cached_blocks == 2 + 3  # a's two, d's three
    kv.free(d)
    assert_pool_full(kv)


def test_eviction_never_touches_a_block_in_use():
    kv = manager(num_blocks=5)  # 4 usable
    a = req("a", range(9))
    compute(kv, a)  # holds 1 2 3; 1 2 cached
    b = req("b", range(50, 59))
    assert not kv.allocate_slots(b, 9, kv.find_cached_prefix(b))  # needs 3, 1 free
    assert kv.allocate_slots(b, 4, kv.find_cached_prefix(b))
    assert kv.get_block_ids(b) == ([4],)
    assert [kv.pool.blocks[i].cache_key is not None for i in (1, 2)] == [True, True]
    assert kv.find_cached_prefix(req("a2", range(9))).num_tokens == 8
    kv.free(a)
    kv.free(b)
    assert_pool_full(kv)


def test_disabled_caching_shares_nothing():
    kv = manager(num_blocks=16, enable_caching=False)
    compute(kv, req("a", range(9)))
    b = req("b", range(9))
    assert kv.find_cached_prefix(b).num_tokens == 0
    assert compute(kv, b) == 0
    assert kv.get_block_ids(b) == ([4, 5, 6],)
    assert kv.pool.num_cached_blocks == 0


# ---- sliding window ------------------------------------------------------------------------------


def hybrid(num_blocks=40, window=5):
    """One full-attention group and one sliding-window group (window 5: a hit at a block
    boundary needs the last block before it)."""
    return manager([full(), sliding(window)], num_blocks=num_blocks)


def test_sliding_window_hit_needs_only_the_blocks_in_the_window():
    kv = hybrid()
    a = req("a", range(17))
    compute(kv, a)
    assert kv.get_block_ids(a) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert kv.allocate_slots(a, 1)  # decode at 17: the window group drops blocks 0-2
    assert kv.get_block_ids(a) == ([1, 2, 3, 4, 5], [0, 0, 0, 9, 10])
    b = req("b", [*range(16), 99, 98])
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 16
    assert kv.allocate_slots(b, 2, hit)
    # The window group starts from nulls and the one block its next query sees.
    assert kv.get_block_ids(b) == ([1, 2, 3, 4, 11], [0, 0, 0, 9, 12])
    assert ref_cnts(kv, [1, 4, 9, 8]) == [2, 2, 2, 0]
    kv.free(a)
    kv.free(b)
    assert_pool_full(kv)


def test_sliding_window_hit_length_is_one_that_every_group_can_serve():
    kv = hybrid(num_blocks=14)  # 13 usable
    a = req("a", range(17))
    compute(kv, a)  # full: 1 2 3 4 | 5, window: 6 7 8 9 | 10 (| = not full, not cached)
    kv.free(a)  # queue: 11 12 13 | 5 4 3 2 1 | 10 9 8 7 6
    # Ten new blocks evict every cached block of the full group, and the window group's 9.
    filler = req("f", range(500, 540))
    assert kv.allocate_slots(filler, 20)
    assert sorted(sum(kv.get_block_ids(filler), [])) == [1, 2, 3, 4, 5, 9, 10, 11, 12, 13]
    kv.free(filler)
    # The window group could serve a hit at 12 (its block 2, id 8, is cached), the full group
    # none: no hit.
    assert kv.find_cached_prefix(req("b", range(17))).num_tokens == 0

    # The other way round: the full group keeps everything, the window group loses block 3.
    kv = hybrid(num_blocks=40)
    a = req("a", range(17))
    compute(kv, a)  # full: 1-5, window: 6-10
    kv.free(a)
    kv.pool.evict(kv.pool.blocks[9])  # window block 3 (tokens 12-15)
    hit = kv.find_cached_prefix(req("b", range(17)))
    # A hit at 16 needs window block 3; at 12 window block 2 (cached): both groups serve 12.
    assert hit.num_tokens == 12
    assert [[b.block_id for b in blocks] for blocks in hit.blocks] == [[1, 2, 3], [0, 0, 8]]


def test_sliding_window_short_prefix_needs_every_block():
    kv = manager([sliding(9)], num_blocks=20)  # a hit needs the last 2 blocks
    compute(kv, req("a", range(13)))  # window: 1 2 3 | 4
    kv.pool.evict(kv.pool.blocks[1])
    hit = kv.find_cached_prefix(req("b", range(13)))
    assert hit.num_tokens == 12
    assert [b.block_id for b in hit.blocks[0]] == [0, 2, 3]
    kv.pool.evict(kv.pool.blocks[3])
    hit = kv.find_cached_prefix(req("c", range(13)))
    assert hit.num_tokens == 0  # a hit at 8 would need blocks 0 and 1, at 4 block 0
    assert isinstance(kv.managers[0], SlidingWindowManager)


# ---- through the scheduler ---------------------------------------------------------------------


def make_scheduler(*, num_blocks=64, budget=64, max_num_seqs=16, specs=None, caching=True):
    kv = KVCacheManager(
        make_kv_cache_config(specs or [full()], num_blocks=num_blocks), enable_caching=caching
    )
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 256), kv)


def step(sched, token=TOKEN):
    out = sched.schedule()
    plan = [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]
    sched.update(out, {s.request.request_id: token for s in out.scheduled if s.sample})
    return out, plan


def run(sched):
    while sched.has_unfinished_requests():
        step(sched)


def test_scheduler_admits_with_the_hit_and_reports_it():
    sched = make_scheduler()
    a = req("a", range(10), max_tokens=2)
    sched.add_request(a)
    run(sched)
    b = req("b", [*range(8), 40, 41, 42], max_tokens=2)
    sched.add_request(b)
    out, plan = step(sched)
    assert plan == [("b", 3)]
    assert out.scheduled[0].block_ids == ([1, 2, 4],)
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 21)
    run(sched)
    assert_pool_full(sched.kv)


def test_siblings_share_the_prompt():
    # n > 1: the children are requests with the same prompt, added together. The first fills
    # the prompt blocks; the others wait one step and share them.
    sched = make_scheduler()
    kids = [req(f"p#{i}", range(13), max_tokens=3) for i in range(3)]
    for k in kids:
        sched.add_request(k)
    out, plan = step(sched)
    assert plan == [("p#0", 13)]
    out, plan = step(sched)
    assert plan == [("p#0", 1), ("p#1", 1), ("p#2", 1)]
    assert [s.block_ids for s in out.scheduled] == [
        ([1, 2, 3, 4],),
        ([1, 2, 3, 5],),
        ([1, 2, 3, 6],),
    ]
    assert ref_cnts(sched.kv, [1, 2, 3, 4]) == [3, 3, 3, 1]
    assert [k.num_cached_tokens for k in kids] == [0, 12, 12]
    run(sched)
    assert_pool_full(sched.kv)


def test_preempted_request_finds_its_own_blocks_again():
    sched = make_scheduler(num_blocks=7, budget=16)  # 6 usable
    a = req("a", range(100, 108), max_tokens=9)  # grows to 16 cached tokens: 4 blocks
    b = req("b", range(9), max_tokens=6)  # grows to 14: 4 blocks
    sched.add_request(a)
    sched.add_request(b)
    computed = 0
    while not b.num_preemptions:
        computed = b.num_computed_tokens
        step(sched)
    assert b.status == RequestStatus.PREEMPTED and computed == 12  # 3 full cached blocks
    run(sched)
    assert b.num_cached_tokens == 0  # its first admission found nothing
    # a's next block took the one with b's tokens 8-11 (a sequence's tail is freed nearest the
    # head of the queue, so it goes first); b's readmission finds the two before it.
    assert sched.prefix_cache_hits == 8
    assert [r.num_output_tokens for r in (a, b)] == [9, 6]
    assert_pool_full(sched.kv)


def test_preemption_rehit_exact_ids():
    sched = make_scheduler(num_blocks=5, budget=64)  # 4 usable
    a = req("a", range(100, 108), max_tokens=5)  # 8 tokens -> 12 cached at most: 3 blocks
    b = req("b", range(5), max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    out, plan = step(sched)
    assert [s.block_ids for s in out.scheduled] == [([1, 2],), ([3, 4],)]
    out, plan = step(sched)  # a needs block 3 at position 8: b is preempted
    assert out.preempted == [b]
    assert plan == [("a", 1)]
    # b computed tokens 0-4: block [0-3] is cached (id 3), id 4 was partial and is reused.
    assert out.scheduled[0].block_ids == ([1, 2, 4],)
    assert sched.kv.pool.blocks[3].cache_key is not None
    while not a.is_finished:
        out, plan = step(sched)
        assert all(rid == "a" for rid, _ in plan)  # b (6 tokens: 2 blocks) does not fit yet
    out, plan = step(sched)
    assert plan == [("b", 2)]  # tokens 4 and 5 only: block [0-3] is a hit
    assert out.scheduled[0].block_ids[0][0] == 3
    run(sched)
    assert_pool_full(sched.kv)


def test_pool_is_full_again_after_a_shared_workload():
    specs = [full() if (i + 1) % 6 == 0 else sliding(6) for i in range(12)]
    sched = make_scheduler(num_blocks=120, budget=24, specs=specs)
    system = list(range(1000, 1021))
    reqs = [req(f"r{i}", system + [i] * (i % 5), max_tokens=6) for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    run(sched)
    assert all(r.num_output_tokens == 6 for r in reqs)
    assert sum(r.num_cached_tokens for r in reqs) > 0
    assert_pool_full(sched.kv)


def test_on_by_default_and_switches_off():
    from fastforward.engine import EngineArgs
    from fastforward.entrypoints.cli import _engine_args, build_parser

    assert EngineArgs().enable_prefix_caching
    parser = build_parser()
    on = _engine_args(parser.parse_args(["generate", "hi"]))
    off = _engine_args(parser.parse_args(["generate", "hi", "--no-prefix-caching"]))
    assert on.enable_prefix_caching and not off.enable_prefix_caching
    assert KVCacheManager(make_kv_cache_config([full()], num_blocks=4)).enable_caching


# ---- randomized simulation with a fake KV ------------------------------------------------------


class FakeKV:
    """Slot ``block_id * block_size + offset`` holds what a layer of group ``g`` wrote there:
    ``(g, hash of the tokens up to that position)``, since a token's KV depends on them all."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[int, int]] = {}

    @staticmethod
    def content(g: int, request: Request, pos: int) -> tuple[int, int]:
        return (g, hash(tuple(request.all_token_ids[: pos + 1])))

    def check_and_write(self, sched: Scheduler, out) -> None:
        """Every query of the step reads before anything is written: a request must not count
        on KV another request of the same step is writing."""
        bs = self.block_size
        writes = {}
        for s in out.scheduled:
            r = s.request
            for g, (m, table) in enumerate(zip(sched.kv.managers, s.block_ids, strict=True)):
                assert len(table) == math.ceil((s.start + s.num_new_tokens) / bs)
                window = getattr(m, "sliding_window", None)
                first = 0 if window is None else max(0, s.start - window + 1)
                for pos in range(first, s.start):  # what this step's queries read
                    slot = table[pos // bs] * bs + pos % bs
                    assert table[pos // bs] != 0, (r.request_id, g, pos)
                    assert self.slots.get(slot) == self.content(g, r, pos), (r.request_id, pos)
                for pos in range(s.start, s.start + s.num_new_tokens):
                    slot = table[pos // bs] * bs + pos % bs
                    assert slot not in writes, "two requests write one slot"
                    writes[slot] = self.content(g, r, pos)
        self.slots.update(writes)


def random_workload(rng: random.Random) -> list[Request]:
    systems = [[rng.randint(10, 30) for _ in range(rng.randint(0, 20))] for _ in range(3)]
    reqs = []
    for i in range(rng.randint(1, 20)):
        prompt = rng.choice(systems) + [rng.randint(10, 30) for _ in range(rng.randint(1, 8))]
        copies = rng.choice([1, 1, 1, 3])  # n > 1: identical prompts added together
        for c in range(copies):
            reqs.append(req(f"r{i}#{c}", prompt, max_tokens=rng.randint(1, 12)))
    return reqs


def simulate(seed: int, caching: bool) -> tuple[dict[str, list[int]], Scheduler]:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    if rng.random() < 0.5:
        specs = [full(bs)] * 2
    else:
        window = rng.randint(1, 10)
        specs = [full(bs) if (i + 1) % 3 == 0 else sliding(window, bs) for i in range(6)]
    groups = len(make_kv_cache_config(specs, num_blocks=2).groups)
    per_request = groups * math.ceil(40 / bs)
    sched = make_scheduler(
        num_blocks=1 + per_request + rng.randint(0, 2 * per_request),
        budget=rng.randint(4, 32),
        max_num_seqs=rng.randint(1, 8),
        specs=specs,
        caching=caching,
    )
    pending = random_workload(rng)
    everyone = list(pending)
    fake = FakeKV(bs)
    for _ in range(5000):
        while pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        if out.is_empty:
            continue
        fake.check_and_write(sched, out)
        # A deterministic "model": the next token depends on every token so far.
        sampled = {
            s.request.request_id: 10 + hash(tuple(s.request.all_token_ids)) % 7
            for s in out.scheduled
            if s.sample
        }
        sched.update(out, sampled)
    else:
        raise AssertionError("simulation did not finish")
    for r in everyone:
        assert r.num_output_tokens == r.max_tokens
    assert_pool_full(sched.kv)
    return {r.request_id: r.output_token_ids for r in everyone}, sched


@pytest.mark.parametrize("seed", range(30))
def test_randomized_caching_reads_only_its_own_kv(seed):
    with_cache, sched = simulate(seed, caching=True)
    without, _ = simulate(seed, caching=False)
    assert with_cache == without


def test_randomized_simulation_hits_and_preempts():
    runs = [simulate(seed, caching=True)[1] for seed in range(30)]
    assert sum(s.prefix_cache_hits for s in runs) > 0
    assert sum(s.num_preemptions for s in runs) > 0
    assert any(isinstance(m, SlidingWindowManager) for s in runs for m in s.kv.managers)


# ---- real models (slow) ----------------------------------------------------------------------


def _license_paragraphs() -> list[str]:
    """Paragraphs of a real text shipped with Python (its licence)."""
    import sys
    from pathlib import Path

    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    text = (lib / "LICENSE.txt").read_text(errors="replace")
    return [" ".join(p.split()) for p in text.split("\n\n") if len(p) > 300]


def _mixed_workload() -> list[tuple[str, int]]:
    """(prompt, arrival step): two shared "system prompts" with distinct questions, and
    prompts sharing nothing, interleaved."""
    paras = _license_paragraphs()
    systems = [paras[0][:500], paras[3][:280]]  # ~110 and ~100 tokens
    questions = [p[:120] for p in paras[5:15]]
    out = []
    for i, q in enumerate(questions[:8]):
        out.append((systems[i % 2] + "\n\nQuestion: " + q, i // 2))
    for i, p in enumerate(paras[15:17] + questions[8:10]):
        out.append((p[:400], 2 * i + 1))
    return out


def _run_staggered(llm, workload, max_tokens: int) -> dict[str, object]:
    from fastforward import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    results, step_no, pending = {}, 0, list(enumerate(workload))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][1] <= step_no:
            i, (prompt, _) = pending.pop(0)
            engine.add_request(prompt, params, request_id=str(i))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        step_no += 1
    return results


def _assert_pool_free(llm) -> None:
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == llm.engine.kv_config.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


@pytest.mark.slow
def test_smollm2_outputs_identical_with_and_without_caching(smollm2_path):
    from fastforward import LLM

    workload = _mixed_workload()
    runs = {}
    for caching in (True, False):
        # 28 blocks of 16 tokens: far less than the workload needs at once, so it preempts.
        llm = LLM(
            str(smollm2_path),
            dtype="float32",
            max_model_len=256,
            num_kv_blocks=28,
            max_num_batched_tokens=128,
            enable_prefix_caching=caching,
        )
        runs[caching] = _run_staggered(llm, workload, max_tokens=12)
        stats = llm.engine.get_stats()
        assert stats.num_preemptions > 0
        _assert_pool_free(llm)
        if caching:
            assert stats.prefix_cache_hits > 0
            assert 0 < stats.prefix_cache_hit_rate < 1
    on, off = runs[True], runs[False]
    for rid in off:
        assert on[rid].outputs[0].token_ids == off[rid].outputs[0].token_ids, rid
        assert off[rid].num_cached_tokens == 0
    shared = [on[str(i)].num_cached_tokens for i in range(2, 8)]  # not the first of each
    assert all(n >= 64 for n in shared), shared
    assert [on[str(i)].num_cached_tokens for i in range(8, 12)] == [0, 0, 0, 0]


@pytest.mark.slow
def test_gemma3_like_sliding_window_identical_with_and_without_caching(tiny_model_dir):
    from fastforward import LLM, SamplingParams

    directory, _ = tiny_model_dir("gemma3")  # layers: sliding (window 7), full, sliding
    rng = random.Random(0)
    shared = [rng.randint(2, 399) for _ in range(45)]  # far longer than the window
    prompts = [shared + [rng.randint(2, 399) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    prompts += [[rng.randint(2, 399) for _ in range(30)]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = {}
    for caching in (True, False):
        llm = LLM(str(directory), dtype="float32", block_size=4, enable_prefix_caching=caching)
        assert any(isinstance(m, SlidingWindowManager) for m in llm.engine.scheduler.kv.managers)
        first = llm.generate(prompts[:1], params)  # fills the cache with the shared prefix
        outs[caching] = first + llm.generate(prompts[1:], params)
        _assert_pool_free(llm)
    for on, off in zip(outs[True], outs[False], strict=True):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
    # Every later prompt with the shared prefix starts from its 11 full blocks (44 tokens).
    assert [o.num_cached_tokens for o in outs[True]] == [0, 44, 44, 44, 44, 44, 0]


@pytest.mark.slow
def test_second_chat_turn_reuses_the_first(smollm2_path):
    from fastforward import LLM, SamplingParams

    llm = LLM(str(smollm2_path), dtype="float32")
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=24, temperature=0)
    user1 = {"role": "user", "content": "Name three rivers in Europe and one fact about each."}
    first = llm.chat([user1], params)[0]
    reply = first.outputs[0].text
    turn2 = [user1, {"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}]
    second = llm.chat(turn2, params)[0]

    ids2 = tok.encode(tok.apply_chat_template(turn2), add_special_tokens=False)
    assert second.prompt_token_ids == ids2
    # What turn 1 left in the cache: its prompt and every output token but the last.
    kv1 = first.prompt_token_ids + first.outputs[0].token_ids[:-1]
    common = 0
    while common < min(len(kv1), len(ids2)) and kv1[common] == ids2[common]:
        common += 1
    bs = llm.engine.kv_config.block_size
    assert common >= len(first.prompt_token_ids)  # the template renders turn 1 the same way
    assert second.num_cached_tokens > 0
    assert second.num_cached_tokens == min(common, len(ids2) - 1) // bs * bs
    _assert_pool_free(llm)

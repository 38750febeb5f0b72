"""Exact, model-free tests of the scheduler: budgets, chunking, preemption, stops, and a
randomized simulation that checks invariants every step and a full pool at the end."""

import math
import random
from collections import Counter

import pytest
import torch

from fastforward.config import SchedulerConfig
from fastforward.kv.manager import KVCacheManager, SlidingWindowManager
from fastforward.kv.spec import FullAttentionSpec, SlidingWindowSpec, make_kv_cache_config
from fastforward.request import Request, RequestStatus
from fastforward.sampling_params import SamplingParams
from fastforward.scheduler import Scheduler

BS = 4
EOS = 2
TOKEN = 7  # what the fake sampler returns unless told otherwise


def full(block_size=BS):
    return FullAttentionSpec(block_size, 1, 8, torch.float32)


def sliding(window, block_size=BS):
    return SlidingWindowSpec(block_size, 1, 8, torch.float32, sliding_window=window)


def make_scheduler(
    *, num_blocks=64, budget=64, max_num_seqs=16, max_model_len=256, specs=None, caching=True
) -> Scheduler:
    config = make_kv_cache_config(specs or [full()], num_blocks=num_blocks)
    kv = KVCacheManager(config, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), kv)


def make_request(rid, prompt_len, max_tokens=16, *, eos=EOS, **params) -> Request:
    """A fake request whose prompt never contains EOS or TOKEN."""
    prompt = [100 + i for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(**params), eos_token_id=eos, max_tokens=max_tokens)


def step(sched: Scheduler, token=TOKEN):
    """One engine step with a fake model that samples ``token`` for every request."""
    out = sched.schedule()
    plan = [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]
    sampled = {s.request.request_id: token for s in out.scheduled if s.sample}
    sched.update(out, sampled)
    return out, plan, sorted(sampled)


def run_to_completion(sched: Scheduler, token=TOKEN, max_steps=10_000) -> int:
    for n in range(max_steps):
        if not sched.has_unfinished_requests():
            return n
        step(sched, token)
    raise AssertionError("workload did not finish")


def assert_pool_full(sched: Scheduler) -> None:
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


# ---- token budget, chunking, decode ----------------------------------------------------------


def test_token_budget_is_shared_in_arrival_order():
    sched = make_scheduler(budget=8, caching=False)
    a, b = make_request("a", 5), make_request("b", 7)
    sched.add_request(a)
    sched.add_request(b)
    _, plan, sampled = step(sched)
    assert plan == [("a", 5), ("b", 3)]
    assert sampled == ["a"]  # b's prompt is not done
    _, plan, sampled = step(sched)
    assert plan == [("a", 1), ("b", 4)]
    assert sampled == ["a", "b"]
    _, plan, _ = step(sched)
    assert plan == [("a", 1), ("b", 1)]
    assert a.output_token_ids == [TOKEN] * 3
    assert b.output_token_ids == [TOKEN] * 2
    run_to_completion(sched)
    assert_pool_full(sched)


def test_token_budget_with_a_shared_prefix():
    # Same workload with prefix caching: a and b share their first block (tokens 100..103),
    # which a fills in step 1, so b waits one step and starts from it.
    sched = make_scheduler(budget=8)
    a, b = make_request("a", 5), make_request("b", 7)
    sched.add_request(a)
    sched.add_request(b)
    _, plan, sampled = step(sched)
    assert plan == [("a", 5)]
    out, plan, sampled = step(sched)
    assert plan == [("a", 1), ("b", 3)]
    assert sampled == ["a", "b"]
    assert [s.block_ids for s in out.scheduled] == [([1, 2],), ([1, 3],)]
    assert b.num_cached_tokens == 4
    run_to_completion(sched)
    assert_pool_full(sched)


def test_chunked_prefill_then_decode():
    sched = make_scheduler(budget=4)
    r = make_request("r", 10, max_tokens=3)
    sched.add_request(r)
    expected = [(4, [1], 4), (4, [1, 2], 8), (2, [1, 2, 3], 10), (1, [1, 2, 3], 11)]
    for n, blocks, computed in expected:
        out, plan, _ = step(sched)
        assert plan == [("r", n)]
        assert out.scheduled[0].block_ids == (blocks,)
        assert r.num_computed_tokens == computed
    assert r.output_token_ids == [TOKEN, TOKEN]
    out, plan, sampled = step(sched)
    assert plan == [("r", 1)] and sampled == ["r"]
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [TOKEN] * 3
    assert not sched.has_unfinished_requests()
    assert_pool_full(sched)


def test_decode_crosses_block_boundary():
    sched = make_scheduler()
    r = make_request("r", 4, max_tokens=3)
    sched.add_request(r)
    out, _, _ = step(sched)
    assert out.scheduled[0].block_ids == ([1],)
    out, _, _ = step(sched)  # computes position 4: a second block
    assert out.scheduled[0].block_ids == ([1, 2],)
    step(sched)
    assert r.is_finished
    assert_pool_full(sched)


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(rid, 3, max_tokens=2) for rid in "abc"]
    for r in reqs:
        sched.add_request(r)
    _, plan, _ = step(sched)
    assert plan == [("a", 3), ("b", 3)]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    _, plan, _ = step(sched)  # a and b finish in this step's update
    assert plan == [("a", 1), ("b", 1)]
    assert (sched.num_running, sched.num_waiting) == (0, 1)
    _, plan, _ = step(sched)
    assert plan == [("c", 3)]
    run_to_completion(sched)
    assert_pool_full(sched)


def test_times_are_set():
    sched = make_scheduler(budget=2)
    r = make_request("r", 3, max_tokens=1)
    sched.add_request(r)
    step(sched)
    assert r.first_scheduled_time is not None and r.first_token_time is None
    step(sched)
    assert r.first_token_time is not None and r.finished_time is not None
    assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finished_time


# ---- preemption ------------------------------------------------------------------------------


def test_preemption_order_fcfs_and_recompute():
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks of 4 tokens
    a, b, c = make_request("a", 8, 5), make_request("b", 3, 5), make_request("c", 3, 5)
    for r in (a, b, c):
        sched.add_request(r)
    out, plan, _ = step(sched)
    assert plan == [("a", 8), ("b", 3), ("c", 3)]
    assert [s.block_ids for s in out.scheduled] == [([1, 2],), ([3],), ([4],)]

    # a needs a third block: the newest running request (c) makes room, b is untouched.
    out, plan, _ = step(sched)
    assert plan == [("a", 1), ("b", 1)]
    assert out.preempted == [c]
    assert out.scheduled[0].block_ids == ([1, 2, 4],)
    assert c.status == RequestStatus.PREEMPTED
    assert (c.num_computed_tokens, c.num_preemptions) == (0, 1)
    assert c.output_token_ids == [TOKEN]  # kept for the recompute

    # b needs a second block and is now the newest running request: it preempts itself and
    # goes to the front of waiting, ahead of the younger c.
    out, plan, _ = step(sched)
    assert plan == [("a", 1)]
    assert out.preempted == [b]
    assert list(sched.waiting) == [b, c]

    # c (4 tokens, 1 block) would fit but b (5 tokens, 2 blocks) does not: nobody overtakes b.
    _, plan, _ = step(sched)
    assert plan == [("a", 1)]
    _, plan, _ = step(sched)
    assert plan == [("a", 1)]
    assert a.status == RequestStatus.FINISHED_LENGTH  # a's blocks go back: 3 4 2 1

    # Recompute covers prompt + output so far; the next token is sampled right away. b's first
    # block (3 prompt tokens + its first output) was full and cached before b was preempted, so
    # b finds it again and computes only its fifth token (4 tokens were [100, 101, 102, 7]).
    out, plan, sampled = step(sched)
    assert plan == [("b", 1), ("c", 4)]
    assert sampled == ["b", "c"]
    assert [s.block_ids for s in out.scheduled] == [([3, 4],), ([2],)]
    run_to_completion(sched)
    for r in (a, b, c):
        assert r.output_token_ids == [TOKEN] * 5
        assert r.all_token_ids == r.prompt_token_ids + r.output_token_ids
    assert (b.num_preemptions, c.num_preemptions) == (1, 1)
    assert sched.get_stats().num_preemptions == 2
    assert_pool_full(sched)


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=3, budget=3)  # 2 usable blocks
    a, w = make_request("a", 1, 4), make_request("w", 2, 4)
    sched.add_request(a)
    sched.add_request(w)
    for _ in range(3):
        step(sched)
    out, plan, _ = step(sched)  # w needs a second block and preempts itself
    assert plan == [("a", 1)]
    assert out.preempted == [w]
    # A 2-token chunk of w would fit the freed block, but admission waits for the next step.
    assert list(sched.waiting) == [w]
    assert a.is_finished
    _, plan, _ = step(sched)
    assert plan == [("w", 1)]  # its first block (full before preemption) is a cache hit
    run_to_completion(sched)
    assert w.output_token_ids == [TOKEN] * 4
    assert_pool_full(sched)


def test_waiting_head_blocks_later_requests():
    sched = make_scheduler(num_blocks=4)  # 3 usable
    sched.add_request(make_request("a", 8, 4))  # 2 blocks
    big, small = make_request("big", 8, 4), make_request("small", 1, 1)
    sched.add_request(big)
    sched.add_request(small)
    _, plan, _ = step(sched)
    assert plan == [("a", 8)]  # big needs 2 blocks, 1 free; small fits but must wait
    assert list(sched.waiting) == [big, small]
    run_to_completion(sched)
    assert_pool_full(sched)


# ---- stop conditions -------------------------------------------------------------------------


def finish_one(token, *, max_tokens=16, max_model_len=256, prompt_len=3, **params):
    sched = make_scheduler(max_model_len=max_model_len)
    r = make_request("r", prompt_len, max_tokens, **params)
    sched.add_request(r)
    run_to_completion(sched, token=token)
    assert_pool_full(sched)
    return r


def test_eos_stops():
    r = finish_one(EOS)
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [EOS]
    assert r.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    r = finish_one(EOS, max_tokens=5, ignore_eos=True)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [EOS] * 5


def test_min_tokens_holds_back_eos_and_stop_tokens():
    r = finish_one(EOS, min_tokens=3)
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.num_output_tokens == 3
    r = finish_one(9, min_tokens=4, stop_token_ids=[9])
    assert r.num_output_tokens == 4 and r.stop_reason == 9


def test_stop_token_ids_record_the_reason():
    r = finish_one(9, stop_token_ids=[5, 9])
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.stop_reason == 9
    assert r.output_token_ids == [9]


def test_max_tokens_is_length():
    r = finish_one(TOKEN, max_tokens=4)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_output_tokens == 4


def test_max_model_len_is_length():
    r = finish_one(TOKEN, max_tokens=100, max_model_len=10, prompt_len=6)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_tokens == 10 and r.num_output_tokens == 4


def test_prompt_of_max_model_len_gets_one_token():
    r = finish_one(TOKEN, max_tokens=100, max_model_len=10, prompt_len=10)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_output_tokens == 1


def test_stop_token_on_last_allowed_token_reports_stop():
    r = finish_one(EOS, max_tokens=1)
    assert r.status == RequestStatus.FINISHED_STOPPED


# ---- finishing from outside, validation --------------------------------------------------------


def test_abort_waiting_running_and_finished():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 5, 1), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a finishes, b still waiting
    sched.add_request(c := make_request("c", 5))
    step(sched)  # b runs
    assert sched.abort_requests(["a", "b", "c", "nobody"]) == [b, c]
    assert b.status == c.status == RequestStatus.FINISHED_ABORTED
    assert b.finished_time is not None
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert not sched.has_unfinished_requests()
    assert sched.abort_requests("b") == []
    assert_pool_full(sched)


def test_abort_between_schedule_and_update():
    sched = make_scheduler()
    a, b = make_request("a", 3), make_request("b", 3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.abort_requests("a")
    assert sched.update(out, {"a": TOKEN, "b": TOKEN}) == [b]
    assert a.output_token_ids == [] and b.output_token_ids == [TOKEN]
    sched.finish_requests("b", RequestStatus.FINISHED_ERROR)
    assert b.status == RequestStatus.FINISHED_ERROR
    assert_pool_full(sched)


def test_finish_requests_needs_a_finished_status():
    sched = make_scheduler()
    with pytest.raises(ValueError):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_update_without_a_sampled_token_raises_and_changes_nothing():
    sched = make_scheduler()
    r = make_request("r", 3)
    sched.add_request(r)
    out = sched.schedule()
    with pytest.raises(KeyError):
        sched.update(out, {})
    assert r.num_computed_tokens == 0
    sched.update(out, {"r": TOKEN})
    assert r.output_token_ids == [TOKEN]


def test_request_that_can_never_fit_is_rejected():
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks: 16 tokens of KV
    sched.add_request(make_request("fits", 10, max_tokens=7))  # caches at most 16 tokens
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request("too_long", 10, max_tokens=8))
    assert sched.num_waiting == 1
    run_to_completion(sched)
    assert_pool_full(sched)


def test_rejects_malformed_requests():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request(make_request("empty", 0))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", 9))
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request(make_request("zero", 3, max_tokens=0))


def test_max_kv_tokens():
    sched = make_scheduler(max_model_len=10)
    assert sched.max_kv_tokens(make_request("a", 3, 4)) == 6
    assert sched.max_kv_tokens(make_request("b", 6, 100)) == 9
    assert sched.max_kv_tokens(make_request("c", 10, 100)) == 10


def test_stats():
    sched = make_scheduler(num_blocks=9, max_num_seqs=1)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 8))
    step(sched)
    stats = sched.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (1, 1, 0)
    assert stats.kv_usage == pytest.approx(2 / 8)  # 8 prompt tokens in blocks of 4


def test_gemma_like_workload_returns_every_block():
    specs = [full() if (i + 1) % 6 == 0 else sliding(6) for i in range(12)]
    sched = make_scheduler(num_blocks=80, budget=10, specs=specs)
    reqs = [make_request(f"r{i}", 3 + 5 * i, 12, ignore_eos=True) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched)
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert_pool_full(sched)


# ---- randomized simulation -------------------------------------------------------------------


def random_scheduler(rng: random.Random) -> Scheduler:
    bs = rng.choice([1, 2, 4])
    if rng.random() < 0.5:
        specs = [full(bs)] * 2
    else:
        window = rng.randint(1, 12)
        specs = [full(bs) if (i + 1) % 6 == 0 else sliding(window, bs) for i in range(6)]
    groups = len(make_kv_cache_config(specs, num_blocks=2).groups)
    per_request = groups * math.ceil(39 / bs)  # the largest request: 24 + 16 - 1 tokens
    num_blocks = 1 + per_request + rng.randint(0, per_request // 2)  # small: preemption
    return make_scheduler(
        num_blocks=num_blocks,
        budget=rng.randint(1, 32),
        max_num_seqs=rng.randint(1, 6),
        max_model_len=64,
        specs=specs,
    )


def check_step(sched: Scheduler, out) -> None:
    """Invariants of one schedule() output, checked before update()."""
    config, kv = sched.config, sched.kv
    assert 0 < out.num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(sched.running) <= config.max_num_seqs
    ids = [s.request.request_id for s in out.scheduled]
    assert len(set(ids)) == len(ids)
    assert {s.request.request_id for s in out.scheduled} <= {r.request_id for r in sched.running}
    for r in out.preempted:
        assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0
        assert r.request_id not in ids
    if out.num_scheduled_tokens < config.max_num_batched_tokens:
        assert len(out.scheduled) == len(sched.running)  # leftover budget: nobody left out
    for s in out.scheduled:
        assert s.num_new_tokens >= 1
        assert s.start + s.num_new_tokens <= s.request.num_tokens
        for m, table in zip(kv.managers, s.block_ids, strict=True):
            check_table(m, table, s.start, s.num_new_tokens)
    check_blocks_held(sched)


def check_table(manager, table: list[int], start: int, n: int) -> None:
    """A table covers exactly the tokens up to start + n, nulls only behind the window."""
    bs = manager.spec.block_size
    assert len(table) == math.ceil((start + n) / bs)
    first_live = 0
    if isinstance(manager, SlidingWindowManager):
        first_live = max(0, start - manager.sliding_window + 1) // bs
    assert table[:first_live] == [0] * first_live
    assert 0 not in table[first_live:]


def check_blocks_held(sched: Scheduler) -> None:
    """Blocks held by running requests are exactly the blocks missing from the pool, each with
    one reference per table holding it (prefix caching shares blocks between requests)."""
    held = Counter(b for r in sched.running for t in sched.kv.get_block_ids(r) for b in t if b)
    assert len(held) == sched.kv.pool.num_usable_blocks - sched.kv.num_free_blocks
    for block_id, count in held.items():
        assert sched.kv.pool.blocks[block_id].ref_cnt == count
    for r in sched.waiting:
        assert all(t == [] for t in sched.kv.get_block_ids(r))


def simulate(seed: int) -> Scheduler:
    rng = random.Random(seed)
    sched = random_scheduler(rng)
    pending = [
        make_request(f"r{i}", rng.randint(1, 24), rng.randint(1, 16), ignore_eos=True)
        for i in range(rng.randint(1, 25))
    ]
    given: dict[str, list[int]] = {r.request_id: [] for r in pending}
    everyone = list(pending)
    for _ in range(5000):
        while pending and rng.random() < 0.4:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        if out.is_empty:
            assert not sched.has_unfinished_requests()
            continue
        check_step(sched, out)
        sampled = {s.request.request_id: rng.randint(0, 9) for s in out.scheduled if s.sample}
        for rid, tok in sampled.items():
            given[rid].append(tok)
        sched.update(out, sampled)
    else:
        raise AssertionError("simulation did not finish")
    for r in everyone:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == r.max_tokens
        assert r.output_token_ids == given[r.request_id]
        assert r.all_token_ids == r.prompt_token_ids + r.output_token_ids
    assert_pool_full(sched)
    return sched


@pytest.mark.parametrize("seed", range(40))
def test_randomized_simulation(seed):
    simulate(seed)


def test_simulation_exercises_preemption():
    assert sum(simulate(seed).num_preemptions for seed in range(40)) > 0

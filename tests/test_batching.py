"""Continuous batching on the real SmolLM2 (fp32, greedy): requests that arrive at different
steps and share batches get exactly the tokens they get alone, with and without preemption, and
the KV pool is entirely free afterwards."""

from __future__ import annotations

import random

import pytest

from fastforward import LLM, SamplingParams

pytestmark = pytest.mark.slow

WORDS = [
    "the",
    "river",
    "carried",
    "old",
    "leaves",
    "past",
    "the",
    "mill",
    "while",
    "children",
    "counted",
    "boats",
    "and",
    "the",
    "baker",
    "sang",
    "about",
    "winter",
    "roads",
    "lanterns",
    "bridges",
    "and",
    "a",
    "quiet",
    "harbour",
    "town",
    "at",
    "dawn",
]
GAP = 1e-4  # a flipped token is only accepted at a top-2 logprob gap below this


def _workload(n: int = 16) -> list[tuple[str, int, int]]:
    """(prompt, max_tokens, arrival step) for n requests of mixed lengths."""
    rng = random.Random(7)
    out = []
    for i in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
        out.append((prompt, rng.randint(4, 24), i // 2))
    return out


def _alone(llm: LLM, workload) -> list:
    outs = []
    for prompt, max_tokens, _ in workload:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
        outs.append(llm.generate(prompt, params)[0].outputs[0])
    return outs


def _staggered(llm: LLM, workload) -> dict[str, list[int]]:
    engine = llm.engine
    results: dict[str, list[int]] = {}
    step = 0
    pending = list(enumerate(workload))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _) = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            engine.add_request(prompt, params, request_id=str(i))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    return results


def _compare(alone, batched: dict[str, list[int]]) -> int:
    """Assert equality up to proven near-ties; returns how many sequences hit one."""
    ties = 0
    for i, ref in enumerate(alone):
        got = batched[str(i)]
        assert len(got) == len(ref.token_ids)
        if got == ref.token_ids:
            continue
        k = next(j for j, (a, b) in enumerate(zip(got, ref.token_ids, strict=True)) if a != b)
        top = sorted((lp.logprob for lp in ref.logprobs[k].values()), reverse=True)
        assert len(top) >= 2 and top[0] - top[1] < GAP, f"request {i} token {k}: not a near-tie"
        ties += 1
    return ties


@pytest.fixture(scope="module")
def reference(smollm2_path):
    llm = LLM(str(smollm2_path), dtype="float32")
    workload = _workload()
    return workload, _alone(llm, workload)


def _assert_pool_free(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == llm.engine.kv_config.num_blocks - 1


def test_staggered_arrivals_match_alone(smollm2_path, reference):
    workload, alone = reference
    llm = LLM(str(smollm2_path), dtype="float32", max_num_batched_tokens=64)
    ties = _compare(alone, _staggered(llm, workload))
    assert ties <= 1
    _assert_pool_free(llm)


def test_preemption_keeps_tokens_and_frees_pool(smollm2_path, reference):
    workload, alone = reference
    # 24 blocks of 16 tokens: far less than 16 requests need at once, enough for any one.
    llm = LLM(
        str(smollm2_path),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=24,
        max_num_batched_tokens=96,
    )
    ties = _compare(alone, _staggered(llm, workload))
    assert ties <= 1
    assert llm.engine.scheduler.get_stats().num_preemptions > 0
    _assert_pool_free(llm)

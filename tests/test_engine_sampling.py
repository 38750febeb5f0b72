"""Engine-level sampling behaviour on a tiny random model: seeds independent of the batch,
n > 1, stop strings, logprobs, streaming."""

from __future__ import annotations

import pytest

from fastforward import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    directory, _ = tiny_model_dir("qwen2")
    return LLM(str(directory), dtype="float32", max_num_batched_tokens=32, block_size=8)


def test_seed_reproducible_across_batch_compositions(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate("the quick brown fox", params)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True) for _ in range(5)]
    prompts = ["a b c", "the quick brown fox", "license terms", "x", "copyright holders", "y z"]
    outs = llm.generate(prompts, [others[0], params, *others[1:]])
    assert outs[1].outputs[0].token_ids == alone
    # Different seeds give different samples (with overwhelming probability over 24 tokens).
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert llm.generate("the quick brown fox", other_seed)[0].outputs[0].token_ids != alone


def test_n_greater_than_one(llm):
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    out = llm.generate("hello there", params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate("hello there", params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_string_truncates(llm):
    full = llm.generate(
        "the license", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )
    text = full[0].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(
        "the license", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_token_ids(llm):
    full = llm.generate("abc", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    ids = full[0].outputs[0].token_ids
    stop_id = ids[4]
    out = llm.generate(
        "abc",
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0].outputs[0]
    assert out.token_ids == ids[: ids.index(stop_id) + 1]
    assert out.stop_reason == stop_id


def test_logprobs(llm):
    out = llm.generate("abc", SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_stream_text_grows_to_final(llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    chunks = list(llm.stream("the quick", params))
    texts = [c.outputs[0].text for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert chunks[-1].finished
    assert texts[-1] == llm.generate("the quick", params)[0].outputs[0].text


def test_final_only_requests_return_once_with_the_same_output(llm):
    """``add_request(final_only=True)`` (LLM.generate's use): step() returns that request's
    output once, finished, the same as a request that reported every step; n = 2 and a stop
    string included."""
    engine = llm.engine
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, stop=["e"], ignore_eos=True),
    ]
    prompt = "the quick brown fox"
    finals: dict[str, list] = {}
    seen: dict[str, int] = {}
    for final_only in (True, False):
        ids = {
            engine.add_request(prompt, p, request_id=f"{final_only}-{i}", final_only=final_only): i
            for i, p in enumerate(params)
        }
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id] = seen.get(out.request_id, 0) + 1
                if out.finished:
                    finals[out.request_id] = [(c.text, c.token_ids) for c in out.outputs]
        assert set(finals) >= set(ids)
    for i in range(len(params)):
        assert seen[f"True-{i}"] == 1  # only the finished output
        assert seen[f"False-{i}"] > 1  # an output after every step that changed it
        assert finals[f"True-{i}"] == finals[f"False-{i}"]

"""Prompt logprobs (``SamplingParams.prompt_logprobs``) on the real SmolLM2-135M: equal to HF
transformers' log-softmax of the same tokens (fp32), the same whether the prompt is prefilled in
one go, in chunks, after a preemption or next to a prefix-cache hit; and the windowed perplexity
of ``fastforward eval`` (which goes through this path) equal to one computed from HF logits."""

from __future__ import annotations

import pytest
import torch

from fastforward import LLM, SamplingParams
from fastforward.entrypoints.eval import default_text, windowed_perplexity

pytestmark = pytest.mark.slow

TEXT = (
    "The Roman Empire was the post-Republican state of ancient Rome. It is generally understood "
    "to mean the period and territory ruled by the Romans following Octavian's assumption of "
    "sole rule under the Principate in 27 BC. "
) * 3


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), dtype="float32", max_num_batched_tokens=48)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)  # [T - 1, V]: row i predicts ids[i + 1]


def test_prompt_logprobs_equal_hf_in_chunks(llm, hf_model):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    out = llm.generate(TEXT, params)[0]
    ids = out.prompt_token_ids
    assert len(ids) > 100  # > 2 chunks of 48 tokens
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    ref = hf_logprobs(hf_model, ids)
    got = torch.tensor([out.prompt_logprobs[i + 1][t].logprob for i, t in enumerate(ids[1:])])
    torch.testing.assert_close(
        got, ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=2e-4, rtol=0
    )
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        top_ids = ref[i].topk(3).indices.tolist()
        ranked = sorted((lp.rank, tid) for tid, lp in entry.items() if lp.rank <= 3)
        assert [tid for _, tid in ranked] == top_ids
        true = entry[ids[i + 1]]
        assert true.rank == int((ref[i] > ref[i, ids[i + 1]]).sum()) + 1
        assert true.decoded_token == llm.get_tokenizer().decode(
            [ids[i + 1]], skip_special_tokens=False
        )


def test_prompt_logprobs_same_with_prefix_hit_and_preemption(smollm2_path, llm):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    base = llm.generate(TEXT, params)[0].prompt_logprobs
    # A tiny KV pool: many long requests at once preempt each other; the prefix cache is warm
    # from the first one. Every request must still score every prompt token, identically.
    small = LLM(
        str(smollm2_path),
        dtype="float32",
        num_kv_blocks=40,
        max_num_batched_tokens=64,
        max_model_len=512,
    )
    small.generate(TEXT, SamplingParams(max_tokens=1, temperature=0))  # fills the prefix cache
    outs = small.generate(
        [TEXT] * 4, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=0)
    )
    assert small.engine.get_stats().num_preemptions > 0
    for out in outs:
        assert len(out.prompt_logprobs) == len(base) and out.prompt_logprobs[0] is None
        for got, want in zip(out.prompt_logprobs[1:], base[1:], strict=True):
            assert got.keys() == want.keys()
            for t in want:
                assert got[t].logprob == pytest.approx(want[t].logprob, abs=1e-4)
    assert small.engine.scheduler.kv.num_free_blocks == small.engine.kv_config.num_blocks - 1


def test_eval_perplexity_equals_hf(llm, hf_model):
    ids = llm.get_tokenizer().encode(default_text().read_text())[:300]
    ppl, count = windowed_perplexity(llm, ids, window=128, stride=64)
    assert count == len(ids) - 1
    nll, prev_end = 0.0, 0
    for begin in range(0, len(ids) - 1, 64):
        end = min(begin + 128, len(ids))
        lp = hf_logprobs(hf_model, ids[begin:end]).gather(
            1, torch.tensor(ids[begin + 1 : end])[:, None]
        )[:, 0]
        new = min(end - prev_end, len(lp))
        nll -= float(lp[-new:].sum())
        prev_end = end
        if end == len(ids):
            break
    assert ppl == pytest.approx(float(torch.tensor(nll / count).exp()), rel=1e-4)


def test_prompt_logprobs_bad_values():
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)

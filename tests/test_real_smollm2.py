"""The real SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized): our greedy tokens equal HF
transformers' on the same weights, both fp32."""

from __future__ import annotations

import pytest
import torch

from fastforward import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), dtype="float32")


def hf_greedy(model, prompt_ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens with HF's own KV cache, and the logits each was picked from."""
    out_ids, all_logits = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(n):
            logits = out.logits[0, -1]
            token = int(logits.argmax())
            out_ids.append(token)
            all_logits.append(logits)
            out = model(
                torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True
            )
    return out_ids, all_logits


def test_greedy_tokens_equal_hf(llm, hf_model):
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        expected, logits = hf_greedy(hf_model, ids, NEW_TOKENS)
        ours = out.outputs[0].token_ids
        if ours != expected:
            # Only acceptable at a near-tie of HF's top two logits, and then the rest differs.
            i = next(k for k, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b)
            top2 = logits[i].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-4, f"{prompt!r}: token {i} differs, no tie"
        assert len(ours) == NEW_TOKENS


def test_text_is_sensible(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=32, temperature=0),
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"

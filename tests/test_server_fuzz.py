"""Fuzz the HTTP API with hypothesis: no input gives a 5xx or hangs, errors are OpenAI-shaped.

One server on a tiny random llama (with a small chat template added, so chat bodies get as far as
rendering and generation) and ``--max-model-len 128`` serves the whole module. Bodies are drawn
from the completion and chat schemas with every field either valid-ish or junk (wrong types,
huge/negative/non-finite numbers, lone surrogates and other unicode, nested junk), plus whole
bodies that are junk JSON, broken JSON, random bytes or sent with the wrong content type, plus
GETs and wrong methods on the server's paths. Every response must come within the timeout with a
status below 500; a JSON error must be ``{"error": {"message", "type", "param", "code"}}``; a
stream must be well-formed SSE ending in ``[DONE]`` with no in-band server error. Afterwards the
server is healthy, idle, and every KV block is back in the pool.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from server_utils import running_server

MAX_MODEL_LEN = 128
TIMEOUT = 30.0  # seconds, for one whole request (a stream read to its end included)
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=os.environ.get("CI") == "true",  # reproducible in CI, exploring elsewhere
    print_blob=True,
    database=None,  # nothing written into the checkout; print_blob tells how to reproduce
)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    src, _ = tiny_model_dir("llama")
    model = tmp_path_factory.mktemp("fuzz") / "tiny-llama-chat"
    shutil.copytree(src, model)
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config))
    with running_server(model, "--max-model-len", str(MAX_MODEL_LEN)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server, timeout=TIMEOUT) as c:
        yield c


# ---- strategies -------------------------------------------------------------------------------

ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "\ud800",  # lone surrogates: valid JSON escapes, not valid Unicode
    "a\udfffb",
    "\ud83d\ude00 emoji",
    "<s>",
    "</s>",
    "{{ raise_exception('x') }}",
    "\u202e\u0301\ufeff",
    "x" * 5000,
    "the " * 300,
]

huge_ints = st.sampled_from([2**31, 2**63, 2**64 + 1, -(2**63), 10**30, -(10**30), -1, 0])
odd_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0]
)
texts = st.text(max_size=40) | st.sampled_from(ODD_STRINGS)
scalars = st.none() | st.booleans() | st.integers() | huge_ints | odd_floats | texts
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)


VOCAB = 400  # the tiny model's vocabulary (conftest trains a 400-token BPE)
good_text = st.text(min_size=1, max_size=40)
good_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
good_float = st.floats(0, 1)
small_int = st.integers(-3, 24)
bad_ids = st.lists(st.integers(-2, 10 * VOCAB) | huge_ints, max_size=40)
stop = texts | st.lists(texts, max_size=5)


def f(good: st.SearchStrategy, odd: st.SearchStrategy | None = None):
    """A field: values a client would send, and values of the right type but out of range."""
    return good, odd if odd is not None else junk


COMMON = {
    "model": f(st.just("tiny") | st.none(), st.just("gpt-4") | texts),
    "n": f(st.integers(1, 3) | st.just(16), st.integers(-1, 0) | st.just(17) | huge_ints),
    "temperature": f(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 2), st.floats(-1, 3)),
    "top_p": f(st.floats(0.05, 1), st.floats(-0.5, 1.5)),
    "stop": f(good_text | st.lists(good_text, max_size=4), stop),
    "seed": f(st.integers(0, 2**32), st.integers(-(2**70), 2**70) | huge_ints),
    "presence_penalty": f(st.floats(-2, 2), st.floats(-3, 3)),
    "frequency_penalty": f(st.floats(-2, 2), st.floats(-3, 3)),
    "stream": f(st.booleans()),
    "stream_options": f(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": f(good_text, texts),
    "logit_bias": f(st.none(), st.dictionaries(texts, st.floats(-100, 100), max_size=3)),
    "top_k": f(st.integers(0, 50), st.integers(-5, 1000) | huge_ints),
    "min_p": f(good_float, st.floats(-0.5, 1.5)),
    "repetition_penalty": f(st.floats(0.5, 2), st.floats(-1, 3)),
    "ignore_eos": f(st.booleans()),
    "min_tokens": f(st.integers(0, 4), small_int | huge_ints),
    "stop_token_ids": f(st.lists(st.integers(0, VOCAB - 1), max_size=3), bad_ids),
    "include_stop_str_in_output": f(st.booleans()),
    "response_format": f(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        st.fixed_dictionaries({"type": texts, "json_schema": junk}),
    ),
    "guided_regex": f(st.sampled_from(["[a-z]{1,8}", "(yes|no)"]), texts),
    "guided_choice": f(st.lists(good_text, min_size=1, max_size=3), st.lists(texts, max_size=3)),
    "guided_json": f(st.just({"type": "object"}), junk),
    "skip_special_tokens": f(st.booleans()),
}

COMPLETION = {
    **COMMON,
    "prompt": f(
        good_text | st.lists(good_text, min_size=1, max_size=3) | good_ids,
        texts | st.lists(texts, max_size=3) | bad_ids | st.lists(bad_ids, max_size=3),
    ),
    "max_tokens": f(st.integers(1, 24) | st.none(), small_int | huge_ints | st.just(MAX_MODEL_LEN)),
    "logprobs": f(st.integers(0, 5) | st.none(), st.integers(-1, 25) | huge_ints),
    "echo": f(st.booleans()),
    "suffix": f(st.none(), texts),
    "best_of": f(st.none() | st.just(1), st.integers(-1, 3)),
}

good_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": good_text}
)
content_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "junk"]), "text": texts}
)
odd_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "bot"])
        | texts,
        "content": texts | st.none() | st.lists(content_part | texts | junk, max_size=3),
    },
    optional={"name": texts, "tool_calls": junk},
)

CHAT = {
    **COMMON,
    "messages": f(
        st.lists(good_message, min_size=1, max_size=4),
        st.lists(good_message | odd_message | junk, max_size=4),
    ),
    "max_tokens": f(st.integers(1, 24) | st.none(), small_int | huge_ints),
    "max_completion_tokens": f(st.integers(1, 24) | st.none(), small_int | huge_ints),
    "logprobs": f(st.booleans()),
    "top_logprobs": f(st.integers(0, 5) | st.none(), st.integers(-1, 25) | huge_ints),
    "add_generation_prompt": f(st.booleans()),
    "tools": f(
        st.none() | st.just([{"type": "function", "function": {"name": "f"}}]),
        st.lists(st.dictionaries(texts, junk, max_size=3), max_size=2),
    ),
}


def bodies(schema: dict[str, tuple], required: str) -> st.SearchStrategy:
    """Dicts holding a random subset of the schema's fields (the required one usually).

    Each body gets a wildness: 'clean' bodies hold only values a client would send (so many get
    through validation and generate), wilder ones more out-of-range values and junk.
    """
    optional = sorted(k for k in schema if k != required)

    @st.composite
    def build(draw) -> dict:
        odd_pct, junk_pct = draw(st.sampled_from([(0, 0), (0, 0), (15, 5), (30, 30)]))

        def value(name: str):
            good, odd = schema[name]
            roll = draw(st.integers(0, 99))
            if roll < junk_pct:
                return draw(junk)
            return draw(odd if roll < junk_pct + odd_pct else good)

        body = {}
        if draw(st.integers(0, 19)) > 0:
            body[required] = value(required)
        for name in draw(st.lists(st.sampled_from(optional), max_size=8, unique=True)):
            body[name] = value(name)
        if junk_pct and draw(st.integers(0, 4)) == 0:
            body[draw(texts)] = draw(junk)  # an unknown field
        return body

    return build()


def encode(body) -> bytes:
    # allow_nan: Python's json (and so the server's parser) reads NaN/Infinity; send them too.
    # ensure_ascii (the default): a lone surrogate goes out as a valid JSON escape (\\ud800).
    return json.dumps(body, allow_nan=True).encode()


# ---- checks -----------------------------------------------------------------------------------

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def check_error_shape(r: httpx.Response) -> None:
    if r.status_code < 400 or "json" not in r.headers.get("content-type", ""):
        return
    body = r.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err = body["error"]
    assert set(err) >= OPENAI_ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str), err


def post(client: httpx.Client, path: str, content: bytes, headers: dict | None = None):
    """POST and read the whole response (a stream to its end) within TIMEOUT seconds."""
    headers = {"content-type": "application/json", **(headers or {})}
    deadline = time.monotonic() + TIMEOUT
    with client.stream("POST", path, content=content, headers=headers) as r:
        chunks = []
        for chunk in r.iter_bytes():
            chunks.append(chunk)
            assert time.monotonic() < deadline, f"{path}: response still streaming after {TIMEOUT}s"
        r._content = b"".join(chunks)
    return r


def check_response(r: httpx.Response, sent: bytes) -> None:
    event(f"status {r.status_code}")  # pytest --hypothesis-show-statistics shows the mix
    assert r.status_code < 500, f"{r.status_code} for body {sent[:2000]!r}:\n{r.text[:2000]}"
    check_error_shape(r)
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        check_sse(r.text, sent)
    elif r.status_code == 200:
        body = r.json()
        assert body["choices"], body
        assert body["usage"]["completion_tokens"] >= 0


def check_sse(text: str, sent: bytes) -> None:
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events and events[-1] == "data: [DONE]", f"stream did not end in [DONE]: {text[-500:]!r}"
    for sse in events[:-1]:
        assert sse.startswith("data: "), sse
        data = json.loads(sse[len("data: ") :])
        err = data.get("error")
        assert not (err and str(err.get("code", "")).startswith("5")), (
            f"in-band server error for body {sent[:2000]!r}: {err}"
        )


# ---- the fuzz tests ---------------------------------------------------------------------------


@settings(FUZZ, max_examples=300)
@given(body=bodies(COMPLETION, "prompt"))
def test_fuzz_completions(client, body):
    content = encode(body)
    check_response(post(client, "/v1/completions", content), content)


@settings(FUZZ, max_examples=300)
@given(body=bodies(CHAT, "messages"))
def test_fuzz_chat(client, body):
    content = encode(body)
    check_response(post(client, "/v1/chat/completions", content), content)


raw_bodies = st.one_of(
    st.binary(max_size=200),
    junk.map(encode),
    st.sampled_from(
        [
            b"",
            b"{",
            b'{"prompt": "a", "max_tokens": 2',
            b"null",
            b"[]",
            b'"prompt"',
            b'{"prompt": "a\xff\xfe", "max_tokens": 2}',  # invalid UTF-8
            b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}',  # a surrogate encoded as UTF-8
            b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}], "max_tokens": 2}',
            b'{"prompt": "a", "max_tokens": 2, "prompt": 7}',
            b'{"prompt": "a", "max_tokens": 1e999}',
            b'{"prompt": "a", "max_tokens": 2.0}',
            b'{"prompt": "a", "max_tokens": 2.5}',
            b'{"prompt": "a", "max_tokens": "2"}',
            b"[" * 5000 + b"]" * 5000,  # deep nesting
            b'{"prompt": [' + b"1," * 20000 + b"1]}",  # far over the context
        ]
    ),
)
content_types = st.sampled_from(
    [
        "application/json",
        "application/json; charset=latin-1",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "",
    ]
)


@settings(FUZZ, max_examples=150)
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    content=raw_bodies,
    content_type=content_types,
)
def test_fuzz_raw_bodies(client, path, content, content_type):
    r = post(client, path, content, {"content-type": content_type})
    check_response(r, content)


PATHS = [
    "/",
    "/health",
    "/metrics",
    "/v1/models",
    "/openapi.json",
    "/docs",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1",
    "/v1/models/tiny",
    "/v1/embeddings",
    "/static/../../etc/passwd",
]


@settings(FUZZ, max_examples=100)
@given(
    path=st.sampled_from(PATHS)
    | st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=30).map(
        lambda s: "/" + s
    ),
    method=st.sampled_from(["GET", "GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]),
    query=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
)
def test_fuzz_other_paths(client, path, method, query):
    try:
        r = client.request(method, path, params=query)
    except httpx.InvalidURL:
        return  # the client refused to send it
    assert r.status_code < 500, f"{method} {path} {query}: {r.status_code} {r.text[:1000]}"
    if method != "HEAD":  # a HEAD answer has headers only
        check_error_shape(r)


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_server_healthy_and_kv_pool_free_after_fuzz(client):
    assert client.get("/health").status_code == 200
    deadline = time.monotonic() + 30
    while True:
        text = client.get("/metrics").text
        idle = {
            name: metric(text, name)
            for name in (
                "fastforward_num_requests_running",
                "fastforward_num_requests_waiting",
                "fastforward_kv_cache_blocks_used",
            )
        }
        if not any(idle.values()):
            break
        assert time.monotonic() < deadline, f"server not idle 30 s after the fuzzing: {idle}"
        time.sleep(0.2)
    # ignore_eos: the tiny random model may sample its EOS at temperature 1 (the default), and
    # whether it does depends on how far the fuzzing advanced the shared generator
    r = client.post(
        "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text

"""The web playground at ``/``: the page itself, and a real headless Chromium chatting with the
real server on SmolLM2-135M.

The browser test needs Debian's ``chromium`` (``/usr/bin/chromium``) and the ``playwright``
Python package (only its driver: no ``playwright install``, the system browser is used). If
either is missing the test fails, it does not skip, so CI cannot pass it silently.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from server_utils import running_server

from fastforward.server.app import STATIC, ServerConfig, build_app

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).parent / "artifacts"
KEY_IDS = [
    "model",
    "api-key",
    "temperature",
    "top-p",
    "max-tokens",
    "seed",
    "system",
    "transcript",
    "prompt",
    "send",
    "stop",
    "clear",
    "ttft",
    "ttft-server",
    "tps",
    "tps-server",
    "cached",
    "prompt-tokens",
    "completion-tokens",
]
NUMBER = re.compile(r"\d+(\.\d+)?")


def test_index_served_with_key_elements():
    from fastapi.testclient import TestClient

    stub = SimpleNamespace(engine=SimpleNamespace(tokenizer=None, max_model_len=2048), healthy=True)
    app = build_app(stub, ServerConfig(served_model_name="stub", api_key="secret"))
    with TestClient(app) as client:
        r = client.get("/")  # the page itself needs no API key; the page sends it to /v1
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    html = r.text
    for element_id in KEY_IDS:
        assert f'id="{element_id}"' in html, element_id
    # Self-contained: no external scripts, styles or fonts (the page must work offline).
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert "/v1/chat/completions" in html and "include_usage" in html
    assert (STATIC / "index.html").is_file()


def _require_browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(
            f"{CHROMIUM} is missing: the playground browser test needs Debian's chromium "
            "(apt-get install -y chromium)"
        )
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        pytest.fail(
            "the playwright Python package is missing: pip install playwright "
            "(do not run `playwright install`; the test drives /usr/bin/chromium)"
        )


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _figure(page, element_id: str) -> str:
    return page.inner_text(f"#{element_id}").strip()


def _wait_number(page, element_id: str, timeout_ms: int = 60_000) -> float:
    page.wait_for_function(
        """id => /^~?\\d+(\\.\\d+)?( ?m?s)?$/.test(document.getElementById(id).textContent.trim())""",
        arg=element_id,
        timeout=timeout_ms,
    )
    return float(NUMBER.search(_figure(page, element_id)).group())


def _send_and_sample(page, message: str) -> tuple[list[str], str]:
    """Send ``message``; sample the streaming reply's text every few ms until it is done."""
    n_before = page.locator(".msg.assistant").count()
    page.fill("#prompt", message)
    page.click("#send")
    page.wait_for_function(
        "n => document.querySelectorAll('.msg.assistant').length > n", arg=n_before
    )
    reply = page.locator(".msg.assistant .body").nth(n_before)
    samples = []
    deadline = time.time() + 120
    while time.time() < deadline:
        streaming, text = page.evaluate(
            """i => {
                const m = document.querySelectorAll('.msg.assistant')[i];
                return [m.classList.contains('streaming'), m.querySelector('.body').textContent];
            }""",
            n_before,
        )
        if not streaming:
            break
        samples.append(text)
        time.sleep(0.03)
    else:
        pytest.fail("the reply did not finish streaming in 120 s")
    return samples, reply.inner_text()


@pytest.mark.slow
def test_playground_streams_in_chromium(smollm2_path, tmp_path):
    _require_browser()
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with (
        running_server(smollm2_path, "--dtype", "float32") as url,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            console_errors: list[str] = []
            page.on("pageerror", lambda e: console_errors.append(str(e)))
            page.set_default_timeout(60_000)
            page.goto(url + "/")

            # The model list is filled from GET /v1/models.
            page.wait_for_function("document.querySelectorAll('#model option').length > 0")
            model_id = page.eval_on_selector("#model", "el => el.value")
            assert (
                model_id == json.load(urllib.request.urlopen(f"{url}/v1/models"))["data"][0]["id"]
            )

            page.fill("#temperature", "0")
            page.fill("#max-tokens", "48")
            page.fill("#system", "You are a concise poet.")

            # Turn 1: streamed text appears piece by piece, then the figures fill in.
            samples, final = _send_and_sample(page, "Write a short poem about the sea.")
            assert final.strip(), "no reply text"
            partial = sorted({s for s in samples if s and s != final}, key=len)
            assert len(partial) >= 3, (
                f"the reply did not stream: only {len(partial)} intermediate texts seen "
                f"in {len(samples)} samples"
            )
            for s in partial:
                assert final.startswith(s), (s, final)  # each sample is a prefix: it grew
            assert len({len(s) for s in partial}) >= 3

            ttft = _wait_number(page, "ttft")
            tps = _wait_number(page, "tps")
            cached_1 = _wait_number(page, "cached")
            prompt_1 = _wait_number(page, "prompt-tokens")
            completion_1 = _wait_number(page, "completion-tokens")
            _wait_number(page, "ttft-server")
            _wait_number(page, "tps-server")
            assert ttft > 0 and tps > 0
            assert 0 < completion_1 <= 48
            assert cached_1 < prompt_1

            # Turn 2: the history goes along (longer prompt) and its prefix comes from the cache.
            samples, final_2 = _send_and_sample(page, "Now give it a title.")
            assert final_2.strip()
            prompt_2 = _wait_number(page, "prompt-tokens")
            cached_2 = _wait_number(page, "cached")
            _wait_number(page, "tps")
            assert prompt_2 > prompt_1 + completion_1, "the first turn was not sent as history"
            assert cached_2 > 0, "the second turn reused no cached prompt tokens"
            assert page.locator(".msg.user").count() == 2
            assert page.locator(".msg.assistant").count() == 2

            page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)
            page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)

            # Errors from the server are shown readably (a context-length 400).
            page.fill("#max-tokens", "1000000")
            page.fill("#prompt", "Hello")
            page.click("#send")
            error = page.locator(".msg.assistant.error .body")
            error.wait_for()
            assert "max_tokens" in error.inner_text() and "context length" in error.inner_text()
            assert page.locator(".msg.assistant").count() == 3

            # Stop aborts the fetch, and with it the request on the server.
            page.fill("#max-tokens", "400")
            page.fill("#prompt", "Tell me a very long story about a dragon and a knight.")
            page.click("#send")
            page.wait_for_function(
                "() => { const b = document.querySelectorAll('.msg.assistant .body');"
                " return b[b.length - 1].textContent.length > 0; }"
            )
            page.click("#stop")
            page.wait_for_function("() => !document.querySelector('.msg.streaming')")
            assert _figure(page, "finish") == "stopped"
            deadline = time.time() + 10
            while _metrics(url)["fastforward_num_requests_running"] > 0:
                assert time.time() < deadline, "the stopped request kept running on the server"
                time.sleep(0.2)
            page.screenshot(path=str(ARTIFACTS / "playground-stop-error.png"), full_page=True)
            page.screenshot(path=str(tmp_path / "playground-stop-error.png"), full_page=True)

            # Clear empties the conversation.
            page.click("#clear")
            assert page.locator(".msg").count() == 0
            assert not console_errors, console_errors
        finally:
            browser.close()

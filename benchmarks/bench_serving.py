"""Serving benchmark: a load generator for OpenAI-compatible servers (fastforward, llama.cpp).

Usage::

    # start fastforward's server on SmolLM2-135M, and llama.cpp's on the same GGUF file if
    # llama-cpp-python[server] is installed; 32 streaming requests, 8 at a time, 64 tokens each
    python benchmarks/bench_serving.py --start fastforward llama.cpp \\
        --num-requests 32 --concurrency 8 --output-tokens 64

    # Poisson arrivals at 2 requests/s instead of a fixed concurrency
    python benchmarks/bench_serving.py --start fastforward --rate 2

    # a server that is already running
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --name mine

The load: ``--num-requests`` streaming ``POST /v1/completions``, sent either ``--concurrency`` at a
time (a closed loop: a client sends its next request when its last one ends) or, with ``--rate``,
at Poisson arrival times (exponential gaps of mean 1/rate; ``inf`` sends them all at once).
Prompts are paragraphs of a real text on this machine (``--text``, by default the GPL-3 text in
/usr/share/common-licenses, else Python's LICENSE.txt), cut to between half and all of
``--prompt-words`` words. Decoding is greedy (or sampled: ``--temperature``, ``--top-p``) and
runs exactly ``--output-tokens`` tokens: EOS is ignored (fastforward: ``ignore_eos``; llama.cpp: a ``logit_bias`` of -100 on every
end-of-generation token). Every server gets the same prompts in the same order, after
``--warmup`` requests that are not counted.

Per request: time to first token (TTFT: send -> first chunk carrying text), time per output
token (TPOT: (end - first token) / (tokens - 1)), end-to-end latency. Per server: request
throughput and output tokens/s over the wall time of the run, TTFT/TPOT/latency at p50/p99 (and
mean). Output tokens are the ``usage`` the server reports with
``stream_options.include_usage``, else ``max_tokens`` when the server says it stopped on the length
limit, else the number of chunks that carried text. The machine's load average before and after
each run is recorded too: timings on a shared machine are only comparable within one run.

Servers started with ``--start`` run one after another on the same machine (never together),
on loopback; their logs go to ``benchmarks/results/``. llama.cpp's server is
``python -m llama_cpp.server --model GGUF --n_threads T --interrupt_requests False`` (its default
interrupts a stream whenever another request arrives); it serves one request at a time and runs
the GGUF's quantized weights natively, while fastforward dequantizes them to ``--dtype`` and
batches requests continuously.

Writes ``benchmarks/results/bench_serving.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a plain script: import fastforward from this checkout
RESULTS = ROOT / "benchmarks" / "results"
TEXTS = [
    Path("/usr/share/common-licenses/GPL-3"),
    Path(sys.base_prefix)
    / "lib"
    / f"python{sys.version_info.major}.{sys.version_info.minor}"
    / "LICENSE.txt",
]


# ---- the workload -----------------------------------------------------------------------------


def load_prompts(text_path: Path | None, n: int, max_words: int, seed: int) -> list[str]:
    """``n`` prompts: paragraphs of a real text, each cut to 1/2..1 of ``max_words`` words."""
    path = text_path or next(p for p in TEXTS if p.is_file())
    paras = [" ".join(p.split()) for p in path.read_text(errors="replace").split("\n\n")]
    paras = [p for p in paras if len(p.split()) >= 8]
    if not paras:
        raise SystemExit(f"no paragraphs of 8+ words in {path}")
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        # Consecutive paragraphs from a random start, enough words for the longest prompts.
        start = rng.randrange(len(paras))
        words: list[str] = []
        j = start
        while len(words) < max_words:
            words += paras[j % len(paras)].split()
            j += 1
        k = rng.randint(max(1, max_words // 2), max_words)
        prompts.append(" ".join(words[:k]))
    return prompts


@dataclass
class RequestResult:
    prompt_words: int
    ok: bool = False
    error: str | None = None
    send: float = 0.0
    first_token: float | None = None
    end: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    tokens_from: str = "chunks"  # or "usage", or "finish_reason=length"
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.send

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def latency(self) -> float:
        return self.end - self.send


@dataclass
class Backend:
    name: str
    url: str
    body_extra: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


async def one_request(
    client: httpx.AsyncClient, backend: Backend, prompt: str, max_tokens: int
) -> RequestResult:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **backend.body_extra,
    }
    if backend.info.get("model_id"):
        body["model"] = backend.info["model_id"]
    res = RequestResult(prompt_words=len(prompt.split()))
    chunks = 0
    res.send = time.perf_counter()
    try:
        async with client.stream("POST", f"{backend.url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ": ping" comments
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    res.ok = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"in-band error: {chunk['error']}"
                    return res
                choices = chunk.get("choices") or []
                text = "".join(c.get("text") or "" for c in choices)
                for c in choices:
                    res.finish_reason = c.get("finish_reason") or res.finish_reason
                if text:
                    chunks += 1
                    if res.first_token is None:
                        res.first_token = time.perf_counter()
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens"):
                    res.output_tokens = usage["completion_tokens"]
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.tokens_from = "usage"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.end = time.perf_counter()
    if res.tokens_from == "chunks":
        if res.finish_reason == "length":
            # No usage in the stream (llama.cpp), and a chunk may carry several tokens or none
            # (text held back): the length limit says how many tokens there were.
            res.output_tokens, res.tokens_from = max_tokens, "finish_reason=length"
        else:
            res.output_tokens = chunks
    if res.ok and res.output_tokens != max_tokens:
        res.error = f"got {res.output_tokens} tokens, asked for {max_tokens}"
        res.ok = False
    return res


async def run_load(
    backend: Backend,
    prompts: list[str],
    max_tokens: int,
    concurrency: int | None,
    rate: float | None,
    seed: int,
) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=max(len(prompts), concurrency or 1) + 4)
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        if rate is None:
            queue = list(enumerate(prompts))
            results: list[RequestResult | None] = [None] * len(prompts)

            async def worker() -> None:
                while queue:
                    i, prompt = queue.pop(0)
                    results[i] = await one_request(client, backend, prompt, max_tokens)

            await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
            done = [r for r in results if r is not None]
        else:
            rng = random.Random(seed)

            async def arrive(delay: float, prompt: str) -> RequestResult:
                await asyncio.sleep(delay)
                return await one_request(client, backend, prompt, max_tokens)

            t, tasks = 0.0, []
            for prompt in prompts:
                tasks.append(asyncio.create_task(arrive(t, prompt)))
                if math.isfinite(rate):
                    t += rng.expovariate(rate)
            done = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - start
    return done, wall


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarize(results: list[RequestResult], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    lat = [r.latency for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)

    def stats(xs: list[float]) -> dict[str, float | None]:
        return {
            "mean": statistics.fmean(xs) if xs else None,
            "p50": pct(xs, 50),
            "p99": pct(xs, 99),
        }

    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall,
        "request_throughput_per_s": len(ok) / wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "output_tokens_counted_from": sorted({r.tokens_from for r in ok}),
        "prompt_tokens_mean": (
            statistics.fmean([r.prompt_tokens for r in ok if r.prompt_tokens is not None])
            if any(r.prompt_tokens is not None for r in ok)
            else None
        ),
        "ttft_s": stats(ttft),
        "tpot_s": stats(tpot),
        "latency_s": stats(lat),
    }


# ---- starting servers -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess on loopback, stopped on exit; its output goes to a log file."""

    def __init__(self, name: str, cmd: list[str], port: int, ready_path: str, timeout: float):
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path, self.timeout = ready_path, timeout
        RESULTS.mkdir(parents=True, exist_ok=True)
        self.log = RESULTS / f"bench_serving_{name.replace('.', '_')}.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"{self.name} did not come up in {self.timeout}s (log: {self.log})")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def fastforward_server(args: argparse.Namespace) -> tuple[Server, Backend]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "fastforward.entrypoints.cli",
        "serve",
        str(args.model),
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--log-level",
        "warning",
    ]
    server = Server("fastforward", cmd, port, "/health", args.start_timeout)
    info = {"command": " ".join(cmd[1:]), "dtype": args.dtype}
    return server, Backend("fastforward", server.url, {"ignore_eos": True}, info)


def llama_cpp_available() -> str | None:
    """None if llama-cpp-python's server can run here, else why not."""
    for mod in ("llama_cpp", "uvicorn", "sse_starlette", "starlette_context"):
        if importlib.util.find_spec(mod) is None:
            return f"python package {mod!r} is missing: pip install 'llama-cpp-python[server]'"
    return None


def llama_cpp_server(args: argparse.Namespace, gguf: Path) -> tuple[Server, Backend]:
    import llama_cpp

    from fastforward.loader.tokenizer import Tokenizer

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--n_threads",
        str(args.threads),
        "--n_threads_batch",
        str(args.threads),
        "--n_ctx",
        str(args.llama_n_ctx),
        "--interrupt_requests",
        "False",
    ]
    # No ignore_eos there: forbid the end-of-text tokens with a logit bias instead. (Not with
    # min_tokens as well: llama-cpp-python 0.3.x then drops both logits processors, since its
    # ``logits_processor = logits_processor.extend(...)`` sets it to None.)
    eos_ids = sorted(Tokenizer.from_gguf(gguf).eos_token_ids)
    extra = {"logit_bias": {str(t): -100.0 for t in eos_ids}}
    server = Server("llama.cpp", cmd, port, "/v1/models", args.start_timeout)
    info = {
        "command": " ".join(cmd[1:]),
        "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
        "weights": "the GGUF's own quantization, run natively",
    }
    return server, Backend("llama.cpp", server.url, extra, info)


# ---- main -------------------------------------------------------------------------------------


def fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def print_table(runs: dict[str, dict[str, Any]]) -> None:
    names = list(runs)
    rows = [
        ("completed / requests", lambda s: f"{s['completed']}/{s['requests']}"),
        ("wall time (s)", lambda s: fmt(s["wall_s"], 1, 1)),
        ("request throughput (req/s)", lambda s: fmt(s["request_throughput_per_s"], 1, 3)),
        ("output tokens/s", lambda s: fmt(s["output_tokens_per_s"], 1, 1)),
        ("TTFT p50 (ms)", lambda s: fmt(s["ttft_s"]["p50"], 1e3)),
        ("TTFT p99 (ms)", lambda s: fmt(s["ttft_s"]["p99"], 1e3)),
        ("TPOT p50 (ms)", lambda s: fmt(s["tpot_s"]["p50"], 1e3)),
        ("TPOT p99 (ms)", lambda s: fmt(s["tpot_s"]["p99"], 1e3)),
        ("latency p50 (s)", lambda s: fmt(s["latency_s"]["p50"], 1, 2)),
        ("latency p99 (s)", lambda s: fmt(s["latency_s"]["p99"], 1, 2)),
        ("load avg 1m before/after", lambda s: "/".join(map(str, s["loadavg_1m_before_after"]))),
    ]
    width = max(len(r[0]) for r in rows) + 2
    print("".join([f"{'metric':<{width}}", *(f"{n:>14}" for n in names)]))
    for label, get in rows:
        print("".join([f"{label:<{width}}", *(f"{get(runs[n]['summary']):>14}" for n in names)]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = p.add_argument_group("servers")
    target.add_argument(
        "--start",
        nargs="+",
        choices=["fastforward", "llama.cpp"],
        default=None,
        help="servers to start and benchmark one after another (default: fastforward and, "
        "if installed, llama.cpp; none when --url is given)",
    )
    target.add_argument("--url", default=None, help="benchmark a server already running here")
    target.add_argument("--name", default="server", help="name of the --url server in the report")
    target.add_argument("--model", default="smollm2-135m", help="catalog name or .gguf path")
    target.add_argument("--dtype", default="float32", help="fastforward --dtype")
    target.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp")
    target.add_argument("--llama-n-ctx", type=int, default=2048, help="llama.cpp context size")
    target.add_argument("--start-timeout", type=float, default=600.0)
    load = p.add_argument_group("load")
    load.add_argument("--num-requests", type=int, default=32)
    mode = load.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="requests in flight")
    mode.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    load.add_argument("--output-tokens", type=int, default=64, help="tokens per request")
    load.add_argument("--prompt-words", type=int, default=200, help="longest prompt, in words")
    load.add_argument("--text", type=Path, default=None, help="text to cut prompts from")
    load.add_argument("--warmup", type=int, default=2, help="uncounted requests first")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    load.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=RESULTS / "bench_serving.json")
    args = p.parse_args(argv)
    if args.concurrency is None and args.rate is None:
        args.concurrency = 8
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = load_prompts(args.text, args.num_requests, args.prompt_words, args.seed)
    warm = load_prompts(args.text, args.warmup, args.prompt_words, args.seed + 1)
    runs: dict[str, dict[str, Any]] = {}
    notes: list[str] = []

    def bench(backend: Backend) -> None:
        mode = f"concurrency {args.concurrency}" if args.rate is None else f"rate {args.rate}/s"
        print(f"== {backend.name}: {len(prompts)} requests, {mode}, {args.output_tokens} tokens")
        backend.body_extra = {
            **backend.body_extra,
            "temperature": args.temperature,
            "top_p": args.top_p,
        }
        if warm:
            asyncio.run(run_load(backend, warm, args.output_tokens, 1, None, args.seed))
        load_before = os.getloadavg()
        results, wall = asyncio.run(
            run_load(backend, prompts, args.output_tokens, args.concurrency, args.rate, args.seed)
        )
        summary = summarize(results, wall)
        summary["loadavg_1m_before_after"] = [
            round(load_before[0], 2),
            round(os.getloadavg()[0], 2),
        ]
        runs[backend.name] = {
            "summary": summary,
            "info": backend.info,
            "request_extra": backend.body_extra,
            "requests": [
                {**asdict(r), "ttft": r.ttft, "tpot": r.tpot, "latency": r.latency} for r in results
            ],
        }
        print(
            f"   {summary['completed']}/{summary['requests']} ok in {wall:.1f}s, "
            f"{summary['output_tokens_per_s']:.1f} output tok/s "
            f"(load average {summary['loadavg_1m_before_after']})"
        )
        for err in summary["errors"]:
            print("   error:", err)

    if args.url:
        # vLLM-style servers (fastforward, vLLM) take ignore_eos; others ignore unknown fields.
        bench(Backend(args.name, args.url.rstrip("/"), {"ignore_eos": True}))
    starts = args.start if args.start is not None else ([] if args.url else None)
    if starts is None:
        starts = ["fastforward", "llama.cpp"]
    gguf: Path | None = None
    if starts:
        from fastforward.hub import resolve_model

        gguf = Path(resolve_model(args.model))
    for name in starts:
        if name == "fastforward":
            server, backend = fastforward_server(args)
        else:
            why = llama_cpp_available()
            if why is None and (gguf is None or gguf.suffix != ".gguf"):
                why = f"llama.cpp needs a .gguf model file, {args.model} resolved to {gguf}"
            if why is not None:
                notes.append(f"llama.cpp skipped: {why}")
                print(f"== llama.cpp skipped: {why}")
                continue
            server, backend = llama_cpp_server(args, gguf)
        print(f"   starting {name} (log: {server.log})", flush=True)
        t0 = time.time()
        with server:
            backend.info["startup_s"] = round(time.time() - t0, 1)
            if name == "llama.cpp":
                # llama.cpp ends generation on every token it calls end-of-generation (SmolLM2:
                # <|endoftext|>, <|im_end|> and <reponame>); forbid all that its log lists too.
                eog = re.findall(r"EOG token\s*=\s*(\d+)", server.log.read_text(errors="replace"))
                backend.body_extra["logit_bias"].update({t: -100.0 for t in eog})
            bench(backend)

    if not runs:
        print("nothing was benchmarked")
        return 1
    print()
    print_table(runs)
    for note in notes:
        print("note:", note)
    report = {
        "benchmark": "bench_serving",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "model": str(gguf or args.model),
        "workload": {
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "rate": args.rate,
            "output_tokens": args.output_tokens,
            "prompt_words_max": args.prompt_words,
            "prompt_words_mean": statistics.fmean(len(p.split()) for p in prompts),
            "text": str(args.text or next(p for p in TEXTS if p.is_file())),
            "warmup": args.warmup,
            "seed": args.seed,
        },
        "runs": runs,
        "notes": notes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

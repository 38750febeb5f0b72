"""Benchmark prefix caching on an agent-style workload: one long system prompt, many questions.

Usage::

    python benchmarks/bench_prefix.py              # 32 requests, ~1,500-token system prompt
    python benchmarks/bench_prefix.py --quick      # smoke run: 8 requests, ~300 tokens
    python benchmarks/bench_prefix.py --dtype float32

The workload (issue 5): ``--requests`` chat requests on SmolLM2-135M (``LLM("smollm2-135m")``,
default dtype unless ``--dtype``) share one system prompt of ~``--system-tokens`` tokens, cut at a
paragraph boundary from the GPL-3 text on this machine (``/usr/share/common-licenses/GPL-3``);
each adds a distinct user question of ~``--question-tokens`` tokens, consecutive pieces of the
Apache-2.0 licence text on this machine. The SmolLM2 chat template renders each conversation and
every request generates ``--new-tokens`` tokens (greedy, EOS ignored).

All requests are submitted at once (``llm.generate`` with the list), once with prefix caching off
and once with it on, each engine in its own ``LLM`` instance, one after the other in this process
(off first; each warmed up with an unrelated short prompt). Measured per run:

* TTFT per request: ``first_token_time - arrival_time`` from ``RequestOutput.metrics``. Since all
  requests arrive together this includes the time spent waiting for earlier requests to be
  scheduled, which is reported on its own as queueing (``first_scheduled_time - arrival_time``);
* request throughput: requests / wall time of the ``generate`` call (and output tokens/s);
* the prefix cache hit rate (``LLMEngine.get_stats()``: tokens served from the cache / tokens
  looked up) and the prompt tokens each request got from the cache (``num_cached_tokens``);
* whether the generated token ids are identical between the two runs; where they are not, the
  first differing token and the gap between the two most likely tokens there (requests ask for
  ``logprobs=2``). Caching changes which tokens are computed together, so in bfloat16 a near-tie
  can flip, as it can between batch compositions without caching; in float32 they agree.

Prints a table (metric | caching off | caching on | ratio on/off) and writes
``benchmarks/results/bench_prefix.json``. Target from the issue: median TTFT at least 5x lower
and request throughput at least 2.5x higher with caching on, identical outputs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# Run as a plain script from anywhere: import fastforward from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastforward import LLM, SamplingParams  # noqa: E402
from fastforward.outputs import RequestOutput  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_prefix.json"
SYSTEM_TEXT = Path("/usr/share/common-licenses/GPL-3")
QUESTION_TEXT = Path("/usr/share/common-licenses/Apache-2.0")

Ids = list[int]


@dataclass(slots=True)
class RunResult:
    """One engine's run of the whole workload."""

    caching: bool
    wall_s: float
    ttft_s: list[float]
    queue_s: list[float]
    num_cached_tokens: list[int]
    output_ids: list[Ids]
    top2_gaps: list[list[float]]  # per request, per token: logprob of best - second best
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int

    @property
    def num_requests(self) -> int:
        return len(self.ttft_s)

    @property
    def req_per_s(self) -> float:
        return self.num_requests / self.wall_s

    @property
    def out_tok_per_s(self) -> float:
        return sum(len(ids) for ids in self.output_ids) / self.wall_s

    @property
    def hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0
        )


# ---- workload ----------------------------------------------------------------------------------


def system_prompt(tok, num_tokens: int) -> str:
    """Whole paragraphs of GPL-3 from the top until ~``num_tokens`` tokens."""
    paragraphs = [" ".join(p.split()) for p in SYSTEM_TEXT.read_text().split("\n\n") if p.strip()]
    text = ""
    for p in paragraphs:
        longer = f"{text}\n\n{p}" if text else p
        if len(tok.encode(longer, add_special_tokens=False)) > num_tokens:
            break
        text = longer
    return text


def questions(tok, count: int, num_tokens: int) -> list[str]:
    """``count`` distinct consecutive ~``num_tokens``-token pieces of the Apache-2.0 text."""
    ids = tok.encode(" ".join(QUESTION_TEXT.read_text().split()), add_special_tokens=False)
    if len(ids) < count * num_tokens:
        raise ValueError(f"{QUESTION_TEXT} is too short for {count} questions")
    pieces = [ids[i * num_tokens : (i + 1) * num_tokens] for i in range(count)]
    return [f"Explain this clause: {tok.decode(p).strip()}" for p in pieces]


def make_prompts(tok, args: argparse.Namespace) -> list[Ids]:
    system = system_prompt(tok, args.system_tokens)
    prompts = []
    for q in questions(tok, args.requests, args.question_tokens):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(tok.encode(text, add_special_tokens=False))
    return prompts


def common_prefix(prompts: list[Ids]) -> int:
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts):
            return i
    return n


# ---- running -----------------------------------------------------------------------------------


def run(args: argparse.Namespace, prompts: list[Ids] | None, caching: bool):
    """Load an engine, warm it up, run the workload; returns (result, prompts used)."""
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=caching)
    tok = llm.get_tokenizer()
    prompts = prompts or make_prompts(tok, args)
    # Warm-up on a prompt that shares nothing with the workload (and no cache entries).
    llm.generate("Warm up: the quick brown fox", SamplingParams(max_tokens=4, temperature=0))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True, logprobs=2)
    before = llm.engine.get_stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    stats = llm.engine.get_stats()
    result = RunResult(
        caching=caching,
        wall_s=wall,
        ttft_s=[_ttft(o) for o in outs],
        queue_s=[o.metrics.first_scheduled_time - o.metrics.arrival_time for o in outs],
        num_cached_tokens=[o.num_cached_tokens for o in outs],
        output_ids=[o.outputs[0].token_ids for o in outs],
        top2_gaps=[_gaps(o) for o in outs],
        prefix_cache_queries=stats.prefix_cache_queries - before.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits - before.prefix_cache_hits,
        num_preemptions=stats.num_preemptions - before.num_preemptions,
    )
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_usable_blocks, "blocks left in use"
    del llm, kv, outs
    gc.collect()
    return result, prompts


def _gaps(out: RequestOutput) -> list[float]:
    gaps = []
    for entry in out.outputs[0].logprobs or []:
        top = sorted((lp.logprob for lp in entry.values()), reverse=True)
        gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return gaps


def divergences(off: RunResult, on: RunResult) -> list[dict[str, Any]]:
    """Where the two runs' tokens first differ, with the top-2 gaps of both runs there."""
    out = []
    for i, (a, b) in enumerate(zip(off.output_ids, on.output_ids, strict=True)):
        k = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if k is not None:
            gaps = (off.top2_gaps[i][k], on.top2_gaps[i][k])
            out.append({"request": i, "token": k, "top2_gap_off": gaps[0], "top2_gap_on": gaps[1]})
    return out


def _ttft(out: RequestOutput) -> float:
    m = out.metrics
    return m.first_token_time - m.arrival_time


# ---- report ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    metric: str
    off: float
    on: float

    @property
    def ratio(self) -> float:
        return self.on / self.off if self.off else float("nan")


def make_rows(off: RunResult, on: RunResult) -> list[Row]:
    med = statistics.median
    return [
        Row("median TTFT (s), incl. queueing", med(off.ttft_s), med(on.ttft_s)),
        Row("p90 TTFT (s)", _p90(off.ttft_s), _p90(on.ttft_s)),
        Row("median queueing before first step (s)", med(off.queue_s), med(on.queue_s)),
        Row("wall time (s)", off.wall_s, on.wall_s),
        Row("request throughput (req/s)", off.req_per_s, on.req_per_s),
        Row("output throughput (tok/s)", off.out_tok_per_s, on.out_tok_per_s),
        Row("prefix cache hit rate", off.hit_rate, on.hit_rate),
        Row("mean cached prompt tokens / request", _mean(off), _mean(on)),
        Row("preemptions", off.num_preemptions, on.num_preemptions),
    ]


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) > 1 else xs[0]


def _mean(r: RunResult) -> float:
    return statistics.mean(r.num_cached_tokens)


def format_table(title: str, rows: list[Row]) -> str:
    header = f"{'metric':<40} | {'caching off':>11} | {'caching on':>10} | {'on/off':>8}"
    lines = [title, header, "-" * len(header)]
    lines += [f"{r.metric:<40} | {r.off:>11.3f} | {r.on:>10.3f} | {r.ratio:>8.3f}" for r in rows]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="engine dtype (default: %(default)s)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--question-tokens", type=int, default=50)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="8 requests, 300-token system, 16 new")
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.system_tokens, args.new_tokens = 8, 300, 16
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = machine_info()
    print(
        f"machine: {info['cpu']}, {info['cpus']} CPUs, torch {info['torch']}, load {info['load_average']}"
    )
    off, prompts = run(args, None, caching=False)
    on, _ = run(args, prompts, caching=True)
    lengths = [len(p) for p in prompts]
    shared = common_prefix(prompts)
    title = (
        f"{args.model}, {args.requests} requests submitted at once, prompts of "
        f"{min(lengths)}-{max(lengths)} tokens sharing the first {shared}, "
        f"{args.new_tokens} new tokens each (greedy)"
    )
    rows = make_rows(off, on)
    print(format_table(title, rows))
    same = sum(a == b for a, b in zip(off.output_ids, on.output_ids, strict=True))
    diverged = divergences(off, on)
    print(f"identical outputs: {same}/{len(prompts)} requests")
    for d in diverged:
        print(
            f"  request {d['request']} differs from token {d['token']} on, where the top-2 "
            f"logprob gap was {d['top2_gap_off']:.4f} (off) / {d['top2_gap_on']:.4f} (on)"
        )
    speedup_ttft = statistics.median(off.ttft_s) / statistics.median(on.ttft_s)
    speedup_tput = on.req_per_s / off.req_per_s
    print(
        f"median TTFT {speedup_ttft:.2f}x lower (target >= 5x), request throughput "
        f"{speedup_tput:.2f}x higher (target >= 2.5x), hit rate {on.hit_rate:.1%}"
    )
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report = {
        "machine": info,
        "config": config,
        "workload": {"prompt_tokens": lengths, "shared_prefix_tokens": shared},
        "rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
        "ttft_speedup": speedup_ttft,
        "throughput_speedup": speedup_tput,
        "identical_outputs": same,
        "divergences": diverged,
        "runs": {("on" if r.caching else "off"): _run_json(r) for r in (off, on)},
        "load_average_after": list(os.getloadavg()),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


def _run_json(r: RunResult) -> dict[str, Any]:
    d = asdict(r)
    d.pop("output_ids")
    d.pop("top2_gaps")
    return d | {"req_per_s": r.req_per_s, "hit_rate": r.hit_rate}


if __name__ == "__main__":
    main()

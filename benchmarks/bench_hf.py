"""Benchmark fastforward against HF transformers on SmolLM2-135M, in one process, back to back.

Usage::

    python benchmarks/bench_hf.py                      # bf16, 128 new tokens, batch 32
    python benchmarks/bench_hf.py --dtypes bfloat16 float32
    python benchmarks/bench_hf.py --quick              # smoke run: 16 new tokens, batch 4
    python benchmarks/bench_hf.py --skip-hf            # fastforward only
    python benchmarks/bench_hf.py --profile            # plus a cProfile of fastforward decode steps

Both engines load the same GGUF file (``fastforward.hub.pull("smollm2-135m")``, Q4_1, dequantized
to ``--dtype`` at load), get the same prompt token ids (``--prompt-tokens`` tokens of real text
each: paragraphs of a license file on this machine), decode greedily and ignore EOS (HF:
``min_new_tokens=max_new_tokens``). Each engine is warmed up once with a short generation.

What is measured (N = ``--new-tokens``):

* single stream, one prompt:
  - TTFT: wall time of a 1-token generation (prefill + first sample);
  - end-to-end tok/s: N / wall time of the N-token generation;
  - decode tok/s: (N - 1) / (wall - TTFT), i.e. without the prefill;
  - fastforward also reports decode tok/s from its own ``RequestMetrics``
    (``first_token_time`` -> ``finished_time``) as a cross-check.
* batched throughput: ``--batch`` prompts, N new tokens each, in one call (HF: a left-padded
  batch ``generate``; fastforward: ``LLM.generate``, continuous batching); generated tokens /
  wall time.
* greedy agreement on the single-stream prompt: how many leading tokens match (a sanity check:
  the two bf16 implementations round differently, so a late divergence is normal).

Every measurement is repeated ``--repeats`` times, alternating the engines (HF, fastforward, HF,
...) so that both see the same machine load, and the best (shortest) time is kept: on a shared
machine the best of a few runs is the least disturbed one. The load average is printed, with a
warning when other processes compete for the CPUs (then trust only the ratios, if anything).
On a shared machine both engines' OpenMP threads spin-wait for CPUs they do not get, which can
slow every step down tenfold; ``OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_hf.py`` keeps the
figures usable there (the setting is recorded in the JSON).

Prints a table (metric | HF transformers | fastforward | ratio ff/HF) and writes
``benchmarks/results/bench_hf.json`` (every sample included). For tok/s a ratio above 1 means
fastforward is faster; for times (TTFT, wall) a ratio below 1 does. ``torch.set_num_threads`` is
left at its default.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import platform
import pstats
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import torch

# Run as a plain script from anywhere: import fastforward from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastforward import LLM, EngineArgs, SamplingParams  # noqa: E402
from fastforward.hub import pull  # noqa: E402

MODEL = "smollm2-135m"
RESULTS = Path(__file__).resolve().parent / "results" / "bench_hf.json"
_PY = f"python{sys.version_info[0]}.{sys.version_info[1]}"
TEXT_SOURCES = (
    Path("/usr/share/common-licenses/GPL-3"),
    Path(sys.base_prefix) / "LICENSE.txt",
    Path(sys.base_prefix) / "lib" / _PY / "LICENSE.txt",
)

Ids = list[int]  # token ids of one prompt or one completion
T = TypeVar("T")


@dataclass
class Generation:
    """What one ``generate`` call returns: the new ids per prompt, and the decode time of the
    first request by the engine's own clock (first token -> finished) where it tells: fastforward
    by its request metrics, HF transformers for a single prompt by a streamer."""

    tokens: list[Ids]
    internal_decode_s: float | None = None


GenerateFn = Callable[[list[Ids], int], Generation]


@dataclass
class Engine:
    name: str
    generate: GenerateFn
    load_s: float


@dataclass
class Samples:
    """Wall times (s) of repeated runs of one measurement, and the last run's output."""

    times: list[float] = field(default_factory=list)
    internal: list[float] = field(default_factory=list)  # fastforward's own decode times
    last: Generation | None = None

    @property
    def best(self) -> float:
        return min(self.times)


@dataclass
class EngineResult:
    load_s: float
    new_tokens: int
    ttft: Samples
    single: Samples
    batched: Samples

    @property
    def single_tokens(self) -> Ids:
        assert self.single.last is not None
        return self.single.last.tokens[0]

    @property
    def e2e_tok_s(self) -> float:
        return self.new_tokens / self.single.best

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / max(self.single.best - self.ttft.best, 1e-9)

    @property
    def batched_tokens(self) -> int:
        assert self.batched.last is not None
        return sum(len(t) for t in self.batched.last.tokens)

    @property
    def batched_tok_s(self) -> float:
        return self.batched_tokens / self.batched.best

    @property
    def internal_decode_tok_s(self) -> float | None:
        internal = self.single.internal
        return (self.new_tokens - 1) / min(internal) if internal else None


@dataclass
class Row:
    metric: str
    hf: float | None
    ff: float | None
    ratio: float | None = field(init=False)

    def __post_init__(self) -> None:
        self.ratio = self.ff / self.hf if self.hf and self.ff is not None else None


# ---------------------------------------------------------------------------------- prompts


def read_text() -> str:
    """The first license text found on this machine."""
    for path in TEXT_SOURCES:
        if path.is_file():
            return path.read_text(encoding="utf-8", errors="replace")
    raise FileNotFoundError(f"no text to make prompts from; tried {[str(p) for p in TEXT_SOURCES]}")


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, whitespace collapsed, short headings dropped."""
    paras = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return [p for p in paras if len(p) > 40]


def make_prompts(encode: Callable[[str], Ids], count: int, num_tokens: int) -> list[Ids]:
    """``count`` distinct prompts of exactly ``num_tokens`` ids: consecutive paragraphs joined
    until long enough, then cut. Wraps around the text (one paragraph later) if it runs out."""
    paras = paragraphs(read_text())
    prompts: list[Ids] = []
    start = 0
    while len(prompts) < count:
        ids: Ids = []
        i = start
        while len(ids) < num_tokens:
            ids += encode(paras[i % len(paras)] + "\n\n")
            i += 1
        prompts.append(ids[:num_tokens])
        start = i if i < len(paras) else (i % len(paras)) + 1
    return prompts


# ---------------------------------------------------------------------------------- engines


def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)


def load_fastforward(dtype: str, batch: int) -> tuple[LLM, GenerateFn]:
    kwargs: dict[str, Any] = {"max_num_seqs": max(64, batch), "download_progress": False}
    if "enable_prefix_caching" in {f.name for f in fields(EngineArgs)}:
        # Timed runs repeat prompts; HF recomputes them every time, so fastforward must too.
        kwargs["enable_prefix_caching"] = False
    llm = LLM(MODEL, dtype=dtype, **kwargs)

    def generate(prompts: list[Ids], new_tokens: int) -> Generation:
        outs = llm.generate(prompts, greedy(new_tokens))
        cached = sum(o.num_cached_tokens for o in outs)
        if cached:  # the timings assume every prompt token is computed
            print(f"warning: fastforward took {cached} prompt tokens from a cache", file=sys.stderr)
        m = outs[0].metrics
        internal = m.finished_time - m.first_token_time if m and m.finished_time else None
        return Generation([list(o.outputs[0].token_ids) for o in outs], internal)

    return llm, generate


def load_hf(
    dtype: torch.dtype, model: str = MODEL, temperature: float = 0.0, top_p: float = 1.0
) -> GenerateFn:
    """HF transformers' ``generate`` on ``model``: greedy, or sampled at ``temperature`` with
    ``top_p`` (no top-k: the model's generation config would otherwise add its own)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    _silence_gguf_progress_bar()
    path = pull(model)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    model.eval()
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}

    def generate(prompts: list[Ids], new_tokens: int) -> Generation:
        batch = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        clock = TokenClock() if len(prompts) == 1 else None  # streamers take one prompt
        with torch.inference_mode():
            out = model.generate(
                **batch,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                **sampling,
                pad_token_id=tok.pad_token_id,
                streamer=clock,
            )
        width = batch["input_ids"].shape[1]
        return Generation([row[width:].tolist() for row in out], clock and clock.decode_s())

    return generate


class TokenClock:
    """A transformers streamer that notes when tokens come out: ``generate`` hands it the prompt
    first, then each new token as it is sampled."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_s(self) -> float | None:
        """First new token -> last (None before a second new token)."""
        return self.times[-1] - self.times[1] if len(self.times) > 2 else None


def _silence_gguf_progress_bar() -> None:
    """transformers' GGUF loader draws a tqdm bar that no logging setting turns off."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        return
    if hasattr(gguf_utils, "tqdm"):
        gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)


# ---------------------------------------------------------------------------------- timing


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Wall time of ``fn()`` and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def alternate(
    engines: list[Engine], prompts: list[Ids], new_tokens: int, repeats: int
) -> dict[str, Samples]:
    """Time ``generate(prompts, new_tokens)`` ``repeats`` times per engine, engines taking turns."""
    samples = {e.name: Samples() for e in engines}
    for _ in range(repeats):
        for e in engines:
            wall, gen = timed(lambda e=e: e.generate(prompts, new_tokens))
            samples[e.name].times.append(wall)
            samples[e.name].last = gen
            if gen.internal_decode_s is not None:
                samples[e.name].internal.append(gen.internal_decode_s)
    return samples


def bench(
    engines: list[Engine], warmup: Ids, prompts: list[Ids], args: argparse.Namespace
) -> dict[str, EngineResult]:
    """Warm up every engine, then the single-stream and batched measurements, alternating."""
    for e in engines:
        e.generate([warmup], 8)
    n = args.new_tokens
    ttft = alternate(engines, prompts[:1], 1, args.repeats)
    single = alternate(engines, prompts[:1], n, args.repeats)
    batched = alternate(engines, prompts[: args.batch], n, args.repeats)
    for e in engines:
        got = [len(t) for t in batched[e.name].last.tokens + single[e.name].last.tokens]
        if any(g != n for g in got):
            print(
                f"warning: {e.name} generated {sorted(set(got))} tokens, not {n}", file=sys.stderr
            )
    return {
        e.name: EngineResult(e.load_s, n, ttft[e.name], single[e.name], batched[e.name])
        for e in engines
    }


def leading_agreement(a: Ids, b: Ids) -> int:
    """How many tokens at the start of ``a`` and ``b`` are identical."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------- profile


def profile_ff_decode(llm: LLM, prompts: list[Ids], steps: int, top: int = 20) -> str:
    """cProfile of ``steps`` decode steps of the engine with ``len(prompts)`` sequences running
    (their prefill done first, outside the profile)."""
    engine = llm.engine
    ids = [engine.add_request(p, greedy(steps + 2)) for p in prompts]
    started: set[str] = set()
    while not started.issuperset(ids):  # prefill (in chunks, maybe) until all have a token
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    wall = time.perf_counter() - start
    for rid in ids:
        engine.abort_request(rid)
    buf = io.StringIO()
    buf.write(
        f"fastforward: {steps} decode steps at batch {len(prompts)}, "
        f"{wall / steps * 1e3:.1f} ms/step under cProfile; sorted by tottime\n"
    )
    pstats.Stats(profiler, stream=buf).strip_dirs().sort_stats("tottime").print_stats(top)
    return buf.getvalue().rstrip() + "\n"


# ---------------------------------------------------------------------------------- report


def machine_info() -> dict[str, Any]:
    cpu, isa = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in text]
    return {
        "cpu": cpu,
        "isa": isa,
        "cpus": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "transformers": _transformers_version(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "MKL_", "KMP_"))},
    }


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def check_load(when: str, cpus: int | None) -> float:
    """Print the 1-minute load average; warn when it says the CPUs are shared."""
    load = os.getloadavg()[0]
    busy = cpus is not None and load > cpus + 0.5
    note = ""
    if busy:
        note = f" -- more than {cpus} CPUs' worth: timings are disturbed"
        if os.environ.get("OMP_WAIT_POLICY", "").lower() != "passive":
            note += " (spinning OpenMP threads suffer most: try OMP_WAIT_POLICY=PASSIVE)"
    print(f"load average {when}: {load:.2f}{note}", flush=True)
    return load


def make_rows(hf: EngineResult | None, ff: EngineResult, batch: int) -> list[Row]:
    def both(fn: Callable[[EngineResult], float]) -> tuple[float | None, float]:
        return (fn(hf) if hf else None), fn(ff)

    n = ff.new_tokens
    return [
        Row("load time (s)", *both(lambda r: r.load_s)),
        Row("single: TTFT (ms)", *both(lambda r: r.ttft.best * 1e3)),
        Row(f"single: decode tok/s ({n} new)", *both(lambda r: r.decode_tok_s)),
        Row("single: decode tok/s, ff's own metrics", None, ff.internal_decode_tok_s),
        Row(f"single: end-to-end tok/s ({n} new)", *both(lambda r: r.e2e_tok_s)),
        Row(f"batched: tok/s ({batch} x {n} new)", *both(lambda r: r.batched_tok_s)),
        Row("batched: wall time (s)", *both(lambda r: r.batched.best)),
    ]


def format_table(title: str, rows: list[Row]) -> str:
    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    header = f"{'metric':<40} | {'HF transformers':>15} | {'fastforward':>11} | {'ratio ff/HF':>11}"
    lines = [title, header, "-" * len(header)]
    lines += [
        f"{r.metric:<40} | {cell(r.hf):>15} | {cell(r.ff):>11} | {cell(r.ratio):>11}" for r in rows
    ]
    return "\n".join(lines)


def result_json(r: EngineResult) -> dict[str, Any]:
    return {
        "load_s": r.load_s,
        "ttft_s": r.ttft.times,
        "single_s": r.single.times,
        "batched_s": r.batched.times,
        "single_decode_tok_s": r.decode_tok_s,
        "single_e2e_tok_s": r.e2e_tok_s,
        "single_internal_decode_tok_s": r.internal_decode_tok_s,
        "batched_tokens": r.batched_tokens,
        "batched_tok_s": r.batched_tok_s,
        "single_tokens": r.single_tokens,
    }


# ---------------------------------------------------------------------------------- main


def run_dtype(dtype: str, args: argparse.Namespace, cpus: int | None) -> dict[str, Any]:
    """Load both engines at ``dtype``, measure them, print the table; returns the JSON record."""
    load_s, (llm, ff_generate) = timed(lambda: load_fastforward(dtype, args.batch))
    engines = [Engine("fastforward", ff_generate, load_s)]
    if not args.skip_hf:
        hf_load_s, hf_generate = timed(lambda: load_hf(getattr(torch, dtype)))
        engines.insert(0, Engine("hf", hf_generate, hf_load_s))
    tok = llm.get_tokenizer()
    encode = functools.partial(tok.encode, add_special_tokens=False)
    prompts = make_prompts(encode, args.batch + 1, args.prompt_tokens)
    warmup, prompts = prompts[-1], prompts[:-1]
    print(f"[{dtype}] measuring {', '.join(e.name for e in engines)} ...", flush=True)
    load_before = check_load("before", cpus)
    results = bench(engines, warmup, prompts, args)
    load_after = check_load("after", cpus)
    ff, hf = results["fastforward"], results.get("hf")
    rows = make_rows(hf, ff, args.batch)
    print()
    print(format_table(f"SmolLM2-135M, {dtype}, prompts of {args.prompt_tokens} tokens", rows))
    record: dict[str, Any] = {
        "rows": [asdict(r) for r in rows],
        "load_average": [load_before, load_after],
        "engines": {name: result_json(r) for name, r in results.items()},
    }
    if hf:
        lead = leading_agreement(hf.single_tokens, ff.single_tokens)
        same = sum(x == y for x, y in zip(hf.single_tokens, ff.single_tokens, strict=False))
        record["agreement"] = {"leading": lead, "same_position": same, "of": ff.new_tokens}
        print(
            f"greedy agreement on the single-stream prompt: the first {lead}/{ff.new_tokens} "
            f"tokens are identical ({same}/{ff.new_tokens} equal position by position)"
        )
    if args.profile:
        record["profile"] = {}
        for batch in sorted({1, args.batch}):
            report = profile_ff_decode(llm, prompts[:batch], args.profile_steps)
            print("\n" + report)
            record["profile"][f"batch_{batch}"] = report
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float32"], help="run each dtype")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement (best kept)")
    p.add_argument("--skip-hf", action="store_true", help="benchmark fastforward only")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 new tokens, batch 4")
    p.add_argument("--profile", action="store_true", help="cProfile fastforward decode steps")
    p.add_argument("--profile-steps", type=int, default=32)
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens, args.batch, args.repeats = 16, 4, 1
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (the decode rate leaves out the first token)")
    if args.batch < 1 or args.repeats < 1 or args.prompt_tokens < 1:
        p.error("--batch, --repeats and --prompt-tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = machine_info()
    print(
        f"machine: {info['cpu']} ({info['cpus']} CPUs; {' '.join(info['isa'])}), "
        f"torch {info['torch']} ({info['torch_threads']} threads), "
        f"transformers {info['transformers']}, python {info['python']}"
        + "".join(f", {k}={v}" for k, v in info["env"].items())
    )
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results = {d: run_dtype(d, args, info["cpus"]) for d in (args.dtypes or [args.dtype])}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": info, "config": config, "results": results}
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()

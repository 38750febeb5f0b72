"""Benchmark fastforward against HF transformers on SmolLM2-135M, in one process, back to back.

Usage::

    python benchmarks/bench_hf.py                      # bf16, 128 new tokens, batch 32
    python benchmarks/bench_hf.py --dtypes bfloat16 float32
    python benchmarks/bench_hf.py --quick              # smoke run: 16 new tokens, batch 4
    python benchmarks/bench_hf.py --skip-hf            # fastforward only
    python benchmarks/bench_hf.py --profile            # plus a cProfile of fastforward decode steps

Both engines load the same GGUF file (``fastforward.hub.pull("smollm2-135m")``, Q4_1, dequantized
to ``--dtype`` at load), get the same prompt token ids (~``--prompt-tokens`` tokens of real text:
paragraphs of a license file on this machine), decode greedily and ignore EOS (HF:
``min_new_tokens=max_new_tokens``). Each engine is warmed up once with a short generation; every
measurement runs HF first, then fastforward, so both see the same machine load.

What is measured:

* single stream, one prompt, ``--new-tokens`` N new tokens (median of ``--repeats`` runs):
  - TTFT: wall time of a 1-token generation (prefill + first sample);
  - end-to-end tok/s: N / wall time of the N-token generation;
  - decode tok/s: (N - 1) / (wall - TTFT), i.e. excluding the prefill;
  - fastforward also reports decode tok/s from its own ``RequestMetrics``
    (``first_token_time`` -> ``finished_time``) as a cross-check.
* batched throughput: ``--batch`` prompts, N new tokens each, one call (HF: a left-padded
  batch ``generate``; fastforward: ``LLM.generate`` with continuous batching);
  total generated tokens / wall time.
* greedy agreement on the single-stream prompt: matching leading tokens (sanity check only;
  bf16 rounding differs between the two implementations, so late divergence is normal).

Prints a table (metric | HF transformers | fastforward | ratio ff/HF) and writes
``benchmarks/results/bench_hf.json``. For tok/s a ratio above 1 means fastforward is faster; for
TTFT a ratio below 1 does. ``torch.set_num_threads`` is left at its default.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# Run as a plain script from anywhere: import fastforward from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastforward import LLM, SamplingParams  # noqa: E402
from fastforward.hub import pull  # noqa: E402

MODEL = "smollm2-135m"
RESULTS = Path(__file__).resolve().parent / "results" / "bench_hf.json"
TEXT_SOURCES = (
    Path("/usr/share/common-licenses/GPL-3"),
    Path(sys.base_prefix) / "LICENSE.txt",
    Path(sys.base_prefix) / f"lib/python{sys.version_info[0]}.{sys.version_info[1]}/LICENSE.txt",
)

# Token ids of one prompt.
Ids = list[int]
# Generate for a list of prompts, N new tokens each; returns the generated ids per prompt.
GenerateFn = Callable[[list[Ids], int], list[Ids]]


@dataclass
class SingleStream:
    ttft_s: float
    e2e_s: float
    new_tokens: int
    tokens: Ids
    internal_decode_tok_s: float | None = None  # fastforward's RequestMetrics, if available

    @property
    def e2e_tok_s(self) -> float:
        return self.new_tokens / self.e2e_s

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / max(self.e2e_s - self.ttft_s, 1e-9)


@dataclass
class Batched:
    wall_s: float
    total_tokens: int

    @property
    def tok_s(self) -> float:
        return self.total_tokens / self.wall_s


@dataclass
class EngineResult:
    load_s: float
    single: SingleStream
    batched: Batched


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
    """``count`` prompts of exactly ``num_tokens`` ids: consecutive paragraphs joined until long
    enough, then cut. Wraps around the text (with a different start) if it runs out."""
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


def load_fastforward(dtype: str, batch: int) -> tuple[LLM, GenerateFn]:
    llm = LLM(MODEL, dtype=dtype, max_num_seqs=max(64, batch), download_progress=False)

    def generate(prompts: list[Ids], new_tokens: int) -> list[Ids]:
        outs = llm.generate(prompts, greedy(new_tokens))
        check_no_cache_hits(outs)
        return [list(o.outputs[0].token_ids) for o in outs]

    return llm, generate


def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)


def check_no_cache_hits(outs: list[Any]) -> None:
    """Timings assume every prompt is computed; warn if a prefix cache served part of one."""
    cached = sum(o.num_cached_tokens for o in outs)
    if cached:
        print(f"warning: fastforward served {cached} prompt tokens from cache", file=sys.stderr)


def load_hf(dtype: torch.dtype) -> GenerateFn:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = pull(MODEL)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    model.eval()

    def generate(prompts: list[Ids], new_tokens: int) -> list[Ids]:
        batch = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(
                **batch,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        width = batch["input_ids"].shape[1]
        return [row[width:].tolist() for row in out]

    return generate


# ---------------------------------------------------------------------------------- timing


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure_single(
    generate: GenerateFn, prompt: Ids, new_tokens: int, repeats: int
) -> SingleStream:
    """Median TTFT (1-token runs) and median wall time of N-token runs, one prompt."""
    ttfts = [timed(lambda: generate([prompt], 1))[0] for _ in range(repeats)]
    runs = [timed(lambda: generate([prompt], new_tokens)) for _ in range(repeats)]
    tokens = runs[0][1][0]
    if len(tokens) != new_tokens:
        print(f"warning: generated {len(tokens)} tokens, asked for {new_tokens}", file=sys.stderr)
    return SingleStream(
        ttft_s=statistics.median(ttfts),
        e2e_s=statistics.median(t for t, _ in runs),
        new_tokens=new_tokens,
        tokens=tokens,
    )


def ff_internal_decode(llm: LLM, prompt: Ids, new_tokens: int, repeats: int) -> float:
    """Decode tok/s from fastforward's own request timestamps (first token -> finished)."""
    rates = []
    for _ in range(repeats):
        m = llm.generate([prompt], greedy(new_tokens))[0].metrics
        rates.append((new_tokens - 1) / (m.finished_time - m.first_token_time))
    return statistics.median(rates)


def measure_batched(generate: GenerateFn, prompts: list[Ids], new_tokens: int) -> Batched:
    wall, outs = timed(lambda: generate(prompts, new_tokens))
    return Batched(wall_s=wall, total_tokens=sum(len(o) for o in outs))


def bench_engine(
    generate: GenerateFn, warmup: Ids, prompts: list[Ids], args: argparse.Namespace, load_s: float
) -> EngineResult:
    generate([warmup], 8)
    single = measure_single(generate, prompts[0], args.new_tokens, args.repeats)
    batched = measure_batched(generate, prompts[: args.batch], args.new_tokens)
    return EngineResult(load_s=load_s, single=single, batched=batched)


def leading_agreement(a: Ids, b: Ids) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------- profile


def profile_ff_decode(llm: LLM, prompt: Ids, steps: int, top: int = 20) -> str:
    """cProfile of ``steps`` single-stream decode steps of the engine (prefill excluded)."""
    engine = llm.engine
    rid = engine.add_request(prompt, greedy(steps + 2))
    engine.step()  # prefill
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    engine.abort_request(rid)
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf).strip_dirs().sort_stats("tottime")
    buf.write(f"fastforward: {steps} decode steps, batch 1, sorted by tottime\n")
    stats.print_stats(top)
    return buf.getvalue()


# ---------------------------------------------------------------------------------- report


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        flags = Path("/proc/cpuinfo").read_text()
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    except OSError:
        isa = []
    return {
        "cpu": cpu,
        "isa": isa,
        "logical_cpus": _cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "transformers": _transformers_version(),
    }


def _cpu_count() -> int | None:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def rows_for(hf: EngineResult | None, ff: EngineResult, ff_internal: float) -> list[Row]:
    def pick(fn: Callable[[EngineResult], float]) -> tuple[float | None, float]:
        return (fn(hf) if hf else None), fn(ff)

    n = ff.single.new_tokens
    b = ff.batched.total_tokens // max(n, 1)
    return [
        Row("load time (s)", *pick(lambda r: r.load_s)),
        Row("single: TTFT (ms)", *pick(lambda r: r.single.ttft_s * 1e3)),
        Row(f"single: decode tok/s ({n} new)", *pick(lambda r: r.single.decode_tok_s)),
        Row("single: decode tok/s (ff metrics)", None, ff_internal),
        Row(f"single: end-to-end tok/s ({n} new)", *pick(lambda r: r.single.e2e_tok_s)),
        Row(f"batched: tok/s ({b} x {n} new)", *pick(lambda r: r.batched.tok_s)),
        Row("batched: wall time (s)", *pick(lambda r: r.batched.wall_s)),
    ]


def format_table(title: str, rows: list[Row]) -> str:
    def cell(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    header = f"{'metric':<36} | {'HF transformers':>15} | {'fastforward':>11} | {'ratio ff/HF':>11}"
    lines = [title, header, "-" * len(header)]
    lines += [
        f"{r.metric:<36} | {cell(r.hf):>15} | {cell(r.ff):>11} | {cell(r.ratio, '.2f'):>11}"
        for r in rows
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main


def run_dtype(dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """Load both engines at ``dtype``, measure them, print the table; returns the JSON record."""
    load_s, (llm, ff_generate) = timed(lambda: load_fastforward(dtype, args.batch))
    encode = llm.get_tokenizer().encode
    prompts = make_prompts(encode, args.batch + 1, args.prompt_tokens)
    warmup, prompts = prompts[-1], prompts[:-1]
    hf = None
    if not args.skip_hf:
        hf_load_s, hf_generate = timed(lambda: load_hf(getattr(torch, dtype)))
        print(f"[{dtype}] HF transformers ...", flush=True)
        hf = bench_engine(hf_generate, warmup, prompts, args, hf_load_s)
    print(f"[{dtype}] fastforward ...", flush=True)
    ff = bench_engine(ff_generate, warmup, prompts, args, load_s)
    ff_internal = ff_internal_decode(llm, prompts[0], args.new_tokens, args.repeats)
    rows = rows_for(hf, ff, ff_internal)
    print()
    print(format_table(f"SmolLM2-135M, {dtype}, prompt {args.prompt_tokens} tokens", rows))
    record: dict[str, Any] = {"rows": [asdict(r) for r in rows]}
    record["fastforward"] = _engine_json(ff)
    if hf:
        record["hf"] = _engine_json(hf)
        agree = leading_agreement(hf.single.tokens, ff.single.tokens)
        same = sum(x == y for x, y in zip(hf.single.tokens, ff.single.tokens, strict=False))
        record["agreement"] = {"leading": agree, "same_position": same, "of": args.new_tokens}
        print(
            f"greedy agreement (single-stream prompt): first {agree}/{args.new_tokens} tokens "
            f"identical, {same}/{args.new_tokens} equal position by position"
        )
    if args.profile:
        report = profile_ff_decode(llm, prompts[0], args.profile_steps)
        print()
        print(report)
        record["profile"] = report
    return record


def _engine_json(result: EngineResult) -> dict[str, Any]:
    s, b = result.single, result.batched
    return {
        "load_s": result.load_s,
        "ttft_s": s.ttft_s,
        "single_e2e_s": s.e2e_s,
        "single_decode_tok_s": s.decode_tok_s,
        "single_e2e_tok_s": s.e2e_tok_s,
        "single_tokens": s.tokens,
        "batched_wall_s": b.wall_s,
        "batched_tokens": b.total_tokens,
        "batched_tok_s": b.tok_s,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float32"], help="run each dtype")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3, help="single-stream runs (median)")
    p.add_argument("--skip-hf", action="store_true", help="benchmark fastforward only")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 new tokens, batch 4")
    p.add_argument("--profile", action="store_true", help="cProfile fastforward decode steps")
    p.add_argument("--profile-steps", type=int, default=32)
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens, args.batch, args.repeats = 16, 4, 1
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (decode rate excludes the first token)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = machine_info()
    print(
        f"machine: {info['cpu']} ({info['logical_cpus']} CPUs, {' '.join(info['isa'])}), "
        f"torch {info['torch']} ({info['torch_threads']} threads), "
        f"transformers {info['transformers']}, python {info['python']}"
    )
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results = {d: run_dtype(d, args) for d in (args.dtypes or [args.dtype])}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"machine": info, "config": config, "results": results}, indent=2)
    )
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()

"""Where a batched generation's time goes: the engine's steps and their parts, by wall clock.

Usage::

    python benchmarks/bench_step.py                        # SmolLM2-135M, 64 x (100 + 128)
    python benchmarks/bench_step.py --batch 8 --temperature 0.8 --top-p 0.95
    python benchmarks/bench_step.py --temperature 0.7 --top-k 40 --top-p 0.9 --min-p 0.05

Runs bench_cpu.py's batched workload (``--batch`` prompts of ``--prompt`` tokens, ``--new`` new
tokens each, ignoring EOS, prefix caching off) through ``LLM.generate`` with timers around the
engine's parts, then prints:

* the timeline: the steps that computed prompt tokens (how many tokens, how many decodes rode
  along, seconds) and the decode-only steps (count, median and total seconds);
* a decode-only step of the full batch taken apart (medians over those steps, ms): scheduling,
  batch preparation, the model (embedding, the decoder layers -- the fused C++ stack or the
  module path -- and the final norm), the output projection (the full logits, or for steps of
  plain greedy picks its int8 greedy screen, ``layers/greedy_screen.py``), sampling, the
  scheduler's update, and the rest of the engine's step (outputs, detokenizing, stop checks).

The timers wrap the engine's own methods on this one engine object (nothing else changes);
a wrapped call costs ~1 us, against steps of milliseconds. Timings on shared VMs move 10-30%
between runs: compare parts within a run. Writes ``benchmarks/results/bench_step.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PARTS = ("schedule", "prepare", "stack", "head", "screen", "sample", "update")


def timed(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that appends its wall time (s) to ``record`` on every call."""

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - t)

    return wrapper


def instrument(engine) -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """Timers around ``engine``'s parts (instance attributes: this engine only): the per-call
    times of each part, and a record per engine step (its kind and seconds)."""
    times: dict[str, list[float]] = defaultdict(list)
    steps: list[dict[str, Any]] = []
    runner, model = engine.runner, engine.runner.model
    engine.scheduler.schedule = timed(times["schedule"], engine.scheduler.schedule)
    engine.scheduler.update = timed(times["update"], engine.scheduler.update)
    runner.prepare = timed(times["prepare"], runner.prepare)
    model.compute_logits = timed(times["head"], model.compute_logits)
    runner._screened = timed(times["screen"], runner._screened)  # greedy steps' int8 screen
    engine._sample = timed(times["sample"], engine._sample)
    model.forward = timed(times["stack"], model.forward)
    execute = runner.execute

    def execute_and_note(sched, *args, **kwargs):
        prompt = sum(s.num_new_tokens for s in sched.scheduled if s.num_new_tokens > 1)
        decodes = sum(1 for s in sched.scheduled if s.num_new_tokens == 1)
        steps.append({"prompt_tokens": prompt, "decodes": decodes})
        return execute(sched, *args, **kwargs)

    runner.execute = execute_and_note
    step = engine.step

    def step_and_time():
        t = time.perf_counter()
        n = len(steps)
        calls = {part: len(times[part]) for part in PARTS}
        out = step()
        if len(steps) > n:  # a step that ran the model: each part's calls in it, summed
            steps[-1]["seconds"] = time.perf_counter() - t
            for part in PARTS:
                steps[-1][part] = sum(times[part][calls[part] :])
        return out

    engine.step = step_and_time
    return times, steps


def summarize(steps: list[dict[str, Any]], wall: float, generated: int) -> dict[str, Any]:
    prompt_steps = [s for s in steps if s["prompt_tokens"]]
    decode_steps = [s for s in steps if not s["prompt_tokens"]]
    out: dict[str, Any] = {
        "wall_s": wall,
        "tok_s": generated / wall,
        "prompt_steps": [
            {k: s[k] for k in ("prompt_tokens", "decodes", "seconds")} for s in prompt_steps
        ],
        "prompt_steps_s": sum(s["seconds"] for s in prompt_steps),
        "decode_steps": len(decode_steps),
        "decode_steps_s": sum(s["seconds"] for s in decode_steps),
    }
    full = [s for s in decode_steps if s["decodes"] == max(d["decodes"] for d in decode_steps)]
    if full:
        med = {p: statistics.median(s[p] for s in full) * 1e3 for p in (*PARTS, "seconds")}
        med["rest"] = med["seconds"] - sum(med[p] for p in PARTS)
        out["decode_step_ms"] = med
        out["decode_step_rows"] = full[0]["decodes"]
    return out


def report(s: dict[str, Any]) -> str:
    lines = [f"{s['wall_s']:.2f} s, {s['tok_s']:.0f} generated tok/s"]
    lines.append(
        f"steps with prompt tokens: {len(s['prompt_steps'])}, {s['prompt_steps_s']:.2f} s "
        "(prompt tokens + decodes riding along: seconds)"
    )
    for p in s["prompt_steps"]:
        lines.append(f"  {p['prompt_tokens']:5d} + {p['decodes']:3d}: {p['seconds']:.3f} s")
    lines.append(f"decode-only steps: {s['decode_steps']}, {s['decode_steps_s']:.2f} s")
    if "decode_step_ms" in s:
        m = s["decode_step_ms"]
        lines.append(f"a decode step of {s['decode_step_rows']} rows (medians, ms):")
        labels = {
            "schedule": "scheduling",
            "prepare": "batch preparation",
            "stack": "model (embedding, layers, norm)",
            "head": "output projection (logits)",
            "screen": "output projection (greedy screen)",
            "sample": "sampling",
            "update": "scheduler update",
            "rest": "rest (outputs, detokenizing)",
        }
        for part, label in labels.items():
            lines.append(f"  {label:33s} {m[part]:8.3f}  {m[part] / m['seconds']:6.1%}")
        lines.append(f"  {'whole step':33s} {m['seconds']:8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="new tokens a prompt")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0: off")
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "bench_step.json")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.prompt < 1 or args.new < 2:
        ap.error("--batch and --prompt at least 1, --new at least 2")

    from bench_cpu import prompts

    from fastforward import LLM, SamplingParams

    llm = LLM(
        args.model,
        max_num_seqs=max(64, args.batch),
        enable_prefix_caching=False,
        download_progress=False,
    )
    params = SamplingParams(
        max_tokens=args.new,
        ignore_eos=True,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
    )
    llm.generate(prompts(args.model, 2, 16), SamplingParams(max_tokens=4))  # warm-up
    ps = prompts(args.model, args.batch, args.prompt, offset=3)
    _, steps = instrument(llm.engine)
    t = time.perf_counter()
    llm.generate(ps, params)
    summary = summarize(steps, time.perf_counter() - t, args.batch * args.new)
    print(report(summary))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, **summary}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

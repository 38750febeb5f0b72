"""Structured outputs on real schemas: do constrained generations parse and validate, and what
does the constraint cost per token?

1. ``--n`` generations (default 1000) over the real SchemaStore schemas of ``schema_corpus``
   (half greedy, half sampled at temperature 0.8 with a seed each), batched through the engine;
   every finished output must ``json.loads`` and validate with ``jsonschema`` against its
   schema. Outputs cut by ``--max-tokens`` are counted apart (they cannot be complete); with
   ``--finish-reserve N`` the last N tokens of the budget steer each output to its end, and
   outputs so shortened (``finish_reason`` "length", complete JSON) are validated and counted
   apart too.
   Schemas the grammar engine refuses (too large, external ``$ref``) are counted and named.
2. Overhead at batch 1 and batch 32: the share of engine step time spent computing and
   applying token masks and advancing the matchers, measured inside the same runs.

Prints a summary and writes ``benchmarks/results/bench_structured.json``.

    python benchmarks/bench_structured.py [--n 1000] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).parent))
from schema_corpus import load_corpus, prompt_for  # noqa: E402

from fastforward import LLM, SamplingParams  # noqa: E402
from fastforward.layers import sampler as sampler_module  # noqa: E402
from fastforward.structured_outputs import StructuredOutputsParams  # noqa: E402


class MaskTimer:
    """Wraps the sampler's mask step and the engine's matcher step (once) to time them."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        sampler_module.apply_grammar_masks = self._timed(sampler_module.apply_grammar_masks)
        llm.engine._advance_grammars = self._timed(llm.engine._advance_grammars)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def usable_schemas(llm: LLM, corpus):
    ok, refused = [], []
    for item in corpus:
        try:
            llm.engine.grammars.compile(StructuredOutputsParams(json=item.schema))
            ok.append(item)
        except ValueError as e:
            refused.append((item.name, str(e).splitlines()[0][:120]))
    return ok, refused


def run(
    llm: LLM,
    timer: MaskTimer,
    schemas,
    n: int,
    max_tokens: int,
    batch: int,
    penalties: dict | None = None,
    finish_reserve: int = 0,
) -> dict:
    """``penalties``: SamplingParams fields against loops (repetition_penalty, dry_*)."""
    jobs = []
    for i in range(n):
        item = schemas[i % len(schemas)]
        sampled = (i // len(schemas)) % 2 == 1 or (n <= len(schemas) and i % 2 == 1)
        params = SamplingParams(
            max_tokens=max_tokens,
            **(penalties or {}),
            temperature=0.8 if sampled else 0.0,
            seed=i if sampled else None,
            structured_outputs=StructuredOutputsParams(
                json=item.schema, finish_reserve=finish_reserve
            ),
        )
        jobs.append((item, prompt_for(item), params))
    llm.engine.scheduler.config.max_num_seqs = batch
    mask_before = timer.seconds
    start = time.perf_counter()
    outs = llm.generate([p for _, p, _ in jobs], [sp for _, _, sp in jobs])
    wall = time.perf_counter() - start
    counts: Counter[str] = Counter()
    failures, cut, shortened = [], [], []
    tokens = 0
    for (item, _, params), out in zip(jobs, outs, strict=True):
        c = out.outputs[0]
        tokens += len(c.token_ids)
        try:
            value = json.loads(c.text)
        except json.JSONDecodeError as e:
            if c.finish_reason == "length":  # cut mid-way: it cannot be complete
                counts["cut_by_max_tokens"] += 1
                cut.append(
                    {"schema": item.name, "sampled": params.temperature > 0, "tail": c.text[-200:]}
                )
            else:
                counts["invalid"] += 1
                failures.append({"schema": item.name, "text": c.text[:300], "error": str(e)[:300]})
            continue
        try:
            jsonschema.validate(value, item.schema)
        except jsonschema.ValidationError as e:
            counts["invalid"] += 1
            failures.append({"schema": item.name, "text": c.text[:300], "error": str(e)[:300]})
            continue
        if c.finish_reason == "length":  # complete, but ended early by the budget
            counts["valid_shortened_by_budget" if finish_reserve else "valid_at_max_tokens"] += 1
            shortened.append({"schema": item.name, "sampled": params.temperature > 0})
        else:
            counts["valid"] += 1
    mask_s = timer.seconds - mask_before
    return {
        "generations": n,
        "batch": batch,
        **dict(counts),
        "generated_tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "mask_s": round(mask_s, 3),
        "mask_share_of_time": round(mask_s / wall, 4),
        "failures": failures[:20],
        "cut": cut[:40],
        "shortened": shortened[:40],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="for the 1,000-generation run (small models loop on array items and digits)",
    )
    ap.add_argument(
        "--dry-multiplier",
        type=float,
        default=0.0,
        help="DRY for the 1,000-generation run (llama.cpp's sampler; 0.8 is its usual setting)",
    )
    ap.add_argument(
        "--dry-sequence-breakers",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='DRY\'s breakers as a JSON list (default llama.cpp\'s ["\\n", ":", "\\"", "*"]; '
        "[] lets DRY see repeats of JSON structure, e.g. a recursive schema nested on and on)",
    )
    ap.add_argument(
        "--finish-reserve",
        type=int,
        default=0,
        metavar="N",
        help="structured_outputs.finish_reserve of the 1,000-generation run: the last N tokens "
        "of --max-tokens steer each output to its end (0: off)",
    )
    ap.add_argument("--overhead-n", type=int, default=64, help="generations per overhead run")
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "bench_structured.json")
    )
    args = ap.parse_args()

    llm = LLM(args.model, max_num_seqs=32)
    schemas, refused = usable_schemas(llm, load_corpus())
    print(f"{len(schemas)} schemas usable, {len(refused)} refused by the grammar engine")
    timer = MaskTimer(llm)
    penalties = {
        "repetition_penalty": args.repetition_penalty,
        "dry_multiplier": args.dry_multiplier,
    }
    if args.dry_sequence_breakers is not None:
        penalties["dry_sequence_breakers"] = args.dry_sequence_breakers
    main_run = run(
        llm,
        timer,
        schemas,
        args.n,
        args.max_tokens,
        batch=32,
        penalties=penalties,
        finish_reserve=args.finish_reserve,
    )
    lists = ("failures", "cut", "shortened")
    print(json.dumps({k: v for k, v in main_run.items() if k not in lists}, indent=1))
    overhead = {}
    for batch in (1, 32):
        n = args.overhead_n if batch > 1 else max(8, args.overhead_n // 8)
        r = run(llm, timer, schemas, n, args.max_tokens, batch=batch)
        overhead[batch] = {
            k: r[k] for k in ("generated_tokens", "wall_s", "mask_s", "mask_share_of_time")
        }
        print(f"batch {batch}: masking {100 * r['mask_share_of_time']:.1f}% of generation time")
    result = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "repetition_penalty": args.repetition_penalty,
        "dry_multiplier": args.dry_multiplier,
        "dry_sequence_breakers": args.dry_sequence_breakers,
        "finish_reserve": args.finish_reserve,
        "schemas_usable": len(schemas),
        "schemas_refused": refused,
        "run": main_run,
        "overhead": overhead,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

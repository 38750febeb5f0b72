"""Benchmark the int8 KV cache against the model-dtype (bf16) cache on SmolLM2-135M.

Usage::

    python benchmarks/bench_kv_cache.py               # 48 requests x 256 new tokens
    python benchmarks/bench_kv_cache.py --quick       # 16 requests x 64

One ``LLM`` per cache dtype, one after the other in this process, both with the same KV memory
budget (``--kv-mib``, small on purpose: the point is what a fixed amount of cache memory buys).
Measured per dtype:

* KV bytes per token and tokens per GiB (from the engine's KV config);
* a memory-bound batch: ``--requests`` prompts of ~``--prompt-tokens`` tokens (consecutive
  pieces of the GPL-3 text on this machine, ``/usr/share/common-licenses/GPL-3``), all
  submitted at once, each generating ``--new-tokens`` greedy tokens: the most requests running
  at once, preemptions, wall time and output tokens/s;
* single-stream decode tok/s at a short and a long context (``--long-context`` tokens), one over
  the median time between tokens: the int8 cache reads half the bytes per key but dequantizes;
* greedy agreement: of ``--greedy-prompts`` 64-token prompts (later pieces of the same text),
  how many give the same first 32 generated tokens with either cache; and, as the noise floor,
  how many the plain PyTorch path (``kernels="torch"``, model-dtype cache) gives like the
  kernel path.

Prints a table (metric | auto | int8 | int8/auto) and writes
``benchmarks/results/bench_kv_cache.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastforward import LLM, SamplingParams  # noqa: E402
from fastforward.entrypoints.eval import decode_speed, kv_bytes_per_token  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_kv_cache.json"
TEXT = Path("/usr/share/common-licenses/GPL-3")


def prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    ids = llm.engine.tokenizer.encode(TEXT.read_text())
    need = n * length
    ids = (ids * (need // len(ids) + 1))[:need]
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def batch_run(llm: LLM, batch: list[list[int]], new_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(p, params, request_id=f"b{i}")
    most, tokens = 0, 0
    preempted = set()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        most = max(most, len(engine.scheduler.running))
        live = engine.scheduler.running + list(engine.scheduler.waiting)
        preempted |= {r.request_id for r in live if r.num_preemptions}
    wall = time.perf_counter() - start
    return {
        "max_running": most,
        "requests_preempted": len(preempted),
        "wall_s": round(wall, 2),
        "output_tok_s": round(tokens / wall, 1),
    }


def measure(args, kv: str) -> dict:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_dtype=kv,
        kv_cache_memory_bytes=args.kv_mib << 20,
        max_model_len=args.long_context + 64,
        max_num_seqs=args.requests,
        enable_prefix_caching=False,
    )
    cfg = llm.engine.kv_config
    per_token = kv_bytes_per_token(llm.engine)
    row = {
        "kv_dtype": str(llm.engine.kv_dtype),
        "kv_bytes_per_token": per_token,
        "tokens_per_gib": (1 << 30) // per_token,
        "blocks": cfg.num_blocks,
    }
    row |= batch_run(llm, prompts(llm, args.requests, args.prompt_tokens), args.new_tokens)
    long_prompt = prompts(llm, 1, args.long_context)[0]
    row["decode_tok_s_short"] = round(decode_speed(llm, long_prompt[:32], args.decode_tokens), 2)
    row["decode_tok_s_long"] = round(decode_speed(llm, long_prompt, args.decode_tokens), 2)
    row["greedy_tokens"] = greedy_tokens(llm, args.greedy_prompts)
    del llm
    gc.collect()
    return row


def greedy_tokens(llm: LLM, n: int) -> list[list[int]]:
    """The first 32 greedy tokens after each of ``n`` 64-token prompts: pieces of the text from
    token 5000 on (not the batch's prompts)."""
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts(llm, 80 + n, 64)[80:], greedy, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def noise_floor(args, reference: list[list[int]]) -> int:
    """How many prompts the plain PyTorch path (``kernels="torch"``, same dtype, unquantized
    cache) continues like the kernel path: the agreement two implementations of the same
    numbers reach, i.e. how often a greedy path of 32 tokens meets a near-tie that rounding
    alone flips."""
    llm = LLM(args.model, dtype=args.dtype, kernels="torch", enable_prefix_caching=False)
    tokens = greedy_tokens(llm, args.greedy_prompts)
    del llm
    gc.collect()
    return sum(a == b for a, b in zip(reference, tokens, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv-mib", type=int, default=96, help="KV cache memory of both engines")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--long-context", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="auto", help="model dtype of both engines")
    ap.add_argument("--greedy-prompts", type=int, default=32, help="for the 32-token agreement")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.new_tokens, args.long_context, args.decode_tokens = 16, 64, 512, 16
    rows = {kv: measure(args, kv) for kv in ("auto", "int8")}
    a, b = rows["auto"], rows["int8"]
    floor = noise_floor(args, a["greedy_tokens"])
    same = [x == y for x, y in zip(a.pop("greedy_tokens"), b.pop("greedy_tokens"), strict=True)]
    print(f"{'metric':<22}{'auto':>12}{'int8':>12}{'int8/auto':>11}")
    for key in a:
        if key == "kv_dtype":
            print(f"{key:<22}{a[key]:>12}{b[key]:>12}")
            continue
        ratio = b[key] / a[key] if a[key] else float("nan")
        print(f"{key:<22}{a[key]:>12}{b[key]:>12}{ratio:>10.2f}x")
    print(f"greedy: {sum(same)} of {len(same)} prompts give the same first 32 tokens")
    print(
        f"noise floor: the plain PyTorch path with the {a['kv_dtype']} cache gives the kernel"
        f" path's first 32 tokens on {floor} of {len(same)}"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        **{k: v for k, v in vars(args).items()},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    agree = {"prompts": len(same), "same_first_32_tokens": sum(same), "torch_path_same": floor}
    RESULTS.write_text(
        json.dumps({"config": meta, "results": rows, "greedy_agreement": agree}, indent=2)
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

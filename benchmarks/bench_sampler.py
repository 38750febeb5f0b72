"""Benchmark the sampler's cost per step at batch 1, 8 and 64 on a real model's logits.

Usage::

    python benchmarks/bench_sampler.py            # SmolLM2-135M, batches 1 8 64
    python benchmarks/bench_sampler.py --batches 64 --reps 5

Each request has a prompt of 100 ids and 120 generated ones (for the penalties). The logits
are SmolLM2-135M's (``LLM("smollm2-135m")``, default dtype) for the next token after
each of ``max(batches)`` prompts of ~100 tokens (the batched workload of bench_cpu.py), taken
from one engine step. For each setting below, every row of the batch asks for it, and three
samplers pick one token a row, side by side in this process:

* ``reference``: vLLM v1's torch path: penalties from dense [rows, vocab] counts
  (fastforward's ``apply_penalties_dense``), the whole vocabulary sorted for top-k/top-p, then
  the exponential race ``argmax(softmax / E)`` with an ``E ~ Exp(1)`` a token, logprobs from a
  ``log_softmax`` of the batch (this file);
* ``ff torch``: fastforward's ``Sampler`` without the C++ kernels (top-p from candidates, one
  uniform a row through a float64 cumulative sum);
* ``ff``: fastforward's ``Sampler`` as the engine builds it (argmax_rows, sample_logits,
  top_p_filter_ and mask_below_).

Prints ms per step for each and the reference / ff ratio, and writes
``benchmarks/results/bench_sampler.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "T=0.8": dict(temperature=0.8),
    "T=1 seeded": dict(temperature=1.0, seed=1),
    "T=0.8 top_k=50": dict(temperature=0.8, top_k=50),
    "T=0.8 top_p=0.95": dict(temperature=0.8, top_p=0.95),
    "T=0.7 top_k=40 top_p=0.9 min_p=0.05": dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
    "T=0.8 repetition_penalty=1.1": dict(temperature=0.8, repetition_penalty=1.1),
    "T=0.8 frequency/presence 0.5/0.3": dict(
        temperature=0.8, frequency_penalty=0.5, presence_penalty=0.3
    ),
    "T=0.8 logprobs=5": dict(temperature=0.8, logprobs=5),
}


def real_logits(model: str, rows: int) -> torch.Tensor:
    """[rows, V] fp32 logits of a decode step of rows prompts of ~100 tokens (the engine's
    sampler sees them all in one call once every prompt is in)."""
    from bench_cpu import prompts

    from fastforward import LLM, SamplingParams

    llm = LLM(model, enable_prefix_caching=False, max_num_seqs=rows, download_progress=False)
    sampler, seen = llm.engine.sampler, []

    def capture(logits, requests, owned=False):
        if logits.shape[0] == rows:
            seen[:] = [logits.float().clone()]
        return sampler(logits, requests, owned=owned)

    llm.engine.sampler = capture
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate(prompts(model, rows, 100, offset=3), params, use_tqdm=False)
    return seen[0]


def reference_sample(
    logits: torch.Tensor, params: dict, gen: torch.Generator, reqs: list
) -> torch.Tensor:
    """vLLM v1's torch-native sampling of every row with the same settings."""
    from fastforward.layers.sampler import apply_penalties_dense

    if params.get("logprobs"):
        lp = torch.log_softmax(logits, dim=-1)
        lp.topk(params["logprobs"], dim=-1)
    if params["temperature"] == 0.0:
        return logits.argmax(dim=-1)
    x = logits.clone()
    apply_penalties_dense(x, reqs)
    x = x / params["temperature"]
    if params.get("min_p"):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * params["min_p"], -1e30)
    if params.get("top_k") or params.get("top_p"):
        sorted_x, order = x.sort(dim=-1)
        if params.get("top_k"):
            kth = sorted_x[:, -params["top_k"]].unsqueeze(1)
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if params.get("top_p"):
            cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
            drop = cum <= 1.0 - params["top_p"]
            drop[:, -1] = False
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = x.scatter(1, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return probs.div_(torch.empty_like(probs).exponential_(generator=gen)).argmax(dim=-1)


def request(i: int, params: dict):
    """Request i with these settings, 100 prompt ids and 120 generated ones."""
    from fastforward.request import Request
    from fastforward.sampling_params import SamplingParams

    req = Request(f"r{i}", list(range(100 + i, 200 + i)), SamplingParams(max_tokens=300, **params))
    for t in range(120):
        req.append_token((t * 37 + i) % 5000)
    return req


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "bench_sampler.json")
    args = ap.parse_args()

    from fastforward import kernels
    from fastforward.layers.sampler import FilterKernels, Sampler

    if not kernels.available():
        sys.exit("bench_sampler: the C++ kernels do not build here")
    ops = kernels.ops()
    logits = real_logits(args.model, max(args.batches))
    gen = torch.Generator().manual_seed(0)
    results = []
    print(f"{'setting':<38} {'batch':>5} {'reference':>10} {'ff torch':>9} {'ff':>7} {'ratio':>6}")
    for name, params in SETTINGS.items():
        for b in args.batches:
            x = logits[:b]
            reqs = [request(i, params) for i in range(b)]
            plain = Sampler(seed=0)
            fast = Sampler(
                seed=0,
                argmax=ops.argmax_rows,
                sample_logits=ops.sample_logits,
                filter_kernels=FilterKernels.from_ops(ops),
            )
            row = {
                "setting": name,
                "batch": b,
                "reference_ms": timed(
                    lambda x=x, p=params, r=reqs: reference_sample(x, p, gen, r), args.reps
                ),
                "ff_torch_ms": timed(
                    lambda x=x, r=reqs, f=plain: f(x.clone(), r, owned=True), args.reps
                ),
                "ff_ms": timed(lambda x=x, r=reqs, f=fast: f(x.clone(), r, owned=True), args.reps),
            }
            results.append(row)
            ratio = row["reference_ms"] / row["ff_ms"]
            print(
                f"{name:<38} {b:>5} {row['reference_ms']:>10.2f} {row['ff_torch_ms']:>9.2f} "
                f"{row['ff_ms']:>7.2f} {ratio:>5.1f}x"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

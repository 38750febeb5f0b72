"""Matmul time of every weight format over a whole model's linears (so the weights stream from
memory as in decoding, not from cache), at several batch sizes, on one thread.

    python benchmarks/bench_quant_kernels.py [--model smollm2|qwen0.5b] [--rows 1,8,16,32,128,256]

For each packed format both paths are timed: the packed kernel and the dense fallback
(dequantize to bf16, then the bf16 matmul); each module's ``packed_rows_max`` (``native_rows_max``
for fastforward's 4-bit kernel) is about where the second overtakes the first. ``*-native``
formats run fastforward's C++ kernels (``bf16-native``: ``linear_bf16``; ``int4-g*-native`` and
``codebook4-native``: ``linear_q4``) as the engine does after switching a model onto them.
Random weights of the model's shapes; ratios are against bf16 ``F.linear`` in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from fastforward.kernels.linear import PackedLinear
from fastforward.quant.codebook import CodebookLinear
from fastforward.quant.int4 import Int4Linear
from fastforward.quant.int8 import Int8GroupLinear, Int8Linear
from fastforward.quant.kmeans import CodebookWeights
from fastforward.quant.rtn import Int4Weights, Int8Weights

PACKED = (Int8Linear, Int4Linear, Int8GroupLinear)  # formats with a packed kernel path
NATIVE = (Int4Linear, CodebookLinear)  # ... and fastforward's 4-bit kernel
SHAPES = {  # per layer [out, in] of qkv, o, gate_up, down; layers; lm_head
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576)),
    "qwen0.5b": ([(1152, 896), (896, 896), (9728, 896), (896, 4864)], 24, (151936, 896)),
}


def _random_module(fmt: str, n: int, k: int) -> torch.nn.Module:
    if fmt == "bf16-native":
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.02).bfloat16()
        return PackedLinear(w, None, None, keep_dense=False, packed_rows_max=1 << 30)
    if fmt.endswith("-native"):
        module = _random_module(fmt.removesuffix("-native"), n, k)
        module.use_native_kernel()
        return module
    gen = torch.Generator().manual_seed(n * 7 + k)
    if fmt == "bf16":
        w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
        return lambda x: F.linear(x, w)  # noqa: E731
    if fmt == "int8":
        codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        return Int8Linear(Int8Weights(codes, torch.rand(n, generator=gen).bfloat16()))
    if fmt.startswith("int4"):
        g = int(fmt.split("g")[-1])
        while k % g:
            g //= 2
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        s = torch.rand(n, k // g, generator=gen) * 0.01
        return Int4Linear(Int4Weights(codes, s, s, g))
    if fmt == "int8-g32":
        codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        return Int8GroupLinear(codes, torch.rand(n, k // 32, generator=gen).half().float())
    if fmt == "codebook4":
        idx = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        centroids = torch.linspace(-1, 1, 16).bfloat16()
        return CodebookLinear(CodebookWeights(idx, centroids, torch.rand(n, k // 32), 32))
    raise ValueError(fmt)


def time_pass(modules, rows: int, reps: int = 5) -> float:
    xs = {k: torch.randn(rows, k).bfloat16() for _, k in modules}
    for m, k in modules:
        m(xs[k])
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for m, k in modules:
            m(xs[k])
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--rows", default="1,8,16,32,128,256")
    p.add_argument("--formats", default="bf16,int8,int4-g32,int4-g64,int8-g32,codebook4")
    ns = p.parse_args()
    torch.set_num_threads(1)
    per_layer, layers, head = SHAPES[ns.model]
    shapes = per_layer * layers + [head]
    rows = [int(r) for r in ns.rows.split(",")]
    print(f"{ns.model}: ms per pass over {len(shapes)} matrices, 1 thread")
    print(f"{'format':<18}{'path':<8}" + "".join(f"{f'M={r}':>10}" for r in rows))
    baseline = {}
    for fmt in ns.formats.split(","):
        modules = [(_random_module(fmt, n, k), k) for n, k in shapes]
        paths = {"bf16": ["dense"], "codebook4": ["dense"], "bf16-native": ["packed"]}.get(
            fmt, ["packed", "dense"]
        )
        for path in paths:
            cells = []
            for r in rows:
                for cls in PACKED:
                    cls.packed_rows_max = 1 << 30 if path == "packed" else 0
                for cls in NATIVE:
                    cls.native_rows_max = 1 << 30 if path == "packed" else 0
                ms = time_pass(modules, r)
                if fmt == "bf16":
                    baseline[r] = ms
                cells.append(
                    f"{ms:7.1f}" + (f"/{baseline[r] / ms:.1f}x" if fmt != "bf16" else "   ")
                )
            print(f"{fmt:<18}{path:<8}" + "".join(f"{c:>10}" for c in cells), flush=True)
        del modules


if __name__ == "__main__":
    main()

"""Time the linear kernels side by side over a whole model's matrices, from memory, by batch.

Usage::

    python benchmarks/bench_matmul.py                       # bf16 and 4-bit paths, 1-2,048 rows
    python benchmarks/bench_matmul.py --rows 8 64 --copies 30 --paths tiles onednn

Each path multiplies SmolLM2-135M's 120 layer matrices (qkv, o, gate/up, down of 30 layers)
and its 49152 x 576 output projection by ``rows`` rows of bf16 activations; the layer matrices
come in ``--copies`` random copies (30: one per layer, the 91 MB of a decode step, so they
stream from memory as in decoding; 1: the same four matrices, from cache), and the times are
scaled to one step (30 layers + the output projection). The paths, all on the weights as the
engine holds them:

* ``packed``: ``linear_bf16`` on the packed layout (the few-row kernel of CPUs without AVX512-BF16);
* ``onednn``: PyTorch's oneDNN linear on a weight prepacked by ``mkldnn::_reorder_linear_weight``;
* ``tiles``: ``linear_amx`` on AMX's tile layout (AMX tiles, or ``vdpbf16ps`` without AMX);
* ``int4-rows`` / ``codebook-rows``: ``linear_q4``'s few-row kernel on 4-bit codes (group 32;
  the layer matrices only);
* ``int4-tiles`` / ``codebook-tiles``: ``linear_q4_amx``, the codes expanded to bf16 tiles once
  per call (the layer matrices only).

Every path's output is checked against a float64 matmul first. Prints ms per step and GFLOP/s
for each path and row count (median of ``--reps`` passes), with the threads torch uses.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
LAYERS = 30
BF16_PATHS = ("packed", "onednn", "tiles")
Q4_PATHS = ("int4-rows", "int4-tiles", "codebook-rows", "codebook-tiles")


def q4_weight(n: int, k: int, table: torch.Tensor, gen: torch.Generator):
    """Random 4-bit codes, scales and zeros in linear_q4's layout, and the weight they stand for."""
    from fastforward.quant import q4pack

    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    s = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
    z = (torch.randn(n, k // 32, generator=gen) * 1e-3).to(torch.bfloat16)
    w = table.double()[codes.long()].view(n, -1, 32) * s.double()[..., None] + z.double()[..., None]
    return (q4pack.pack(codes), q4pack.pack_scales(s, z), table), w.view(n, k)


def build(path: str, copies: int, ops, gen: torch.Generator):
    """[(shape, weights, call(x, weight), repeat)] for one path."""
    shapes = [(s, copies, LAYERS // copies) for s in LAYER_SHAPES]
    if path in BF16_PATHS:
        shapes.append((HEAD, 1, 1))
    out = []
    for (n, k), count, repeat in shapes:
        dense = [
            torch.randn(n, k, generator=gen).mul_(0.05).to(torch.bfloat16) for _ in range(count)
        ]
        if path == "packed":
            ws = [ops.pack_linear_weight(w) for w in dense]
            call = lambda x, w, n=n: ops.linear_bf16(x, w, n, None)  # noqa: E731
        elif path == "onednn":
            ws = [torch.ops.mkldnn._reorder_linear_weight(w) for w in dense]
            call = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
        elif path == "tiles":
            ws = [ops.pack_amx_weight(w) for w in dense]
            call = lambda x, w, n=n: ops.linear_amx(x, w, n, None, False)  # noqa: E731
        else:
            levels = (
                (torch.arange(16) - 8) if path.startswith("int4") else torch.linspace(-8, 7, 16)
            )
            table = levels.to(torch.bfloat16)
            pairs = [q4_weight(n, k, table, gen) for _ in range(count)]
            ws, dense = [p[0] for p in pairs], [p[1] for p in pairs]
            # linear_q4_rows: linear_q4's own kernel, which it hands larger batches from
            op = ops.linear_q4_rows if path.endswith("rows") else ops.linear_q4_amx
            call = lambda x, w, op=op: op(x, *w, 32)  # noqa: E731
        out.append(((n, k), ws, dense, call, repeat))
    return out


def check(entries, rows: int, gen: torch.Generator) -> None:
    for (n, k), ws, dense, call, _ in entries:
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        ref = x.double() @ dense[0].double().t()
        got = call(x, ws[0]).double()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        if err > 2e-2:
            raise SystemExit(f"bench_matmul: a path is off by {err:.3g} at {rows} rows, {n}x{k}")


def time_step(entries, rows: int, reps: int, gen: torch.Generator) -> float:
    xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for (_, k), *_ in entries}
    step = 0.0
    for (_, k), ws, _, call, repeat in entries:
        x = xs[k]
        call(x, ws[0])
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            for w in ws:
                call(x, w)
            times.append((time.perf_counter() - t) / len(ws))
        step += statistics.median(times) * len(ws) * repeat
    return step * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 256, 2048])
    ap.add_argument("--paths", nargs="+", default=list(BF16_PATHS + Q4_PATHS))
    ap.add_argument("--copies", type=int, choices=[1, 2, 3, 5, 6, 10, 15, 30], default=30)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    from fastforward import kernels

    if not kernels.available():
        raise SystemExit("bench_matmul: the C++ kernels do not build here")
    ops = kernels.ops()
    gen = torch.Generator().manual_seed(0)
    print(
        f"threads {torch.get_num_threads()}, AMX {ops.amx_native()}, "
        f"AVX512-BF16 tiles {ops.bf16_tiles_native()}, {args.copies} copies of each layer matrix"
    )
    print(f"{'path':<16}" + "".join(f"{f'{r} rows':>18}" for r in args.rows))
    for path in args.paths:
        if path in Q4_PATHS and not ops.bf16_tiles_native() and path.endswith("tiles"):
            print(f"{path:<16}  (needs AVX512-BF16)")
            continue
        entries = build(path, args.copies, ops, gen)
        flops = sum(2 * n * k * len(ws) * rep for (n, k), ws, _, _, rep in entries)
        cells = []
        for r in args.rows:
            check(entries, r, gen)
            ms = time_step(entries, r, args.reps, gen)
            cells.append(f"{ms:8.1f} ms {flops * r / ms / 1e6:4.0f} GF")
        print(f"{path:<16}" + "".join(f"{c:>18}" for c in cells), flush=True)
        del entries


if __name__ == "__main__":
    main()

"""``fastforward eval MODEL``: quality, memory and speed of weight formats, side by side.

For each format the model is loaded afresh and measured on the same tokens:

- perplexity of a fixed real text that ships with the machine (default: the GNU GPL v3 from
  Debian's ``/usr/share/common-licenses/GPL-3``, else CPython's own ``LICENSE.txt``), scored in
  windows of ``window`` tokens moved by ``stride`` (each token is scored once, with at least
  ``window - stride`` tokens of context after the first window);
- memory of the weights (bytes, bits per weight) and of the KV cache per token (``FMT+kv-int8``
  measures format FMT with an int8 KV cache);
- single-stream decode speed (greedy; one over the median time between tokens).

The table is printed, and saved as CSV and JSON with a PNG of quality and speed against bits
per weight next to them.
"""

from __future__ import annotations

import argparse
import csv
import gc
import hashlib
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

DEFAULT_FORMATS = "fp32,bf16,int8,int4,int4-g64,codebook4,gguf"
_DTYPE_FORMATS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def default_text() -> Path:
    gpl = Path("/usr/share/common-licenses/GPL-3")
    if gpl.is_file():
        return gpl
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return lib / "LICENSE.txt"


@dataclass(slots=True)
class EvalConfig:
    model: str
    formats: list[str]
    text: Path = field(default_factory=default_text)
    window: int = 512
    stride: int = 256
    max_tokens: int = 4096  # of the text
    decode_tokens: int = 64
    threads: int | None = None


@dataclass(slots=True)
class FormatResult:
    format: str
    dtype: str
    quantization: str | None
    perplexity: float
    tokens_scored: int
    weight_bytes: int
    bits_per_weight: float
    kv_bytes_per_token: int
    decode_tok_s: float
    load_s: float
    score_s: float
    left_float: list[str] = field(default_factory=list)


def engine_options(fmt: str) -> tuple[str, str | None, str]:
    """A format name -> (engine dtype, quantization, kv_cache_dtype). ``FMT+kv-int8`` is
    format FMT with an int8 KV cache."""
    from fastforward.kv.quant import KV_CACHE_DTYPES
    from fastforward.quant import parse_quantization

    weights, _, kv = fmt.partition("+")
    kv_dtype = "auto"
    if kv:
        kv_dtype = kv.removeprefix("kv-")
        if not kv.startswith("kv-") or kv_dtype not in KV_CACHE_DTYPES:
            choices = ", ".join(f"+kv-{k}" for k in KV_CACHE_DTYPES)
            raise ValueError(f"format {fmt!r}: the part after '+' must be one of {choices}")
    if weights in _DTYPE_FORMATS:
        return _DTYPE_FORMATS[weights], None, kv_dtype
    return "bfloat16", parse_quantization(weights).name, kv_dtype


def windowed_perplexity(llm, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """exp(mean NLL) over ``ids``, scoring each token once (HF's strided perplexity).

    Every window is one request with ``prompt_logprobs=0`` (the path the server's
    ``echo``/``logprobs`` uses), all submitted together so the engine batches them."""
    from fastforward.sampling_params import SamplingParams

    spans, prev_end = [], 0
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + window, len(ids))
        spans.append((begin, end, end - prev_end if prev_end else end - begin - 1))
        prev_end = end
        if end == len(ids):
            break
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([ids[b:e] for b, e, _ in spans], params, use_tqdm=False)
    nll, count = 0.0, 0
    for (begin, end, new), out in zip(spans, outs, strict=True):
        new = min(new, end - begin - 1)
        window_ids = ids[begin:end]
        entries = out.prompt_logprobs[len(window_ids) - new :]
        nll -= sum(e[t].logprob for e, t in zip(entries, window_ids[-new:], strict=True))
        count += new
    return float(torch.tensor(nll / count).exp()), count


def decode_speed(llm, prompt: list[int], tokens: int) -> float:
    """Greedy single-stream decode tokens/s: one over the median time between generated
    tokens (the median, not the mean, so other processes' bursts on a shared machine count
    less)."""
    from fastforward.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    stamps = [time.perf_counter() for _ in llm.stream(prompt, params)]
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    return 1.0 / gaps[len(gaps) // 2] if gaps else float("nan")


def kv_bytes_per_token(engine) -> int:
    return sum(
        g.spec.page_size_bytes // g.spec.block_size * len(g.layer_indices)
        for g in engine.kv_config.groups
    )


def evaluate_format(cfg: EvalConfig, fmt: str, ids: list[int]) -> FormatResult:
    from fastforward.entrypoints.llm import LLM
    from fastforward.quant.apply import weight_stats

    dtype, quantization, kv_dtype = engine_options(fmt)
    start = time.perf_counter()
    llm = LLM(
        cfg.model,
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_dtype,
        max_model_len=None,
    )
    load_s = time.perf_counter() - start
    engine = llm.engine
    start = time.perf_counter()
    ppl, count = windowed_perplexity(llm, ids, cfg.window, cfg.stride)
    score_s = time.perf_counter() - start
    stats = weight_stats(engine.model)
    speed = decode_speed(llm, ids[:32], cfg.decode_tokens)
    left = sorted(engine.quantization.skipped) if engine.quantization else []
    return FormatResult(
        fmt, dtype, quantization, ppl, count, stats.bytes, stats.bits_per_weight,
        kv_bytes_per_token(engine), speed, load_s, score_s, left,
    )  # fmt: skip


def run_eval(cfg: EvalConfig) -> list[FormatResult]:
    from fastforward.hub import resolve_model
    from fastforward.loader.model_loader import load_tokenizer

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg.model = str(resolve_model(cfg.model))
    text = cfg.text.read_text(encoding="utf-8", errors="replace")
    ids = load_tokenizer(cfg.model).encode(text)[: cfg.max_tokens]
    results = []
    for fmt in cfg.formats:
        engine_options(fmt)  # fail early on a bad name
    for fmt in cfg.formats:
        print(f"[eval] {fmt} ...", file=sys.stderr, flush=True)
        results.append(evaluate_format(cfg, fmt, ids))
        gc.collect()
    return results


def _ratios(results: list[FormatResult]) -> list[dict]:
    by = {r.format: r for r in results}
    ref, fast = by.get("fp32"), by.get("bf16")
    rows = []
    for r in results:
        row = asdict(r)
        row["ppl_vs_fp32_pct"] = 100 * (r.perplexity / ref.perplexity - 1) if ref else None
        row["bytes_vs_fp32"] = r.weight_bytes / ref.weight_bytes if ref else None
        row["decode_vs_bf16"] = r.decode_tok_s / fast.decode_tok_s if fast else None
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'format':<14}{'ppl':>9}{'vs fp32':>9}{'weights MB':>12}{'bits/w':>8}{'vs fp32':>9}"
        f"{'KV B/tok':>10}{'decode tok/s':>14}{'vs bf16':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        pct = "" if r["ppl_vs_fp32_pct"] is None else f"{r['ppl_vs_fp32_pct']:+.2f}%"
        mem = "" if r["bytes_vs_fp32"] is None else f"{r['bytes_vs_fp32']:.3f}x"
        spd = "" if r["decode_vs_bf16"] is None else f"{r['decode_vs_bf16']:.2f}x"
        lines.append(
            f"{r['format']:<14}{r['perplexity']:>9.3f}{pct:>9}{r['weight_bytes'] / 1e6:>12.1f}"
            f"{r['bits_per_weight']:>8.2f}{mem:>9}{r['kv_bytes_per_token']:>10}"
            f"{r['decode_tok_s']:>14.2f}{spd:>9}"
        )
    return "\n".join(lines)


def save_results(cfg: EvalConfig, rows: list[dict], out: Path) -> list[Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    # not with_suffix: a model name like qwen2.5-coder-0.5b has a dot of its own
    csv_path, json_path, png_path = (
        out.parent / f"{out.name}{s}" for s in (".csv", ".json", ".png")
    )
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(
            {k: (";".join(v) if isinstance(v, list) else v) for k, v in r.items()} for r in rows
        )
    text = cfg.text.read_bytes()
    meta = {
        "model": cfg.model,
        "text": str(cfg.text),
        "text_sha256": hashlib.sha256(text).hexdigest(),
        "window": cfg.window,
        "stride": cfg.stride,
        "max_tokens": cfg.max_tokens,
        "decode_tokens": cfg.decode_tokens,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    json_path.write_text(json.dumps({"config": meta, "results": rows}, indent=2))
    paths = [csv_path, json_path]
    if plot_results(rows, png_path, Path(cfg.model).name):
        paths.append(png_path)
    return paths


def plot_results(rows: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed (pip install 'fastforward[eval]'): no plot",
            file=sys.stderr,
        )
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in (
        (ax1, "perplexity", "perplexity (lower is better)"),
        (ax2, "decode_tok_s", "decode tokens/s (higher is better)"),
    ):
        xs = [r["bits_per_weight"] for r in rows]
        ys = [r[key] for r in rows]
        ax.scatter(xs, ys)
        for r, x, y in zip(rows, xs, ys, strict=True):
            ax.annotate(r["format"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks([4, 5, 6, 8, 16, 32], labels=["4", "5", "6", "8", "16", "32"])
        ax.set_xlabel("bits per weight (log scale)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: quality and speed vs bits per weight")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="perplexity, memory and decode speed across weight formats")
    p.add_argument("model", help="catalog name, .gguf file or HF directory")
    p.add_argument(
        "--formats",
        default=DEFAULT_FORMATS,
        help="comma-separated: fp32, bf16, fp16 or a --quantization method, each optionally "
        "with +kv-int8 for an int8 KV cache (default: %(default)s)",
    )
    p.add_argument(
        "--text", type=Path, default=None, help=f"text to score (default: {default_text()})"
    )
    p.add_argument("--window", type=int, default=512, help="tokens per scored window")
    p.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens of the text to score")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens generated for tok/s")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--out", type=Path, default=None, help="output path prefix (default: eval-MODEL)"
    )
    p.set_defaults(func=cmd_eval)


def cmd_eval(ns: argparse.Namespace) -> int:
    cfg = EvalConfig(
        model=ns.model,
        formats=[f.strip() for f in ns.formats.split(",") if f.strip()],
        text=ns.text or default_text(),
        window=ns.window,
        stride=ns.stride,
        max_tokens=ns.max_tokens,
        decode_tokens=ns.decode_tokens,
        threads=ns.threads,
    )
    if not 0 < ns.stride <= ns.window:
        raise ValueError("need 0 < stride <= window")
    rows = _ratios(run_eval(cfg))
    print(f"{cfg.model}: perplexity of {cfg.text} ({rows[0]['tokens_scored']} tokens)")
    print(format_table(rows))
    out = ns.out or Path(f"eval-{Path(cfg.model).stem}")
    for path in save_results(cfg, rows, out):
        print(f"wrote {path}")
    return 0

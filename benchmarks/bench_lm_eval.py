"""lm-evaluation-harness through fastforward's server, checked against the offline engine.

Starts ``fastforward serve MODEL`` on loopback and runs the harness's own CLI against it with
its ``local-completions`` model (``/v1/completions`` with ``echo: true, logprobs: 1,
max_tokens: 1``, token-id prompts) and ``tokenizer_backend=remote`` (our ``/tokenizer_info``,
``/tokenize``, ``/detokenize``), on a rolling-loglikelihood task (the harness's wikitext
recipe) over real texts from the machine: the licences in ``/usr/share/common-licenses``
(Debian's ``base-files``) and CPython's ``LICENSE.txt``. The harness reports word and byte
perplexity; per document it logs the total log-likelihood.

The same documents are then scored offline, in this process, by ``LLM.generate`` with
``prompt_logprobs`` on exactly the harness's windows (its ``get_rolling_token_windows`` and
``make_disjoint_window``, prefixed with the same token), and the two are compared per
document and as word perplexity.

    pip install "lm-eval[api]"   # not a dependency of fastforward
    python benchmarks/bench_lm_eval.py [--model smollm2-135m] [--max-length 1024]

Writes ``benchmarks/results/bench_lm_eval.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import Server, free_port  # noqa: E402

from fastforward import LLM, SamplingParams  # noqa: E402

LICENCES = Path("/usr/share/common-licenses")
TASK = "fastforward_licences"


def documents(limit: int) -> list[dict[str, str]]:
    """Real texts on the machine, named, in a fixed order; the largest ``limit`` of them."""
    paths = sorted(p for p in LICENCES.iterdir() if p.is_file() and not p.is_symlink())
    cpython = Path(sysconfig.get_paths()["stdlib"]).parent.parent / "LICENSE.txt"
    cpython = cpython if cpython.exists() else Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if cpython.exists():
        paths.append(cpython)
    docs = [
        {"name": p.name, "text": p.read_text(encoding="utf-8", errors="replace")} for p in paths
    ]
    docs = sorted(docs, key=lambda d: -len(d["text"]))[:limit]
    if not docs:
        raise SystemExit(f"no texts found under {LICENCES}")
    return sorted(docs, key=lambda d: d["name"])


def write_task(folder: Path, docs: list[dict[str, str]]) -> None:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    # The harness's wikitext task, pointed at a local JSON file.
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n"
        "  - metric: word_perplexity\n"
        "  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n"
    )


def run_harness(url: str, model: str, folder: Path, max_length: int) -> tuple[dict, dict, float]:
    """The harness's CLI against the server: its metrics and, per document name, its total
    log-likelihood."""
    out = folder / "out"
    args = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        f"base_url={url}/v1/completions,model={model},tokenizer_backend=remote,"
        f"max_length={max_length},num_concurrent=1,max_retries=1",
        "--tasks",
        TASK,
        "--include_path",
        str(folder),
        "--log_samples",
        "--output_path",
        str(out),
    ]
    start = time.perf_counter()
    subprocess.run(args, check=True)
    wall = time.perf_counter() - start
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][TASK]
    per_doc = {}
    for line in next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines():
        s = json.loads(line)
        resp = s["resps"][0][0]
        per_doc[s["doc"]["name"]] = float(resp[0] if isinstance(resp, list) else resp)
    return results, per_doc, wall


def offline_loglikelihoods(
    llm: LLM, docs: list[dict[str, str]], max_length: int
) -> tuple[dict[str, float], int]:
    """Each document's total log-likelihood on the harness's own windows, from
    ``prompt_logprobs`` of the offline engine; and the number of tokens scored."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    tok = llm.get_tokenizer()
    prefix = tok.bos_token_id or tok.eos_token_id  # the harness's remote-tokenizer rule
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out, scored = {}, 0
    for d in docs:
        windows = [
            make_disjoint_window(w)
            for w in get_rolling_token_windows(
                token_list=tok.encode(d["text"], add_special_tokens=False),
                prefix_token=prefix,
                max_seq_len=max_length - 2,  # as the harness: max_length - 1 - 1
                context_len=1,
            )
        ]
        prompts = [list(ctx) + list(cont) for ctx, cont in windows]
        total = 0.0
        for (ctx, cont), res in zip(windows, llm.generate(prompts, params), strict=True):
            ids, lps = res.prompt_token_ids, res.prompt_logprobs
            total += sum(lps[i][ids[i]].logprob for i in range(len(ctx), len(ids)))
            scored += len(cont)
        out[d["name"]] = total
    return out, scored


def words(text: str) -> int:
    return len(re.split(r"\s+", text))  # the harness's count_words


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-length", type=int, default=1024, help="the harness's max_length")
    ap.add_argument("--docs", type=int, default=8, help="the largest N texts")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_lm_eval.json"))
    args = ap.parse_args()

    docs = documents(args.docs)
    port = free_port()
    cmd = [
        sys.executable, "-m", "fastforward.entrypoints.cli", "serve", args.model,
        "--dtype", args.dtype, "--port", str(port), "--host", "127.0.0.1",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_task(folder, docs)
        with Server("fastforward", cmd, port, "/health", args.start_timeout) as server:
            results, harness, wall = run_harness(server.url, args.model, folder, args.max_length)

    llm = LLM(args.model, dtype=args.dtype)
    offline, scored = offline_loglikelihoods(llm, docs, args.max_length)
    n_words = sum(words(d["text"]) for d in docs)
    word_ppl = math.exp(-sum(offline.values()) / n_words)
    diffs = {name: harness[name] - offline[name] for name in offline}
    worst = max(abs(v) / abs(offline[k]) for k, v in diffs.items())
    print(f"{'document':<28} {'harness ll':>14} {'offline ll':>14} {'diff':>10}")
    for d in docs:
        n = d["name"]
        print(f"{n:<28} {harness[n]:>14.4f} {offline[n]:>14.4f} {diffs[n]:>10.2e}")
    hw = results["word_perplexity,none"]
    print(
        f"word perplexity: harness {hw:.6f}, offline {word_ppl:.6f} "
        f"({100 * (hw / word_ppl - 1):+.5f}%); worst per-document |diff| {worst:.2e} relative; "
        f"{scored} tokens scored; harness wall {wall:.1f} s"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "max_length": args.max_length,
                "documents": [d["name"] for d in docs],
                "harness_results": results,
                "harness_loglikelihood": harness,
                "offline_loglikelihood": offline,
                "offline_word_perplexity": word_ppl,
                "tokens_scored": scored,
                "harness_wall_s": wall,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

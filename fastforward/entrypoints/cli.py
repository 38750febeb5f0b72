"""The ``fastforward`` command: pull, generate, chat, serve, quantize, eval."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from fastforward.engine import EngineArgs
from fastforward.entrypoints import eval as eval_cmd
from fastforward.entrypoints import quantize as quantize_cmd
from fastforward.hub import DEFAULT_MODEL, default_cache_dir
from fastforward.kernels.apply import KERNEL_MODES
from fastforward.kv.quant import KV_CACHE_DTYPES


def _engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help="catalog name (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b; "
        "pulled on first use), a .gguf file, or an HF model directory (default: %(default)s)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        help="weight and activation dtype: auto (bfloat16 where the CPU has native bf16 or "
        "fastforward's bf16 kernels run, else float32), float32, bfloat16, float16 (default: %(default)s)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length in tokens, prompt plus output (default: the model's own)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=EngineArgs.max_num_seqs,
        help="most sequences decoded together in one step (default: %(default)s)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=EngineArgs.max_num_batched_tokens,
        help="token budget of one step; longer prompts are prefilled in chunks (default: %(default)s)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=EngineArgs.block_size,
        help="tokens per KV cache block (default: %(default)s)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="memory for the KV cache in GiB (default: 1 GiB, more if max-model-len needs it)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=EngineArgs.kv_cache_dtype,
        choices=("auto", *KV_CACHE_DTYPES),
        help="KV cache storage: auto (the model's dtype) or int8 (a scale per token and head, "
        "~2x the tokens in the same memory; default: %(default)s)",
    )
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="weight format: int8, int4 (groups of 32), int4-g64, int4-g128, codebook4, "
        "codebook4-g64, codebook8, or gguf (keep a GGUF file's blocks packed); default: none",
    )
    g.add_argument(
        "--kernels",
        default=EngineArgs.kernels,
        choices=KERNEL_MODES,
        help="auto: fastforward's C++ CPU kernels (paged attention, bf16 linears) where they "
        "build; native: insist on them; torch: the plain PyTorch reference paths "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4}\', '
        '\'{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}\' (a draft model of the '
        'same tokenizer) or \'{"method": "layer_skip"}\' (self-drafting); keys in '
        "docs/speculative.md (default: off)",
    )
    g.add_argument(
        "--no-fused-layers",
        dest="fused_layers",
        action="store_false",
        help="with the native kernels, run each layer's modules from Python instead of all "
        "layers in one C++ call per step (to measure what the fused stack gains)",
    )
    g.add_argument(
        "--no-huge-pages",
        dest="huge_pages",
        action="store_false",
        help="leave the weights and the KV cache in PyTorch's allocations instead of buffers "
        "of 2 MiB pages (Linux; to measure what the pages gain)",
    )
    g.add_argument(
        "--no-greedy-screen",
        dest="greedy_screen",
        action="store_false",
        help="compute the full logits for every step instead of picking the plain greedy "
        "tokens of one or two sequences through an int8 copy of the output projection (the "
        "same tokens; to measure what the screen gains, and to save the copy's memory)",
    )
    g.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="compute every prompt in full instead of reusing the KV of earlier requests' "
        "shared prefixes (prefix caching is on by default)",
    )


def _sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="tokens to generate at most (default: %(default)s)",
    )
    g.add_argument(
        "--temperature", "-t", type=float, default=0.0, help="0 = greedy (default: %(default)s)"
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats")
    g.add_argument(
        "--presence-penalty", type=float, default=0.0, help="in [-2, 2], OpenAI semantics"
    )
    g.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="in [-2, 2], OpenAI semantics"
    )
    g.add_argument(
        "--dry-multiplier",
        type=float,
        default=0.0,
        help="DRY: > 0 penalizes tokens that extend a repeated sequence (llama.cpp's sampler; "
        "0.8 is its usual setting)",
    )
    g.add_argument("--dry-base", type=float, default=1.75, help="DRY's growth per repeated token")
    g.add_argument(
        "--dry-allowed-length", type=int, default=2, help="DRY: repeats this long go free"
    )
    g.add_argument(
        "--sampling-seed", type=int, default=None, help="per-request seed for reproducible sampling"
    )
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    g = p.add_argument_group("structured output (one of them; docs/structured.md)")
    c = g.add_mutually_exclusive_group()
    c.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        default=None,
        help="the output is JSON valid against this JSON Schema (a file, or the schema inline)",
    )
    c.add_argument("--json", action="store_true", help="the output is a JSON object")
    c.add_argument("--regex", default=None, help="the output matches this regular expression")
    c.add_argument(
        "--grammar-file", default=None, help="the output follows this Lark grammar (a file)"
    )
    c.add_argument(
        "--choice", action="append", default=None, help="the output is one of these (repeatable)"
    )
    g.add_argument(
        "--finish-reserve",
        type=int,
        default=0,
        metavar="N",
        help="in the last N tokens of --max-tokens, steer the output to its end (close strings, "
        "arrays and objects) so that it still parses; it then finishes with 'length' "
        "(default: %(default)s = off)",
    )


def _engine_args(ns: argparse.Namespace) -> EngineArgs:
    memory = None if ns.kv_cache_memory is None else int(ns.kv_cache_memory * (1 << 30))
    return EngineArgs(
        model=ns.model,
        dtype=ns.dtype,
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        block_size=ns.block_size,
        kv_cache_memory_bytes=memory,
        seed=ns.seed,
        quantization=ns.quantization,
        kv_cache_dtype=ns.kv_cache_dtype,
        enable_prefix_caching=ns.enable_prefix_caching,
        fused_layers=ns.fused_layers,
        huge_pages=ns.huge_pages,
        greedy_screen=ns.greedy_screen,
        kernels=ns.kernels,
        speculative_config=ns.speculative_config,
    )


def _structured_outputs(ns: argparse.Namespace):
    """The output constraint of ``--json-schema``/``--json``/``--regex``/``--grammar-file``/
    ``--choice``, or None."""
    from fastforward.structured_outputs import StructuredOutputsParams

    if ns.json_schema is not None:
        text = ns.json_schema
        if not text.lstrip().startswith("{"):
            path = Path(text)
            if not path.is_file():
                raise ValueError(f"--json-schema: {text} is neither a file nor a JSON object")
            text = path.read_text()
        kind = {"json": text}
    elif ns.json:
        kind = {"json_object": True}
    elif ns.regex is not None:
        kind = {"regex": ns.regex}
    elif ns.grammar_file is not None:
        try:
            kind = {"grammar": Path(ns.grammar_file).read_text()}
        except OSError as e:
            raise ValueError(f"--grammar-file: {e}") from None
    elif ns.choice:
        kind = {"choice": ns.choice}
    else:
        if ns.finish_reserve:
            raise ValueError("--finish-reserve needs an output constraint (--json-schema, ...)")
        return None
    return StructuredOutputsParams(**kind, finish_reserve=ns.finish_reserve)


def _sampling_params(ns: argparse.Namespace):
    from fastforward.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty,
        presence_penalty=ns.presence_penalty,
        frequency_penalty=ns.frequency_penalty,
        dry_multiplier=ns.dry_multiplier,
        dry_base=ns.dry_base,
        dry_allowed_length=ns.dry_allowed_length,
        seed=ns.sampling_seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
        structured_outputs=_structured_outputs(ns),
    )


def _make_llm(ns: argparse.Namespace):
    from fastforward.entrypoints.llm import LLM

    kwargs = asdict(_engine_args(ns))
    return LLM(kwargs.pop("model"), **kwargs)


def cmd_pull(ns: argparse.Namespace) -> int:
    from fastforward.hub import pull

    path = pull(ns.name, cache_dir=ns.cache_dir)
    print(path)
    return 0


def _stream_to_stdout(llm, prompt, params) -> str:
    printed = 0
    text = ""
    for out in llm.stream(prompt, params):
        text = out.outputs[0].text
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)
    sys.stdout.write("\n")
    return text


def cmd_generate(ns: argparse.Namespace) -> int:
    params = _sampling_params(ns)  # bad options fail before the model loads
    llm = _make_llm(ns)
    if ns.chat_template:
        tok = llm.get_tokenizer()
        messages = [{"role": "user", "content": ns.prompt}]
        prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    else:
        prompt = ns.prompt
    if ns.no_stream:
        print(llm.generate(prompt, params)[0].outputs[0].text)
    else:
        _stream_to_stdout(llm, prompt, params)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    params = _sampling_params(ns)  # bad options fail before the model loads
    llm = _make_llm(ns)
    tok = llm.get_tokenizer()
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    print(
        "Chatting with",
        ns.model,
        "- empty line or Ctrl-D to quit, /reset to forget.",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/reset":
            history = history[:1] if ns.system else []
            continue
        history.append({"role": "user", "content": line})
        ids = tok.encode(tok.apply_chat_template(history), add_special_tokens=False)
        reply = _stream_to_stdout(llm, ids, params)
        history.append({"role": "assistant", "content": reply})
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from fastforward.server.serve import ServeArgs, serve

    if ns.model_pos:
        ns.model = ns.model_pos
    args = ServeArgs(
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key,
        served_model_name=ns.served_model_name,
        max_waiting=ns.max_waiting,
        max_body_bytes=ns.max_body_bytes,
        log_level=ns.log_level,
    )
    serve(_engine_args(ns), args)
    return 0


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server and web playground")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="model to serve (same as --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument(
        "--served-model-name", default=None, help="model id in the API (default: --model)"
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="waiting requests before 503 (default: %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 << 20,
        help="largest request body (default: %(default)s)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _engine_options(p)
    p.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastforward",
        description="fastforward: run LLMs fast on the hardware you have.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    _serve_parser(sub)

    p = sub.add_parser("pull", help="download a model into the cache and verify it")
    p.add_argument("name", help="catalog name, e.g. smollm2-135m")
    p.add_argument(
        "--cache-dir", default=None, help=f"cache directory (default: {default_cache_dir()})"
    )
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("generate", help="generate a completion for one prompt, streamed")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument(
        "--chat-template",
        action="store_true",
        help="wrap the prompt as a user message in the model's chat template",
    )
    p.add_argument("--no-stream", action="store_true", help="print the whole text at the end")
    _engine_options(p)
    _sampling_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal, streamed")
    p.add_argument("--system", default=None, help="system prompt")
    _engine_options(p)
    _sampling_options(p)
    p.set_defaults(func=cmd_chat, max_tokens=512)

    quantize_cmd.add_parser(sub)
    eval_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = ns.func
    try:
        return func(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The ``fastforward`` command line, run as a user would."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fastforward.entrypoints.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_explains_every_option():
    out = run("generate", "--help")
    assert out.returncode == 0
    for option in (
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--dtype",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--stop",
        "--ignore-eos",
        "--json-schema",
        "--regex",
        "--choice",
        "--finish-reserve",
    ):
        assert option in out.stdout
    assert run("--help").returncode == 0
    assert "pull" in run("--help").stdout


def test_generate(tiny_model_dir):
    directory, _ = tiny_model_dir("llama")
    out = run(
        "generate",
        "the license",
        "--model",
        str(directory),
        "--dtype",
        "float32",
        "--max-tokens",
        "6",
        "--ignore-eos",
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip()) > 0


# the same tokens either way
@pytest.mark.parametrize("extra", [[], ["--no-fused-layers"], ["--no-huge-pages"]])
def test_generate_matches_library(tiny_model_dir, extra):
    from fastforward import LLM, SamplingParams

    directory, _ = tiny_model_dir("llama")
    out = run(
        "generate",
        "the license",
        "--model",
        str(directory),
        "--dtype",
        "float32",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--no-stream",
        *extra,
    )
    expected = (
        LLM(str(directory), dtype="float32")
        .generate("the license", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    assert out.stdout == expected + "\n"


def test_bad_option_is_a_clean_error(tiny_model_dir):
    directory, _ = tiny_model_dir("llama")
    out = run("generate", "x", "--model", str(directory), "--top-p", "3")
    assert out.returncode == 2
    assert "top_p" in out.stderr and "Traceback" not in out.stderr
    out = run("generate", "x", "--model", "no-such-model")
    assert out.returncode == 2 and "unknown model" in out.stderr


def test_structured_output_options(tiny_model_dir, tmp_path):
    """The constraint options reach the engine: a tiny random model's output still follows
    them (and ends in valid JSON within --max-tokens with --finish-reserve)."""
    directory, _ = tiny_model_dir("llama")
    base = ("generate", "x", "--model", str(directory), "--dtype", "float32", "--no-stream")
    out = run(*base, "--choice", "yes", "--choice", "no", "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("yes", "no")
    out = run(*base, "--regex", "[0-9]{3}", "--max-tokens", "8")
    assert re.fullmatch(r"[0-9]{3}", out.stdout.strip()), out.stdout
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "array", "items": {"type": "integer"}}))
    out = run(*base, "--json-schema", str(schema), "--max-tokens", "16", "--finish-reserve", "8")
    assert out.returncode == 0, out.stderr
    assert all(isinstance(v, int) for v in json.loads(out.stdout))
    for bad, needle in (
        (("--finish-reserve", "4"), "needs an output constraint"),
        (("--json-schema", str(tmp_path / "missing.json")), "neither a file"),
        (("--json-schema", '{"type": "frobnicate"}'), "frobnicate"),
    ):
        out = run(*base, *bad)
        assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_chat_streams_on_real_model(smollm2_path):
    out = run(
        "chat",
        "--model",
        str(smollm2_path),
        "--max-tokens",
        "24",
        "--dtype",
        "float32",
        stdin="What is the capital of France?\n\n",
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout

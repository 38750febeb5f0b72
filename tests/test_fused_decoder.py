"""The decoder stack in one C++ call (fastforward/kernels/decoder.py) against the module path
it replaces: the same kernels in the same order, so tokens and log-probs are equal exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import write_tiny_gguf

from fastforward import LLM, SamplingParams, kernels
from fastforward.kernels.decoder import FusedDecoder

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for kernels")

needs_q4 = pytest.mark.skipif(
    not (kernels.available() and kernels.ops().linear_q4_native()), reason="no AVX512-BF16"
)

# prompts of 5 (prefilled through the stack too) to 40 tokens (prefilled by the modules)
PROMPTS = [list(range(5, 10)), list(range(7, 47)), list(range(30, 43)), list(range(3, 20))]


def _run(directory, fused: bool, **kw):
    llm = LLM(str(directory), fused_layers=fused, download_progress=False, **kw)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3)
    return llm, _tokens_and_logprobs(llm.generate(PROMPTS, params, use_tqdm=False))


def _tokens_and_logprobs(outs) -> list:
    got = []
    for o in outs:
        c = o.outputs[0]
        got.append(
            (c.token_ids, [sorted((k, v.logprob) for k, v in d.items()) for d in c.logprobs])
        )
    return got


@pytest.fixture
def count_fused_calls(monkeypatch):
    calls = []
    original = FusedDecoder.__call__

    def counting(self, *args, **kw):
        calls.append(args[0].shape[0])
        return original(self, *args, **kw)

    monkeypatch.setattr(FusedDecoder, "__call__", counting)
    return calls


@pytest.mark.parametrize("arch", ["llama", "llama3-rope-tied", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_stack_equals_module_path(tiny_model_dir, arch, dtype, count_fused_calls):
    # mistral: a window of 7 < the contexts; qwen3: q/k norms and head_dim 24
    directory, _ = tiny_model_dir(arch)
    fused_llm, fused = _run(directory, True, dtype=dtype, kernels="native")
    assert fused_llm.engine.model.fused_decoder is not None, fused_llm.engine.runner.fused_reason
    assert count_fused_calls, "no step went through the stack"
    assert 4 in count_fused_calls  # a decode step of the four sequences together
    calls = len(count_fused_calls)
    plain_llm, plain = _run(directory, False, dtype=dtype, kernels="native")
    assert plain_llm.engine.model.fused_decoder is None
    assert len(count_fused_calls) == calls
    assert fused == plain


def test_fused_stack_equals_module_path_at_batch_24(tiny_model_dir, count_fused_calls):
    """Decode steps of 24 rows: the stack writes them into its step buffers (StepScratch, up
    to 64 rows) and its attention hands the items out by steal_for; the same tokens and
    logprobs as the module path."""
    directory, _ = tiny_model_dir("llama")
    prompts = [list(range(3 + i, 9 + 2 * i)) for i in range(24)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    got = []
    for fused in (True, False):
        llm = LLM(str(directory), fused_layers=fused, kernels="native", download_progress=False)
        got.append(_tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False)))
        if fused:
            assert 24 in count_fused_calls  # a decode step of all of them, through the stack
    assert got[0] == got[1]


needs_vnni = pytest.mark.skipif(
    not (kernels.available() and kernels.ops().int8_rows_native()), reason="no AVX512-VNNI"
)


@pytest.mark.parametrize(
    ("arch", "method", "dtype"),
    [
        pytest.param("llama3-rope-tied", "int4", "bfloat16", marks=needs_vnni),
        # biases on q/k/v, and float32 activations around the 4-bit kernel
        pytest.param("qwen2", "int4", "bfloat16", marks=needs_vnni),
        pytest.param("qwen2", "int4", "float32", marks=needs_vnni),
        pytest.param("llama3-rope-tied", "codebook4", "bfloat16", marks=needs_q4),
        pytest.param("llama3-rope-tied", "int8", "bfloat16", marks=needs_vnni),
        # int5 layers, and q/k (int5) beside v (int8) in one ConcatLinear
        pytest.param("qwen2", "int4-mix", "bfloat16", marks=needs_vnni),
    ],
)
def test_fused_stack_runs_quantized_layers(tiny_model_dir, arch, method, dtype, count_fused_calls):
    directory, _ = tiny_model_dir(arch)
    kw = dict(quantization=method, kernels="native", dtype=dtype)
    fused_llm, fused = _run(directory, True, **kw)
    assert fused_llm.engine.model.fused_decoder is not None, fused_llm.engine.runner.fused_reason
    assert count_fused_calls
    _, plain = _run(directory, False, **kw)
    assert fused == plain


@needs_vnni
def test_fused_stack_runs_gguf_blocks(tiny_model_dir, tmp_path, count_fused_calls):
    """A GGUF file's blocks kept packed (gguf format): 4-bit, 5-bit and int8-group (Q8_0)
    layers, alone and side by side in a ConcatLinear, through the stack as through the
    modules."""
    from gguf import GGMLQuantizationType as QT

    from fastforward.quant.int8 import Int8GroupLinear

    directory, hf_model = tiny_model_dir("qwen2")
    types = {"attn_q": QT.Q4_0, "attn_k": QT.Q5_0, "attn_v": QT.Q8_0, "attn_output": QT.Q5_0}
    types |= {"ffn_gate": QT.Q5_0, "ffn_up": QT.Q4_1, "ffn_down": QT.Q8_0, "output": QT.Q8_0}
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, hf_model, types, tokenizer_dir=directory)
    fused_llm, fused = _run(path, True, quantization="gguf", kernels="native")
    assert fused_llm.engine.model.fused_decoder is not None, fused_llm.engine.runner.fused_reason
    down = fused_llm.engine.model.layers[0].mlp.down_proj
    assert isinstance(down, Int8GroupLinear) and down.native
    assert count_fused_calls
    _, plain = _run(path, False, quantization="gguf", kernels="native")
    assert fused == plain


@pytest.mark.parametrize(
    ("arch", "kw", "reason"),
    [
        ("gemma3", {"kernels": "native"}, "not the Llama layer"),
        ("llama", {"kernels": "torch"}, "native kernels"),
        ("llama", {"kernels": "native", "fused_layers": False}, "fused_layers=False"),
    ],
)
def test_models_the_stack_does_not_cover_keep_the_module_path(tiny_model_dir, arch, kw, reason):
    directory, _ = tiny_model_dir(arch)
    llm = LLM(str(directory), download_progress=False, **kw)
    assert llm.engine.model.fused_decoder is None
    assert reason in llm.engine.runner.fused_reason
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_one_off_score_does_not_write_the_serving_cache(tiny_model_dir, count_fused_calls):
    """engine.score swaps in a KV cache of its own; the stack, bound to the serving cache,
    must step aside rather than write the scored tokens into the serving blocks."""
    directory, _ = tiny_model_dir("llama")
    fused_llm = LLM(str(directory), kernels="native", download_progress=False)
    plain_llm = LLM(str(directory), kernels="native", fused_layers=False, download_progress=False)
    ids = list(range(40, 52))  # short enough for the stack
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for llm in (fused_llm, plain_llm):
        first = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
        score = llm.engine.score(ids)
        again = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
        assert first == again
        outs.append((first, score))
    assert outs[0][0] == outs[1][0]
    assert torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_kv_cache_runs_through_the_stack(tiny_model_dir, arch, count_fused_calls):
    """An int8 KV cache with its calibrated per-channel key scales: the stack applies them
    (q * m and k / m in fp32) as the modules do, and gives the same tokens."""
    directory, _ = tiny_model_dir(arch)
    fused_llm, fused = _run(directory, True, kernels="native", kv_cache_dtype="int8")
    assert all(a.key_mult is not None for a in fused_llm.engine.model.attention_layers())
    assert count_fused_calls
    _, plain = _run(directory, False, kernels="native", kv_cache_dtype="int8")
    assert fused == plain


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "auto"])
def test_prompt_chunks_take_a_prompt_kernel_in_both_paths(
    tiny_model_dir, kv_cache_dtype, count_fused_calls, monkeypatch
):
    """Where a layer's prompt chunks go to a prompt kernel ahead of paged_attention
    (Attention.prompts_split: an int8 cache's blocks dequantized; a bf16 cache as it is where
    the long-query path would take them, AVX512-BF16 without AMX), steps of prompt chunks only
    (one prompt of 40 tokens; prompts of 20 and 24) run through the stack, whose layers hand
    them to that kernel, as the modules do: the same tokens and log-probs. A step that mixes
    them with decode rows takes the module path, whose prompt chunk goes to the prompt kernel
    and its decode rows to paged_attention."""
    from fastforward.layers.attention import Attention

    directory, _ = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    runs = [[list(range(7, 47))], [list(range(3, 23)), list(range(30, 54))]]  # <= 48 rows
    mixed = [list(range(5, 10)), list(range(7, 47))]  # one step: 5 + 40 rows
    prompt_calls = []
    original = Attention._prompts_kernel

    def counting(self, q, meta):
        prompt_calls.append(q.shape[0])
        return original(self, q, meta)

    monkeypatch.setattr(Attention, "_prompts_kernel", counting)
    got = {}
    for fused in (True, False):
        llm = LLM(
            str(directory),
            fused_layers=fused,
            kernels="native",
            kv_cache_dtype=kv_cache_dtype,
            dtype="bfloat16",
            enable_prefix_caching=False,
            download_progress=False,
        )
        attn = llm.engine.model.attention_layers()[0]
        if not attn.prompts_split(torch.bfloat16):
            pytest.skip(f"no prompt kernel ahead of paged_attention for a {kv_cache_dtype} cache")
        layers = len(llm.engine.model.attention_layers())
        outs = []
        for prompts in runs:
            count_fused_calls.clear()
            prompt_calls.clear()
            outs += _tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False))
            long_rows = sum(len(p) for p in prompts)
            assert (long_rows in count_fused_calls) == fused  # the prompts' step: the stack
            assert prompt_calls == ([] if fused else [long_rows] * layers)
        count_fused_calls.clear()
        prompt_calls.clear()
        outs += _tokens_and_logprobs(llm.generate(mixed, params, use_tqdm=False))
        assert 45 not in count_fused_calls  # the mixed step: the modules
        assert prompt_calls == [40] * layers  # its prompt chunk on the prompt kernel
        got[fused] = outs
    assert got[True] == got[False]


def test_layer_skip_drafts_run_through_the_stack(tiny_model_dir, count_fused_calls):
    directory, _ = tiny_model_dir("llama")
    spec = {"method": "layer_skip", "num_speculative_tokens": 3, "draft_layers": [0, 2]}
    kw = dict(kernels="native", speculative_config=spec)
    _, fused = _run(directory, True, **kw)
    assert count_fused_calls
    _, plain = _run(directory, False, **kw)
    assert fused == plain


@pytest.mark.skipif(
    not (kernels.available() and kernels.ops().amx_native()), reason="the CPU has no AMX"
)
def test_batches_above_the_amx_rows_run_through_the_stack(tiny_model_dir, count_fused_calls):
    """Decode steps of more rows than the AMX kernel takes (linear.AMX_ROWS_MAX): the stack
    multiplies by the weight unpacked from the tiles, the one copy kept, as the modules do."""
    from fastforward.kernels.linear import AMX_ROWS_MAX

    directory, _ = tiny_model_dir("llama")
    prompts = [[5 + i % 50, 7 + i % 13, 9] for i in range(AMX_ROWS_MAX + 8)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    got = []
    for fused in (True, False):
        llm = LLM(
            str(directory), fused_layers=fused, kernels="native", dtype="bfloat16",
            max_num_seqs=len(prompts), max_num_batched_tokens=4096, download_progress=False,
        )  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        got.append([o.outputs[0].token_ids for o in outs])
        if fused:
            assert max(count_fused_calls) > AMX_ROWS_MAX
    assert got[0] == got[1]

"""Every architecture against HF transformers on tiny random configs (fp32): logits through
the paged KV cache with chunked prefill, and greedy generation through the whole engine."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS

from fastforward import LLM, SamplingParams, kernels
from fastforward.engine import kv_specs
from fastforward.kernels.apply import apply_cpu_kernels
from fastforward.kv.calibrate import pair_rotary
from fastforward.kv.spec import make_kv_cache_config
from fastforward.loader.model_loader import load_model, open_checkpoint
from fastforward.models.config import model_config_from_dict
from fastforward.models.registry import model_class
from fastforward.request import Request
from fastforward.runner import ModelRunner
from fastforward.scheduler_output import ScheduledRequest, SchedulerOutput

SEQ_LEN = 40  # longer than the sliding window (7) of the Mistral and Gemma 3 configs


def _chunked_logits(
    directory,
    token_ids: list[int],
    chunk: int,
    native: bool = False,
    dtype=torch.float32,
    kv_dtype=None,
    key_scales: bool = False,
) -> torch.Tensor:
    loaded = load_model(directory, dtype, torch.device("cpu"))
    if native:
        apply_cpu_kernels(loaded.model, dtype)
    if key_scales:  # random per-channel key scales, equal within each RoPE pair
        g = torch.Generator().manual_seed(0)
        for a in loaded.model.attention_layers():
            m = torch.rand(a.num_kv_heads, a.head_dim, generator=g) * 20 + 0.05
            a.set_key_channel_scale(pair_rotary(m, a.rotary_dim))
    specs = kv_specs(loaded.config, block_size=4, dtype=kv_dtype or dtype)
    kv_config = make_kv_cache_config(specs, num_blocks=64)
    runner = ModelRunner(loaded.model, kv_config, torch.device("cpu"))
    req = Request("r", token_ids, SamplingParams())
    per_group = -(-len(token_ids) // 4)
    # Distinct, non-contiguous blocks per group, so wrong block-table handling shows up.
    tables = tuple(
        [1 + g + len(kv_config.groups) * i for i in range(per_group)][::-1]
        for g in range(len(kv_config.groups))
    )
    outs = []
    while req.num_computed_tokens < len(token_ids):
        n = min(chunk, len(token_ids) - req.num_computed_tokens)
        batch = runner.prepare(SchedulerOutput([ScheduledRequest(req, n, tables)]))
        with torch.no_grad():
            hidden = loaded.model(batch.input_ids, batch.positions, batch.meta)
            outs.append(loaded.model.compute_logits(hidden))
        req.num_computed_tokens += n
    return torch.cat(outs).float()


NATIVE = pytest.param(
    True, marks=pytest.mark.skipif(not kernels.available(), reason="no C++ kernels")
)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [SEQ_LEN, 9, 1])
@pytest.mark.parametrize("native", [False, NATIVE], ids=["torch", "native"])
def test_logits_match_hf(tiny_model_dir, arch, chunk, native):
    directory, hf_model = tiny_model_dir(arch)
    torch.manual_seed(1)
    ids = torch.randint(0, hf_model.config.vocab_size, (SEQ_LEN,))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    ours = _chunked_logits(directory, ids.tolist(), chunk, native)
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [9, 1])
def test_int8_kv_cache_logits_close_to_hf(tiny_model_dir, arch, chunk):
    """An int8 KV cache (fp32 model) stays within int8 rounding of HF's fp32 logits, on the
    torch path and through the native kernel. (The two agree closely but not to fp32 rounding:
    a last-bit difference in a key can round one int8 code the other way.)"""
    directory, hf_model = tiny_model_dir(arch)
    torch.manual_seed(5)
    ids = torch.randint(0, hf_model.config.vocab_size, (SEQ_LEN,))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    ref = _chunked_logits(directory, ids.tolist(), chunk, kv_dtype=torch.int8)
    exact = _chunked_logits(directory, ids.tolist(), chunk)
    err, spread = (ref - expected).abs().max().item(), expected.abs().max().item()
    assert 0 < err < 0.02 * spread, (err, spread)  # quantized, and only by int8 rounding
    assert (exact - expected).abs().max().item() < err / 10
    if kernels.available():
        native = _chunked_logits(directory, ids.tolist(), chunk, True, kv_dtype=torch.int8)
        assert (native - ref).abs().max().item() < err / 4
        assert (native - expected).abs().max().item() < 1.5 * err


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("native", [False, NATIVE], ids=["torch", "native"])
def test_key_channel_scales_leave_logits_unchanged(tiny_model_dir, arch, native):
    """Keys stored as k / m and queries multiplied by m (m shared by each RoPE pair, partial
    rotary included): the same logits as without, prefill chunks and decode."""
    directory, hf_model = tiny_model_dir(arch)
    torch.manual_seed(7)
    ids = torch.randint(0, hf_model.config.vocab_size, (SEQ_LEN,)).tolist()
    plain = _chunked_logits(directory, ids, 9, native)
    scaled = _chunked_logits(directory, ids, 9, native, key_scales=True)
    torch.testing.assert_close(scaled, plain, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not kernels.available(), reason="no C++ kernels")
@pytest.mark.parametrize("arch", ARCHS)
def test_native_bf16_logits_close_to_reference_bf16(tiny_model_dir, arch):
    """bf16 weights through the packed linear, fused norms and native attention, against the
    plain PyTorch bf16 path and HF fp32: both bf16 paths stay as close to fp32 as each other."""
    directory, hf_model = tiny_model_dir(arch)
    torch.manual_seed(3)
    ids = torch.randint(0, hf_model.config.vocab_size, (SEQ_LEN,)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    ref = _chunked_logits(directory, ids, 9, native=False, dtype=torch.bfloat16)
    fast = _chunked_logits(directory, ids, 9, native=True, dtype=torch.bfloat16)
    ref_err = (ref - expected).abs().max().item()
    fast_err = (fast - expected).abs().max().item()
    assert fast_err <= 2 * ref_err + 1e-3, (fast_err, ref_err)
    assert (fast.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_hf(tiny_model_dir, arch):
    directory, hf_model = tiny_model_dir(arch)
    llm = LLM(str(directory), dtype="float32", block_size=4, max_num_batched_tokens=16)
    torch.manual_seed(2)
    prompts = [torch.randint(2, 300, (n,)).tolist() for n in (5, 23)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf_model, prompt, 20)
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.kv_config.num_blocks - 1


def test_model_built_on_meta_draws_no_random_init(tiny_model_dir, monkeypatch):
    """load_model builds on the meta device: no module draws an init there (a process's first
    normal_ on meta costs ~1 s of PyTorch's lazy set-up, for values the checkpoint replaces);
    built on a real device, the embedding still gets nn.Embedding's N(0, 1) init."""
    directory, _ = tiny_model_dir("llama")
    drawn_on_meta = []
    real_normal = torch.nn.init.normal_

    def normal_(t, *args, **kwargs):
        drawn_on_meta.append(t.is_meta)
        return real_normal(t, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "normal_", normal_)
    loaded = load_model(directory, torch.float32, torch.device("cpu"))
    assert not any(drawn_on_meta)
    assert torch.isfinite(loaded.model.embed_tokens.weight).all()

    config = model_config_from_dict(open_checkpoint(directory).hf_config())
    torch.manual_seed(0)
    w = model_class(config)(config).embed_tokens.weight.detach()
    assert 0.9 < float(w.std()) < 1.1 and abs(float(w.mean())) < 0.05

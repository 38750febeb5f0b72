"""AWQ: the scale search against round-to-nearest on a synthetic layer with outlier input
channels, the folding of the scales into a real model (the float model must not change, and the
Hessians it hands on must be those of the scaled inputs), and the ``int4-awq`` formats end to
end (the save/load round trip is in test_quantization.py)."""

from __future__ import annotations

import pytest
import torch

from fastforward import LLM
from fastforward.loader.model_loader import load_model
from fastforward.quant.awq import GRID, awq_scale_model, fake_int4, output_error, search_scales
from fastforward.quant.gptq import collect_hessians
from fastforward.quant.rtn import dequantize_int4, hessian_blocks, quantize_int4
from fastforward.scoring import score_tokens


def _outlier_layer(n=64, k=256, seed=0):
    """Inputs where a few channels are ~20x larger than the rest (as after Qwen's norms)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    size = torch.rand(k, generator=gen) + 0.2
    size[torch.randperm(k, generator=gen)[:8]] *= 20
    x = torch.randn(4096, k, generator=gen) * size
    return w, x.t() @ x / len(x)


def test_scale_search_lowers_the_output_error():
    w, h = _outlier_layer()
    s, alpha = search_scales(w, h, 32)
    plain = output_error(w, torch.ones(256), h, 32)
    assert 0 < alpha < 1 and s.shape == (256,)
    assert output_error(w, s, h, 32) < 0.8 * plain
    # the big channels get scaled up, and max(s) * min(s) = 1
    big = h.diagonal() > h.diagonal().median() * 50
    assert s[big].min() > s[~big].max()
    assert float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-5)


def test_scale_search_with_even_inputs_keeps_round_to_nearest():
    w, _ = _outlier_layer()
    s, alpha = search_scales(w, torch.eye(256), 32)  # every channel alike: nothing to gain
    assert alpha == 0.0 and torch.equal(s, torch.ones(256))
    assert GRID == 20


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])  # biases + GQA; unit-offset norms
def test_folding_keeps_the_float_model_and_rescales_the_hessians(tiny_model_dir, arch):
    directory, _ = tiny_model_dir(arch)
    model = load_model(directory, torch.float32, torch.device("cpu")).model
    windows = [list(range(3, 60)), list(range(70, 120))]
    with torch.no_grad():  # fatten a few channels so that the search scales something
        for layer in model.layers:
            layer.input_layernorm.weight[:4] += 3.0
    hessians = collect_hessians(model, windows)
    before = score_tokens(model, windows[0], torch.float32)
    chosen = awq_scale_model(model, hessians, 32)
    n = len(model.layers)
    assert len(chosen) == 3 * n and any(a > 0 for a in chosen.values())
    torch.testing.assert_close(
        score_tokens(model, windows[0], torch.float32), before, atol=1e-4, rtol=1e-4
    )
    again = collect_hessians(model, windows)  # the inputs as they are now
    for name in chosen:
        torch.testing.assert_close(hessians[name], again[name], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("method", ["int4-awq", "int4-awq-gptq", "int4-g64-awq"])
def test_awq_formats_load_and_stay_close_to_float(tiny_model_dir, method):
    directory, _ = tiny_model_dir("qwen2")
    llm = LLM(str(directory), quantization=method, download_progress=False)
    report = llm.engine.quantization
    assert report.method == method and "lm_head" in report.quantized and not report.skipped
    ids = list(range(3, 60))
    ref = LLM(str(directory), dtype="float32", download_progress=False).engine.score(ids)
    assert (llm.engine.score(ids) - ref).abs().max() < 0.15


def test_clipping_by_output_error_lowers_it():
    w, h = _outlier_layer(seed=1)
    blocks = hessian_blocks(h, 32)
    assert blocks.shape == (8, 32, 32) and torch.equal(blocks[2], h[64:96, 64:96])

    def err(q):
        e = dequantize_int4(q) - w
        return float(((e @ h) * e).sum())

    by_weight, by_output = quantize_int4(w, 32), quantize_int4(w, 32, hessian=h)
    assert err(by_output) < 0.9 * err(by_weight)
    full = quantize_int4(w, 32, clip=False)  # no clipping: the widest range of every group
    assert torch.equal(full.scales, quantize_int4(w, 32, clip=False, hessian=h).scales)
    assert (full.scales.float() >= by_output.scales.float()).all()


def test_fake_rounding_is_the_packed_rounding():
    w, _ = _outlier_layer()
    want = dequantize_int4(quantize_int4(w, 32, clip=False))
    got = fake_int4(w, 32)
    # the same scales and zeros; a code may differ by one step where (w - z) / s sits at .5 to
    # within float32 rounding (in-place ops vectorize differently)
    steps = (got - want).abs() / quantize_int4(w, 32, clip=False).scales.float().repeat_interleave(
        32, 1
    )
    assert (steps < 1e-3).float().mean() > 0.999 and steps.max() < 1.001

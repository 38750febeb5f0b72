"""GPTQ: the algorithm against round-to-nearest on synthetic layers, the Hessians it gathers
against activations computed by hand, the calibration corpus, and the ``int4-gptq`` format
end to end (the round trip and closeness to float are in test_quantization.py)."""

from __future__ import annotations

import pytest
import torch

from fastforward import LLM
from fastforward.calibration import calibration_texts, calibration_windows
from fastforward.loader.model_loader import load_model
from fastforward.quant.gptq import collect_hessians, gptq_int4
from fastforward.quant.rtn import dequantize_int4, quantize_int4


def _layer(n=64, k=256, seed=0):
    """A weight, and inputs whose channels are correlated and of unequal size (as real
    activations are): what GPTQ exploits."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k)
    x = (torch.randn(2048, k, generator=gen) * torch.rand(k, generator=gen) * 3) @ mix
    return w, x


def _output_error(x, w, q):
    return (x @ (w - dequantize_int4(q)).t()).square().sum().item()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_gptq_lowers_the_output_error(group):
    w, x = _layer()
    h = x.t() @ x / len(x)
    rtn, gptq = quantize_int4(w, group), gptq_int4(w, h, group)
    assert gptq.codes.dtype == torch.uint8 and int(gptq.codes.max()) <= 15
    assert gptq.scales.shape == (64, 256 // group) and gptq.scales.dtype == torch.bfloat16
    assert _output_error(x, w, gptq) < 0.7 * _output_error(x, w, rtn)
    # what it trades: the weights themselves move further than round-to-nearest's
    assert (dequantize_int4(gptq) - w).square().sum() > (dequantize_int4(rtn) - w).square().sum()


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    w, _ = _layer()
    h = torch.diag(torch.rand(256) + 0.5)  # no correlation: no error worth moving
    rtn, gptq = quantize_int4(w, 32), gptq_int4(w, h, 32)
    assert torch.equal(gptq.codes, rtn.codes)
    assert torch.equal(gptq.scales, rtn.scales) and torch.equal(gptq.zeros, rtn.zeros)


def test_gptq_survives_dead_inputs_and_rejects_bad_groups():
    w, x = _layer()
    x[:, 10:20] = 0  # channels that never fire: a singular Hessian
    q = gptq_int4(w, x.t() @ x / len(x), 32)
    assert torch.isfinite(dequantize_int4(q)).all()
    with pytest.raises(ValueError, match="multiple of the group size"):
        gptq_int4(w[:, :250], torch.eye(250), 32)


def test_hessians_are_those_of_the_layer_inputs(tiny_model_dir):
    directory, _ = tiny_model_dir("llama3-rope-tied")
    model = load_model(directory, torch.float32, torch.device("cpu")).model
    windows = [list(range(3, 40)), list(range(50, 90))]
    hessians = collect_hessians(model, windows)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(hessians) == linears | {"embed_tokens"}  # tied: the head's input too
    with torch.no_grad():  # the first projection's input, by hand
        xs = [model.layers[0].input_layernorm(model.embed_tokens(torch.tensor(w))) for w in windows]
    x = torch.cat(xs)
    h = hessians["layers.0.self_attn.qkv_proj"]
    torch.testing.assert_close(h, x.t() @ x / len(x), rtol=1e-4, atol=1e-5)
    assert all(torch.allclose(h, h.t()) for h in hessians.values())


def test_calibration_windows_mix_prose_and_code():
    texts = calibration_texts()
    assert texts and all("GPL" not in t.source for t in texts)  # eval scores the GPL-3

    class Chars:  # one token per character: the windows are slices of the texts
        def encode(self, text):
            return [ord(c) for c in text]

    windows = calibration_windows(Chars(), 4 * 64, 64)
    assert len(windows) == 4 and all(len(w) == 64 for w in windows)
    first = "".join(map(chr, windows[0]))
    second = "".join(map(chr, windows[1]))
    assert first == texts[0].text[:64]  # the Apache License leads, as the KV scales expect
    assert second in "".join(t.text for t in texts if t.source.endswith(".py"))
    with pytest.raises(ValueError, match="window"):
        calibration_windows(Chars(), 10, 64)


def test_gptq_format_loads_and_generates(tiny_model_dir):
    directory, _ = tiny_model_dir("qwen2")  # biases, untied head
    llm = LLM(str(directory), quantization="int4-gptq", download_progress=False)
    report = llm.engine.quantization
    assert report.method == "int4-gptq" and "lm_head" in report.quantized
    ref = LLM(str(directory), dtype="float32", download_progress=False).engine.score(range(3, 60))
    got = llm.engine.score(list(range(3, 60)))
    assert (got - ref).abs().max() < 0.15

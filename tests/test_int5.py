"""int5 weights (Q5_0's grid) on their kernel, and the ``int4-mix`` recipe that uses them."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from fastforward import LLM, SamplingParams, kernels
from fastforward.entrypoints.quantize import quantize_to_dir
from fastforward.quant.apply import weight_stats
from fastforward.quant.base import ConcatLinear, QuantizedEmbedding
from fastforward.quant.checkpoint import packed_modules
from fastforward.quant.int4 import Int4Linear
from fastforward.quant.int5 import (
    Int5Linear,
    dequantize_int5,
    pack,
    pack_high,
    quantize_int5,
    unpack,
    unpack_high,
)
from fastforward.quant.int8 import Int8Linear

VNNI = kernels.available() and kernels.ops().int8_rows_native()
needs_vnni = pytest.mark.skipif(not VNNI, reason="linear_q5 needs AVX512-VNNI")
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the kernels did not build")


def _weight(n=96, k=256, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[3, 7] = 0.9  # an outlier
    return w


def test_q5_0_weights_come_back_exactly():
    """Weights on GGUF's Q5_0 grid (the gguf package's own quantize/dequantize) are found again
    bit for bit: the same scales, the same codes."""
    w = _weight(64, 256).numpy()
    on_grid = gguf_dequantize(gguf_quantize(w, QT.Q5_0), QT.Q5_0)
    q = quantize_int5(torch.from_numpy(on_grid))
    assert torch.equal(dequantize_int5(q), torch.from_numpy(on_grid))
    assert q.scales.dtype == torch.float16 and int(q.codes.max()) <= 31


def test_rounding_error_is_well_below_int4s():
    from fastforward.quant.rtn import dequantize_int4, quantize_int4

    w = _weight()
    e5 = (dequantize_int5(quantize_int5(w)) - w).norm()
    e4 = (dequantize_int4(quantize_int4(w, 32)) - w).norm()
    assert e5 < 0.65 * e4  # one more bit: about half the error (symmetric, so not quite)


def test_fifth_bit_layout_round_trip():
    codes = torch.randint(0, 32, (48, 64), generator=torch.Generator().manual_seed(1))
    high = pack_high(codes)
    assert high.shape == (3, 16, 8) and high.dtype == torch.uint8
    assert torch.equal(unpack_high(high), codes >> 4)
    assert torch.equal(unpack(pack(codes)), codes)
    m = Int5Linear(quantize_int5(_weight(48, 64)))
    ids = torch.tensor([0, 47, 17, 16, 5])
    assert torch.equal(unpack(m.codes, ids), unpack(m.codes)[ids])
    assert torch.equal(m.rows(ids), m.dequantize()[ids])
    emb = QuantizedEmbedding(m, torch.float32)
    assert torch.equal(emb(ids[None]), m.dequantize()[ids][None])


def test_checkpoint_tensors_round_trip():
    m = Int5Linear(quantize_int5(_weight()), bias=torch.randn(96))
    back = Int5Linear.from_packed(m.packed_state(), m.config(), m.bias)
    a, b = m.packed_state(), back.packed_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(back.dequantize(), m.dequantize())


def test_plain_path_is_dequantize_then_matmul():
    m = Int5Linear(quantize_int5(_weight()))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    expected = x.float() @ m.dequantize().t()
    got = m(x).float()
    torch.testing.assert_close(got, expected, atol=1e-2 * expected.abs().max(), rtol=0)


@needs_vnni
@pytest.mark.parametrize(("n", "k"), [(96, 256), (32, 64), (48, 4864 // 8)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16])
def test_kernel_equals_dequantize_then_matmul(n, k, rows):
    """linear_q5 against a float64 product with the dequantized weight: within the bf16
    rounding of the output and the int16 steps of x (a wrong code or bit is ~100% of a
    weight)."""
    m = Int5Linear(quantize_int5(_weight(n, k)))
    m.use_native_kernel()
    assert m.native and m.kernel_rows_max >= 16
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    expected = (x.double() @ m.dequantize().double().t()).float()
    got = m(x).float()
    torch.testing.assert_close(got, expected, atol=6e-3 * expected.abs().max(), rtol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_expansion_is_the_dequantized_weight(dtype):
    m = Int5Linear(quantize_int5(_weight()))
    out = torch.empty(96, 256, dtype=dtype)
    torch.ops.fastforward.dequantize_q5(m.codes, m.scales, out)
    assert torch.equal(out, m.dequantize().to(dtype))
    ids = torch.tensor([95, 0, 17, 17])
    rows = torch.empty(len(ids), 256, dtype=dtype)
    torch.ops.fastforward.dequantize_q5(m.codes, m.scales, rows, ids)
    assert torch.equal(rows, out[ids])
    with pytest.raises(RuntimeError, match="outside the weight"):
        torch.ops.fastforward.dequantize_q5(m.codes, m.scales, rows, torch.tensor([0, 1, 2, 96]))


@needs_kernels
def test_embedding_rows_on_the_kernels_are_the_dequantized_rows():
    """Once on fastforward's kernels an embedding lookup expands its rows in one C++ call: the
    same float32 bits as the PyTorch path's."""
    m = Int5Linear(quantize_int5(_weight()))
    ids = torch.tensor([0, 95, 17, 16, 5])
    plain = m.rows(ids)
    m.use_native_kernel()
    assert torch.equal(m.rows(ids), plain)
    emb = QuantizedEmbedding(m, torch.bfloat16)
    assert torch.equal(emb(ids[None]), plain.to(torch.bfloat16)[None])


@needs_kernels
def test_large_batches_expand_the_weight():
    m = Int5Linear(quantize_int5(_weight()))
    m.use_native_kernel()
    m.native_rows_max = 8  # without native bf16 the kernel takes every batch: lowered here
    rows = m.native_rows_max + 1
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    expected = x.float() @ m.dequantize().t()
    got = m(x).float()
    torch.testing.assert_close(got, expected, atol=1e-2 * expected.abs().max(), rtol=0)
    plain = copy.deepcopy(m)
    plain.native, plain.expand_dtype = False, None
    torch.testing.assert_close(got, plain(x).float(), atol=1e-2 * expected.abs().max(), rtol=0)


@needs_kernels
def test_kernel_rejects_bad_layouts():
    m = Int5Linear(quantize_int5(_weight()))
    x = torch.randn(2, 256).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="codes"):
        torch.ops.fastforward.linear_q5(x, m.codes[..., :32].contiguous(), m.scales, 32)
    with pytest.raises(RuntimeError, match="float16"):
        torch.ops.fastforward.linear_q5(x, m.codes, m.scales.float(), 32)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.fastforward.linear_q5(x[:, :128], m.codes, m.scales, 32)
    with pytest.raises(RuntimeError, match="group size"):
        torch.ops.fastforward.linear_q5(x, m.codes, m.scales, 48)


# ---------------------------------------------------------------- int4-mix


def test_mix_recipe_puts_each_matrix_in_its_format(tiny_model_dir):
    directory, _ = tiny_model_dir("qwen2")  # untied embedding, q/k/v biases, GQA
    llm = LLM(str(directory), dtype="bfloat16", quantization="int4-mix", download_progress=False)
    model = llm.engine.model
    layer = model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, ConcatLinear) and qkv.bias is not None
    assert [type(p) for p in qkv.parts] == [Int5Linear, Int8Linear]
    assert isinstance(layer.self_attn.o_proj, Int5Linear)
    assert isinstance(layer.mlp.gate_up_proj, Int5Linear)
    assert isinstance(layer.mlp.down_proj, Int4Linear) and layer.mlp.down_proj.group_size == 32
    assert isinstance(model.lm_head, Int4Linear) and model.lm_head.group_size == 32
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert model.embed_tokens.linear.group_size == 64
    assert not llm.engine.quantization.skipped


@pytest.mark.parametrize("arch", ["qwen2", "llama3-rope-tied"])
def test_mix_stays_close_to_float_and_between_int4_and_int8(tiny_model_dir, arch):
    directory, _ = tiny_model_dir(arch)
    ids = list(range(3, 60))
    ref = LLM(str(directory), dtype="float32", download_progress=False).engine.score(ids)
    err = {}
    for method in ("int4", "int4-mix", "int8"):
        llm = LLM(str(directory), dtype="bfloat16", quantization=method, download_progress=False)
        err[method] = (llm.engine.score(ids) - ref).abs().max().item()
    assert err["int4-mix"] < 0.1
    assert err["int8"] < err["int4-mix"] < err["int4"]


def test_mix_round_trips_through_a_checkpoint(tiny_model_dir, tmp_path):
    directory, _ = tiny_model_dir("qwen2")
    out = quantize_to_dir(str(directory), "int4-mix", tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["method"] == "int4-mix"
    direct = LLM(str(directory), dtype="float32", quantization="int4-mix", download_progress=False)
    loaded = LLM(str(out), dtype="float32", download_progress=False)
    a, b = packed_modules(direct.engine.model), packed_modules(loaded.engine.model)
    assert a.keys() == b.keys()
    for name in a:
        sa, sb = a[name][0].packed_state(), b[name][0].packed_state()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name
    ids = list(range(3, 60))
    assert torch.equal(direct.engine.score(ids), loaded.engine.score(ids))
    assert weight_stats(direct.engine.model) == weight_stats(loaded.engine.model)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert direct.generate(ids, params)[0].outputs[0].token_ids == (
        loaded.generate(ids, params)[0].outputs[0].token_ids
    )


def test_int5_takes_five_and_a_half_bits_a_weight():
    """5.5 bits for int5 (4 + 1 + a float16 scale per 32), measured on the module's buffers."""
    m = Int5Linear(quantize_int5(_weight()))
    nbytes = sum(b.numel() * b.element_size() for b in m.buffers())
    assert 8 * nbytes / m.num_weights == pytest.approx(5.5)
    assert np.isclose(8 * m.codes.numel() / m.num_weights, 5.0)

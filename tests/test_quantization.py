"""Weight quantization: each packed format against its own dequantization, GGUF block decoding
against the ``gguf`` package bit for bit, quantize -> save -> load round trips, the scoring
path against HF transformers, the CLI, and (slow) real SmolLM2 output."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from conftest import write_tiny_gguf
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from fastforward import LLM, SamplingParams, kernels
from fastforward.entrypoints.cli import main
from fastforward.entrypoints.quantize import quantize_to_dir
from fastforward.loader.gguf_weights import GGUFCheckpoint
from fastforward.loader.model_loader import load_model
from fastforward.models.config import model_config_from_dict
from fastforward.models.registry import model_class
from fastforward.quant import int4pack
from fastforward.quant.apply import weight_stats
from fastforward.quant.base import ConcatLinear, QuantizedEmbedding, QuantizedLinear
from fastforward.quant.checkpoint import packed_modules
from fastforward.quant.codebook import CodebookLinear
from fastforward.quant.gguf_blocks import EIGHT_BIT, FOUR_BIT, PACKABLE, decode_blocks
from fastforward.quant.gguf_load import load_gguf_packed
from fastforward.quant.int4 import Int4Linear, int4_from_codes
from fastforward.quant.int5 import Int5Linear, quantize_int5
from fastforward.quant.int8 import Int8GroupLinear, Int8Linear
from fastforward.quant.kmeans import quantize_codebook
from fastforward.quant.rtn import quantize_int4, quantize_int8
from fastforward.scoring import score_tokens

N, K = 96, 256  # N % 16 == 0 and K % 128 == 0: every kernel and group size applies


def _weight(n: int = N, k: int = K, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[3, 7] = 0.9  # an outlier, as real checkpoints have
    return w


def _modules() -> dict[str, QuantizedLinear]:
    w = _weight()
    codes = torch.randint(-32, 32, (N, K), generator=torch.Generator().manual_seed(1))
    scales = torch.rand(N, K // 16, generator=torch.Generator().manual_seed(2)) * 0.01
    modules = {
        "int8": Int8Linear(quantize_int8(w)),
        "int4-g32": Int4Linear(quantize_int4(w, 32)),
        "int4-g64": Int4Linear(quantize_int4(w, 64)),
        "int4-g128": Int4Linear(quantize_int4(w, 128)),
        "int8-group16": Int8GroupLinear(codes.to(torch.int8), scales),
        "codebook4": CodebookLinear(quantize_codebook(w, 16, 32)),
        "codebook8": CodebookLinear(quantize_codebook(w, 256, 128)),
        "int5": Int5Linear(quantize_int5(w)),
    }
    q4 = kernels.available() and kernels.ops().linear_q4_native()
    int4 = kernels.available() and kernels.ops().int8_rows_native()  # the int4 table: VNNI
    for name in ("int4-g32", "int4-g64", "int4-g128", "codebook4"):
        if q4 or (int4 and name != "codebook4"):
            native = copy.deepcopy(modules[name])
            native.use_native_kernel()
            modules[f"{name}-native"] = native
    if kernels.available() and kernels.ops().int8_rows_native():
        native = copy.deepcopy(modules["int8"])
        native.use_native_kernel()
        modules["int8-native"] = native
        native = copy.deepcopy(modules["int5"])
        native.use_native_kernel()
        modules["int5-native"] = native
        # int8 groups (GGUF Q8_0/Q6_K): linear_i8g_amx on AMX, linear_i8g_rows on VNNI alone
        native = copy.deepcopy(modules["int8-group16"])
        native.use_native_kernel()
        modules["int8-group16-native"] = native
    return modules


def _amx() -> bool:
    return kernels.available() and kernels.ops().amx_native()


# ---------------------------------------------------------------- packed matmul == dequantize


@pytest.mark.parametrize("name", list(_modules()))
@pytest.mark.parametrize("rows", [1, 3, "dense"])  # the packed kernel and the dense path
def test_quantized_matmul_equals_dequantize_then_matmul(name, rows):
    module = _modules()[name]
    # past the packed kernel's rows: the dense path; layers on fastforward's kernels have none
    # on an AMX CPU (4-bit: every batch takes its AMX tiles) or one without native bf16 (the
    # integer kernels take every batch), so there 259 rows go through those
    rows = min(module.kernel_rows_max, 256) + 3 if rows == "dense" else rows
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    expected = x.float() @ module.dequantize().t()
    got = module(x).float()
    # bf16 rounding (2^-9 relative) of the output, and of the weights on the dense path, and
    # the accumulation order: about 1% of the output scale at most (a wrong code is ~100%)
    torch.testing.assert_close(got, expected, atol=1e-2 * expected.abs().max(), rtol=0)


@pytest.mark.parametrize("name", list(_modules()))
def test_embedding_rows_are_dequantized_rows(name):
    module = _modules()[name]
    ids = torch.tensor([[0, 95, 17], [64, 80, 3]])  # rows in full blocks and in the tail
    emb = QuantizedEmbedding(module, torch.float32)
    assert torch.equal(emb(ids), module.dequantize()[ids])


@pytest.mark.parametrize(
    "name",
    ["int4-g32", "int4-g64", "int4-g128", "codebook4", "int8", "int5"]
    + [pytest.param("int8-group16", marks=pytest.mark.skipif(not _amx(), reason="no AMX"))],
)
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_native_layout_keeps_the_values(name, rows):
    """Moving onto fastforward's 4-bit kernel (or, for int8 groups, its AMX kernel; for int8
    rows, linear_i8_rows) repacks the same codes, scales and zeros: the dequantized weight, the
    embedding rows and the checkpoint tensors are bit for bit the same, and the matmul (few rows
    on the packed kernel, more past it) agrees with the PyTorch path's within bf16 rounding."""
    modules = _modules()
    if f"{name}-native" not in modules:
        pytest.skip(f"no native kernel for {name} on this CPU")
    plain, native = modules[name], modules[f"{name}-native"]
    assert native.native and not plain.native
    assert torch.equal(native.dequantize(), plain.dequantize())
    ids = torch.tensor([0, 95, 17, 64])
    assert torch.equal(native.rows(ids), plain.rows(ids))
    a, b = plain.packed_state(), native.packed_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    expected = plain(x).float()
    torch.testing.assert_close(
        native(x).float(), expected, atol=1e-2 * expected.abs().max(), rtol=0
    )


def test_quantizers_error_is_small_and_ordered():
    w = _weight()

    def rel(module):
        return float((module.dequantize() - w).square().mean() / w.square().mean())

    m = _modules()
    assert rel(m["int8"]) < 2e-4
    assert rel(m["int4-g32"]) < rel(m["int4-g64"]) < rel(m["int4-g128"]) < 0.02
    assert rel(m["codebook8"]) < 1e-3
    # the same 4.5 bits per weight: k-means levels beat a uniform grid on Gaussian weights
    assert rel(m["codebook4"]) < rel(m["int4-g64"])


def test_int4_kernel_layout_round_trip():
    gen = torch.Generator().manual_seed(4)
    for n in (64, 80, 112, 176):  # full blocks plus 16/48-row tails
        codes = torch.randint(0, 16, (n, 64), generator=gen, dtype=torch.uint8)
        packed = int4pack.to_kernel_layout(codes)
        assert torch.equal(int4pack.from_kernel_layout(packed, 64), codes)
        rows = torch.tensor([n - 1, 0, n // 2, 65 % n])
        assert torch.equal(int4pack.kernel_layout_rows(packed, 64, rows), codes[rows])
        assert torch.equal(int4pack.unpack_plain(int4pack.pack_plain(codes)), codes)


def test_concat_linear_runs_each_part():
    a, b = Int4Linear(quantize_int4(_weight(32), 32)), Int8Linear(quantize_int8(_weight(16)))
    both = ConcatLinear([a, b], None, [32, 16])
    x = torch.randn(2, K).to(torch.bfloat16)
    assert torch.equal(both(x), torch.cat([a(x), b(x)], dim=-1))
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


# ---------------------------------------------------------------- GGUF blocks, bit for bit


def _random_blocks(qtype: QT, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random block bytes whose fp16 scale fields are finite (any other byte is a valid code)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    fp16_fields = {QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q4_K: [0, 2], QT.Q5_0: [0], QT.Q8_0: [0]}
    for off in fp16_fields.get(qtype, [208]):  # Q6_K keeps its d at the end
        scale = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
def test_gguf_block_decoding_is_bit_exact(qtype):
    raw = _random_blocks(qtype, 32, 512)
    expected = gguf_dequantize(raw, qtype).reshape(32, 512)
    codes = decode_blocks(raw, qtype, (32, 512))
    assert np.array_equal(codes.dequantize().numpy().view(np.uint32), expected.view(np.uint32))
    if qtype in EIGHT_BIT:  # the packed module stores the codes and scales exactly
        module = Int8GroupLinear(codes.codes, codes.scales)
        assert np.array_equal(module.dequantize().numpy().view(np.uint32), expected.view(np.uint32))
    else:  # the codes are kept exactly; scales and zeros are rounded to the kernel's bf16
        module = Int4Linear(int4_from_codes(codes))
        assert torch.equal(module.unpacked_codes(), codes.codes)
        torch.testing.assert_close(
            module.dequantize(),
            torch.from_numpy(expected),
            atol=0.02 * np.abs(expected).max(),
            rtol=0,
        )


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0], ids=lambda q: q.name)
def test_gguf_blocks_of_real_values_are_bit_exact(qtype):
    values = _weight(16, 256).numpy()
    raw = gguf_quantize(values, qtype)
    expected = gguf_dequantize(raw, qtype)
    ours = decode_blocks(raw, qtype, (16, 256)).dequantize().numpy()
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))


def test_gguf_blocks_load_packed(tiny_model_dir, tmp_path):
    """A GGUF file's blocks go into packed modules (mixed types in one fused layer become a
    ConcatLinear; Q5_0 keeps its 5-bit codes) and compute what the dequantized float model
    computes."""
    _, hf_model = tiny_model_dir("qwen2")
    types = {"attn_q": QT.Q4_0, "attn_k": QT.Q4_1, "attn_v": QT.Q8_0, "attn_output": QT.Q5_0}
    types |= {"ffn_gate": QT.Q8_0, "ffn_up": QT.Q5_0, "ffn_down": QT.Q4_1, "token_embd": QT.Q8_0}
    types |= {"output": QT.Q4_0}
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, hf_model, types)
    ckpt = GGUFCheckpoint(path)
    config = model_config_from_dict(ckpt.hf_config())
    with torch.device("meta"):
        packed, plain = model_class(config)(config), model_class(config)(config)
    packed = packed.to(torch.float32).to_empty(device="cpu")
    report = load_gguf_packed(packed, ckpt, torch.float32)
    plain = plain.to(torch.float32).to_empty(device="cpu")
    plain.load_weights(ckpt.tensors())
    assert isinstance(packed.layers[0].self_attn.qkv_proj, ConcatLinear)
    gate_up = packed.layers[0].mlp.gate_up_proj  # Q8_0 gate, Q5_0 up
    assert isinstance(gate_up, ConcatLinear)
    assert [type(p) for p in gate_up.parts] == [Int8GroupLinear, Int5Linear]
    assert isinstance(packed.layers[0].self_attn.o_proj, Int5Linear)
    assert isinstance(packed.embed_tokens, QuantizedEmbedding)
    assert not report.skipped and len(report.quantized) == 2 + 4 * config.num_hidden_layers
    for name, (module, _) in packed_modules(packed).items():
        dense = plain.get_submodule(name).weight.detach()
        if isinstance(module, Int8GroupLinear | Int5Linear) or name.endswith("gate_up_proj"):
            assert torch.equal(module.dequantize(), dense), name
        else:
            torch.testing.assert_close(
                module.dequantize(), dense, atol=0.02 * dense.abs().max(), rtol=0
            )
    ids = list(range(2, 40))
    got, expected = (
        score_tokens(packed, ids, torch.float32),
        score_tokens(plain, ids, torch.float32),
    )
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)


# ---------------------------------------------------------------- models: round trips, scoring


METHODS = ["int8", "int4", "int4-g64", "int4-gptq", "codebook4", "codebook8"]


ROUND_TRIPS = [("llama3-rope-tied", m) for m in METHODS]  # tied: the embedding is the head
ROUND_TRIPS += [("llama", "int4-g64"), ("qwen2", "int8"), ("qwen2", "codebook4")]  # + biases
ROUND_TRIPS += [("qwen2", "int4-awq")]  # AWQ scales folded into the norms


@pytest.mark.parametrize(("arch", "method"), ROUND_TRIPS)
def test_quantize_save_load_round_trip(tiny_model_dir, tmp_path, arch, method):
    directory, _ = tiny_model_dir(arch)
    out = quantize_to_dir(str(directory), method, tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["method"] == method
    direct = LLM(str(directory), dtype="float32", quantization=method, download_progress=False)
    loaded = LLM(str(out), dtype="float32", download_progress=False)
    a, b = packed_modules(direct.engine.model), packed_modules(loaded.engine.model)
    assert a.keys() == b.keys() and len(a) >= 5
    for name in a:
        sa, sb = a[name][0].packed_state(), b[name][0].packed_state()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
    ids = list(range(3, 60))
    assert torch.equal(direct.engine.score(ids), loaded.engine.score(ids))
    assert weight_stats(direct.engine.model) == weight_stats(loaded.engine.model)
    tok_a, tok_b = direct.get_tokenizer(), loaded.get_tokenizer()
    assert tok_b.encode("GNU General Public License") == tok_a.encode("GNU General Public License")
    assert (tok_b.bos_token_id, tok_b.eos_token_ids) == (tok_a.bos_token_id, tok_a.eos_token_ids)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert direct.generate(ids, params)[0].outputs[0].token_ids == (
        loaded.generate(ids, params)[0].outputs[0].token_ids
    )


@pytest.mark.parametrize("method", METHODS)
def test_quantized_model_stays_close_to_float(tiny_model_dir, method):
    directory, _ = tiny_model_dir("llama")
    ids = list(range(3, 60))
    ref = LLM(str(directory), dtype="float32", download_progress=False).engine.score(ids)
    llm = LLM(str(directory), dtype="bfloat16", quantization=method, download_progress=False)
    got = llm.engine.score(ids)
    # log-probs of a small random model (their spread is ~0.5): 8-bit formats stay within
    # bf16 noise, 4-bit ones within a few percent
    assert (got - ref).abs().max() < (0.02 if method in ("int8", "codebook8") else 0.15)
    stats = weight_stats(llm.engine.model)
    assert stats.bits_per_weight < (9 if method in ("int8", "codebook8") else 5.5)


def test_scoring_matches_hf(tiny_model_dir):
    directory, hf_model = tiny_model_dir("mistral")  # sliding window: masks matter
    ids = torch.randint(
        0, hf_model.config.vocab_size, (50,), generator=torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(ids[None]).logits[0, :-1].float(), dim=-1)
    expected = logp.gather(1, ids[1:, None]).squeeze(1)
    loaded = load_model(directory, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(score_tokens(loaded.model, ids.tolist(), torch.float32), expected,
                               atol=2e-5, rtol=1e-4)  # fmt: skip


def test_scoring_leaves_generation_alone(tiny_model_dir):
    directory, _ = tiny_model_dir("llama")
    llm = LLM(str(directory), dtype="float32", download_progress=False)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    before = llm.generate([5, 6, 7, 8], params)[0].outputs[0].token_ids
    llm.engine.score(list(range(2, 90)))
    assert llm.generate([5, 6, 7, 8], params)[0].outputs[0].token_ids == before
    stats = llm.engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)


def test_unknown_method_and_gguf_needs_gguf(tiny_model_dir):
    directory, _ = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(directory), quantization="int3", download_progress=False)
    with pytest.raises(ValueError, match="GGUF"):
        LLM(str(directory), quantization="gguf", download_progress=False)


@pytest.mark.parametrize("arch", ["llama", "llama3-rope-tied"])
def test_bf16_weights_count_once_on_the_native_kernels(tiny_model_dir, arch):
    """PackedLinear's copies of a bf16 weight (and a tied output layer's, which is the
    embedding's) are not counted again: half the float32 model's bytes, 16 bits a weight."""
    directory, _ = tiny_model_dir(arch)
    fp32 = weight_stats(LLM(str(directory), dtype="float32", download_progress=False).engine.model)
    llm = LLM(str(directory), dtype="bfloat16", kernels="native", download_progress=False)
    bf16 = weight_stats(llm.engine.model)
    assert bf16.bits_per_weight == 16 and bf16.num_weights == fp32.num_weights
    assert bf16.bytes * 2 == fp32.bytes


# ---------------------------------------------------------------- CLI


def test_cli_quantize_and_eval(tiny_model_dir, tmp_path, capsys):
    directory, _ = tiny_model_dir("llama")
    out = tmp_path / "int4"
    assert main(["quantize", str(directory), "--method", "int4", "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    prefix = tmp_path / "eval" / "tiny"
    argv = ["eval", str(directory), "--formats", "fp32,bf16,int8,int4", "--max-tokens", "80"]
    argv += ["--window", "32", "--stride", "16", "--decode-tokens", "4", "--out", str(prefix)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "int4" in table and "ppl" in table
    result = json.loads(prefix.with_suffix(".json").read_text())
    rows = {r["format"]: r for r in result["results"]}
    assert set(rows) == {"fp32", "bf16", "int8", "int4"}
    assert rows["fp32"]["tokens_scored"] == 79 and rows["fp32"]["ppl_vs_fp32_pct"] == 0
    assert rows["int8"]["weight_bytes"] < 0.5 * rows["fp32"]["weight_bytes"]
    # bf16 on the native kernels keeps extra copies of each layer for other batch sizes: the
    # weights still count once, 16 bits each
    assert rows["bf16"]["bits_per_weight"] == 16
    assert rows["bf16"]["weight_bytes"] * 2 == rows["fp32"]["weight_bytes"]
    assert rows["bf16"]["kv_bytes_per_token"] * 2 == rows["fp32"]["kv_bytes_per_token"]
    assert prefix.with_suffix(".csv").read_text().startswith("format,")
    try:
        import matplotlib  # noqa: F401  (the plot is optional: the `eval` extra)
    except ImportError:
        return
    assert prefix.with_suffix(".png").stat().st_size > 1000


# ---------------------------------------------------------------- real SmolLM2


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4", "gguf"])
def test_smollm2_quantized_greedy_is_sensible(smollm2_path, method):
    llm = LLM(str(smollm2_path), quantization=method, download_progress=False)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    text = llm.generate("The capital of France is", params)[0].outputs[0].text
    assert "Paris" in text


@pytest.mark.slow
def test_smollm2_gguf_packed_tensors_match_the_file(smollm2_path):
    """Our packed modules hold exactly the file's Q4_1 codes and Q8_0 codes and scales."""
    llm = LLM(str(smollm2_path), quantization="gguf", download_progress=False)
    model, ckpt = llm.engine.model, GGUFCheckpoint(smollm2_path)
    assert not llm.engine.quantization.skipped
    embd = ckpt.file.tensors["token_embd.weight"]
    expected = gguf_dequantize(ckpt.file.raw(embd), embd.qtype).reshape(embd.shape)
    got = model.embed_tokens.linear.dequantize().numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    down = ckpt.file.tensors["blk.3.ffn_down.weight"]
    assert down.qtype in FOUR_BIT
    codes = decode_blocks(ckpt.file.raw(down), down.qtype, down.shape)
    assert torch.equal(model.layers[3].mlp.down_proj.unpacked_codes(), codes.codes)
    assert weight_stats(model).bits_per_weight < 6


@pytest.mark.slow
def test_smollm2_gguf_tensors_dequantize_as_gguf_does(smollm2_path):
    """The float tensors a GGUF file loads as (our block decoder for its Q4_1 and Q8_0
    matrices) are gguf's own dequantization, bit for bit, in the order the file holds them."""
    ckpt = GGUFCheckpoint(smollm2_path)
    cfg = ckpt.hf_config()
    got = dict(ckpt.tensors())
    seen = set()
    for info in ckpt.file.tensors.values():
        name = ckpt.hf_name(info.name)
        if name is None:
            continue
        seen.add(info.qtype)
        data = gguf_dequantize(ckpt.file.raw(info), info.qtype).reshape(info.shape)
        want = ckpt._undo_conversion(info.name, data, cfg)
        assert np.array_equal(got[name].numpy().view(np.uint32), want.view(np.uint32)), name
    assert seen & set(FOUR_BIT) and seen & set(PACKABLE) - set(FOUR_BIT)

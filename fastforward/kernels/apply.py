"""Switching a loaded model onto the fast CPU kernels, and reporting what was switched."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fastforward import kernels
from fastforward.kernels.linear import PackedLinear, onednn_prepack, tiles_pack
from fastforward.layers.activation import GatedActivation
from fastforward.layers.attention import Attention
from fastforward.layers.norm import RMSNorm
from fastforward.layers.rotary import RotaryEmbedding
from fastforward.quant.base import QuantizedLinear
from fastforward.quant.int4 import Int4Linear
from fastforward.quant.int5 import Int5Linear
from fastforward.quant.int8 import Int8GroupLinear, Int8Linear

logger = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "native", "torch")

# Rows up to which the packed kernel beats oneDNN's bf16 matmul on a CPU with native bf16 where
# the kernels have no vdpbf16ps (measured on an AMX Xeon, 2 threads, the 120 matrices of
# SmolLM2 in a row: 8 rows 17 ms vs 19 ms, 16 rows 26 vs 18; a throwaway timing script, not a
# project benchmark). Without native bf16 the packed kernel serves batches below
# FP32_ROWS_MIN.
PACKED_ROWS_MAX_NATIVE_BF16 = 8
# Without native bf16, batches of this many rows or more multiply in float32 on the weight
# expanded a chunk at a time (linear_bf16_gemm), the rest on the packed kernel: SmolLM2's 120
# layer matrices from memory on a Xeon with AVX-512 but no AVX512-BF16, three alternating
# rounds, ms: 32 rows 52.4 / 53.6 / 53.9 packed against 52.0 / 53.5 / 56.6 in float32, 48 rows
# 78.7 / 82.1 / 72.3 against 69.8 / 75.8 / 64.4, 64 rows 104.0 / 92.1 / 99.4 against 87.2 /
# 87.1 / 90.1 (a throwaway timing script); batch 64 x 128 new tokens 198 / 273 / 301 / 277 tok/s
# at 128 rows against 294 / 321 / 291 / 330 at 48 (alternating processes). (128 while the
# float32 path converted the whole weight per call.)
FP32_ROWS_MIN = 48
# Where the kernels have vdpbf16ps (AVX512-BF16, with or without AMX) the tiles of
# kernels/linear.py linear_amx serve every batch and no packed copy is kept (one row: the tiles
# streamed by vdpbf16ps). On AMX tiles the crossover was at 1-2 rows: the same 120 matrices
# took 9.7 ms packed / 9.8 ms AMX at 1 row, 9.8 / 9.6 at 2, 15.2 / 10.2 at 8 and 22.8 / 9.7 at
# 16 (the weights from memory; a throwaway timing script). Without AMX (Zen 4 EPYC, 2 threads,
# the 120 matrices and the output projection from memory, ms, packed / oneDNN / tiles): 1 row
# 14.8 / 25.7 / 14.1, 8 rows 22.2 / 22.9 / 13.8, 64 rows 89.6 / 53.0 / 47.0, 512 rows 677 /
# 357 / 350 (a throwaway timing script; the figures move 10-30% between runs there, the
# ratios less).
PACKED_ROWS_MAX_TILES = 1


@dataclass(slots=True)
class KernelReport:
    """Which layers run fastforward's own kernels."""

    mode: str  # "native" when the kernels are in use, else "torch"
    linears: list[str] = field(default_factory=list)
    attention_layers: int = 0
    # 4-bit layers on linear_q4, int8-group layers on linear_i8g_amx (AMX CPUs)
    quantized: list[str] = field(default_factory=list)
    reason: str = ""  # why the native kernels are not used, when they are not


def sdpa_has_amx() -> bool:
    """Whether PyTorch's own attention (SDPA's flash kernel, oneDNN brgemm underneath) has AMX
    tiles to run on. There it beats our vdpbf16ps kernel on long query runs by 3.5-5x (an AMX
    Xeon, 2 threads, SmolLM2's heads: one layer's 512-token prefill 1.0 ms against 5.1 ms, 2,048
    tokens 9.7 against 83 ms; 512-token prefill end to end 1,836 -> 2,967 tok/s in
    bench_cpu.py, a 4,000-token one 451 -> 1,599), so prefills go to SDPA and the kernel keeps
    decode and short query runs. Without AMX our kernel is the faster one (docs/cpu.md)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def check_mode(mode: str) -> None:
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels={mode!r} is not supported (choose {', '.join(KERNEL_MODES)})")


def kernels_usable(mode: str, device: torch.device) -> tuple[bool, str]:
    """Whether the native kernels will be used, and the reason when not. ``native`` insists
    (an error if they cannot load); ``auto`` uses them on the CPU when they build."""
    check_mode(mode)
    if mode == "torch":
        return False, "kernels='torch' asked for the PyTorch paths"
    if device.type != "cpu":
        if mode == "native":
            raise ValueError(f"the native kernels run on the CPU, not on {device}")
        return False, f"device {device} is not the CPU"
    build = kernels.load()
    if not build.loaded:
        if mode == "native":
            raise RuntimeError(f"kernels='native' but they did not build: {build.error}")
        return False, f"the kernels did not build ({build.error})"
    return True, ""


def apply_cpu_kernels(model: nn.Module, dtype: torch.dtype) -> KernelReport:
    """Attention, RoPE, RMSNorm and gated activations take the native kernels (float32 or bf16);
    with bf16 weights every float linear layer, and a tied output projection, becomes a
    ``PackedLinear``; 16-centroid codebook layers move onto ``linear_q4`` where the CPU has
    AVX512-BF16, int4 layers where it has AVX512-VNNI (the int4 table's integer path), int5
    layers onto ``linear_q5`` and int8 ones onto ``linear_i8_rows`` where it has AVX512-VNNI,
    int8-group layers (GGUF Q8_0/Q6_K) onto ``linear_i8g_amx`` where it has AMX and onto
    ``linear_i8g_rows`` (few rows) where it has only AVX512-VNNI."""
    report = KernelReport("native")
    q4 = kernels.ops().linear_q4_native()
    # quantized weights compute in bf16 whatever the engine dtype (quant/base.py); the formats
    # move where the CPU has AVX512-BF16, int4, int5 and the int8 formats also where it has
    # only AVX512-VNNI (integer dot products; they check for it)
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear | Int5Linear | Int8Linear | Int8GroupLinear) or (
            q4 and isinstance(module, QuantizedLinear)
        ):
            module.use_native_kernel()
            if module.native:
                report.quantized.append(name)
    if dtype not in (torch.float32, torch.bfloat16):
        report.reason = f"no native kernels for {dtype}"
        return report
    long_queries = (
        dtype == torch.bfloat16
        and kernels.ops().paged_attention_bf16_native()
        and not sdpa_has_amx()
    )
    long_queries_int8 = bool(kernels.ops().paged_attention_int8_native())
    for module in model.modules():
        if isinstance(module, Attention | RMSNorm | GatedActivation | RotaryEmbedding):
            module.use_kernel = True
        if isinstance(module, Attention):
            module.kernel_long_queries = long_queries
            module.kernel_long_queries_int8 = long_queries_int8
            module.kernel_prompts_amx = dtype == torch.bfloat16 and bool(
                kernels.ops().prefill_attention_amx_native(module.head_dim)
            )
            module.kernel_prompts_f32 = bool(
                kernels.ops().prefill_attention_f32_native(module.head_dim)
            )
            report.attention_layers += 1
    if dtype != torch.bfloat16:
        return report
    native_bf16 = cpu_has_native_bf16()
    rows_max = PACKED_ROWS_MAX_NATIVE_BF16 if native_bf16 else 1 << 62
    fp32_rows_min = None if native_bf16 else FP32_ROWS_MIN
    if native_bf16 and kernels.ops().bf16_tiles_native():
        rows_max = PACKED_ROWS_MAX_TILES
    # nn.Linear and its fused subclass MergedLinear; quantized modules are not nn.Linear
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, module in targets:
        new = PackedLinear(
            module.weight,
            module.bias,
            getattr(module, "out_sizes", None),
            keep_dense=native_bf16,
            packed_rows_max=rows_max,
            fp32_out=name == "lm_head",
            fp32_rows_min=fp32_rows_min,
        )
        model.set_submodule(name, new)
        report.linears.append(name)
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", 0) is None and isinstance(embed, nn.Embedding):
        # Tied: the output projection reads the embedding matrix; the packed copy serves
        # decode, the embedding keeps the dense one for lookups and large batches.
        model.lm_head = PackedLinear(
            embed.weight,
            None,
            None,
            keep_dense=False,
            packed_rows_max=rows_max,
            fp32_out=True,
            fp32_rows_min=fp32_rows_min,
        )
        model.lm_head.tied = True
        if native_bf16:
            w = embed.weight.detach().to(torch.bfloat16)
            model.lm_head.dense = embed.weight
            model.lm_head.set_tiles(tiles_pack(w))
            model.lm_head.onednn = onednn_prepack(w) if model.lm_head.tiles is None else None
        report.linears.append("lm_head (tied)")
    return report

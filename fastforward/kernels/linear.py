"""The linear layer of the fast CPU path: bf16 weights, fp32 accumulation.

Where the CPU multiplies bf16 natively (AVX512-BF16, with or without AMX) the weight is kept
once, as AMX's B tiles (blocks of 16 output features, K in pairs side by side: the layout both
AMX and ``vdpbf16ps`` multiply), and ``linear_amx`` serves every batch from it: one row by
``vdpbf16ps`` streaming the tiles, more rows on AMX tiles (up to ``AMX_ROWS_MAX``; larger batches
take oneDNN on the weight unpacked from the tiles) or, without AMX, ``vdpbf16ps`` on 6 rows x
64 features of accumulators in registers. fp32 results, so the output projection needs no
rescoring. Where the kernels were built without AVX512-BF16 on such a CPU, decode-sized
batches run the packed kernel (tiles of 16 output features, ``[N/16, K, 16]``, fp32 FMAs) and
larger ones oneDNN's blocked copy where PyTorch can prepack it
(``mkldnn::_reorder_linear_weight``; ``F.linear`` on a plain weight reorders it on every call,
1.3-2x at 16-64 rows on an AMX Xeon), else the dense ``[N, K]`` weight. On a CPU without
native bf16 no second copy is kept: the packed kernel serves batches below ``fp32_rows_min``,
larger ones multiply in float32 on the packed weight expanded a chunk at a time
(``linear_bf16_gemm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastforward import kernels

# logits per row recomputed with fp32 accumulation when the output projection runs through
# oneDNN (batches above ``packed_rows_max``)
RESCORE_TOP = 16

# Rows up to which the AMX tiles serve a batch; above, oneDNN on the weight unpacked from the
# tiles (its reorder amortized over the rows) is the faster. AMX Xeon, 2 threads,
# SmolLM2's four layer matrices, us (a throwaway timing script, noisy): 64 rows 27-141 against
# oneDNN's prepacked 41-162; 512 rows 193-999 against 298-912; 2,048 rows 816-4,293 against
# the unpacked weight's 681-3,357. Kept equal to decoder.cpp's kAmxRowsMax.
AMX_ROWS_MAX = 512


def onednn_prepack(w: torch.Tensor) -> torch.Tensor | None:
    """``w [N, K]`` bf16 in oneDNN's blocked layout for ``mkldnn::_linear_pointwise``, or None
    where this PyTorch has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w)
    except (AttributeError, RuntimeError):
        return None


def onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def tiles_pack(w: torch.Tensor) -> torch.Tensor | None:
    """``w [N, K]`` bf16 as ``linear_amx``'s B tiles, or None where the kernels have no
    ``vdpbf16ps`` (no AVX512-BF16)."""
    ops = kernels.ops()
    return ops.pack_amx_weight(w) if ops.bf16_tiles_native() else None


def tiles_rows_max() -> int:
    """Rows up to which ``linear_amx`` takes a batch: ``AMX_ROWS_MAX`` on AMX tiles, every
    batch on ``vdpbf16ps`` (which keeps up with oneDNN at 512-2,048 rows on the Zen 4 EPYC)."""
    return AMX_ROWS_MAX if kernels.ops().amx_native() else 1 << 62


class PackedLinear(nn.Module):
    """Replaces an ``nn.Linear`` (or fused ``MergedLinear``) with the same forward contract."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out_sizes: list[int] | None,
        *,
        keep_dense: bool,
        packed_rows_max: int,
        fp32_out: bool = False,
        fp32_rows_min: int | None = None,
    ) -> None:
        super().__init__()
        # CPUs without native bf16: batches of at least this many rows multiply in float32
        # (the weight converted for the call), faster there than the software-bf16 kernel
        self.fp32_rows_min = fp32_rows_min
        # The output projection: the packed kernel returns its fp32 accumulators, so logits
        # are not rounded to bf16 (whose steps of 1/8 at |logit| 16-32 turn near-ties exact)
        self.fp32_out = fp32_out
        self.tied = False  # a tied output projection: its weight is the embedding's
        w = weight.detach().to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = w.shape
        self.out_sizes = None if out_sizes is None else list(out_sizes)
        self.packed_rows_max = packed_rows_max
        # native bf16: the tiles, the one copy (fp32 results: the output projection needs no
        # rescoring); else for large batches oneDNN's blocked copy, else the dense weight (the
        # output projection keeps the dense one then: its top logits are recomputed from rows
        # of it)
        tiles = tiles_pack(w) if keep_dense else None
        # the few-row copy; the tiles serve single rows too (linear_amx), so then there is none
        packed = kernels.ops().pack_linear_weight(w) if tiles is None else None
        self.register_buffer("packed", packed, persistent=False)
        self.set_tiles(tiles)
        self.onednn = onednn_prepack(w) if keep_dense and self.tiles is None else None
        need_dense = keep_dense and self.tiles is None and (self.onednn is None or fp32_out)
        self.dense = nn.Parameter(w, requires_grad=False) if need_dense else None
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The ``[N, K]`` bf16 weight (unpacked on demand when no dense copy is kept)."""
        if self.dense is not None:
            return self.dense
        if self.packed is None:
            return kernels.ops().unpack_amx_weight(self.tiles, self.out_features, self.in_features)
        return kernels.ops().unpack_linear_weight(self.packed, self.out_features)

    def set_tiles(self, tiles: torch.Tensor | None) -> None:
        """Take ``tiles`` (``tiles_pack``'s, or None) as the large-batch copy; with tiles the
        few-row copy is freed: ``linear_amx`` serves single rows too."""
        self.tiles = tiles
        self.tiles_rows_max = tiles_rows_max() if tiles is not None else 0
        if tiles is not None:
            self.packed = None

    @property
    def large_batch_weight(self) -> torch.Tensor | None:
        """What batches above ``packed_rows_max`` multiply by: the tiles, else the
        oneDNN-blocked copy, else the dense one (None: the packed kernel serves every batch)."""
        for w in (self.tiles, self.onednn, self.dense):
            if w is not None:
                return w
        return None

    @property
    def num_weights(self) -> int:
        return self.in_features * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.fp32_rows_min is not None and rows >= self.fp32_rows_min:
            return self._fp32_gemm(x)
        if self.packed is not None and (
            self.large_batch_weight is None or rows <= self.packed_rows_max
        ):
            x = x.float() if self.fp32_out else x
            return torch.ops.fastforward.linear_bf16(x, self.packed, self.out_features, self.bias)
        if self.tiles is not None and rows <= self.tiles_rows_max:
            return torch.ops.fastforward.linear_amx(
                x, self.tiles, self.out_features, self.bias, self.fp32_out
            )
        xb = x.to(torch.bfloat16)
        dense = self.weight if self.tiles is not None else self.dense
        if self.onednn is not None:
            y = onednn_linear(xb.reshape(-1, self.in_features), self.onednn)
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(xb, dense)
        if self.fp32_out:
            return self._rescored(x, y, dense)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def _fp32_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` in float32 on the packed weight expanded for this call, a chunk at a
        time (``linear_bf16_gemm``): on a CPU without native bf16 (so no AMX tiles, and the
        packed copy is always kept) the fp32 GEMM outruns the software-bf16 kernel from ~48
        rows on, the expansion included (``FP32_ROWS_MIN``, docs/cpu.md)."""
        return torch.ops.fastforward.linear_bf16_gemm(
            x, self.packed, self.out_features, self.bias, self.fp32_out
        )

    def _rescored(self, x: torch.Tensor, y: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """fp32 logits from oneDNN's bf16 ones (the CPU matmul has no fp32 output for bf16
        inputs): each row's ``RESCORE_TOP`` largest are recomputed from the same bf16 numbers
        with fp32 accumulation, so the greedy pick and the top logprobs are not bf16 ties; the
        rest keep bf16's rounding (2^-9 relative). One pass of the ``rescore_logits`` kernel
        (conversion, top-k and the recomputed dot products; at batch 64 of SmolLM2's 49k
        vocabulary ~0.2 ms against ~6 ms for the same in torch ops). The fp32 sums' order
        differs from the packed kernel's (batches up to ``packed_rows_max``), by fp32 rounding
        only."""
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = y.reshape(x2.shape[0], self.out_features)
        k = min(RESCORE_TOP, self.out_features)
        out = torch.ops.fastforward.rescore_logits(y, x2, dense, self.bias, k)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"dense={'kept' if self.dense is not None else 'no'}, "
            f"onednn={'prepacked' if self.onednn is not None else 'no'}, "
            f"tiles={'packed' if self.tiles is not None else 'no'}, "
            f"packed_rows_max={self.packed_rows_max}"
        )

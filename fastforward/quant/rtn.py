"""Round-to-nearest quantizers: int8 per output channel, int4 per group with scale and zero.

Scales (and zeros) are rounded to bf16, the dtype the CPU kernels read, *before* the codes are
chosen, so the codes are the best ones for the scales the kernel will actually use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KERNEL_DTYPE = torch.bfloat16  # the only dtype the CPU int8/int4 kernels vectorize

# int4: the fraction of each group's [min, max] range that is kept. Clipping a little of the
# range lowers the error of the many values near the middle more than it costs the extremes;
# each group takes the factor with the lowest squared error.
_INT4_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
_ROWS = 4096  # rows quantized at a time (bounds the float temporaries of a large embedding)


def group_for(in_features: int, group_size: int) -> int:
    """The largest group size (halving down to 32) that divides the input width."""
    while group_size > 32 and in_features % group_size:
        group_size //= 2
    return group_size


def round_up_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype``, never below ``x`` (positive inputs)."""
    y = x.to(dtype)
    low = y.float() < x
    return torch.where(low, torch.nextafter(y.float(), torch.tensor(float("inf"))).to(dtype), y)


@dataclass(slots=True)
class Int8Weights:
    codes: torch.Tensor  # [N, K] int8 in -127..127
    scales: torch.Tensor  # [N] bf16; w ~= codes * scales


def quantize_int8(weight: torch.Tensor) -> Int8Weights:
    """Symmetric per-output-channel int8."""
    w = weight.float()
    amax = w.abs().amax(dim=1).clamp(min=1e-12)
    scales = round_up_to(amax / 127.0, KERNEL_DTYPE)
    codes = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weights(codes, scales)


@dataclass(slots=True)
class Int4Weights:
    codes: torch.Tensor  # [N, K] uint8 in 0..15
    scales: torch.Tensor  # [N, K/g] bf16
    zeros: torch.Tensor  # [N, K/g] bf16; w ~= (codes - 8) * scales + zeros
    group_size: int


def quantize_int4(
    weight: torch.Tensor,
    group_size: int,
    clip: bool = True,
    hessian: torch.Tensor | None = None,
) -> Int4Weights:
    """Asymmetric group-wise int4 (the layout of ``_weight_int4pack_mm_for_cpu``), with a
    per-group search over how much of the range to clip (``clip=False``: the full range, six
    times faster). The clipping is judged by the squared error of the weights or, given the
    ``[K, K]`` Hessian of the layer's inputs, by that of the outputs (its diagonal blocks)."""
    blocks = None if hessian is None else hessian_blocks(hessian, group_size)
    parts = [
        quantize_int4_rows(weight[i : i + _ROWS], group_size, clip, blocks)
        for i in range(0, len(weight), _ROWS)
    ]
    return Int4Weights(
        torch.cat([p[0] for p in parts]),
        torch.cat([p[1] for p in parts]),
        torch.cat([p[2] for p in parts]),
        group_size,
    )


def hessian_blocks(hessian: torch.Tensor, group_size: int) -> torch.Tensor:
    """The ``[K/g, g, g]`` diagonal blocks of a ``[K, K]`` Hessian: how each group's inputs
    weigh (and correlate) within the group."""
    k = hessian.shape[0]
    g = k // group_size
    idx = torch.arange(g)
    return hessian.float().reshape(g, group_size, g, group_size)[idx, :, idx, :]


def quantize_int4_rows(
    weight: torch.Tensor,
    group_size: int,
    clip: bool = True,
    blocks: torch.Tensor | None = None,
):
    """Codes, scales and zeros of ``weight [n, K]``; ``blocks`` (``hessian_blocks``, ``[K/g,
    g, g]``) makes the clipping search minimize each group's output error instead."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    best = None
    for shrink in _INT4_SHRINK if clip else _INT4_SHRINK[:1]:
        mid, half = (hi + lo) / 2, (hi - lo) / 2 * shrink
        cand = _int4_candidate(w, mid - half, mid + half, blocks)
        if best is None:
            best = cand
            continue
        better = cand[3] < best[3]
        best = tuple(
            torch.where(better[..., None] if t.dim() == 3 else better, t, b)
            for t, b in zip(cand, best, strict=True)
        )
    codes, scales, zeros, _ = best
    return codes.view(n, k).to(torch.uint8), scales, zeros


def int4_grid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 scales and zeros (``w ~= (code - 8) * scale + zero``) of groups spanning
    ``[lo, hi]``."""
    scales = ((hi - lo) / 15).clamp(min=1e-10).to(KERNEL_DTYPE)
    return scales, (lo + 8 * scales.float()).to(KERNEL_DTYPE)


def _int4_candidate(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, blocks=None):
    scales, zeros = int4_grid(lo, hi)
    s, z = scales.float()[..., None], zeros.float()[..., None]
    codes = torch.round((w - z) / s + 8).clamp(0, 15)
    e = (codes - 8) * s + z - w  # [n, groups, g]
    if blocks is None:
        err = e.square().sum(dim=2)
    else:  # e_g^T H_g e_g for every row and group
        eg = e.transpose(0, 1)  # [groups, n, g]
        err = (torch.bmm(eg, blocks) * eg).sum(dim=2).t().contiguous()
    return codes, scales, zeros, err


def dequantize_int4(q: Int4Weights) -> torch.Tensor:
    n, k = q.codes.shape
    g = q.group_size
    codes = q.codes.float().view(n, k // g, g) - 8
    return (codes * q.scales.float()[..., None] + q.zeros.float()[..., None]).view(n, k)

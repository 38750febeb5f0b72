"""Codebook quantization: weights merged by their value distribution.

A matrix keeps one codebook of ``C`` centroids (16: 4-bit indices; 256: 8-bit) and a bf16
scale per group of ``group_size`` inputs: ``w = scale[group] * centroid[index]``. The
centroids come from 1-D k-means (Lloyd's iterations from the quantiles, weighted by
``scale**2`` so they minimise the error in weight units) over the group-normalized values;
then each group's scale is refit by least squares to its assigned centroids, and the two steps
alternate a few rounds.

Why this shape: on SmolLM2 and Qwen2.5 matrices, 16 centroids per *row* without group scales
have about twice the squared error of int4 with a scale and zero per 64 (a row mixes groups of
very different spread); normalizing groups and sharing one codebook across the matrix gives
the codebook all the data and lets it place its levels where the normalized values are dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastforward.quant.rtn import KERNEL_DTYPE

_ROUNDS = 2  # k-means / scale refits after the first fit
_ITERS = 30  # Lloyd's iterations per fit
_SAMPLE = 1 << 18  # values the centroids are fit on (a fixed random subset of a large matrix)


@dataclass(slots=True)
class CodebookWeights:
    indices: torch.Tensor  # [N, K] uint8
    centroids: torch.Tensor  # [C] bf16, ascending
    scales: torch.Tensor  # [N, K / group_size] bf16
    group_size: int


def quantize_codebook(weight: torch.Tensor, num_centroids: int, group_size: int) -> CodebookWeights:
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    scales = w.abs().amax(dim=2, keepdim=True).clamp(min=1e-12)
    gen = torch.Generator().manual_seed(0)
    big = w.numel() > _SAMPLE
    sample = torch.randint(w.numel(), (_SAMPLE,), generator=gen) if big else None
    centroids = None
    for _ in range(_ROUNDS + 1):
        values, weights = (w / scales).reshape(-1), scales.expand_as(w).square().reshape(-1)
        if sample is not None:
            values, weights = values[sample], weights[sample]
        centroids = _kmeans(values, weights, num_centroids, centroids)
        scales = _refit_scales(w, centroids[_assign(w / scales, centroids)])
    centroids = centroids.to(KERNEL_DTYPE).float()
    scales = scales.to(KERNEL_DTYPE)
    indices = _assign(w / scales.float(), centroids).to(torch.uint8)
    return CodebookWeights(
        indices.view(n, k), centroids.to(KERNEL_DTYPE), scales.squeeze(2), group_size
    )


def _kmeans(
    values: torch.Tensor, weights: torch.Tensor, c: int, init: torch.Tensor | None
) -> torch.Tensor:
    """Weighted 1-D k-means. In sorted order every cluster is a contiguous run, so a Lloyd step
    only needs the run boundaries and prefix sums."""
    sorted_values, order = values.sort()
    w = weights[order].double()
    prefix_wv = F.pad((w * sorted_values.double()).cumsum(0), (1, 0))
    prefix_w = F.pad(w.cumsum(0), (1, 0))
    total = len(sorted_values)
    if init is None:
        init = sorted_values[((torch.arange(c) + 0.5) / c * total).long()]
    centroids = init.float()
    for _ in range(_ITERS):
        bounds = torch.searchsorted(sorted_values, (centroids[1:] + centroids[:-1]) / 2)
        lo = F.pad(bounds, (1, 0), value=0)
        hi = F.pad(bounds, (0, 1), value=total)
        mass = prefix_w[hi] - prefix_w[lo]
        means = (prefix_wv[hi] - prefix_wv[lo]) / mass.clamp(min=1e-300)
        # An empty cluster keeps its centroid; 1-D Lloyd's steps keep the order.
        centroids = torch.where(mass > 0, means.float(), centroids)
    return centroids.sort().values


def _assign(values: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid (centroids ascending)."""
    return torch.bucketize(values, (centroids[1:] + centroids[:-1]) / 2)


def _refit_scales(w: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Per group, the scale minimising ``|w - scale * levels|^2``."""
    num = (w * levels).sum(dim=2, keepdim=True)
    den = levels.square().sum(dim=2, keepdim=True)
    fallback = w.abs().amax(dim=2, keepdim=True)
    ls = torch.where(den > 0, num / den.clamp(min=1e-30), fallback)
    return torch.where(ls > 0, ls, fallback).clamp(min=1e-12)


def dequantize_codebook(q: CodebookWeights) -> torch.Tensor:
    """float32 weights, each the bf16-rounded product ``scale * centroid`` (as the kernel
    computes it)."""
    n, k = q.indices.shape
    levels = q.centroids.float()[q.indices.long()].view(n, k // q.group_size, q.group_size)
    return (levels * q.scales.float()[..., None]).to(KERNEL_DTYPE).float().view(n, k)

"""PyTorch's CPU int4 weight layout, and the way back from it.

``torch.ops.aten._weight_int4pack_mm_for_cpu`` reads 4-bit codes in a layout made by
``_convert_weight_to_int4pack_for_cpu``: rows in blocks of ``BLOCK_N`` (64 with AVX-512, 32
with AVX2), each block stored k-major, byte ``j`` of a k-column holding rows ``j`` (low nibble)
and ``j + BLOCK_N/2`` (high nibble); a tail block of 16, 32 or 48 rows holds neighbouring rows
``2i, 2i+1`` in one byte. The layout depends on the CPU, so files store the plain layout
(``[N, K/2]``, low nibble = even column) and we pack at load; unpacking (for saving, for
dequantized prefill matmuls, and for embedding rows) is done here and checked once against the
op on a probe matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

_PACK_ROWS = 8192  # pack in row chunks (a multiple of every BLOCK_N) to bound the int32 copy


@dataclass(frozen=True, slots=True)
class Int4Layout:
    block_n: int  # rows per block
    halves: bool  # full blocks pair row j with j + block_n/2 (else neighbours 2i, 2i+1)


def pack_plain(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` codes in 0..15 -> plain ``[N, K/2]`` uint8 (low nibble = even column)."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_plain(packed: torch.Tensor) -> torch.Tensor:
    """Plain ``[N, K/2]`` uint8 -> ``[N, K]`` codes."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def to_kernel_layout(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` codes in 0..15 -> the CPU kernel's ``[N, K/2]`` uint8 layout."""
    chunks = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes[i : i + _PACK_ROWS].to(torch.int32), 1
        )
        for i in range(0, codes.shape[0], _PACK_ROWS)
    ]
    return torch.cat(chunks) if len(chunks) > 1 else chunks[0]


def from_kernel_layout(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The kernel's ``[N, K/2]`` layout -> ``[N, K]`` uint8 codes."""
    return _unpack(packed, in_features, kernel_layout())


def kernel_layout_rows(packed: torch.Tensor, in_features: int, rows: torch.Tensor) -> torch.Tensor:
    """Codes ``[len(rows), K]`` of some rows of a kernel-layout matrix, unpacking only their
    blocks (embedding lookups)."""
    layout = kernel_layout()
    n, k = packed.shape[0], in_features
    full = n // layout.block_n * layout.block_n
    out = torch.empty(rows.shape[0], k, dtype=torch.uint8, device=packed.device)
    in_full = rows < full
    if in_full.any():
        r = rows[in_full]
        blocks = packed.reshape(-1)[: full * k // 2].view(-1, k, layout.block_n // 2)[
            r // layout.block_n
        ]  # [R, K, block_n/2]
        lane, hi = _lane_of(r % layout.block_n, layout)
        byte = blocks.gather(2, lane.view(-1, 1, 1).expand(-1, k, 1)).squeeze(2)
        out[in_full] = torch.where(hi[:, None], byte >> 4, byte & 15)
    if not in_full.all():
        tail = _unpack_tail(packed, full, k)
        out[~in_full] = tail[rows[~in_full] - full]
    return out


def _lane_of(r: torch.Tensor, layout: Int4Layout) -> tuple[torch.Tensor, torch.Tensor]:
    half = layout.block_n // 2
    if layout.halves:
        return r % half, r >= half
    return r // 2, (r % 2) == 1


def _unpack(packed: torch.Tensor, k: int, layout: Int4Layout) -> torch.Tensor:
    n = packed.shape[0]
    full = n // layout.block_n * layout.block_n
    parts = []
    if full:
        blocks = packed.reshape(-1)[: full * k // 2].view(-1, k, layout.block_n // 2)
        lo, hi = blocks & 15, blocks >> 4  # [NB, K, block_n/2]
        if layout.halves:
            rows = torch.cat((lo, hi), dim=2)
        else:
            rows = torch.stack((lo, hi), dim=3).flatten(2)
        parts.append(rows.transpose(1, 2).reshape(full, k))
    if full < n:
        parts.append(_unpack_tail(packed, full, k))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _unpack_tail(packed: torch.Tensor, full: int, k: int) -> torch.Tensor:
    # A short last block (16, 32 or 48 rows): rows 2i and 2i+1 share a byte, k-major.
    nb = packed.shape[0] - full
    tail = packed.reshape(-1)[full * k // 2 :].view(k, nb // 2)
    return torch.stack((tail & 15, tail >> 4), dim=2).reshape(k, nb).t()


_CANDIDATES = (Int4Layout(64, True), Int4Layout(32, True), Int4Layout(32, False))


@cache
def kernel_layout() -> Int4Layout:
    """The layout this CPU's kernel uses, found by packing a probe matrix (a full block of each
    candidate size plus a 16-row tail)."""
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 16, (144, 64), generator=gen, dtype=torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe.to(torch.int32), 1)
    for layout in _CANDIDATES:
        if torch.equal(_unpack(packed, 64, layout), probe):
            return layout
    raise NotImplementedError(
        "unknown int4 weight layout of this PyTorch CPU build: int4 weights cannot be unpacked"
    )


def int4_shape_ok(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the CPU int4 kernel takes a ``[out, in]`` weight with this group size."""
    return (
        out_features % 16 == 0
        and in_features % group_size == 0
        and group_size in (32, 64, 128, 256)
    )

"""The layout of fastforward's own 4-bit kernel (``torch.ops.fastforward.linear_q4``,
``kernels/csrc/linear_q4.cpp``), and the way back from it.

Codes: ``[N/16, K/4, 32]`` uint8. For tile ``t`` (outputs ``16t..16t+15``) and input quad ``p``
(inputs ``4p..4p+3``), byte ``2i`` holds codes ``[16t+i, 4p]`` (low nibble) and ``[16t+i, 4p+2]``
(high), byte ``2i+1`` holds ``[16t+i, 4p+1]`` and ``[16t+i, 4p+3]``: the kernel's zero-extension
and word permutation turn the 32 bytes into the bf16 pairs its dot products take.
Scales (and zeros): ``[N/16, K/group, C, 16]`` bf16, one 32- or 64-byte read per tile and group.
The layout is the same on every CPU that runs the kernel (unlike ATen's int4 packing).
"""

from __future__ import annotations

import torch

TILE = 16
# With AMX, linear_q4 hands batches from 9 rows (int4; codebooks from 5) to AMX tiles, expanding the codes to bf16 tiles
# once per call (csrc/linear_amx.cpp linear_q4_amx), which beats dequantizing the whole weight
# for oneDNN at every batch size measured (SmolLM2's [3072, 576] gate/up at 2,048 rows: 4.3 ms
# against 6.0 ms, at 256 rows 0.5 against 2.2): there 4-bit layers take every batch.


def kernel_rows_max(without_amx: int) -> int:
    """The largest batch a layer should give linear_q4 (call with the kernels loaded): every
    batch where the kernels multiply bf16 tiles (AMX, or AVX512-BF16's ``vdpbf16ps``: linear_q4
    hands larger batches to ``linear_q4_amx``, which expands the codes once per call), else
    ``without_amx`` where the CPU has native bf16 (the kernel's cost grows with the rows there)
    and every batch where it has not (``few_row_kernel_limit``)."""
    from fastforward import kernels
    from fastforward.quant.base import EVERY_BATCH, few_row_kernel_limit

    if kernels.ops().bf16_tiles_native():  # AMX builds have them too
        return EVERY_BATCH
    return few_row_kernel_limit(without_amx)


def shape_ok(out_features: int, in_features: int, group_size: int) -> bool:
    return out_features % TILE == 0 and group_size % 4 == 0 and in_features % group_size == 0


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` codes in 0..15 -> ``[N/16, K/4, 32]`` uint8."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3)
    return (c[..., :2] | (c[..., 2:] << 4)).reshape(n // TILE, k // 4, 2 * TILE).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``[N/16, K/4, 32]`` uint8 -> ``[N, K]`` codes."""
    tiles, quads, _ = packed.shape
    b = packed.view(tiles, quads, TILE, 2)
    c = torch.cat((b & 15, b >> 4), dim=-1)  # [T, K/4, 16, 4]: inputs 4p, 4p+1, 4p+2, 4p+3
    return c.permute(0, 2, 1, 3).reshape(tiles * TILE, quads * 4)


def rows(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Codes ``[len(index), K]`` of some rows, reading only their bytes (embedding lookups)."""
    tiles, quads, _ = packed.shape
    b = packed.view(tiles, quads, TILE, 2)[index // TILE, :, index % TILE]  # [R, K/4, 2]
    return torch.cat((b & 15, b >> 4), dim=-1).reshape(index.shape[0], quads * 4)


def pack_scales(*per_group: torch.Tensor) -> torch.Tensor:
    """``[N, G]`` scales (and zeros) -> ``[N/16, G, C, 16]`` bf16."""
    s = torch.stack(per_group, dim=-1).to(torch.bfloat16)  # [N, G, C]
    n, g, c = s.shape
    return s.view(n // TILE, TILE, g, c).permute(0, 2, 3, 1).contiguous()


def scale_rows(packed: torch.Tensor, index: torch.Tensor) -> list[torch.Tensor]:
    """Scales (and zeros) of some rows, C tensors ``[len(index), G]`` (embedding lookups)."""
    s = packed[index // TILE, :, :, index % TILE]  # [R, G, C]
    return [s[..., i] for i in range(s.shape[-1])]


def unpack_scales(packed: torch.Tensor) -> list[torch.Tensor]:
    """``[N/16, G, C, 16]`` -> C tensors ``[N, G]``."""
    tiles, g, c, _ = packed.shape
    s = packed.permute(0, 3, 1, 2).reshape(tiles * TILE, g, c)
    return [s[..., i] for i in range(c)]

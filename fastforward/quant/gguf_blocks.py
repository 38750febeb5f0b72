"""GGUF block formats -> codes and per-group scales, without expanding to floats.

Every block type in our models is a group-wise affine code:

- 4-bit codes ``q`` in 0..15 (Q4_0, Q4_1, Q4_K): ``w = (q - shift) * scale + offset``,
  groups of 32, which is what the CPU int4 kernel computes (with bf16 scales).
- signed codes that fit int8 (Q8_0: -128..127; Q5_0: -16..15; Q6_K: -32..31):
  ``w = q * scale``, groups of 32 (16 for Q6_K).

``BlockCodes.dequantize`` reproduces ``gguf.quants.dequantize`` bit for bit: the same float32
operations in the same order (tests check it on every type).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

FOUR_BIT = (QT.Q4_0, QT.Q4_1, QT.Q4_K)
EIGHT_BIT = (QT.Q5_0, QT.Q6_K, QT.Q8_0)
PACKABLE = FOUR_BIT + EIGHT_BIT


@dataclass(slots=True)
class BlockCodes:
    """A matrix in group-wise affine codes: ``w = (codes - shift) * scales (+ offsets)``."""

    codes: torch.Tensor  # [N, K] uint8 (4-bit) or int8
    scales: torch.Tensor  # [N, K / group_size] float32
    offsets: torch.Tensor | None  # [N, K / group_size] float32, added after scaling
    shift: int
    group_size: int
    bits: int  # 4 or 8

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        g = self.group_size
        q = self.codes.float().view(n, k // g, g)
        if self.shift:
            q = q - self.shift
        w = q * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.view(n, k)

    def rows(self, index: torch.Tensor) -> BlockCodes:
        """The same code restricted to (or reordered by) output rows ``index``."""
        offsets = None if self.offsets is None else self.offsets[index]
        return BlockCodes(
            self.codes[index], self.scales[index], offsets, self.shift, self.group_size, self.bits
        )


def decode_blocks(raw: np.ndarray, qtype: QT, shape: tuple[int, int]) -> BlockCodes:
    """``raw`` bytes ``[rows, bytes_per_row]`` of a ``shape`` = ``[N, K]`` tensor -> codes."""
    if qtype not in _DECODERS:
        raise ValueError(f"GGUF type {qtype.name} has no packed form")
    n, k = shape
    codes, scales, offsets, shift, group, bits = _DECODERS[qtype](np.ascontiguousarray(raw))
    return BlockCodes(
        torch.from_numpy(np.ascontiguousarray(codes)).view(n, k),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)).view(n, k // group),
        None
        if offsets is None
        else torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.float32)).view(n, k // group),
        shift,
        group,
        bits,
    )


def _blocks(raw: np.ndarray, size: int) -> np.ndarray:
    return raw.reshape(-1, size)


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Bytes ``[..., width]`` -> low nibbles then high nibbles ``[..., 2 * width]``."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _q4_0(raw):
    b = _blocks(raw, 18)
    return _nibbles(b[:, 2:], 16), _f16(b[:, :2]), None, 8, 32, 4


def _q4_1(raw):
    b = _blocks(raw, 20)
    return _nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4]), 0, 32, 4


def _q4_k(raw):
    from gguf.quants import Q4_K

    b = _blocks(raw, 144)
    nb = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    scales = d * sc.astype(np.float32)  # [nb, 8]
    offsets = -(dmin * m.astype(np.float32))
    qs = b[:, 16:].reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(nb, 256)
    return codes, scales, offsets, 0, 32, 4


def _q8_0(raw):
    b = _blocks(raw, 34)
    return b[:, 2:].copy().view(np.int8), _f16(b[:, :2]), None, 0, 32, 8


def _q5_0(raw):
    b = _blocks(raw, 22)
    nb = b.shape[0]
    qh = b[:, 2:6].copy().view(np.uint32).reshape(nb, 1) >> np.arange(32, dtype=np.uint32)
    high = (qh & 1).astype(np.uint8) << 4
    codes = (_nibbles(b[:, 6:], 16) | high).astype(np.int8) - np.int8(16)
    return codes, _f16(b[:, :2]), None, 0, 32, 8


def _q6_k(raw):
    b = _blocks(raw, 210)
    nb = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    scales = _f16(b[:, 208:210]) * sc  # [nb, 16]
    ql = ql.reshape(nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(nb, 8, 32)
    qh = qh.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(nb, 8, 32)
    codes = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    return codes.reshape(nb, 256), scales, None, 0, 16, 8


_DECODERS = {
    QT.Q4_0: _q4_0,
    QT.Q4_1: _q4_1,
    QT.Q4_K: _q4_k,
    QT.Q8_0: _q8_0,
    QT.Q5_0: _q5_0,
    QT.Q6_K: _q6_k,
}

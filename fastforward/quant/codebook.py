"""Codebook (k-means) weights: ``w = scale[group] * centroid[index]``, one codebook per matrix
(see ``kmeans.py``).

``codebook4``: 16 centroids, 4-bit indices packed two to a byte, a bf16 scale per 32 inputs
(4.5 bits per weight, like int4-g64). ``codebook4-g64``: scales per 64 (4.25 bits, like
int4-g128). ``codebook8``: 256 centroids, one byte per index, scales per 128 (8.125 bits).

No PyTorch CPU kernel does a table lookup inside a matmul. On the PyTorch path every call looks
the weight up into bf16 and runs the dense bf16 matmul: the memory at rest is small, but a decode
step is slower than plain bf16. Once the engine switches the model onto fastforward's kernels,
16-centroid matrices run ``torch.ops.fastforward.linear_q4`` (the int4 kernel with the centroids
as its 16-entry table, ``q4pack.py``'s layout), which reads the 4-bit indices in place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fastforward.quant import int4pack, q4pack
from fastforward.quant.base import QuantizedLinear
from fastforward.quant.kmeans import CodebookWeights
from fastforward.quant.rtn import KERNEL_DTYPE


class CodebookLinear(QuantizedLinear):
    format = "codebook"
    native_rows_max = 256  # as int4 (benchmarks/bench_quant_kernels.py)

    def __init__(self, q: CodebookWeights, bias=None, out_sizes=None) -> None:
        n, k = q.indices.shape
        super().__init__(k, n, bias, out_sizes)
        self.num_centroids = q.centroids.shape[0]
        self.group_size = q.group_size
        self.nibbles = self.num_centroids <= 16
        stored = int4pack.pack_plain(q.indices) if self.nibbles else q.indices
        self.register_buffer("indices", stored.contiguous())
        self.register_buffer("centroids", q.centroids.to(KERNEL_DTYPE).contiguous())  # [C]
        self.register_buffer("scales", q.scales.to(KERNEL_DTYPE).contiguous())  # [N, K/g]
        self.native = False  # indices and scales in linear_q4's layout

    def use_native_kernel(self) -> None:
        """16 centroids: repack indices and scales for ``torch.ops.fastforward.linear_q4``."""
        ok = self.nibbles and q4pack.shape_ok(self.out_features, self.in_features, self.group_size)
        if self.native or not ok:
            return
        self.indices = q4pack.pack(int4pack.unpack_plain(self.indices))  # [N/16, K/4, 32]
        self.scales = q4pack.pack_scales(self.scales)  # [N/16, K/g, 1, 16]
        self.centroids = torch.cat((self.centroids, self.centroids.new_zeros(16)))[:16]
        self.native = True
        self.native_rows_max = q4pack.kernel_rows_max(type(self).native_rows_max)

    def _plain(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices (plain layout) and ``[N, K/g]`` scales, for checkpoints."""
        if not self.native:
            return self.indices, self.scales
        (scales,) = q4pack.unpack_scales(self.scales)
        return int4pack.pack_plain(q4pack.unpack(self.indices)), scales

    def _lookup(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or rows ``index`` of it) in bf16; a lookup reads only its rows."""
        r, g = self.out_features if index is None else index.shape[0], self.group_size
        if self.native:
            if index is None:
                codes, (scales,) = q4pack.unpack(self.indices), q4pack.unpack_scales(self.scales)
            else:
                codes = q4pack.rows(self.indices, index)
                (scales,) = q4pack.scale_rows(self.scales, index)
            levels = self.centroids[codes.long()]
        else:
            idx = self.indices if index is None else self.indices[index]
            scales = self.scales if index is None else self.scales[index]
            if self.nibbles:
                # one lookup per byte: a 256-entry table of (low, high) centroid pairs
                byte = torch.arange(256, device=idx.device)
                table = torch.stack((self.centroids[byte % 16], self.centroids[byte // 16]), dim=1)
            else:
                table = self.centroids[:, None]
            levels = F.embedding(idx.to(torch.int32), table)
        return (levels.view(r, -1, g) * scales[..., None]).view(r, self.in_features)

    @property
    def kernel_rows_max(self) -> int:
        return self.native_rows_max if self.native else 0  # the PyTorch path is always dense

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.shape[0] <= self.native_rows_max:
            return torch.ops.fastforward.linear_q4(
                x, self.indices, self.scales, self.centroids, self.group_size
            )
        return F.linear(x, self._lookup())

    def dense_bf16(self) -> torch.Tensor:
        return self._lookup()

    def dequantize(self) -> torch.Tensor:
        return self._lookup().float()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return self._lookup(index).float()

    def packed_state(self) -> dict[str, torch.Tensor]:
        indices, scales = self._plain()
        centroids = self.centroids[: self.num_centroids]
        return {"indices": indices, "centroids": centroids, "scales": scales}

    def config(self) -> dict[str, Any]:
        return super().config() | {
            "num_centroids": self.num_centroids,
            "group_size": self.group_size,
        }

    @classmethod
    def from_packed(cls, tensors, config, bias):
        idx = tensors["indices"]
        if config["num_centroids"] <= 16:
            idx = int4pack.unpack_plain(idx)
        q = CodebookWeights(idx, tensors["centroids"], tensors["scales"], config["group_size"])
        return cls(q, bias, config.get("out_sizes"))

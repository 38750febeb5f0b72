"""Linear layers. Projections that read the same input are fused into one matmul (q/k/v and
gate/up); checkpoints store them apart, so each fused layer knows where every shard goes.

Weight quantization (``fastforward.quant``) swaps these modules for packed ones with the same
``forward`` contract after loading; a fused layer is quantized as one matrix and keeps its
``out_sizes``."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One ``nn.Linear`` whose output rows are the concatenation of several projections."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint's ``weight`` or ``bias`` of projection ``shard`` into place."""
        param = self.weight if name == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a {name} for a layer built without one")
        copy_rows(param, self.out_sizes, shard, tensor, name)


def copy_rows(
    param: torch.Tensor, out_sizes: list[int], shard: int, tensor: torch.Tensor, name: str = ""
) -> None:
    """Copy projection ``shard`` of a fused layer into its rows of ``param``."""
    start, size = sum(out_sizes[:shard]), out_sizes[shard]
    if tensor.shape[0] != size or tensor.shape[1:] != param.shape[1:]:
        raise ValueError(
            f"shard {shard} {name or 'tensor'} has shape {tuple(tensor.shape)}, expected "
            f"({size}, {', '.join(map(str, param.shape[1:]))})"
        )
    with torch.no_grad():
        param[start : start + size].copy_(tensor)

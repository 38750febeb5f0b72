"""What every quantized linear shares: the ``nn.Linear`` forward contract, fused-layer shards,
embedding rows, and the packed tensors a checkpoint stores.

A quantized module replaces an ``nn.Linear`` (or a fused ``MergedLinear``, quantized as one
matrix) after the float weights are loaded: ``forward(x [..., in]) -> [..., out]`` in
``x.dtype``. The matmul itself runs in bf16, the one dtype the CPU int8/int4 kernels vectorize.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fastforward.layers.linear import copy_rows
from fastforward.quant.rtn import KERNEL_DTYPE

EVERY_BATCH = 1 << 62  # a packed kernel's rows limit that no batch reaches


def few_row_kernel_limit(rows: int) -> int:
    """The largest batch for fastforward's integer kernels (linear_q4's int4 path, linear_q5,
    linear_i8_rows, linear_i8g_rows): ``rows`` where the CPU has native bf16, whose dense
    matmul wins above a few rows; every batch where it has not. There the AVX512-VNNI integer
    dot products beat expanding the weight for a float32 matmul at every batch size measured:
    Qwen2.5-0.5B's gate/up [9728, 896] at 2,048 rows, 2 threads, Xeon without AVX512-BF16,
    int4 253 against 361 ms, int5 285 / 376, int8 122 / 683 (a throwaway timing script)."""
    from fastforward.kernels.apply import cpu_has_native_bf16

    return rows if cpu_has_native_bf16() else EVERY_BATCH


def expand_dtype() -> torch.dtype:
    """The dtype a packed weight is expanded to for the dense matmul of large batches: bf16
    where the CPU multiplies it natively, else float32 (oneDNN's software bf16 is slower)."""
    from fastforward.kernels.apply import cpu_has_native_bf16

    return KERNEL_DTYPE if cpu_has_native_bf16() else torch.float32


class QuantizedLinear(nn.Module):
    """Base of the weight-quantized linears. Subclasses hold the packed weight as buffers and
    implement ``matmul`` (bf16 ``[M, K] -> [M, N]``), ``dequantize`` and ``packed_state``."""

    format: ClassVar[str] = ""
    # Batches up to this many rows run the packed kernel; larger ones (prefill, scoring)
    # dequantize the weight to bf16 once per call and run the dense bf16 matmul, which is
    # faster there: the packed kernels' cost grows with the rows, the dequantization's does
    # not. Each format sets its crossover (benchmarks/bench_quant_kernels.py).
    packed_rows_max: ClassVar[int] = 16
    native = False  # whether the packed tensors are in fastforward's own kernel layout

    def use_native_kernel(self) -> None:
        """Move onto fastforward's own kernel (``torch.ops.fastforward``) where the format has
        one (the same values, repacked); formats without one stay as they are."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        out_sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.out_sizes = None if out_sizes is None else list(out_sizes)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)

    # -- the nn.Linear contract --

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        y = self.matmul(flat).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def expanded_matmul(self, x: torch.Tensor, expand, dtype: torch.dtype) -> torch.Tensor:
        """``x @ W^T`` on the weight expanded once for this call by ``expand(out)`` (a C++
        dequantize into an ``[N, K]`` tensor of ``dtype``), for batches past the packed kernel."""
        w = torch.empty(self.out_features, self.in_features, dtype=dtype)
        expand(w)
        return F.linear(x.to(dtype), w).to(x.dtype)

    @property
    def kernel_rows_max(self) -> int:
        """Batches up to this many rows run the packed kernel in use; larger ones go dense."""
        return self.packed_rows_max

    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        """A fused layer's bias arrives one projection at a time (the packed weight does not
        come through here)."""
        if name != "bias" or self.bias is None or self.out_sizes is None:
            raise ValueError(f"quantized layer cannot take a {name} shard")
        copy_rows(self.bias, self.out_sizes, shard, tensor)

    # -- views of the weight --

    def dequantize(self) -> torch.Tensor:
        """The weight this module multiplies by, ``[N, K]`` float32."""
        raise NotImplementedError

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the dequantized weight, ``[len(index), K]`` float32 (embeddings)."""
        return self.dequantize()[index]

    def dense_bf16(self) -> torch.Tensor:
        return self.dequantize().to(KERNEL_DTYPE)

    # -- checkpoints --

    def packed_state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint stores (CPU-independent layouts)."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """What ``from_packed`` needs besides the tensors (goes into ``quantization_config``)."""
        cfg: dict[str, Any] = {
            "format": self.format,
            "in_features": self.in_features,
            "out_features": self.out_features,
        }
        if self.out_sizes is not None:
            cfg["out_sizes"] = self.out_sizes
        return cfg

    @classmethod
    def from_packed(
        cls, tensors: dict[str, torch.Tensor], config: dict[str, Any], bias: torch.Tensor | None
    ) -> QuantizedLinear:
        raise NotImplementedError

    # -- accounting --

    @property
    def num_weights(self) -> int:
        return self.in_features * self.out_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


class ConcatLinear(QuantizedLinear):
    """A fused layer whose projections came in different packed formats (a GGUF file may store
    q/k as Q4_K and v as Q6_K): each part runs its own kernel, outputs are concatenated."""

    format = "concat"

    def __init__(
        self, parts: list[QuantizedLinear], bias: torch.Tensor | None, out_sizes: list[int]
    ) -> None:
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts), bias, out_sizes)
        self.parts = nn.ModuleList(parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(x) for p in self.parts], dim=-1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def packed_state(self) -> dict[str, torch.Tensor]:
        return {
            f"parts.{i}.{name}": t
            for i, p in enumerate(self.parts)
            for name, t in p.packed_state().items()
        }

    def config(self) -> dict[str, Any]:
        return super().config() | {"parts": [p.config() for p in self.parts]}

    @classmethod
    def from_packed(cls, tensors, config, bias):
        from fastforward.quant.formats import module_from_packed

        parts = [
            module_from_packed(
                {k.split(".", 2)[2]: t for k, t in tensors.items() if k.startswith(f"parts.{i}.")},
                part,
                None,
            )
            for i, part in enumerate(config["parts"])
        ]
        return cls(parts, bias, config["out_sizes"])


class QuantizedEmbedding(nn.Module):
    """An embedding table kept packed: lookups dequantize only the rows asked for. With tied
    embeddings the same module serves as the output projection (``linear``)."""

    def __init__(self, linear: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = linear
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = linear.out_features, linear.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.linear.rows(ids.reshape(-1))
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

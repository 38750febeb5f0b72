"""Quantized KV cache: int8 keys and values with one scale per token and KV head.

``kv_cache_dtype="int8"`` stores each new key and value vector as int8 with a symmetric
per-(token, head) scale (``absmax / 127``, kept as float16 beside the page): quantized once
when written, dequantized when attention reads it. A vector of ``head_dim`` bf16 numbers (2
bytes each) becomes ``head_dim`` bytes plus a 2-byte scale, so a page holds ~1.9-2x the tokens
(``head_dim`` 64: 128 -> 66 bytes) and the scheduler, which sizes the pool in bytes, runs that
many more sequences in the same memory. The scale is dynamic (no calibration): every vector
uses its own range, as llama.cpp's q8_0 cache does per 32 numbers.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16
QMAX = 127.0
# the names ``kv_cache_dtype`` takes (vLLM's option); "auto" keeps the model's dtype
KV_CACHE_DTYPES = {"int8": torch.int8}


def resolve_kv_cache_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    if name in (None, "auto"):
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {name!r} is not supported (choose auto, {', '.join(KV_CACHE_DTYPES)})"
        )
    return KV_CACHE_DTYPES[name]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype == torch.int8


def scale_bytes(dtype: torch.dtype) -> int:
    """Bytes of scale stored per (token, head) vector of a cache of ``dtype``."""
    return SCALE_DTYPE.itemsize if is_quantized(dtype) else 0


def kv_cache_layout(
    shape: tuple[int, ...], dtype: torch.dtype
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The (shape, dtype) of a KV slot's tensors: the cache ``[2, num_blocks, block_size, KVH,
    D]`` of ``dtype`` and, if that dtype is quantized, its scales ``[2, num_blocks, block_size,
    KVH]``."""
    layout = [(tuple(shape), dtype)]
    if is_quantized(dtype):
        layout.append((tuple(shape[:-1]), SCALE_DTYPE))
    return layout


def allocate_kv_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A zeroed cache ``[2, num_blocks, block_size, KVH, D]`` of ``dtype`` and, if that dtype
    is quantized, its scales ``[2, num_blocks, block_size, KVH]`` (else None)."""
    tensors = [torch.zeros(s, dtype=d, device=device) for s, d in kv_cache_layout(shape, dtype)]
    return tensors[0], tensors[1] if len(tensors) > 1 else None


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (int8 ``[..., D]``, scale ``[...]``) with ``x ~ q * scale``."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / QMAX).to(SCALE_DTYPE)
    scale = scale.clamp(min=torch.finfo(SCALE_DTYPE).tiny)  # an all-zero vector stays zero
    q = torch.round(xf / scale.float()[..., None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()[..., None]).to(dtype)

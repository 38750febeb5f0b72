"""fastforward's own CPU kernels (C++, vectorised for the machine's SIMD width, threaded with
ATen's pool), built on first use: a bf16-weight linear layer, a 4-bit one (int4 and codebook
weights through a 16-entry table, AVX512-BF16), paged attention that reads the
block-paged KV cache in place, RMSNorm, gated activations and RoPE. ``available()`` says whether they loaded; every caller keeps
the plain PyTorch path as the fallback and as the reference the tests compare against."""

from __future__ import annotations

import torch

from fastforward.kernels.build import KernelBuild, build_and_load

_state: dict[str, KernelBuild] = {}  # the one build per process (a loaded library cannot reload)


def load() -> KernelBuild:
    if "build" not in _state:
        _state["build"] = build_and_load()
    return _state["build"]


def available() -> bool:
    return load().loaded


def ops():
    if not available():
        raise RuntimeError(f"fastforward CPU kernels are not available: {load().error}")
    return torch.ops.fastforward


__all__ = ["KernelBuild", "available", "load", "ops"]

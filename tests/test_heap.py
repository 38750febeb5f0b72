"""Start-up's freed temporaries handed back to the system (fastforward/heap.py)."""

from __future__ import annotations

import ctypes.util
import os
import platform

import pytest
import torch

from fastforward.heap import trim_heap

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
    or ctypes.util.find_library("c") is None,
    reason="glibc's malloc_trim",
)  # fmt: skip


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_trim_heap_returns_freed_heap_memory():
    """After a 16 MiB block is freed (glibc's mmap threshold rises to its size), 160 MiB of
    4 MiB tensors come from the heap; freed below a tensor still held, they stay resident
    until trim_heap hands their pages back."""
    big = torch.ones(16 << 20, dtype=torch.uint8)
    del big
    blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(40)]
    held = torch.ones(1 << 20, dtype=torch.uint8)
    del blocks
    before = _rss_mib()
    assert trim_heap()
    assert before - _rss_mib() > 100
    assert int(held.sum()) == 1 << 20

"""Start-up's freed temporaries handed back to the system (fastforward/heap.py)."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
    or ctypes.util.find_library("c") is None,
    reason="glibc's malloc_trim",
)  # fmt: skip


# Each in a fresh process: after other tests the heap has holes, where the small block meant
# to sit above the freed ones can land, and then free() itself gives their pages back.
_TRIM = """
import os, torch
from fastforward.heap import trim_heap

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

big = torch.ones(16 << 20, dtype=torch.uint8)
del big
blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(40)]
held = torch.ones(1 << 20, dtype=torch.uint8)
del blocks
before = rss_mib()
trimmed = trim_heap()
print(int(trimmed), before - rss_mib(), int(held.sum()))
"""


def _run(code: str, *args: str) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return [float(x) for x in out.stdout.split()[-3:]]


def test_trim_heap_returns_freed_heap_memory():
    """After a 16 MiB block is freed (glibc's mmap threshold rises to its size), 160 MiB of
    4 MiB tensors come from the heap; freed below a tensor still held, they stay resident
    until trim_heap hands their pages back."""
    trimmed, returned, held = _run(_TRIM)
    assert trimmed == 1
    assert returned > 100
    assert held == 1 << 20


# VmHWM, not ru_maxrss: a forked child's ru_maxrss starts from its parent's (pytest's) size
_START = """
import sys
from fastforward import LLM
llm = LLM(sys.argv[1], kv_cache_dtype="int8")
with open("/proc/self/status") as f:
    status = f.read()
kib = [int(status.split(key + ":")[1].split()[0]) for key in ("VmHWM", "VmRSS")]
print(*(k / 1024 for k in kib))
"""


def test_engine_start_peaks_near_where_it_ends(smollm2_path):
    """The runner hands the heap back between gathering the weights into huge pages and
    touching the KV cache, so the copies the gather freed are not resident beside the cache.
    SmolLM2 with an int8 cache (whose key-scale calibration raises glibc's mmap threshold, so
    the packed weights come from the heap) peaked 310 MiB above its memory after start
    without that trim, 0-19 MiB with it. A fresh process, so the peak is the start's."""
    peak, now = _run(_START, str(smollm2_path))[-2:]
    assert peak - now < 100, f"start peaked at {peak:.0f} MiB, {now:.0f} MiB after it"

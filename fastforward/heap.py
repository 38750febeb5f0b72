"""Handing the C heap's free pages back to the system (glibc's ``malloc_trim``).

glibc serves allocations below its mmap threshold from its heap and keeps freed heap memory
resident. The threshold starts at 128 KiB but rises to the size of each large mmapped block
freed (up to 32 MiB), so after a pass with large temporaries (an int8 KV cache's key-scale
calibration over 512 tokens) the weights packed next come from the heap too, and once the
runner has copied them into huge pages their freed copies stay resident:
SmolLM2 with an int8 cache held 2,037 MiB after start against 1,737 after a trim (bf16 KV:
1,802 against 1,732). The runner trims before it touches the KV cache too, so those copies
are not resident beside it at the start's peak (int8 KV 2,045 -> 1,734 MiB).
"""

from __future__ import annotations

import ctypes
import ctypes.util


def trim_heap() -> bool:
    """Return the heap's free pages to the system; False where there is no ``malloc_trim``
    (not glibc) or nothing was returned."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))

"""Just-in-time build of the C++ CPU kernels (``csrc/``) into ``torch.ops.fastforward``.

The library is compiled for the machine it runs on (``-march=native``) on first use and cached
under ``~/.cache/fastforward/kernels/<key>``, the key hashing the sources, the flags, the torch
version and the CPU's feature flags, so a changed source or a different CPU rebuilds. Where the
build fails (no compiler, no ninja, a compile error) the result says why and the engine keeps
the plain PyTorch paths.

Builders take turns under an ``flock`` on the cache directory: PyTorch's own build lock is a
file that a builder killed mid-build leaves behind, after which every later load waits for it
forever (a CI run killed while compiling did that here). Under the ``flock`` such a file can
only be stale, so it is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = (
    "linear.cpp",
    "linear_q4.cpp",
    "linear_amx.cpp",
    "linear_i8g.cpp",
    "linear_q5.cpp",
    "attention.cpp",
    "attention_amx.cpp",
    "attention_prompt.cpp",
    "elementwise.cpp",
    "greedy_screen.cpp",
    "decoder.cpp",
    "ops.cpp",
)
HEADERS = (
    "vec.h",
    "ops.h",
    "amx.h",
    "bf16_tiles.h",
    "int16_rows.h",
    "parallel.h",
    "expand.h",
    "prompts.h",
)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-DNDEBUG")
CSRC = Path(__file__).parent / "csrc"


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """Where the kernels were built and whether they loaded (``error`` says why not)."""

    directory: Path
    loaded: bool
    error: str = ""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("FASTFORWARD_CACHE") or Path.home() / ".cache" / "fastforward"
    return Path(base) / "kernels"


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Exclusive use of a build directory for this process (released when it exits, however
    it exits); PyTorch's ``lock`` file found there then is a dead builder's, and is removed."""
    import fcntl

    with open(directory / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing a stale kernel build lock left by a killed build: %s", stale)
            stale.unlink(missing_ok=True)
        yield


def build_and_load(verbose: bool = False) -> KernelBuild:
    """Compile (or reuse) and load the kernels; never raises."""
    if hasattr(torch.ops.fastforward, "linear_bf16"):
        return KernelBuild(Path(), True)
    key = build_key()
    directory = cache_root() / key
    try:
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        with build_lock(directory):
            cpp_extension.load(
                name=f"fastforward_kernels_{key}",
                sources=[str(CSRC / s) for s in SOURCES],
                extra_cflags=list(FLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=verbose,
            )
    except Exception as exc:  # no compiler, no ninja, a build error: fall back, say why
        lines = str(exc).strip().splitlines() or [""]
        first_error = next((ln for ln in lines if "error:" in ln), lines[-1])
        message = f"{type(exc).__name__}: {first_error.strip()}"
        logger.warning("fastforward CPU kernels unavailable (%s); using PyTorch paths", message)
        return KernelBuild(directory, False, message)
    return KernelBuild(directory, True)

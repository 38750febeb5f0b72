"""Calibration text from files every machine we run on has: licence texts Debian ships and
CPython's own standard library (prose and code, for chat and coder models alike).

The GNU licences are left out on purpose: ``fastforward eval`` scores perplexity on the GPL-3,
and the GPL-2/LGPL/GFDL share much of its wording. Used by the int8 KV cache's key scales
(``kv/calibrate.py``) and by GPTQ (``quant/gptq.py``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

LICENSES = Path("/usr/share/common-licenses")
LICENSE_FILES = ("Apache-2.0", "MPL-2.0", "MPL-1.1", "CC0-1.0", "Artistic", "BSD")
# Standard-library modules: plain, well-commented Python of several styles.
STDLIB_FILES = ("textwrap.py", "difflib.py", "fractions.py", "heapq.py", "argparse.py", "csv.py")


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class CalibrationText:
    source: str  # the file it was read from
    text: str


def stdlib_dir() -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return Path(sys.base_prefix) / "lib" / version


def calibration_texts() -> list[CalibrationText]:
    """The licence texts first (the Apache License 2.0 leads), then CPython's LICENSE.txt and
    standard-library sources; only the files present on this machine."""
    paths = [LICENSES / name for name in LICENSE_FILES]
    paths += [stdlib_dir() / "LICENSE.txt"] + [stdlib_dir() / name for name in STDLIB_FILES]
    return [
        CalibrationText(str(p), p.read_text(encoding="utf-8", errors="replace"))
        for p in paths
        if p.is_file()
    ]


def calibration_windows(tokenizer: Encoder, num_tokens: int, window: int) -> list[list[int]]:
    """Token windows of ``window`` tokens, ``num_tokens`` in all (fewer if the texts run out),
    taken in turn from prose and code so that both are represented at any size."""
    if window < 2 or num_tokens < window:
        raise ValueError(f"need window >= 2 and num_tokens >= window, got {window}, {num_tokens}")
    texts = calibration_texts()
    if not texts:
        raise ValueError("no calibration text on this machine (licence files, CPython sources)")
    prose = [t for t in texts if not t.source.endswith(".py")]
    code = [t for t in texts if t.source.endswith(".py")]
    streams = [_windows(group, tokenizer, window) for group in (prose, code) if group]
    out: list[list[int]] = []
    while len(out) * window < num_tokens and streams:
        for stream in list(streams):
            chunk = next(stream, None)
            if chunk is None:
                streams.remove(stream)
            elif len(out) * window < num_tokens:
                out.append(chunk)
    return out


def _windows(texts: list[CalibrationText], tokenizer: Encoder, window: int):
    for t in texts:
        ids = tokenizer.encode(t.text)
        for i in range(0, len(ids) - window + 1, window):
            yield ids[i : i + window]

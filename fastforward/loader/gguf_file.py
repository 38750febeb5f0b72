"""A small, fast reader of the GGUF container: metadata and the tensor index, parsed with
``struct`` over an mmap, tensors as zero-copy views of the raw bytes.

``gguf.GGUFReader`` turns every element of every metadata array into numpy objects, which
takes seconds for a 262k-token vocabulary; we only touch what we use. Block dequantization
still comes from the ``gguf`` package (``gguf.quants``).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_GGUF_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (PyTorch order): the GGUF dims reversed
    qtype: GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


class GGUFFile:
    """An open GGUF file: ``metadata`` (dict) and ``tensors`` (name -> ``TensorInfo``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.metadata, self.tensors = _parse(self._buf, str(self.path))
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
            raise ValueError(f"{self.path}: corrupt or truncated GGUF file ({e})") from None

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 rows ``[rows, bytes_per_row]`` (no copy)."""
        data = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return data.reshape(rows, -1)


def _read_metadata(buf, name: str, prefix: str = "") -> tuple[dict[str, Any], int, int]:
    """Header and key/value metadata (keys starting with ``prefix``); returns the metadata,
    the number of tensors and the position where the tensor index starts."""
    if buf[:4] != b"GGUF":
        raise ValueError(f"{name}: not a GGUF file (corrupt or truncated: no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{name}: unsupported GGUF version {version}")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = _read_string(buf, pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        keep = key.startswith(prefix)
        value, pos = _read_value(buf, pos + 4, vtype, keep=keep)
        if keep:
            metadata[key] = value
    return metadata, n_tensors, pos


def _parse(buf: mmap.mmap, name: str) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    metadata, n_tensors, pos = _read_metadata(buf, name)
    raw_infos = []
    for _ in range(n_tensors):
        tname, pos = _read_string(buf, pos)
        (ndim,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        raw_infos.append((tname, dims, qtype, offset))
    align = int(metadata.get("general.alignment", 32))
    data_start = -(-pos // align) * align
    tensors = {}
    for tname, dims, qtype, offset in raw_infos:
        info = _tensor_info(tname, dims, qtype, data_start + offset, name)
        if info.offset + info.nbytes > len(buf):
            raise ValueError(
                f"{name}: corrupt or truncated GGUF file (tensor {tname} ends at byte "
                f"{info.offset + info.nbytes}, the file has {len(buf)})"
            )
        tensors[tname] = info
    return metadata, tensors


def _tensor_info(tname: str, dims, qtype: int, offset: int, name: str) -> TensorInfo:
    try:
        qt = GGMLQuantizationType(qtype)
    except ValueError:
        raise ValueError(f"{name}: tensor {tname} has unknown type {qtype}") from None
    block, type_size = GGML_QUANT_SIZES[qt]
    n = int(np.prod(dims)) if dims else 1
    if n % block:
        raise ValueError(f"{name}: tensor {tname} size {n} is not a multiple of block {block}")
    return TensorInfo(
        tname, tuple(int(d) for d in reversed(dims)), qt, offset, n // block * type_size
    )


def read_gguf_metadata(path: str | os.PathLike, prefix: str = "") -> dict[str, Any]:
    """The key/value metadata of a GGUF file (keys starting with ``prefix``)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _read_metadata(buf, str(path), prefix)[0]


def _read_string(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    if pos + 8 + n > len(buf):
        raise struct.error("string runs past the end of the file")
    raw = buf[pos + 8 : pos + 8 + n]
    return raw.decode("utf-8", errors="replace"), pos + 8 + n


def _read_value(buf, pos: int, vtype: int, keep: bool = True) -> tuple[Any, int]:
    if vtype == _GGUF_STRING:
        return _read_string(buf, pos)
    if vtype in _GGUF_SCALARS:
        fmt = _GGUF_SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _GGUF_ARRAY:
        item_type, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _GGUF_SCALARS:
            fmt = _GGUF_SCALARS[item_type]
            size = struct.calcsize(fmt)
            if pos + n * size > len(buf):
                raise struct.error("array runs past the end of the file")
            values = list(struct.iter_unpack(fmt, buf[pos : pos + n * size])) if keep else []
            return [v[0] for v in values], pos + n * size
        items = []
        for _ in range(n):
            item, pos = _read_value(buf, pos, item_type, keep)
            items.append(item)
        return items, pos
    raise ValueError(f"unknown GGUF value type {vtype}")

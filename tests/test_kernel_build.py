"""The kernels' build lock: a builder killed mid-build must not make later loads wait forever
(PyTorch's own lock file stays behind when its holder dies)."""

from __future__ import annotations

import fcntl
import subprocess
import sys

from fastforward.kernels.build import build_lock

HOLD = """
import pathlib, sys, time
from fastforward.kernels.build import build_lock
directory = pathlib.Path(sys.argv[1])
lock = build_lock(directory)
lock.__enter__()
(directory / "lock").touch()  # as PyTorch's build does, then killed mid-build
print("held", flush=True)
time.sleep(120)
"""


def _try_lock(directory) -> bool:
    with open(directory / "build.flock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def test_a_killed_builder_leaves_nothing_that_blocks_the_next(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        assert not _try_lock(tmp_path)  # another builder waits while the first one builds
    finally:
        proc.kill()
        proc.wait()
    assert (tmp_path / "lock").exists()  # PyTorch's lock file outlives its holder
    assert _try_lock(tmp_path)  # the flock does not
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()  # stale under the flock: removed


def test_the_build_lock_is_taken_again_after_a_clean_exit(tmp_path):
    with build_lock(tmp_path):
        assert not _try_lock(tmp_path)
    assert _try_lock(tmp_path)

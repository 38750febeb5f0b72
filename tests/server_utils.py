"""Start the real server as a subprocess for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(model: str | Path, *extra: str, timeout: float = 180.0):
    """Yield the base URL (``http://127.0.0.1:PORT``) of a server started with ``extra`` args.

    The server's output goes to a log file whose path is printed if start-up fails.
    """
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"fastforward-server-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "fastforward.entrypoints.cli",
        "serve",
        str(model),
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra,
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, timeout, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"server did not become healthy in {timeout}s:\n{log.read_text()[-3000:]}")

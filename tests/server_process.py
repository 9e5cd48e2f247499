"""`python infer.py serve` in a subprocess, for the tests that drive one: a free port, and waiting until it answers."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    """Return once GET url/health answers 200; fail with the log's end if the server exits or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the server did not come up:\n{log_path.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)

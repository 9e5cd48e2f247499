"""`python infer.py serve` in a subprocess, for the tests that drive one: a free port, and waiting until it answers;
and an app served by uvicorn on a thread of this process (`serve_app`)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
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


@contextlib.contextmanager
def serve_app(app):
    """Serve an ASGI app (`make_app`'s) with uvicorn on a thread over 127.0.0.1: yields its URL, stops it after."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)

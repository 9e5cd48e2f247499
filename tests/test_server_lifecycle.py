"""`python infer.py serve` under signals, on a tiny teacher (CPU, fp32, one device), driven by the official `openai`
client over 127.0.0.1: requests still running when `--shutdown-grace` runs out are aborted with an answer (a stream's
error event, a 503), not cut off, and the process exits 0 within the grace.

The engine is slowed to one step per STEP_S (the server runs in `python -c`, `Engine.step` wrapped), so a request
outlasts the grace on any machine; every wait here is bounded. A step that raises (injected the same way) fails the
open requests with an error and stops the server with status 1, as vLLM's server exits when its engine dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from swiftkv_jax.tiny_assets import make_tiny_assets

from conftest import xla_flags
from server_process import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]
GRACE, STEP_S = 2.0, 0.01   # a 400-token request takes >= 4 s, twice the grace

# `infer.py serve` with Engine.step slowed by SLOW_STEP_S seconds, raising at step FAIL_AT_STEP when that is set
SERVE = """
import itertools, os, sys, time
import swiftkv_jax.serving.continuous as continuous
step, delay, steps = continuous.Engine.step, float(os.environ["SLOW_STEP_S"]), itertools.count()
def slow_step(self):
    time.sleep(delay)
    if next(steps) == int(os.environ.get("FAIL_AT_STEP", -1)):
        raise RuntimeError("injected step failure")
    return step(self)
continuous.Engine.step = slow_step
from swiftkv_jax.infer_cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_assets(tmp_path_factory.mktemp("lifecycle"), num_examples=60)


def _start(assets: Path, log_path: Path, **env):
    """The slowed server, once it answers: (process, url)."""
    port = free_port()
    env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu",
               SLOW_STEP_S=str(STEP_S), PYTHONPATH=str(REPO), **env)
    argv = [sys.executable, "-c", SERVE, "serve", "--model", str(assets / "teacher"), "--port", str(port),
            "--served-model-name", "m", "--cache-dtype", "float32", "--page-size", "16", "--num-pages", "64",
            "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--single-buckets", "2", "--prompt-buckets", "16",
            "--max-model-len", "512", "--shutdown-grace", str(GRACE),
            "--compilation-cache", str(assets / "xla")]  # the second server loads what the first compiled
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, log_path, timeout=120)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, url


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_requests_past_the_grace_are_aborted_with_an_answer_and_exit_0(assets, tmp_path, sig):
    log_path = tmp_path / "server.log"
    proc, url = _start(assets, log_path)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    body = dict(model="m", prompt="Count from 3 to 9.", max_tokens=400, extra_body=dict(ignore_eos=True))
    results, streaming = {}, threading.Event()

    def stream():
        chunks = []
        try:
            for chunk in client.completions.create(stream=True, **body):
                chunks.append(chunk)
                streaming.set()
            results["stream"] = f"ended after {len(chunks)} chunks, finish {chunks[-1].choices[0].finish_reason}"
        except openai.APIError as e:
            results["stream"] = e

    def whole():
        try:
            results["whole"] = client.completions.create(**body)
        except openai.APIError as e:
            results["whole"] = e

    threads = [threading.Thread(target=f, daemon=True) for f in (stream, whole)]
    try:
        for thread in threads:
            thread.start()
        assert streaming.wait(30), log_path.read_text()[-3000:]
        start = time.monotonic()
        proc.send_signal(sig)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # draining: no new connection
            httpx.get(f"{url}/health", timeout=5)
        code = proc.wait(timeout=GRACE + 20)
        seconds = time.monotonic() - start
        for thread in threads:
            thread.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = log_path.read_text()
    assert code == 0 and seconds < GRACE + 5, (code, seconds, log[-3000:])
    # the stream got an error event (openai raises it as APIError), not a connection cut mid-body
    error = results.get("stream")
    assert type(error) is openai.APIError and "server is shutting down" in error.message, (error, log[-3000:])
    error = results.get("whole")
    assert isinstance(error, openai.InternalServerError) and error.status_code == 503, (error, log[-3000:])
    assert "server is shutting down" in error.message and error.response.headers["retry-after"] == "1"
    assert "Traceback" not in log, log[-3000:]


def test_a_failed_engine_step_fails_the_requests_and_stops_the_server(assets, tmp_path):
    """Not a process that stays up answering 503 to everything: the open requests get the error, then it exits 1."""
    log_path = tmp_path / "server.log"
    proc, url = _start(assets, log_path, FAIL_AT_STEP="20")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    body = dict(model="m", prompt="Count from 3 to 9.", max_tokens=400, extra_body=dict(ignore_eos=True))
    try:
        with pytest.raises(openai.APIError, match="the engine failed: RuntimeError: injected step failure"):
            for _ in client.completions.create(stream=True, **body):
                pass
        code = proc.wait(timeout=GRACE + 20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = log_path.read_text()
    assert code == 1, (code, log[-3000:])
    assert "the engine failed: RuntimeError: injected step failure: the server stops" in log, log[-3000:]


class _IdleEngine:
    """What EngineLoop needs of an engine, holding the requests it is given."""

    def __init__(self):
        self.requests = []

    def stats(self):
        return {}

    def has_unfinished(self):
        return False

    def add_request(self, prompt, request_id, **options):
        self.requests.append(request_id)

    def abort(self, request_id, reason="abort"):
        pass


def test_a_request_added_as_the_engine_fails_is_refused_not_left_unanswered(monkeypatch):
    """A handler that passed the `alive` check just before the loop thread failed every open request registered its
    route after they were answered: it never got an answer (since the server stops on a failed engine, it was cut
    off at the end of the grace). The failure lands in that window here, deterministically."""
    import asyncio
    import uuid

    from swiftkv_jax.serving import engine_loop as engine_loop_lib

    engine = _IdleEngine()
    loop = engine_loop_lib.EngineLoop(engine)
    loop.start()
    try:
        def fail_meanwhile():  # what the loop thread does when a step raises, between the check and the lock
            loop.error = "the engine failed: RuntimeError: boom"
            loop._fail_all()
            return uuid.UUID(int=1)

        monkeypatch.setattr(engine_loop_lib.uuid, "uuid4", fail_meanwhile)
        event_loop = asyncio.new_event_loop()
        with pytest.raises(RuntimeError, match="the engine failed: RuntimeError: boom"):
            loop.add([1, 2], asyncio.Queue(), event_loop)
        event_loop.close()
        assert loop.in_flight == 0 and engine.requests == []
    finally:
        loop.stop(timeout=1.0)

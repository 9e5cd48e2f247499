"""`EngineLoop`: the engine's step loop on one background thread, talking to asyncio request handlers.

Handlers call `add` (which calls the thread-safe `engine.add_request`, so bad input raises ValueError in the handler)
and `abort`; the loop thread alone calls `engine.step()` and hands each output to its request's asyncio.Queue with
`loop.call_soon_threadsafe`, one call per event loop per step. When the engine has nothing to do the thread sleeps on
an Event that `add` and `abort` set: an idle server does not spin.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import defaultdict
from typing import Callable, Optional

log = logging.getLogger(__name__)


class EngineFailed:
    """Put on every open request's queue when `engine.step` raised: the engine cannot be trusted any more."""

    def __init__(self, message: str):
        self.message = message


class EngineLoop:
    def __init__(self, engine, on_finish: Optional[Callable] = None):
        self.engine = engine
        self.on_finish = on_finish          # called on the loop thread with each finished RequestOutput
        self._routes: dict[str, tuple] = {}  # request id -> (asyncio loop, queue)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: Optional[str] = None
        self.stats = engine.stats()         # a snapshot after every step, for /metrics
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---- handler side (any thread) ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stop.is_set()

    @property
    def in_flight(self) -> int:
        return len(self._routes)

    def add(self, prompt, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop, **options) -> str:
        """Queue a request whose outputs go to `queue`; raises ValueError (bad input) like `engine.add_request`."""
        if not self.alive:
            raise RuntimeError(self.error or "the engine loop is not running")
        request_id = uuid.uuid4().hex
        with self._lock:
            if self.error is not None:  # failed since the check above: _fail_all may have answered the routes already
                raise RuntimeError(self.error)
            self._routes[request_id] = (loop, queue)
        try:
            self.engine.add_request(prompt, request_id=request_id, **options)
        except BaseException:
            with self._lock:
                self._routes.pop(request_id, None)
            raise
        self._wake.set()
        return request_id

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request that has not finished (no-op otherwise); its pages go back at the next step. reason "stop":
        the handler saw a stop string (it counts as finished, not aborted)."""
        if request_id in self._routes:
            self.engine.abort(request_id, reason)
            self._wake.set()

    def abort_all(self) -> int:
        ids = list(self._routes)
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

    def stop(self, timeout: float = 5.0) -> None:
        """Abort whatever is left, let the loop hand out the aborts, and stop the thread."""
        if self._thread.is_alive() and self.abort_all():
            deadline = time.monotonic() + timeout
            while self._routes and time.monotonic() < deadline and self._thread.is_alive():
                time.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the loop thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._wake.clear()
            if not engine.has_unfinished():
                self.stats = engine.stats()
                self._wake.wait(timeout=1.0)
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001  a broken engine fails every open request, loudly
                log.exception("the engine step failed; failing every open request")
                self.error = f"the engine failed: {type(e).__name__}: {e}"
                self._fail_all()
                return
            self.stats = engine.stats()
            self._deliver(outputs)

    def _deliver(self, outputs) -> None:
        batches = defaultdict(list)
        with self._lock:
            for out in outputs:
                route = self._routes.pop(out.request_id, None) if out.finished else self._routes.get(out.request_id)
                if route is not None:
                    batches[route[0]].append((route[1], out))
        for out in outputs:
            if out.finished and self.on_finish is not None:
                self.on_finish(out)
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _fail_all(self) -> None:
        failure = EngineFailed(self.error)
        with self._lock:
            routes, self._routes = self._routes, {}
        batches = defaultdict(list)
        for loop, queue in routes.values():
            batches[loop].append((queue, failure))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass


def _put_all(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)

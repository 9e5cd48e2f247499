"""The server process (`python infer.py serve`): build and warm up the engine, then listen until SIGTERM/SIGINT.

    engine, startup = start_engine(model, engine_options)   # build + warm up, counting XLA programs
    serve(model, tokenizer, "my-model", port=8000, engine_options=...)  # what the CLI runs

The listening socket is bound before the engine is built (`listening_socket`, as vLLM does), so a port in use or an
address not of this machine fails at once, not after minutes of loading and compiling; uvicorn listens on that very
socket once the engine is warm (until then a client is refused, not left waiting).

On SIGTERM/SIGINT no new connection is accepted, requests in flight get a grace period, then whatever is left is
aborted (a stream ends with an error event and `data: [DONE]`) and the process exits 0. A failed engine step fails
every open request, then stops the server the same way and `serve` returns 1 (vLLM's server exits when its engine
dies), rather than staying up to answer 503 to everything.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from typing import Optional

from swiftkv_jax.serving.engine_loop import EngineLoop
from swiftkv_jax.serving.http.routes import MAX_REQUEST_BYTES, make_app

log = logging.getLogger(__name__)


def _uvicorn_server(config, engine_loop: EngineLoop, grace: float):
    import uvicorn

    class Server(uvicorn.Server):
        """On SIGTERM/SIGINT uvicorn stops accepting and waits `grace` seconds for the responses in flight, then
        cancels them mid-body. Here the engine aborts what is left a little earlier, so that every stream still ends
        with an error event and `data: [DONE]`; and a graceful shutdown exits 0 (uvicorn re-raises the signal)."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                log.info("signal %d: no new connections; requests in flight get %.1f s", sig, grace)
                timer = threading.Timer(max(0.0, grace - min(1.0, grace / 2)), engine_loop.abort_all)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if engine_loop.error is not None and not self.should_exit:
                log.error("%s: the server stops", engine_loop.error)
                self.should_exit = True
            return await super().on_tick(counter)

    return Server(config)


def start_engine(model, engine_options: Optional[dict] = None):
    """Build the engine and compile every step bucket (or load it from JAX's persistent compilation cache, when
    `compile_cache.enable_compilation_cache` turned it on). A given max_model_len the pool cannot hold is refused
    before the warm-up (the engine alone would serve it, refusing each request that does not fit). Returns (engine,
    startup): startup holds `seconds` (build and warm-up, wall clock), `warmup_seconds`, `buckets`, the XLA programs
    of both (`programs` = `compiled` + `loaded` from the cache; `written` to it), `compile_seconds` (in XLA) and
    `compilation_cache` (its directory or None)."""
    from swiftkv_jax.serving.compile_cache import active_cache_dir, count_compiles
    from swiftkv_jax.serving.continuous import Engine, check_max_model_len

    start = time.perf_counter()
    with count_compiles() as counts:
        engine = Engine(model, **(engine_options or {}))
        if (engine_options or {}).get("max_model_len") is not None:  # before minutes of warm-up, as vLLM
            check_max_model_len(engine.max_model_len, engine.config.max_position_embeddings,
                                engine.allocator.capacity * engine.page_size)
        warmup_seconds = engine.warmup()
    startup = dict(seconds=time.perf_counter() - start, warmup_seconds=warmup_seconds,
                   buckets=engine.stats()["compiled_buckets"], compile_seconds=counts.seconds,
                   programs=counts.programs, compiled=counts.compiled, loaded=counts.loaded, written=counts.written,
                   compilation_cache=active_cache_dir())
    log.info("warm-up: compiled %d step buckets (singles %s x prompts %s) in %.1f s", startup["buckets"],
             engine.single_buckets, engine.prompt_buckets, warmup_seconds)
    log.info("start-up: %d XLA programs compiled, %d loaded from the compilation cache (%s); %.1f s in XLA, %.1f s "
             "in all", counts.compiled, counts.loaded, startup["compilation_cache"] or "off", counts.seconds,
             startup["seconds"])
    return engine, startup


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (`serve` listens on it once the engine is warm); port 0
    binds a free one (see getsockname). OSError as getaddrinfo and bind raise it: socket.gaierror for a host that
    does not resolve, EADDRINUSE for a port in use, EADDRNOTAVAIL for an address not of this machine."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may reuse a TIME_WAIT port
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def serve(model, tokenizer, model_name, *, host: str = "127.0.0.1", port: int = 8000,
          engine_options: Optional[dict] = None, max_waiting: int = 256, shutdown_grace: float = 10.0,
          stop_token_ids=None, sock: Optional[socket.socket] = None, sampling_defaults: Optional[dict] = None,
          api_key: Optional[str] = None, tool_parser: Optional[str] = None,
          max_request_bytes: int = MAX_REQUEST_BYTES) -> int:
    """Bind (host, port) unless `sock` is given already bound (`listening_socket`), build the engine, compile every
    step bucket (`start_engine`), then listen until SIGTERM/SIGINT: new connections are refused at once, requests in
    flight get `shutdown_grace` seconds to finish, the rest are aborted. Port 0: a free port, logged.
    sampling_defaults, api_key, tool_parser and max_request_bytes: `make_app`'s. Returns 0, or 1 when an engine step
    failed (which stops the server)."""
    import uvicorn

    if shutdown_grace < 0:
        raise ValueError(f"shutdown_grace must be >= 0 seconds, got {shutdown_grace}")
    sock = sock or listening_socket(host, port)
    with contextlib.closing(sock):  # also on a failed build; uvicorn closes it on shutdown too
        host, port = sock.getsockname()[:2]
        began = time.perf_counter()
        engine, startup = start_engine(model, engine_options)
        app = make_app(engine, tokenizer, model_name, max_waiting=max_waiting, stop_token_ids=stop_token_ids,
                       startup=startup, sampling_defaults=sampling_defaults, api_key=api_key, tool_parser=tool_parser,
                       max_request_bytes=max_request_bytes)
        config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_grace,
                                access_log=False, log_level="info", lifespan="on")
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        try:  # listen here, not in uvicorn: under uvloop a listen that fails leaves a server that never answers
            sock.listen(config.backlog)
        except OSError as e:  # a socket bound beside ours (SO_REUSEADDR: both may bind while neither listens)
            raise ValueError(f"--port {port}: another process began listening on {host}:{port} while this server "
                             f"was starting ({e.strerror}; e.g. a second `infer.py serve` that was loading): stop "
                             f"it or choose another --port") from None
        log.info("serving %s on %s (ready %.1f s after the engine build began)",
                 model_name if isinstance(model_name, str) else ", ".join(model_name), url,
                 time.perf_counter() - began)
        engine_loop = app.state.server.loop
        _uvicorn_server(config, engine_loop, shutdown_grace).run(sockets=[sock])
    log.info("stopped")
    return 0 if engine_loop.error is None else 1

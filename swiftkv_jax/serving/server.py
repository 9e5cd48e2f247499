"""An OpenAI-compatible HTTP server on the continuous-batching engine (`python infer.py serve`).

    app = make_app(engine, tokenizer, "my-model", max_waiting=256)      # a FastAPI app, for tests and embedding
    serve(model, tokenizer, "my-model", port=8000, engine_options=...)  # what the CLI runs: warm up, then listen
    engine, startup = start_engine(model, engine_options)             # build + warm up, counting XLA programs

Endpoints: POST /v1/completions and /v1/chat/completions (streamed as server-sent events with `stream: true`),
GET /v1/models, /health (200 while the engine loop runs, 503 otherwise) and /metrics (Prometheus text).

The engine steps on one background thread (`http.engine_loop.EngineLoop`); each HTTP request adds its choices to the
engine and reads their outputs from its own asyncio.Queue. A client that goes away has its requests aborted at once
mid-stream, within DISCONNECT_POLL_S while it waits for a whole response, so their pages go back to the pool. On
SIGTERM/SIGINT (`serve`) no new connection is accepted, requests in flight get a grace period, then whatever is left
is aborted (a stream ends with an error event and `data: [DONE]`) and the process exits 0. Admission is bounded: at
most `max_num_seqs + max_waiting` engine requests are open at a time; beyond that a request gets 503 with
Retry-After, so memory never grows with the offered load. Every refusal is an OpenAI error object
(`http.protocol.RequestError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
import uuid
from typing import Optional

from fastapi import Request  # at module level: FastAPI resolves the handlers' annotations here

from swiftkv_jax.serving.http.engine_loop import EngineFailed, EngineLoop
from swiftkv_jax.serving.http.protocol import Job, RequestError, parse_chat, parse_completion
from swiftkv_jax.serving.http.text import ChoiceText

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5   # how often a non-streaming request checks that its client is still there
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


# ---- metrics ------------------------------------------------------------------------------------------------------
class _Metrics:
    """One registry per app (so several apps in one process do not clash)."""

    def __init__(self, server: "_Server"):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("swiftkv_http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("swiftkv_engine_requests_finished", "engine requests finished, by the engine's "
                                "finish reason (stop: a stop id or string, length, abort)", ["finish_reason"],
                                registry=r)
        histogram = lambda name, text: Histogram(name, text, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = histogram("swiftkv_time_to_first_token_seconds", "time to first token, from arrival")
        self.tpot = histogram("swiftkv_time_per_output_token_seconds", "mean time per output token after the first")
        self.e2e = histogram("swiftkv_e2e_request_latency_seconds", "arrival to finish")
        self.queue = histogram("swiftkv_request_queue_time_seconds", "arrival to first scheduled")
        r.register(_EngineCollector(server))

    def on_finish(self, out) -> None:  # the loop thread; prometheus_client is thread-safe
        self.finished.labels(out.finish_reason or "unknown").inc()
        m = out.metrics or {}
        for histogram, key in ((self.ttft, "ttft_s"), (self.tpot, "tpot_s"), (self.e2e, "e2e_s"),
                               (self.queue, "queue_s")):
            if m.get(key) is not None:
                histogram.observe(m[key])


class _EngineCollector:
    """Engine gauges and counters, from the snapshot the loop thread takes after every step."""

    def __init__(self, server: "_Server"):
        self.server = server

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.server.loop.stats
        gauges = (("swiftkv_num_requests_running", "requests holding a sequence slot", s["running"]),
                  ("swiftkv_num_requests_waiting", "requests queued in the engine", s["waiting"]),
                  ("swiftkv_num_requests_in_flight", "engine requests admitted by the server and not finished",
                   self.server.loop.in_flight),
                  ("swiftkv_max_requests_in_flight", "admission limit: max_num_seqs + max_waiting", self.server.limit),
                  ("swiftkv_kv_pages_total", "pages in the paged KV cache", s["pages_total"]),
                  ("swiftkv_kv_pages_free", "free pages in the paged KV cache", s["pages_free"]),
                  ("swiftkv_kv_cache_usage", "fraction of the KV cache's pages in use", s["page_usage"]),
                  ("swiftkv_compiled_buckets", "step shapes compiled", s["compiled_buckets"]),
                  ("swiftkv_prefix_cache_pages", "pages cached for prefix reuse", s["prefix_cache_pages"]),
                  ("swiftkv_engine_healthy", "1 while the engine loop runs", int(self.server.loop.alive)))
        for name, text, value in gauges:
            yield GaugeMetricFamily(name, text, value=value)
        yield from _startup_gauges(self.server.startup)
        counters = (("swiftkv_num_preemptions", "preemptions (a request gave its pages back)", s["preemptions"]),
                    ("swiftkv_prompt_tokens", "prompt tokens run (recomputed ones again)", s["prompt_tokens"]),
                    ("swiftkv_generation_tokens", "tokens generated", s["generated_tokens"]),
                    ("swiftkv_engine_steps", "engine steps", s["steps"]),
                    ("swiftkv_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                     s["prefix_cache_queries"]),
                    ("swiftkv_prefix_cache_hits", "prompt tokens found in the prefix cache", s["prefix_cache_hits"]),
                    ("swiftkv_prefix_cache_evictions", "cached pages evicted", s["prefix_cache_evictions"]))
        for name, text, value in counters:
            yield CounterMetricFamily(name, text, value=value)


def _startup_gauges(startup: Optional[dict]):
    """The start-up's figures (`start_engine`), when the app was given them."""
    from prometheus_client.core import GaugeMetricFamily

    if startup is None:
        return
    yield GaugeMetricFamily("swiftkv_startup_seconds", "engine build and warm-up, wall clock", value=startup["seconds"])
    yield GaugeMetricFamily("swiftkv_startup_compile_seconds", "seconds in XLA building the programs of the engine "
                            "build and warm-up (compiling, or loading from the compilation cache)",
                            value=startup["compile_seconds"])
    programs = GaugeMetricFamily("swiftkv_startup_programs", "XLA programs of the engine build and warm-up: compiled, "
                                 "or loaded from the persistent compilation cache", labels=["source"])
    programs.add_metric(["compiled"], startup["compiled"])
    programs.add_metric(["cache"], startup["loaded"])
    yield programs
    yield GaugeMetricFamily("swiftkv_compilation_cache_enabled", "1 when JAX's persistent compilation cache is on",
                            value=int(startup["compilation_cache"] is not None))


class _CountRequests:
    """ASGI middleware: count every HTTP response by endpoint and status (a stream is counted when it ends)."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.counter.labels(endpoint, str(status[0])).inc()


# ---- token strings for logprobs -----------------------------------------------------------------------------------
def _gpt2_byte_decoder() -> dict:
    """The byte-level BPE alphabet (GPT-2, Llama 3): printable character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class _TokenStrings:
    """A token id's text and exact bytes (a byte-level token may hold part of a character)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.byte_decoder = _gpt2_byte_decoder()

    def __call__(self, token_id: int) -> tuple[str, list]:
        if token_id not in self.cache:
            text = self.tokenizer.decode([token_id])
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if self.byte_level and piece and all(c in self.byte_decoder for c in piece) and \
                    token_id not in self.tokenizer.all_special_ids:
                data = bytes(self.byte_decoder[c] for c in piece)
            else:
                data = text.encode("utf-8")
            self.cache[token_id] = (text, list(data))
        return self.cache[token_id]


# ---- one request's choices ----------------------------------------------------------------------------------------
class _Choice:
    def __init__(self, index: int, prompt_index: int, prompt_ids, tokenizer, stop):
        self.index, self.prompt_index, self.prompt_len = index, prompt_index, len(prompt_ids)
        self.text = ChoiceText(tokenizer, prompt_ids, stop)
        self.request_id: Optional[str] = None
        self.tokens: list[int] = []
        self.logprobs: list[tuple] = []    # (token id, logprob, {id: logprob}, text offset)
        self.finish_reason: Optional[str] = None
        self.done = False


class _Server:
    """What the handlers share: the engine loop, the tokenizer and the limits."""

    def __init__(self, engine, tokenizer, model_name: str, max_waiting: int, stop_token_ids, startup=None):
        self.engine, self.tokenizer, self.model_name, self.startup = engine, tokenizer, model_name, startup
        self.created = int(time.time())
        self.max_model_len = engine.max_model_len
        self.capacity_tokens = (engine.allocator.capacity) * engine.page_size
        self.vocab_size = engine.config.vocab_size
        self.limit = engine.scheduler.max_num_seqs + max_waiting
        if stop_token_ids is None:
            stop_token_ids = set(engine.config.eos_token_id or ()) | ({tokenizer.eos_token_id} - {None})
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.token_strings = _TokenStrings(tokenizer)
        self.metrics = _Metrics(self)
        self.loop = EngineLoop(engine, on_finish=self.metrics.on_finish)

    # ---- admission --------------------------------------------------------------------------------------------
    def engine_options(self, job: Job, prompt_ids: list, choice: int) -> dict:
        p = len(prompt_ids)
        param = "messages" if job.kind == "chat" else "prompt"
        room = self.max_model_len - p
        if room < 1:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens, but the "
                               f"{param} has {p} tokens: no room is left for a completion. Shorten the {param}.",
                               param, code="context_length_exceeded")
        max_tokens = job.max_tokens if job.max_tokens is not None else min(room, self.capacity_tokens - p)
        if p + max_tokens > self.max_model_len:
            name = "max_tokens" if job.kind == "completion" else "max_completion_tokens"
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                               f"requested {p + max_tokens} tokens ({p} in the {param}, {max_tokens} for the "
                               f"completion). Reduce the {param} or {name} (at most {room} here).", name,
                               code="context_length_exceeded")
        s = job.engine
        stops = sorted(set(s["extra_stop_ids"]) | (set() if s["ignore_eos"] else set(self.stop_token_ids)))
        seed = None if job.seed is None else (job.seed + choice) % 2**31
        return dict(max_tokens=max_tokens, temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"],
                    seed=seed, stop_token_ids=stops, logprobs=job.logprobs, top_logprobs=job.top_logprobs)

    def refuse_prompt_logprobs(self, prompt_ids) -> None:
        """echo + logprobs asks for the prompt's logprobs, which the engine refuses: its message says why."""
        try:
            request_id = self.engine.add_request(prompt_ids, prompt_logprobs=True, max_tokens=1)
        except ValueError as e:
            raise RequestError(f"echo with logprobs needs prompt logprobs, which this server cannot give: {e}",
                               "echo", code="unsupported_parameter") from None
        self.engine.abort(request_id)
        raise RequestError("echo with logprobs is not supported", "echo", code="unsupported_parameter")

    def start(self, job: Job, queue: asyncio.Queue) -> list[_Choice]:
        """Check the job against the limits and add its choices to the engine; all or none."""
        if not self.loop.alive:
            raise RequestError(self.loop.error or "the server is shutting down", None, 503, type="server_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        if job.echo and job.logprobs:
            self.refuse_prompt_logprobs(job.prompts[0])
        wanted = len(job.prompts) * job.n
        if wanted > self.limit:
            raise RequestError(f"this request needs {wanted} sequences (prompts x n) but the server admits at most "
                               f"{self.limit} at a time", "n")
        if self.loop.in_flight + wanted > self.limit:
            raise RequestError(f"the server is at capacity ({self.loop.in_flight} requests in flight, at most "
                               f"{self.limit}): retry later", None, 503, code="overloaded", type="server_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        plans = []
        for i, ids in enumerate(job.prompts):
            for j in range(job.n):
                plans.append((_Choice(i * job.n + j, i, ids, self.tokenizer, job.stop), ids,
                              self.engine_options(job, ids, j)))
        loop = asyncio.get_running_loop()
        try:
            for choice, ids, options in plans:
                choice.request_id = self.loop.add(ids, queue, loop, **options)
        except ValueError as e:
            self.abort(c for c, _, _ in plans)
            raise RequestError(str(e), _param_of(str(e), job)) from None
        except RuntimeError as e:
            self.abort(c for c, _, _ in plans)
            raise RequestError(str(e), None, 503, type="server_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return [c for c, _, _ in plans]

    def abort(self, choices) -> None:
        for choice in choices:
            if choice.request_id is not None and not choice.done:
                self.loop.abort(choice.request_id)

    # ---- outputs ----------------------------------------------------------------------------------------------
    async def outputs(self, choices: list[_Choice], queue: asyncio.Queue, request=None):
        """Yield (choice, new text, new logprob rows) as tokens arrive, until every choice is done. With `request`
        (a non-streaming response) check every DISCONNECT_POLL_S that the client is still there."""
        by_id = {c.request_id: c for c in choices}
        left, poll = len(choices), [0.0]
        while left:
            if request is None:
                item = await queue.get()
            else:
                item = await _get_or_poll(queue, request, poll)
            if isinstance(item, EngineFailed):
                raise RequestError(item.message, None, 500, type="server_error")
            choice = by_id.get(item.request_id)
            if choice is None or choice.done:
                continue
            if item.finished and item.finish_reason == "abort":
                raise RequestError("the request was aborted: the server is shutting down", None, 503,
                                   type="server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
            offset = len(choice.text.text)
            delta = choice.text.add(item.new_token_ids)
            rows = []
            for k, token in enumerate(item.new_token_ids):
                lp = item.new_logprobs[k] if k < len(item.new_logprobs) else None
                top = item.new_top_logprobs[k] if k < len(item.new_top_logprobs) else {}
                rows.append((token, lp, top, offset))
            choice.tokens.extend(item.new_token_ids)
            choice.logprobs.extend(rows)
            if choice.text.stopped:
                choice.finish_reason = "stop"
                self.loop.abort(choice.request_id, reason="stop")
            elif item.finished:
                delta += choice.text.finish()
                choice.finish_reason = "stop" if choice.text.stopped else item.finish_reason
            if choice.finish_reason is not None:
                choice.done = True
                left -= 1
            yield choice, delta, rows

    # ---- response pieces --------------------------------------------------------------------------------------
    def completion_logprobs(self, rows, echo_len: int = 0) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for token, lp, top, offset in rows:
            tokens.append(self.token_strings(token)[0])
            values.append(lp)
            tops.append({self.token_strings(t)[0]: v for t, v in top.items()} if top else
                        {self.token_strings(token)[0]: lp})
            offsets.append(offset + echo_len)
        return dict(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)

    def chat_logprobs(self, rows) -> dict:
        content = []
        for token, lp, top, _ in rows:
            text, data = self.token_strings(token)
            content.append(dict(token=text, logprob=lp, bytes=data, top_logprobs=[
                dict(token=self.token_strings(t)[0], logprob=v, bytes=self.token_strings(t)[1])
                for t, v in top.items()]))
        return dict(content=content, refusal=None)

    @staticmethod
    def usage(job: Job, choices) -> dict:
        prompt = sum(len(p) for p in job.prompts)
        completion = sum(len(c.tokens) for c in choices)
        return dict(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class _ClientGone(Exception):
    pass


async def _get_or_poll(queue: asyncio.Queue, request, state: list):
    """queue.get(), checking at most every DISCONNECT_POLL_S (state[0]: the next check, loop time) that the client is
    still there, whether or not outputs keep arriving. The get is never cut short by a timeout (which could drop an
    item), only cancelled with the caller."""
    loop = asyncio.get_running_loop()
    getter = None
    try:
        while True:
            if loop.time() >= state[0]:
                state[0] = loop.time() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise _ClientGone()
            if getter is None:
                if not queue.empty():
                    return queue.get_nowait()
                getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter}, timeout=max(0.0, state[0] - loop.time()))
            if done:
                return getter.result()
    finally:
        if getter is not None and not getter.done():
            getter.cancel()


def _param_of(message: str, job: Job) -> Optional[str]:
    """The request field an engine ValueError is about, from its first words."""
    first = message.split(" ", 1)[0]
    fields = {"temperature", "top_p", "top_k", "seed", "stop_token_ids", "max_tokens", "top_logprobs"}
    if first in fields:
        return first
    if "max_tokens" in message:
        return "max_tokens" if job.kind == "completion" else "max_completion_tokens"
    if "prompt" in message:
        return "messages" if job.kind == "chat" else "prompt"
    return None


def _error_response(error: RequestError):
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


# ---- the app -----------------------------------------------------------------------------------------------------
def make_app(engine, tokenizer, model_name: str, *, max_waiting: int = 256, stop_token_ids=None,
             startup: Optional[dict] = None):
    """A FastAPI app serving `engine` (its loop thread starts now and stops with the app's lifespan).

    stop_token_ids: the default stop tokens (default: the config's EOS ids and the tokenizer's EOS); a request adds
    its own `stop_token_ids` and drops the defaults with `ignore_eos`. startup: `start_engine`'s figures, shown in
    /metrics (swiftkv_startup_*). app.state.server holds the shared state (app.state.server.loop.stats: the engine's
    last stats)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
        raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
    server = _Server(engine, tokenizer, model_name, max_waiting, stop_token_ids, startup)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(server.loop.stop)

    app = FastAPI(title="swiftkv-jax", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_CountRequests, counter=server.metrics.requests)
    server.loop.start()

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):  # unknown paths and methods, as OpenAI error objects
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {exc.detail}",
                                       "type": "invalid_request_error", "param": None, "code": code}},
                            status_code=exc.status_code)

    async def read_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise RequestError(f"We could not parse the JSON body of your request ({e}). The body must be a JSON "
                               f"object.", None, code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError(f"the JSON body must be an object, got {type(body).__name__}", None,
                               code="invalid_json")
        model = body.get("model")
        if model is not None and model != server.model_name:
            raise RequestError(f"The model `{model}` does not exist: this server serves `{server.model_name}`",
                               "model", 404, code="model_not_found")
        return body

    async def run(request: Request, parse, kind: str):
        try:
            body = await read_body(request)
            job = parse(body, tokenizer, server.vocab_size)
            queue = asyncio.Queue()
            choices = server.start(job, queue)
        except RequestError as e:
            return _error_response(e)
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        head = dict(id=rid, created=int(time.time()), model=server.model_name)
        if job.stream:
            return _Stream(stream(job, choices, queue, head), server, choices, media_type="text/event-stream")
        try:
            async for _ in server.outputs(choices, queue, request):
                pass
        except RequestError as e:
            return _error_response(e)
        except _ClientGone:
            return PlainTextResponse("", status_code=499)
        finally:
            server.abort(choices)
        return JSONResponse(whole(job, choices, head))

    def whole(job: Job, choices, head) -> dict:
        out = []
        for c in choices:
            if job.kind == "completion":
                echo = job.prompt_texts[c.prompt_index] if job.echo else ""
                lp = server.completion_logprobs(c.logprobs, len(echo)) if job.logprobs else None
                out.append(dict(index=c.index, text=echo + c.text.text, logprobs=lp, finish_reason=c.finish_reason))
            else:
                out.append(dict(index=c.index, message=dict(role="assistant", content=c.text.text, refusal=None),
                                logprobs=server.chat_logprobs(c.logprobs) if job.logprobs else None,
                                finish_reason=c.finish_reason))
        obj = "text_completion" if job.kind == "completion" else "chat.completion"
        return dict(head, object=obj, choices=out, usage=server.usage(job, choices), system_fingerprint=None)

    async def stream(job: Job, choices, queue, head):
        chat = job.kind == "chat"
        base = dict(head, object="chat.completion.chunk" if chat else "text_completion")
        if job.include_usage:
            base["usage"] = None

        def chunk(choice, text, rows, finish):
            if chat:
                delta = {"content": text} if text else {}
                lp = server.chat_logprobs(rows) if job.logprobs and rows else None
                entry = dict(index=choice.index, delta=delta, logprobs=lp, finish_reason=finish)
            else:
                lp = server.completion_logprobs(rows) if job.logprobs and rows else None
                entry = dict(index=choice.index, text=text, logprobs=lp, finish_reason=finish)
            return _sse(dict(base, choices=[entry]))

        for c in choices:
            if chat:
                yield _sse(dict(base, choices=[dict(index=c.index, delta=dict(role="assistant", content=""),
                                                    logprobs=None, finish_reason=None)]))
            elif job.echo:
                yield chunk(c, job.prompt_texts[c.prompt_index], [], None)
        try:
            async for c, text, rows in server.outputs(choices, queue):
                if text or (job.logprobs and rows) or c.done:
                    yield chunk(c, text, rows, c.finish_reason if c.done else None)
        except RequestError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
            return
        if job.include_usage:
            yield _sse(dict(base, choices=[], usage=server.usage(job, choices)))
        yield "data: [DONE]\n\n"

    class _Stream(StreamingResponse):
        """A stream that aborts its choices however it ends: finished, client gone (cancelled) or never started."""

        def __init__(self, content, server_, choices, **kwargs):
            super().__init__(content, **kwargs)
            self._server, self._choices = server_, choices

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self._server.abort(self._choices)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, parse_completion, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, parse_chat, "chat")

    @app.get("/v1/models")
    async def models():
        return dict(object="list", data=[dict(id=server.model_name, object="model", created=server.created,
                                              owned_by="swiftkv-jax", max_model_len=server.max_model_len)])

    @app.get("/health")
    async def health():
        if server.loop.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "error": server.loop.error or "shutting down"},
                            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# ---- serve: what `infer.py serve` runs ------------------------------------------------------------------------------
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

    return Server(config)


def start_engine(model, engine_options: Optional[dict] = None):
    """Build the engine and compile every step bucket (or load it from JAX's persistent compilation cache, when
    `compile_cache.enable_compilation_cache` turned it on). Returns (engine, startup): startup holds `seconds` (build
    and warm-up, wall clock), `warmup_seconds`, `buckets`, the XLA programs of both (`programs` = `compiled` +
    `loaded` from the cache; `written` to it), `compile_seconds` (in XLA) and `compilation_cache` (its directory or
    None)."""
    from swiftkv_jax.serving.compile_cache import active_cache_dir, count_compiles
    from swiftkv_jax.serving.continuous import Engine

    start = time.perf_counter()
    with count_compiles() as counts:
        engine = Engine(model, **(engine_options or {}))
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


def serve(model, tokenizer, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          engine_options: Optional[dict] = None, max_waiting: int = 256, shutdown_grace: float = 10.0,
          stop_token_ids=None) -> int:
    """Build the engine, compile every step bucket (`start_engine`), then listen until SIGTERM/SIGINT: new
    connections are refused at once, requests in flight get `shutdown_grace` seconds to finish, the rest are aborted.
    Returns 0."""
    import uvicorn

    if shutdown_grace < 0:
        raise ValueError(f"shutdown_grace must be >= 0 seconds, got {shutdown_grace}")
    began = time.perf_counter()
    engine, startup = start_engine(model, engine_options)
    app = make_app(engine, tokenizer, model_name, max_waiting=max_waiting, stop_token_ids=stop_token_ids,
                   startup=startup)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_grace, access_log=False,
                            log_level="info", lifespan="on")
    log.info("serving %s on http://%s:%d (ready %.1f s after the engine build began)", model_name, host, port,
             time.perf_counter() - began)
    _uvicorn_server(config, app.state.server.loop, shutdown_grace).run()
    log.info("stopped")
    return 0

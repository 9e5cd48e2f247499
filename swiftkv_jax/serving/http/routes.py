"""The OpenAI-compatible app on the continuous-batching engine: admission, each request's outputs, the endpoints.

    app = make_app(engine, tokenizer, "my-model", max_waiting=256)      # a FastAPI app, for tests and embedding

Endpoints: POST /v1/completions and /v1/chat/completions (streamed as server-sent events with `stream: true`),
GET /v1/models, vLLM's POST /tokenize and /detokenize and GET /version, /health (200 while the engine loop runs, 503
otherwise) and /metrics (Prometheus text). With an API key every path but /health, /metrics and /version needs
`Authorization: Bearer KEY` (`access.Authenticate`); a request's X-Request-Id header comes back on its response.

The engine steps on one background thread (`serving.engine_loop.EngineLoop`); each HTTP request's body is parsed
and tokenized on another (`Server.parser`, so that a prompt of megabytes stalls no other client), then adds its
choices to the engine and reads their outputs from its own asyncio.Queue. A client that goes away has its requests
aborted at once mid-stream, within DISCONNECT_POLL_S while it waits for a whole response, so their pages go back to
the pool. Admission is bounded: at most `max_num_seqs + max_waiting` engine requests are open at a time; beyond that a
request gets 503 with Retry-After, so memory never grows with the offered load. Every refusal is an OpenAI error
object (`protocol.RequestError`); a bad value the engine refuses (`InvalidRequest`) names the request's field.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import copy
import functools
import json
import time
import uuid
from typing import Optional

from fastapi import Request  # at module level: FastAPI resolves the handlers' annotations here
from starlette.requests import ClientDisconnect

from swiftkv_jax.serving.engine_loop import EngineFailed, EngineLoop
from swiftkv_jax.serving.errors import InvalidRequest
from swiftkv_jax.serving.http.access import Authenticate, EchoRequestId
from swiftkv_jax.serving.http.metrics import CountRequests, Metrics
from swiftkv_jax.serving.http.protocol import (Job, RequestError, parse_chat, parse_completion, parse_detokenize,
                                               parse_tokenize, shown)
from swiftkv_jax.serving.http.responses import Choice, Chunks, TokenStrings, prompt_rows, sse, whole
from swiftkv_jax.serving.http.tool_calls import PARSERS

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/version",
             "/health", "/metrics")
RETRY_AFTER_S = 1
MAX_REQUEST_BYTES = 64 * 2**20  # a request body's default cap: a batch of long prompts as token ids fits in it
DISCONNECT_POLL_S = 0.5   # how often a non-streaming request checks that its client is still there


class Server:
    """What the handlers share: the engine loop, the tokenizer and the limits."""

    def __init__(self, engine, tokenizer, model_names: tuple, max_waiting: int, stop_token_ids, startup=None,
                 sampling_defaults=None, api_key: Optional[str] = None, tool_parser: Optional[str] = None,
                 max_request_bytes: int = MAX_REQUEST_BYTES):
        self.engine, self.tokenizer, self.startup = engine, tokenizer, startup
        self.max_request_bytes = max_request_bytes  # a longer body gets 413, unread past the cap
        # vLLM's --served-model-name A B ...: a request may name any; the first is the default and the metrics' label
        self.model_names, self.model_name = model_names, model_names[0]
        self.tool_parser = tool_parser  # --tool-call-parser (with --enable-auto-tool-choice): tool_choice "auto"
        self.sampling_defaults = dict(sampling_defaults or {})  # protocol.sampling_defaults' (generation_config.json)
        self.api_key = api_key  # None: open to all (access.Authenticate reads it on every request)
        self.created = int(time.time())
        self.max_model_len = engine.max_model_len
        self.capacity_tokens = (engine.allocator.capacity) * engine.page_size
        self.limit = engine.scheduler.max_num_seqs + max_waiting
        if stop_token_ids is None:
            stop_token_ids = set(engine.config.eos_token_id or ()) | ({tokenizer.eos_token_id} - {None})
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.token_strings = TokenStrings(tokenizer)
        self.metrics = Metrics(self)
        self.loop = EngineLoop(engine, on_finish=self.metrics.on_finish)
        # one thread parses request bodies (JSON, tokenizer, chat template) off the event loop, one at a time, with
        # its own copy of the tokenizer: a fast tokenizer shared by two threads may refuse an encode while the other
        # decodes ("Already borrowed", huggingface/tokenizers#537; vLLM gives each thread a copy too)
        self.parser = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="parse")
        self.parser_tokenizer = copy.deepcopy(tokenizer)

    # ---- admission --------------------------------------------------------------------------------------------
    def engine_options(self, job: Job, prompt_ids: list, choice: int) -> dict:
        """add_request's options for one choice; the context check in OpenAI's words (clients look for its code)."""
        p = len(prompt_ids)
        param = "messages" if job.kind == "chat" else "prompt"
        room = self.max_model_len - p
        if room < 1:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens, but the "
                               f"{param} has {p} tokens: no room is left for a completion. Shorten the {param}.",
                               param, code="context_length_exceeded")
        max_tokens = job.max_tokens if job.max_tokens is not None else min(room, self.capacity_tokens - p)
        if p + max_tokens > self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                               f"requested {p + max_tokens} tokens ({p} in the {param}, {max_tokens} for the "
                               f"completion). Reduce the {param} or {job.max_tokens_field} (at most {room} here).",
                               job.max_tokens_field, code="context_length_exceeded")
        if job.max_tokens_cap is not None:  # generation_config's max_new_tokens: vLLM's server limit, on every request
            max_tokens = min(max_tokens, job.max_tokens_cap)
        s = job.engine
        stops = sorted(set(s["extra_stop_ids"]) | (set() if s["ignore_eos"] else set(self.stop_token_ids)))
        seed = job.seed if job.seed is None or choice == 0 else (job.seed + choice) % 2**31
        return dict(max_tokens=max(1, max_tokens), temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"],
                    seed=seed, stop_token_ids=stops, logprobs=job.logprobs, top_logprobs=job.top_logprobs,
                    prompt_logprobs=job.prompt_logprobs, min_p=s["min_p"], repetition_penalty=s["repetition_penalty"],
                    presence_penalty=s["presence_penalty"], frequency_penalty=s["frequency_penalty"],
                    logit_bias=s["logit_bias"], min_tokens=s["min_tokens"],
                    grammar=None if job.grammar is None else job.grammar.copy(),
                    allowed_token_ids=s["allowed_token_ids"], bad_words_ids=s["bad_words_ids"])

    def start(self, job: Job, queue: asyncio.Queue) -> list[Choice]:
        """Check the job against the limits and add its choices to the engine; all or none."""
        if not self.loop.alive:
            raise RequestError(self.loop.error or "the server is shutting down", None, 503, type="server_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        wanted = len(job.prompts) * job.n
        if wanted > self.limit:
            raise RequestError(f"this request needs {wanted} sequences (prompts x n) but the server admits at most "
                               f"{self.limit} at a time", "n" if job.n > 1 else job.param("prompt"))
        if self.loop.in_flight + wanted > self.limit:
            raise RequestError(f"the server is at capacity ({self.loop.in_flight} requests in flight, at most "
                               f"{self.limit}): retry later", None, 503, code="overloaded", type="server_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        plans = []
        for i, ids in enumerate(job.prompts):
            for j in range(job.n):
                plans.append((Choice(i * job.n + j, i, ids, self.tokenizer, job.stop, job.max_tokens != 0,
                                     job.tool_parser, job.engine["min_tokens"], job.include_stop, job.decode), ids,
                              self.engine_options(job, ids, j)))
        loop = asyncio.get_running_loop()
        try:
            for choice, ids, options in plans:
                choice.request_id = self.loop.add(ids, queue, loop, **options)
        except InvalidRequest as e:
            self.abort(c for c, _, _ in plans)
            raise RequestError(str(e), job.param(e.param)) from None
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
    async def outputs(self, job: Job, choices: list[Choice], queue: asyncio.Queue, request=None):
        """Yield (choice, new text, new logprob rows) as tokens arrive, until every choice is done; a choice's prompt
        logprobs (echo with logprobs) are set on it before its first yield. With `request` (a non-streaming
        response) check every DISCONNECT_POLL_S that the client is still there."""
        by_id = {c.request_id: c for c in choices}
        left, poll = len(choices), [0.0]
        unfinished = collections.Counter(c.prompt_index for c in choices)  # per prompt: a request of n choices
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
            if item.finished and item.finish_reason == "error":  # its token mask failed (a grammar's, or none left)
                if item.error_param is not None:  # its own settings left no token: the client's to fix
                    raise RequestError(item.error, job.param(item.error_param))
                raise RequestError(item.error, None, 500, type="server_error")
            if item.finished and item.finish_reason == "abort":
                raise RequestError("the request was aborted: the server is shutting down", None, 503,
                                   type="server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
            if item.prompt_logprobs is not None and choice.prompt_rows is None:
                choice.prompt_rows = prompt_rows(choice.prompt_ids, item.prompt_logprobs, item.prompt_top_logprobs)
            delta, rows = "", []
            if not choice.keep_output:  # max_tokens 0: the prompt scored, the token it needed dropped
                choice.finish_reason = "length"
                self.loop.abort(choice.request_id, reason="stop")
            else:
                # a stop id that ended the request is counted and scored but is not text (vLLM's, as an EOS),
                # unless include_stop_str_in_output (vLLM's detokenizer then decodes it: a special one is skipped
                # unless skip_special_tokens is false); a grammar that ended it (structured outputs) ended on a token
                # of its text
                ends_on_stop_id = item.finished and item.finish_reason == "stop" and not item.grammar_done and \
                    not choice.text.include_stop
                delta = choice.text.add(item.new_token_ids[:-1] if ends_on_stop_id else item.new_token_ids)
                for k, token in enumerate(item.new_token_ids):
                    lp = item.new_logprobs[k] if k < len(item.new_logprobs) else None
                    top = item.new_top_logprobs[k] if k < len(item.new_top_logprobs) else {}
                    rows.append((token, lp, top, choice.text_offset))
                    choice.text_offset += len(self.token_strings.text(token))
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
                unfinished[choice.prompt_index] -= 1
                if not unfinished[choice.prompt_index]:  # its n choices all finished (vLLM's ParentRequest)
                    self.metrics.on_request([len(c.tokens) for c in choices if c.prompt_index == choice.prompt_index])
            yield choice, choice.to_send(delta), rows


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


def _version() -> str:
    """The installed swiftkv-jax's version (pyproject.toml's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swiftkv-jax")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _error_response(error: RequestError):
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


# ---- the app -----------------------------------------------------------------------------------------------------
def make_app(engine, tokenizer, model_name, *, max_waiting: int = 256, stop_token_ids=None,
             startup: Optional[dict] = None, sampling_defaults: Optional[dict] = None, api_key: Optional[str] = None,
             tool_parser: Optional[str] = None, max_request_bytes: int = MAX_REQUEST_BYTES):
    """A FastAPI app serving `engine` (its loop thread starts now and stops with the app's lifespan).

    model_name: the name clients give as `model`, or several (vLLM's `--served-model-name A B`): a request may name
    any, and its response carries the name it gave; the first is the default and /metrics' `model_name` label.
    stop_token_ids: the default stop tokens (default: the config's EOS ids and the tokenizer's EOS); a request adds
    its own `stop_token_ids` and drops the defaults with `ignore_eos`. startup: `process.start_engine`'s figures,
    shown in /metrics (swiftkv_startup_*). sampling_defaults: what a request that omits temperature, top_p, top_k,
    repetition_penalty, min_p gets, and max_tokens, every request's cap; `protocol.sampling_defaults` of a
    generation_config.json.
    api_key: every path but /health, /metrics and /version needs `Authorization: Bearer <api_key>` (else 401).
    tool_parser: vLLM's --tool-call-parser (`tool_calls.PARSERS`: llama3_json, hermes), which chat requests with
    tools and tool_choice "auto" need; their outputs come back as tool calls where they parse as ones.
    max_request_bytes: the longest request body read (default MAX_REQUEST_BYTES, 64 MiB); a longer one gets 413
    without being read further, so that no client makes the server hold more than that per request.
    app.state.server holds the shared state (app.state.server.loop.stats: the engine's last stats)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
        raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string (or None: no key)")
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be an integer >= 1, got {max_request_bytes!r}")
    if tool_parser is not None and tool_parser not in PARSERS:
        raise ValueError(f"tool_parser must be one of {', '.join(PARSERS)} (or None), got {tool_parser!r}")
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    if not names or any(not isinstance(n, str) or not n for n in names) or len(set(names)) < len(names):
        raise ValueError(f"model_name must be a non-empty name, or a list of distinct ones, got {model_name!r}")
    server = Server(engine, tokenizer, names, max_waiting, stop_token_ids, startup, sampling_defaults, api_key,
                    tool_parser, max_request_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(server.loop.stop)
        server.parser.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="swiftkv-jax", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(Authenticate, server=server)
    app.add_middleware(CountRequests, counter=server.metrics.requests, endpoints=ENDPOINTS)  # 401s counted too
    app.add_middleware(EchoRequestId)
    server.loop.start()

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):  # unknown paths and methods, as OpenAI error objects
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {exc.detail}",
                                       "type": "invalid_request_error", "param": None, "code": code}},
                            status_code=exc.status_code)

    def read_body(raw: bytes) -> dict:
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise RequestError(f"We could not parse the JSON body of your request ({e}). The body must be a JSON "
                               f"object.", None, code="invalid_json") from None
        except RecursionError:  # Python's parser recurses once a level: thousands of [[[... exhaust its stack
            raise RequestError("We could not parse the JSON body of your request: it nests too deeply. The body "
                               "must be a JSON object of the OpenAI API's fields.", None, code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError(f"the JSON body must be an object, got {type(body).__name__}", None,
                               code="invalid_json")
        for name, value in body.items():  # JSON's \ud800 escapes parse to lone surrogates, which no text can hold
            try:
                json.dumps([name, value], ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                name = name.encode("utf-8", "backslashreplace").decode("utf-8")[:80]
                raise RequestError(f"{name} holds a string that is not valid Unicode (a lone surrogate such as "
                                   f"\\ud800): send UTF-8 text", name, code="invalid_json") from None
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError(f"model must be a string (a served model's name), got {type(model).__name__}",
                               "model")
        if model is not None and model not in server.model_names:
            model = model if len(model) <= 200 else shown(model)
            served = ", ".join(f"`{name}`" for name in server.model_names)
            raise RequestError(f"The model `{model}` does not exist: this server serves {served}",
                               "model", 404, code="model_not_found")
        return body

    async def body_bytes(request: Request) -> bytes:
        """The request's body, at most server.max_request_bytes of it: a longer one (by its Content-Length, or as it
        arrives) is a 413 before the rest is read."""
        cap = server.max_request_bytes
        declared = request.headers.get("content-length", "")
        chunks, size = [], int(declared) if declared.isdigit() else 0
        if size <= cap:
            size = 0
            try:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > cap:
                        break
                    chunks.append(chunk)
            except ClientDisconnect:  # gone before its body arrived: nobody to answer, and no traceback to log
                raise RequestError("the client closed the connection before its request body arrived", None,
                                   code="client_disconnected") from None
        if size > cap:
            raise RequestError(f"the request body holds more than {cap} bytes, the server's limit "
                               f"(--max-request-bytes): send fewer or shorter prompts per request, or raise the "
                               f"limit", None, 413, code="request_too_large")
        return b"".join(chunks)

    async def parsed(request: Request, parse):
        """parse(body, the parser's tokenizer), on the parser thread: the JSON, the tokenizer and the chat template
        there, as a prompt of megabytes takes seconds, while the event loop goes on serving every other client
        (vLLM tokenizes off its loop too). RequestError for bad input."""
        raw = await body_bytes(request)
        return await asyncio.get_running_loop().run_in_executor(
            server.parser, lambda: parse(read_body(raw), server.parser_tokenizer))

    async def run(request: Request, parse, kind: str):
        try:
            model, job = await parsed(request, lambda body, tokenizer: (
                body.get("model") or server.model_name, parse(body, tokenizer, server.sampling_defaults)))
            queue = asyncio.Queue()
            choices = server.start(job, queue)
        except RequestError as e:
            return _error_response(e)
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        head = dict(id=rid, created=int(time.time()), model=model)  # the name the request used, as vLLM's
        if job.stream:
            return _Stream(stream(job, choices, queue, head), server, choices, media_type="text/event-stream")
        try:
            async for _ in server.outputs(job, choices, queue, request):
                pass
        except RequestError as e:
            return _error_response(e)
        except _ClientGone:
            return PlainTextResponse("", status_code=499)
        finally:
            server.abort(choices)
        return JSONResponse(whole(job, choices, head, server.token_strings))

    async def stream(job: Job, choices, queue, head):
        chunks = Chunks(job, choices, head, server.token_strings)
        echoed = set()
        for c in choices:
            opening = chunks.opening(c)
            if opening:
                yield opening
        try:
            async for c, text, rows in server.outputs(job, choices, queue):
                if job.echo and job.logprobs and c.index not in echoed:
                    echoed.add(c.index)
                    yield chunks.echo(c)
                if text or (job.logprobs and rows) or c.done:
                    yield chunks.piece(c, text, rows, c.finish_reason if c.done else None, c.tool_calls)
        except RequestError as e:
            yield sse(e.body())
            yield "data: [DONE]\n\n"
            return
        if job.include_usage:
            yield chunks.usage()
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
        return await run(request, functools.partial(parse_completion, max_model_len=server.max_model_len),
                         "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, functools.partial(parse_chat, tool_parser=server.tool_parser,
                                                    max_model_len=server.max_model_len), "chat")

    @app.get("/v1/models")
    async def models():
        return dict(object="list", data=[dict(id=name, object="model", created=server.created, owned_by="swiftkv-jax",
                                              root=server.model_name, max_model_len=server.max_model_len)
                                         for name in server.model_names])

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            return JSONResponse(await parsed(request, lambda body, tokenizer: parse_tokenize(
                body, tokenizer, server.max_model_len)))
        except RequestError as e:
            return _error_response(e)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            return JSONResponse(await parsed(request, parse_detokenize))
        except RequestError as e:
            return _error_response(e)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/health")
    async def health():
        if server.loop.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "error": server.loop.error or "shutting down"},
                            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app

"""The OpenAI server under hostile but valid requests: an app (`make_app`) on a tiny teacher (CPU, fp32), served by
uvicorn on a thread over 127.0.0.1 and driven with httpx. A request that costs much (a prompt of megabytes, a batch
with a prompt the pool cannot hold) gets its answer without stalling the other clients, and leaves nothing behind in
the engine; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.data.chat import load_tokenizer
from swiftkv_jax.serving.continuous import Engine
from swiftkv_jax.serving.http.routes import make_app
from swiftkv_jax.tiny_assets import make_tiny_assets

from server_process import serve_app

PAGE, PAGES, MAX_MODEL_LEN = 16, 16, 512   # a pool of 256 tokens under a longer max_model_len (the engine allows it)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, engine) of a server on 127.0.0.1, stopped after the module."""
    root = make_tiny_assets(tmp_path_factory.mktemp("limits"), num_examples=60)
    tokenizer = load_tokenizer(str(root / "teacher"))
    engine = Engine(sk.load(root / "teacher"), cache_dtype="float32", page_size=PAGE, num_pages=PAGES,
                    max_num_seqs=4, max_num_batched_tokens=32, single_buckets=(4,), prompt_buckets=(32,),
                    max_model_len=MAX_MODEL_LEN)
    app = make_app(engine, tokenizer, "m", max_waiting=16)
    with serve_app(app) as url:
        yield url, engine, tokenizer, app


@pytest.fixture(scope="module")
def server_tokenizer(server):
    return server[2]


def _idle(engine, timeout: float = 10.0) -> dict:
    """The engine's stats once nothing runs, waits or holds a page (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (stats["running"] == 0 and stats["waiting"] == 0 and not engine.has_unfinished()
                and stats["pages_free"] == stats["pages_total"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_a_batch_with_a_prompt_the_pool_cannot_hold_leaves_nothing_behind(server):
    """The first prompts are added to the engine before the last is refused (it fits max_model_len, not the pool):
    they are aborted, their pages and ids go back, and the server serves on."""
    url, engine, *_ = server
    fits, too_big = [5] * 40, [5] * (PAGE * PAGES + 8)
    response = httpx.post(f"{url}/v1/completions", timeout=60,
                          json=dict(prompt=[fits, fits, too_big], max_tokens=8, n=2, ignore_eos=True))
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "max_tokens", error
    assert "but the whole KV cache has" in error["message"], error
    stats = _idle(engine)
    assert stats["pages_free"] == stats["pages_total"] and stats["running"] == stats["waiting"] == 0, stats
    assert not engine._live_ids and not engine._sequences
    assert httpx.post(f"{url}/v1/completions", json=dict(prompt=fits, max_tokens=2), timeout=60).status_code == 200


class _HeldTokenizer:
    """The parser's tokenizer, holding each encode until `release` is set (a prompt of megabytes takes seconds)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.started, self.release = tokenizer, threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.started.set()
        assert self.release.wait(30), "never released"
        return self.tokenizer(*args, **kwargs)

    def __len__(self):
        return len(self.tokenizer)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


class _CountingTokenizer(_HeldTokenizer):
    """_HeldTokenizer, counting its callers: the threads that called it, and the most inside it at once."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.lock, self.threads, self.inside, self.most = threading.Lock(), [], 0, 0

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.threads.append(threading.get_ident())
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            with self.lock:
                self.inside -= 1


def test_a_prompt_being_tokenized_does_not_stall_the_other_clients(server):
    """Tokenizing a 3.6 MB prompt took 4 s on the event loop, and every other client waited that long (a /health took
    as long as the whole refusal). Bodies are parsed on the parser thread, with its own copy of the tokenizer (a fast
    tokenizer shared by two threads may refuse an encode while the other decodes): here its encode is held until a
    /health has been answered, which on the event loop would never happen."""
    url, engine, tokenizer, app = server
    state = app.state.server
    assert state.parser_tokenizer is not tokenizer
    text = "hello world, " * 10
    assert state.parser_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    held = _HeldTokenizer(state.parser_tokenizer)
    state.parser_tokenizer = held

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            request = asyncio.create_task(http.post(f"{url}/v1/completions", json=dict(prompt=text, max_tokens=2)))
            assert await asyncio.to_thread(held.started.wait, 30), "the request was never tokenized"
            health = await asyncio.wait_for(http.get(f"{url}/health"), 10)  # while its prompt is being tokenized
            assert not request.done()
            held.release.set()
            return health, await request

    try:
        health, response = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        held.release.set()
        state.parser_tokenizer = held.tokenizer
    assert health.status_code == 200
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2, response.text
    assert _idle(engine)["running"] == 0


def test_the_parser_thread_tokenizes_one_body_at_a_time(server):
    """The parser's copy of the tokenizer is used by one thread only (a fast tokenizer used by two threads at once may
    refuse an encode, "Already borrowed": huggingface/tokenizers#537): while one body's encode is held, a second
    request's waits for it rather than entering the same tokenizer (a pool of 4 parser threads passed every test)."""
    url, engine, tokenizer, app = server
    state = app.state.server
    held = _CountingTokenizer(state.parser_tokenizer)
    state.parser_tokenizer = held

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            requests = [asyncio.create_task(http.post(f"{url}/v1/completions", json=dict(prompt=p, max_tokens=1)))
                        for p in ("one two", "three four")]
            assert await asyncio.to_thread(held.started.wait, 30), "the request was never tokenized"
            await asyncio.sleep(0.5)  # time for a second parser thread, were there one, to enter the tokenizer
            with held.lock:
                entered = len(held.threads)
            held.release.set()
            return entered, await asyncio.gather(*requests)

    try:
        entered, responses = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        held.release.set()
        state.parser_tokenizer = held.tokenizer
    assert entered == 1 and held.most == 1 and len(set(held.threads)) == 1, (entered, held.most, held.threads)
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    assert _idle(engine)["running"] == 0


BIG = "x" * 100_000
HUGE_VALUES = [  # (path, body, param): each refused value is 100 KB or thousands of entries
    ("/v1/completions", dict(prompt="hi", logit_bias={str(i): 1 for i in range(5000)}), "logit_bias"),
    ("/v1/completions", dict(prompt="hi", suffix=BIG), "suffix"),
    ("/v1/completions", dict(prompt="hi", stop_token_ids=list(range(5000))), "stop_token_ids"),
    ("/v1/completions", dict(prompt="hi", stop_token_ids=[BIG]), "stop_token_ids"),
    ("/v1/completions", dict(prompt="hi", stop=[BIG, 5]), "stop"),
    ("/v1/completions", dict(prompt="hi", temperature=BIG), "temperature"),
    ("/v1/completions", dict(prompt="hi", echo=BIG), "echo"),
    ("/v1/completions", dict(prompt="hi", best_of=BIG), "best_of"),
    ("/v1/completions", dict(prompt="hi", stream=True, stream_options={BIG: True}), "stream_options"),
    ("/v1/completions", dict({f"field{i}": 1 for i in range(5000)}, prompt="hi"), "field0"),
    ("/v1/completions", {"prompt": "hi", BIG: 1}, BIG[:80]),
    ("/v1/completions", dict(prompt="hi", model=BIG), "model"),
    ("/v1/chat/completions", dict(messages=[{"role": BIG, "content": "hi"}]), "messages[0].role"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": {"a": BIG}}]), "messages[0].content"),
]


def test_errors_quote_a_huge_value_in_part(server):
    """A refusal quoted the whole refused value: 100 KB of suffix or 5000 logit_bias entries came back in the error
    message (54 KB for the logit_bias, 26 KB of out-of-vocabulary stop ids). Now at most SHOWN characters of it."""
    url, engine, *_ = server
    with httpx.Client(timeout=60) as http:
        for path, body, param in HUGE_VALUES:
            response = http.post(f"{url}{path}", json=body)
            error = response.json()["error"]
            assert response.status_code in (400, 404) and error["param"] == param, (param, error["message"][:300])
            assert len(error["message"]) < 400, (param, len(error["message"]), error["message"][:300])
        assert http.post(f"{url}/v1/completions", json=dict(prompt="hi", max_tokens=2)).status_code == 200


def test_long_stop_strings_are_bounded_and_cheap_to_hold_back(server, server_tokenizer):
    """A stop string of 100 KB was taken, and holding back the text that could still become one cost each token
    O(text x stop) on the event loop (16 stop strings of 1024 characters: 6.9 s of CPU for 3000 tokens of 6000
    characters; one of 1 MB, 2.2 s for 8000 characters, growing with the cube of the output). Now a stop string has at
    most MAX_STOP_CHARS characters, and only the places where one could begin are tried."""
    from swiftkv_jax.serving.http.protocol import MAX_STOP_CHARS
    from swiftkv_jax.serving.http.text import ChoiceText

    url, engine, *_ = server
    response = httpx.post(f"{url}/v1/completions", timeout=60,
                          json=dict(prompt="hi", stop=["a", "x" * (MAX_STOP_CHARS + 1)], max_tokens=4))
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "stop", error
    assert f"at most {MAX_STOP_CHARS} characters, got one of {MAX_STOP_CHARS + 1}" in error["message"], error
    body = dict(prompt="hi", stop=["x" * MAX_STOP_CHARS] * 16, max_tokens=4)
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200

    tokenizer = server_tokenizer
    stops = ["\u00e9" * (MAX_STOP_CHARS - 1) + "x"] + ["o" * (MAX_STOP_CHARS - 1) + str(i) for i in range(15)]
    text, rng = ChoiceText(tokenizer, [], stops), np.random.default_rng(0)
    start = time.perf_counter()
    for token in rng.integers(3, len(tokenizer), 3000):
        text.add([int(token)])
    seconds = time.perf_counter() - start
    assert len(text.text) > 3000 and not text.stopped
    assert seconds < 3.0, f"3000 tokens took {seconds:.2f} s with 16 stop strings of {MAX_STOP_CHARS} characters"
    # the text held back is what a search of every tail finds
    for tail in ("", "o", "\u00e9\u00e9", "oo", "o" * 50 + "\u00e9", "ab\u00e9"):
        probe = ChoiceText(tokenizer, [], stops)
        expected = max((k for s in stops for k in range(len(s)) if tail.endswith(s[:k])), default=0)
        assert probe._hold_back("zz" + tail) == expected, tail


def test_an_api_key_guards_every_path_but_health_metrics_and_version(server):
    """make_app(api_key=...): the official client with the key is served; a wrong or missing key gets 401 (openai's
    AuthenticationError) with an OpenAI error object, counted in /metrics; /health, /metrics, /version stay open.
    The key is read per request (app.state.server.api_key), so it is set here on the module's server and reset."""
    import openai

    url, _, _, app = server
    app.state.server.api_key = "s3cret"
    try:
        client = lambda key: openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        out = client("s3cret").completions.create(model="m", prompt="hi", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError) as refused:
            client("wrong").completions.create(model="m", prompt="hi", max_tokens=2)
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client("s3cret-and-more").models.list()
        for method, path in (("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                             ("GET", "/v1/nothing")):
            response = httpx.request(method, f"{url}{path}", json={}, timeout=10)
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer", path
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            assert "no API key given" in response.json()["error"]["message"]
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(f"{url}{path}", timeout=10).status_code == 200, path
        assert 'swiftkv_http_requests_total{endpoint="/v1/completions",status="401"} 1.0' in \
            httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        app.state.server.api_key = None
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200


def test_the_api_key_header_is_read_as_vllms(server):
    """The Authorization header as vLLM's AuthenticationMiddleware reads it (Starlette's Headers.get: the first
    header; the scheme case-insensitive, as RFC 7235 has it): `bearer KEY` is served (curl users write it so), and
    two headers are not joined into a key (`Bearer s3` + `cret` passed as `Bearer s3cret`)."""
    url, _, _, app = server
    app.state.server.api_key = "s3cret"
    try:
        get = lambda *headers: httpx.get(f"{url}/v1/models", headers=list(headers), timeout=10).status_code
        assert get(("Authorization", "Bearer s3cret")) == 200
        assert get(("authorization", "bearer s3cret")) == 200
        assert get(("Authorization", "BEARER s3cret")) == 200
        assert get(("Authorization", "Bearer s3"), ("Authorization", "cret")) == 401
        assert get(("Authorization", "Bearer s3cret"), ("Authorization", "Bearer wrong")) == 200  # the first
        assert get(("Authorization", "Bearer wrong"), ("Authorization", "Bearer s3cret")) == 401
        for wrong in ("Basic s3cret", "Bearers3cret", "Bearer  s3cret", "s3cret", "Bearer s3cretX"):
            assert get(("Authorization", wrong)) == 401, wrong
    finally:
        app.state.server.api_key = None


def test_shown_quotes_at_most_SHOWN_characters_of_the_repr():
    """An error quotes a refused value's repr whole up to SHOWN (80) characters, else exactly its first 80 and its
    length (the server test above only bounds the whole message at 400 characters: a cut at 3 x SHOWN, or a value of
    exactly SHOWN characters cut, passed it)."""
    from swiftkv_jax.serving.http.protocol import SHOWN, shown

    assert SHOWN == 80
    assert shown("x" * 78) == repr("x" * 78) and len(repr("x" * 78)) == 80  # exactly 80: whole
    assert shown("x" * 79) == "'" + "x" * 79 + "... (81 characters)"  # 81: the first 80 and the length
    assert shown(BIG) == "'" + "x" * 79 + f"... ({len(BIG) + 2} characters)"
    bias = {str(i): 1 for i in range(5000)}
    assert shown(bias) == f"{repr(bias)[:80]}... ({len(repr(bias))} characters)"
    assert shown(None) == "None" and shown([1, 2]) == "[1, 2]"


def test_generation_configs_max_new_tokens_caps_every_request(server):
    """vLLM's --generation-config max_new_tokens is a server limit: each request gets the least of the context's room,
    its own max_tokens (completions' default 16) and the file's, on both endpoints; a request past the context is still
    refused (vLLM checks it first). Set on the module's server's defaults (read per request) and reset."""
    import openai

    url, _, _, app = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    ask = dict(model="m", temperature=0, extra_body=dict(ignore_eos=True))
    messages = [{"role": "user", "content": "hi"}]
    app.state.server.sampling_defaults = dict(max_tokens=3)
    try:
        assert client.completions.create(prompt="hi", **ask).usage.completion_tokens == 3  # default 16, capped
        assert client.completions.create(prompt="hi", max_tokens=10, **ask).usage.completion_tokens == 3
        assert client.completions.create(prompt="hi", max_tokens=2, **ask).usage.completion_tokens == 2
        assert client.chat.completions.create(messages=messages, max_tokens=10, **ask).usage.completion_tokens == 3
        assert client.chat.completions.create(messages=messages, **ask).usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.completions.create(prompt="hi", max_tokens=MAX_MODEL_LEN, **ask)
    finally:
        app.state.server.sampling_defaults = {}
    assert client.completions.create(prompt="hi", max_tokens=10, **ask).usage.completion_tokens == 10


def test_a_body_over_the_cap_is_a_413_unread_past_it_and_the_server_goes_on(server):
    """make_app(max_request_bytes=...) (`--max-request-bytes`): a body longer than the cap gets 413 with an OpenAI
    error object, whether its Content-Length says so or it comes chunked with none; one within it is served. The cap
    is read per request (app.state.server.max_request_bytes): set small here on the module's server, then reset."""
    url, engine, _, app = server
    cap, default = 2000, app.state.server.max_request_bytes
    assert default == 64 * 2**20
    request = json.dumps({"prompt": "hi " * 20, "max_tokens": 2})
    within = (request + " " * (cap - len(request))).encode()  # JSON's whitespace: the same request, `cap` bytes long
    over = within + b" "
    headers = {"content-type": "application/json"}
    post = lambda path, body: httpx.post(f"{url}{path}", content=body, headers=headers, timeout=60)
    app.state.server.max_request_bytes = cap
    try:
        assert post("/v1/completions", within).status_code == 200
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            response = post(path, over)
            error = response.json()["error"]
            assert response.status_code == 413 and error["code"] == "request_too_large", (path, error)
            assert f"more than {cap} bytes" in error["message"] and "--max-request-bytes" in error["message"]
        chunked = post("/v1/completions", (over[i:i + 500] for i in range(0, len(over), 500)))  # no Content-Length
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    finally:
        app.state.server.max_request_bytes = default
    assert post("/v1/completions", over).status_code == 200
    assert _idle(engine)["running"] == 0


def test_max_request_bytes_must_be_a_positive_integer(server):
    engine, tokenizer = server[1], server[2]
    for bad in (0, -1, 1.5, True, "64"):
        with pytest.raises(ValueError, match="max_request_bytes must be an integer >= 1"):
            make_app(engine, tokenizer, "m", max_request_bytes=bad)


def test_a_client_gone_before_its_body_arrived_leaves_no_traceback(server):
    """A client that sends its headers and part of its body, then hangs up: the server logged uvicorn's "Exception in
    ASGI application" with starlette's ClientDisconnect traceback. Nobody is left to answer; nothing is logged, and the
    server goes on."""
    import logging
    import socket

    url, engine, *_ = server
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "hi", ')
            time.sleep(0.3)  # the handler is reading the body when the client goes
        time.sleep(0.5)
        assert httpx.post(f"{url}/v1/completions", json=dict(prompt="hi", max_tokens=2), timeout=60).status_code == 200
    finally:
        log.removeHandler(handler)
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]

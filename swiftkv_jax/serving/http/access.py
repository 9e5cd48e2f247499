"""Who may call the server, and the X-Request-Id echo: two ASGI middlewares (pure ASGI, so streams pass through).

`Authenticate`: with an API key (`--api-key`, vLLM's), every request needs `Authorization: Bearer KEY` (the first such
header; the scheme in any case, as vLLM's), else 401
with an OpenAI error object (code `invalid_api_key`, as OpenAI's). /health, /metrics and /version stay open (a load
balancer's probe and Prometheus carry no key, as with vLLM); /tokenize and /detokenize need the key, unlike vLLM's
(it guards /v1 only): they take the parser thread's time, which the /v1 requests wait for. The key is compared in
constant time (`hmac.compare_digest`).

`EchoRequestId`: a request's `X-Request-Id` header comes back on its response, always (vLLM's
`--enable-request-id-headers`; it is off by default there only for the cost of its middleware, none here).
"""

from __future__ import annotations

import hmac

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class Authenticate:
    """ASGI middleware: `server.api_key` (None: everyone may call) in every request's Authorization header."""

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        key = self.server.api_key
        if key is None or scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        # as vLLM's middleware reads it (Starlette's Headers.get): the first Authorization header, its scheme
        # case-insensitive (RFC 7235: "bearer KEY" is a Bearer token); joining every such header let `Bearer s3` and
        # `cret` pass as one key
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token, key.encode("utf-8")):
            return await self.app(scope, receive, send)
        what = "no API key given" if not given else "an incorrect API key"
        body = {"error": {"message": f"{what}: send the server's key (--api-key) as `Authorization: Bearer KEY`",
                          "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
        from fastapi.responses import JSONResponse

        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


class EchoRequestId:
    """ASGI middleware: the request's X-Request-Id header on its response (unless the response sets its own)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        rid = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None) \
            if scope["type"] == "http" else None
        if rid is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start" and \
                    not any(k.lower() == b"x-request-id" for k, _ in message.get("headers", ())):
                message = dict(message, headers=[*message.get("headers", ()), (b"x-request-id", rid)])
            await send(message)

        await self.app(scope, receive, send_with_id)

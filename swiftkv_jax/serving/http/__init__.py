"""The OpenAI-compatible HTTP server on `sk.Engine` (`python infer.py serve`), by concern: `protocol` (request
bodies parsed, the error object), `routes` (admission, each request's outputs, the endpoints: `make_app`),
`responses` (response bodies and logprob objects, streamed chunks), `text` (incremental detokenization and stop
strings), `metrics` (Prometheus), `access` (the API key, X-Request-Id) and `process` (`listening_socket`,
`start_engine`, `serve`: start-up and signals). The engine's step loop thread it drives is `serving.engine_loop`."""

from swiftkv_jax.serving.http.process import listening_socket, serve, start_engine
from swiftkv_jax.serving.http.routes import make_app

__all__ = ["listening_socket", "make_app", "serve", "start_engine"]

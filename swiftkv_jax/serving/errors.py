"""The one error a request's own bad setting raises, from the sampling checks up to the HTTP server."""

from __future__ import annotations

from swiftkv_jax.checks import ArgumentError


class InvalidRequest(ArgumentError):
    """A request's own setting is bad: the message says what and how to fix it; `param` names the setting (the
    engine's name: prompt, max_tokens, temperature, ...), so that a server can point its client at the field."""

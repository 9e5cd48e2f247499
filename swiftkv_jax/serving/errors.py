"""The one error a request's own bad setting raises, from the sampling checks up to the HTTP server."""

from __future__ import annotations

from typing import Optional


class InvalidRequest(ValueError):
    """A request's own setting is bad: the message says what and how to fix it; `param` names the setting (the
    engine's name: prompt, max_tokens, temperature, ...), so that a server can point its client at the field."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param

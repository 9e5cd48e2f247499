"""Tool calls in a chat model's output, as vLLM's `--enable-auto-tool-choice --tool-call-parser NAME` finds them.

    content, calls = parse("hermes", text)    # calls: OpenAI's [{"id", "type": "function", "function": {...}}]

`llama3_json` (Llama 3.1/3.2's JSON tool format, vLLM's Llama3JsonToolParser): the output, after whitespace and an
optional `<|python_tag|>`, is one or more JSON objects `{"name": ..., "parameters"|"arguments": {...}}` separated
by `;`; text after the last is dropped (as vLLM's). Unlike vLLM's non-streaming parser, which takes a JSON object
anywhere in the text, a call must begin the output, as vLLM's streaming parser requires: then streamed and whole
responses agree, and an answer that quotes JSON midway stays an answer. Objects nest to any depth (vLLM's regex
finds two levels). `hermes` (Qwen2.5, Hermes 2 Pro; vLLM's Hermes2ProToolParser): `<tool_call>{json}</tool_call>`
blocks, the last possibly unclosed; the content is the text before the first. Output that does not parse as calls
(bad JSON, no "name", no arguments) is all content, as vLLM's.

`ToolText` streams one choice's text through a parser: content goes out as it arrives while the output cannot be a
call; once it may be one (llama3_json: the output begins with `{` or `<|python_tag|>`; hermes: `<tool_call>` has
appeared, and a tail that may begin it is held back), the rest is held to the end, then parsed: calls, or the held
text as content. What a stream sends is exactly what the whole response holds.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from swiftkv_jax.serving.http.text import held_back

PYTHON_TAG = "<|python_tag|>"
TOOL_CALL = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def _call(obj) -> Optional[dict]:
    """OpenAI's tool call of a parsed {"name", "arguments"|"parameters"} object (None: not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"  # Llama's prompt asks for "parameters"
    if key not in obj:
        return None
    return dict(id=f"chatcmpl-tool-{uuid.uuid4().hex}", type="function",
                function=dict(name=obj["name"], arguments=json.dumps(obj[key], ensure_ascii=False)))


def llama3_json(text: str) -> tuple[Optional[str], list]:
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        at = len(body) - len(body[at:].lstrip())  # JSONDecoder.raw_decode takes no leading whitespace
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call(obj)
        if call is None:
            return text, []
        calls.append(call)
        rest = body[at:].lstrip()
        if not rest.startswith(";") or not rest[1:].lstrip().startswith("{"):  # what follows the calls is dropped
            return None, calls
        at = len(body) - len(rest) + 1


def hermes(text: str) -> tuple[Optional[str], list]:
    start = text.find(TOOL_CALL)
    if start < 0:
        return text, []
    calls = []
    for closed, unclosed in _HERMES_BLOCK.findall(text):
        try:
            call = _call(json.loads(closed or unclosed))
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    return text[:start] or None, calls


PARSERS = {"llama3_json": llama3_json, "hermes": hermes}
# tool_choice "required" and a named function ("function:" + its name): calls forced by guided decoding (vLLM's), the
# output a JSON array of {"name", "parameters"} or the named function's arguments
REQUIRED, FUNCTION = "required", "function:"


def forced(parser: str, text: str) -> tuple[Optional[str], list]:
    """(content, calls) of an output whose grammar forced calls: the calls and content "" (vLLM's), or the text and
    none where the output is no whole JSON (cut short by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, []
    if parser == REQUIRED:
        calls = [_call(obj) for obj in value] if isinstance(value, list) else [None]
    else:
        calls = [_call({"name": parser[len(FUNCTION):], "arguments": value})]
    return ("", calls) if calls and None not in calls else (text, [])


def parse(parser: str, text: str) -> tuple[Optional[str], list]:
    """(content, tool calls) of a whole output: ([] and the text when it holds no call)."""
    if parser == REQUIRED or parser.startswith(FUNCTION):
        return forced(parser, text)
    return PARSERS[parser](text)


class ToolText:
    """One choice's text (after stop strings) through a tool-call parser: `add` returns the content that may be sent
    now; `finish` the rest, and the whole response's content and calls."""

    def __init__(self, parser: str):
        self.forced = parser == REQUIRED or parser.startswith(FUNCTION)
        if parser not in PARSERS and not self.forced:
            raise ValueError(f"unknown tool-call parser {parser!r}: use one of {', '.join(PARSERS)}")
        self.parser = parser
        self.parts: list[str] = []   # all the text so far
        self.pending = ""            # not sent, and no call begun: whitespace, or what may begin one
        self.calling = self.forced   # a call may have begun: everything from `pending` on is held to the end
        self.plain = False           # llama3_json: the output began with text, so it is no call
        self.sent = 0                # characters given out

    def add(self, delta: str) -> str:
        self.parts.append(delta)
        if self.calling or self.plain:
            out = "" if self.calling else delta
            self.sent += len(out)
            return out
        self.pending += delta
        if self.parser == "hermes":
            at = self.pending.find(TOOL_CALL)
            end = at if at >= 0 else len(self.pending) - held_back(self.pending, [TOOL_CALL])
            self.calling = at >= 0
        else:
            body = self.pending.lstrip()
            if not body or PYTHON_TAG.startswith(body):
                return ""
            self.calling = body.startswith(("{", PYTHON_TAG))
            self.plain = not self.calling
            end = 0 if self.calling else len(self.pending)
        out, self.pending = self.pending[:end], self.pending[end:]
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, Optional[str], list]:
        """(the text still to send, the response's content, its tool calls)."""
        text = "".join(self.parts)
        content, calls = parse(self.parser, text)
        if calls:
            return "", content, calls
        return text[self.sent:], text, []

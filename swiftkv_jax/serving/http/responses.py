"""OpenAI response bodies: one request's choices as they accumulate, and the JSON (whole, or server-sent chunks)
with logprob objects built from token ids: completions' `{tokens, token_logprobs, top_logprobs, text_offset}` (the
prompt's own first with echo: its first token has no logprob, `null`), chat's `{content: [{token, logprob, bytes,
top_logprobs}]}` with each token's exact bytes."""

from __future__ import annotations

import json
import re
from typing import Optional

from swiftkv_jax.serving.http.protocol import Job
from swiftkv_jax.serving.http.text import ChoiceText
from swiftkv_jax.serving.http.tool_calls import FUNCTION, ToolText


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


def _decoder_steps(decoder) -> list:
    """The steps of a `tokenizers` decoder, as its JSON ({"type": ...} each; [] without one)."""
    if decoder is None:
        return []
    state = json.loads(decoder.__getstate__())
    return state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]


class TokenStrings:
    """A token id's text and exact bytes (a byte-level token may hold part of a character; a SentencePiece piece
    "▁word" is " word", and its byte-fallback token <0xNN> the byte NN)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}
        steps = _decoder_steps(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))
        types = {step.get("type") for step in steps}
        self.byte_level = "ByteLevel" in types
        self.metaspace = "Metaspace" in types or any(
            step.get("type") == "Replace" and step.get("pattern") == {"String": "▁"} and step.get("content") == " "
            for step in steps)
        self.byte_fallback = "ByteFallback" in types
        self.byte_decoder = _gpt2_byte_decoder()

    def __call__(self, token_id: int) -> tuple[str, list]:
        if token_id not in self.cache:
            text = self.tokenizer.decode([token_id])
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            special = token_id in self.tokenizer.all_special_ids
            if self.byte_level and piece and all(c in self.byte_decoder for c in piece) and not special:
                data = bytes(self.byte_decoder[c] for c in piece)
            elif self.byte_fallback and piece and re.fullmatch("<0x[0-9A-F]{2}>", piece) and not special:
                data = bytes([int(piece[3:5], 16)])
            elif self.metaspace and piece and not special:
                data = piece.replace("▁", " ").encode("utf-8")
            else:
                data = text.encode("utf-8")
            self.cache[token_id] = (text, list(data))
        return self.cache[token_id]

    def text(self, token_id: int) -> str:
        return self(token_id)[0]


class Choice:
    """One choice of a request: its engine request, text, tokens and logprob rows as they arrive."""

    def __init__(self, index: int, prompt_index: int, prompt_ids, tokenizer, stop, keep_output: bool = True,
                 tool_parser: Optional[str] = None, min_tokens: int = 0, include_stop: bool = False,
                 decode: Optional[dict] = None):
        self.index, self.prompt_index, self.prompt_ids = index, prompt_index, list(prompt_ids)
        # min_tokens: no stop string in its text; include_stop, decode: `ChoiceText`'s (the request's text options)
        self.text = ChoiceText(tokenizer, prompt_ids, stop, min_tokens, include_stop, **(decode or {}))
        self.tools = ToolText(tool_parser) if tool_parser else None  # the text after stop strings, through a parser
        self.content: Optional[str] = None  # with a parser, once done: the message's content and tool calls
        self.tool_calls: list = []
        self.keep_output = keep_output      # False: max_tokens 0 with echo, the prompt scored and nothing kept
        self.request_id: Optional[str] = None
        self.tokens: list[int] = []
        self.logprobs: list[tuple] = []     # (token id, logprob, {id: logprob}, text offset)
        self.text_offset = 0                # the generated tokens' texts so far, in characters (vLLM's text_offset)
        self.prompt_rows: Optional[list] = None  # with prompt logprobs: (token id, logprob or None, {id: logprob})
        self.finish_reason: Optional[str] = None
        self.done = False

    def to_send(self, delta: str) -> str:
        """What to send of `delta` (new text, after stop strings): all of it without a tool-call parser; with one,
        what cannot be part of a call, and once the choice is done the rest, with the message's content and tool
        calls set (finish_reason "tool_calls" when it made any)."""
        if self.tools is None:
            return delta
        delta = self.tools.add(delta)
        if self.done:
            rest, self.content, self.tool_calls = self.tools.finish()
            delta += rest
            # a named function's forced call finishes "stop", as vLLM's (and OpenAI's)
            named = self.tools.parser.startswith(FUNCTION)
            self.finish_reason = "tool_calls" if self.tool_calls and not named else self.finish_reason
        return delta


def prompt_rows(prompt_ids, logprobs, tops) -> list:
    """The engine's prompt logprobs as rows: each prompt token with its logprob (None first) and the most likely
    tokens there, itself among them (as vLLM's)."""
    rows = []
    for token, lp, top in zip(prompt_ids, logprobs, tops):
        rows.append((token, lp, None if lp is None else {**(top or {}), token: lp}))
    return rows


def completion_logprobs(strings: TokenStrings, rows, prompt: Optional[list] = None, echo_len: int = 0) -> dict:
    """OpenAI's completion logprobs object of generated rows, after the prompt's (`prompt`: prompt_rows) with echo:
    text offsets count from the start of the echoed prompt (`echo_len` characters, which the special tokens the
    echoed text leaves out, a BOS, take no part of), each token's at the end of the tokens' texts before it. Each
    token's top logprobs hold it too (OpenAI's: up to logprobs + 1 of them, as vLLM's)."""
    tokens, values, tops, offsets = [], [], [], []
    offset, special = 0, set(strings.tokenizer.all_special_ids) if prompt else ()
    for token, lp, top in prompt or ():
        tokens.append(strings.text(token))
        values.append(lp)
        tops.append(None if top is None else {strings.text(t): v for t, v in top.items()})
        offsets.append(offset)
        offset += 0 if token in special else len(tokens[-1])
    for token, lp, top, at in rows:
        tokens.append(strings.text(token))
        values.append(lp)
        tops.append({**{strings.text(t): v for t, v in (top or {}).items()}, tokens[-1]: lp})  # + the sampled
        offsets.append(at + echo_len)
    return dict(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def chat_logprobs(strings: TokenStrings, rows) -> dict:
    content = []
    for token, lp, top, _ in rows:
        text, data = strings(token)
        content.append(dict(token=text, logprob=lp, bytes=data, top_logprobs=[
            dict(token=strings.text(t), logprob=v, bytes=strings(t)[1]) for t, v in top.items()]))
    return dict(content=content, refusal=None)


def usage(job: Job, choices) -> dict:
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(c.tokens) for c in choices)
    return dict(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def whole(job: Job, choices, head: dict, strings: TokenStrings) -> dict:
    """The non-streaming response body."""
    out = []
    for c in choices:
        if job.kind == "completion":
            echo = job.prompt_texts[c.prompt_index] if job.echo else ""
            lp = completion_logprobs(strings, c.logprobs, c.prompt_rows, len(echo)) if job.logprobs else None
            out.append(dict(index=c.index, text=echo + c.text.text, logprobs=lp, finish_reason=c.finish_reason))
        else:
            message = dict(role="assistant", content=c.content if c.tools else c.text.text, refusal=None)
            if c.tools:
                message["tool_calls"] = c.tool_calls
            out.append(dict(index=c.index, message=message,
                            logprobs=chat_logprobs(strings, c.logprobs) if job.logprobs else None,
                            finish_reason=c.finish_reason))
    obj = "text_completion" if job.kind == "completion" else "chat.completion"
    return dict(head, object=obj, choices=out, usage=usage(job, choices), system_fingerprint=None)


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class Chunks:
    """A streamed response's server-sent events, one choice's piece at a time."""

    def __init__(self, job: Job, choices, head: dict, strings: TokenStrings):
        self.job, self.choices, self.strings = job, choices, strings
        self.chat = job.kind == "chat"
        self.base = dict(head, object="chat.completion.chunk" if self.chat else "text_completion")
        if job.include_usage:
            self.base["usage"] = None

    def _event(self, entry: dict) -> str:
        body = dict(self.base, choices=[entry])
        if self.job.continuous_usage:  # vLLM's continuous_usage_stats: the usage so far on every chunk
            body["usage"] = usage(self.job, self.choices)
        return sse(body)

    def opening(self, choice: Choice) -> Optional[str]:
        """The first event of a choice: chat's role; a completion's echoed prompt, unless its logprobs are still to
        come (then `echo` sends it with them)."""
        if self.chat:
            return self._event(dict(index=choice.index, delta=dict(role="assistant", content=""), logprobs=None,
                                    finish_reason=None))
        if self.job.echo and not self.job.logprobs:
            return self.piece(choice, self.job.prompt_texts[choice.prompt_index], [], None)
        return None

    def echo(self, choice: Choice) -> str:
        """A completion's echoed prompt with its logprobs (once the engine has them)."""
        lp = completion_logprobs(self.strings, [], choice.prompt_rows)
        return self._event(dict(index=choice.index, text=self.job.prompt_texts[choice.prompt_index], logprobs=lp,
                                finish_reason=None))

    def piece(self, choice: Choice, text: str, rows, finish, tool_calls=()) -> str:
        """A choice's new text and logprob rows; chat's tool calls too (all at once, at the end: each whole, with
        its index, as the openai client's stream helpers accumulate them)."""
        if self.chat:
            lp = chat_logprobs(self.strings, rows) if self.job.logprobs and rows else None
            delta = {"content": text} if text else {}
            if tool_calls:
                delta["tool_calls"] = [dict(call, index=k) for k, call in enumerate(tool_calls)]
            entry = dict(index=choice.index, delta=delta, logprobs=lp, finish_reason=finish)
        else:
            echo_len = len(self.job.prompt_texts[choice.prompt_index]) if self.job.echo else 0
            lp = completion_logprobs(self.strings, rows, echo_len=echo_len) if self.job.logprobs and rows else None
            entry = dict(index=choice.index, text=text, logprobs=lp, finish_reason=finish)
        return self._event(entry)

    def usage(self) -> str:
        return sse(dict(self.base, choices=[], usage=usage(self.job, self.choices)))

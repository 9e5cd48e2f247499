"""Structured outputs (guided decoding) with llguidance: a `Grammar` is what `sk.Engine.add_request(grammar=...)`
takes, so that the engine stays tokenizer-free. It wraps one llguidance `LLMatcher` (one per request, or per choice
of a request with n > 1: `copy`), whose state lives on the host and moves only on the tokens the engine accepts.

    from swiftkv_jax.serving import structured
    g = structured.json_schema(tokenizer, {"type": "object", "properties": {...}}, vocab_size=engine.config.vocab_size)
    engine.add_request(prompt_ids, max_tokens=256, grammar=g)

Builders: `json_schema` and `json_object` (OpenAI's response_format; JSON compact unless `json_options` says
otherwise), and `from_spec` for vLLM's `structured_outputs` constraints (json, json_object, regex, choice, and a
Lark or GBNF grammar), all through llguidance's grammars (`llguidance.grammar_from`); one it refuses is a
`GrammarError` carrying llguidance's message.

The engine asks `fill(row)` for the allowed next tokens (int32 words, bit i % 32 of word i // 32 for token i, the
layout of llguidance's and vLLM's bitmasks; ids past the tokenizer's vocabulary, a model's padding ids, are never
allowed), hands every token it samples to `accept`, and ends the request ("stop") once `done`. Once the grammar is
complete the tokenizer's EOS is what the mask allows (llguidance's), so a request with EOS among its stop ids stops
there as any other.

llguidance is optional (`pip install llguidance`, or the `structured` extra): `available()` says whether it imports,
and the builders raise `MissingDependency` (an ImportError naming the package) without it.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Optional, Sequence

import numpy as np

INSTALL = "pip install llguidance"


class MissingDependency(ImportError):
    """llguidance is not installed."""


class GrammarError(ValueError):
    """llguidance refused the grammar (a bad JSON schema, regex or grammar): the message is llguidance's."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise MissingDependency(f"structured outputs need llguidance: {INSTALL}") from None
    return llguidance


def available() -> bool:
    try:
        _llguidance()
    except MissingDependency:
        return False
    return True


def words(vocab_size: int) -> int:
    """int32 words of a bitmask row over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


# llguidance's tokenizer from a transformers one is costly (about a second for 128K tokens): one per tokenizer object
# and settings, kept as long as the tokenizer lives
_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer, eos_token_ids: Optional[Sequence[int]] = None):
    """llguidance's tokenizer for a transformers fast tokenizer (cached per tokenizer object); EOS: eos_token_ids
    (the server's stop ids), else the tokenizer's."""
    _llguidance()
    import llguidance.hf

    eos = sorted(set(eos_token_ids)) if eos_token_ids else None
    key = tuple(eos) if eos else None
    with _LOCK:
        cache = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in cache:
            cache[key] = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
        return cache[key]


class Grammar:
    """One request's grammar state: an llguidance matcher over a tokenizer of `tokenizer_vocab` ids. `fill(row)`
    writes the allowed next tokens into an int32 row of at least words(tokenizer_vocab) words (the rest zeroed: not
    allowed), `accept(token)` advances (a refused token raises: the engine sampled outside the mask, a bug), `done`:
    nothing but EOS may follow (llguidance's is_stopped), the request is over."""

    def __init__(self, matcher, tokenizer_vocab: int, description: str = "grammar"):
        self._matcher, self.tokenizer_vocab, self.description = matcher, tokenizer_vocab, description

    def copy(self) -> "Grammar":
        """A fresh copy in the same state (one per choice of a request with n > 1)."""
        return Grammar(self._matcher.deep_copy(), self.tokenizer_vocab, self.description)

    def fill(self, row: np.ndarray) -> None:
        assert row.dtype == np.int32 and row.ndim == 1 and row.flags["C_CONTIGUOUS"], "an int32 row, contiguous"
        n = words(self.tokenizer_vocab)
        if row.shape[0] < n:
            raise ValueError(f"a bitmask row of {row.shape[0]} words is too short for the grammar's vocabulary of "
                             f"{self.tokenizer_vocab} tokens")
        row[n:] = 0
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, n * 4)
        if self._matcher.is_error():
            raise RuntimeError(f"the {self.description} failed: {self._matcher.get_error()}")

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise RuntimeError(f"the {self.description} refused token {token}, which the engine sampled under its "
                               f"mask: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is complete under the grammar."""
        return self._matcher.is_accepting()


def _matcher(tokenizer, grammar: str, description: str, vocab_size: Optional[int],
             eos_token_ids: Optional[Sequence[int]]) -> Grammar:
    llguidance = _llguidance()
    lt = ll_tokenizer(tokenizer, eos_token_ids)
    if vocab_size is not None and lt.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer has {lt.vocab_size} tokens, more than the model's vocab_size {vocab_size}")
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lt)
    if error:
        raise GrammarError(f"invalid {description}: {messages[0]}")
    matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"invalid {description}: {matcher.get_error()}")
    return Grammar(matcher, lt.vocab_size, description)


# compact JSON (no free whitespace, as llguidance's default): a small model cannot wander off into blanks forever
JSON_OPTIONS = {"whitespace_flexible": False}


def json_options(any_whitespace: Optional[bool] = None, whitespace_pattern: Optional[str] = None) -> dict:
    """llguidance's JSON compile options: compact (`JSON_OPTIONS`) unless `any_whitespace` (JSON's whitespace,
    llguidance's flexible) or a `whitespace_pattern` (a regex of the whitespace allowed between tokens) says
    otherwise."""
    options = dict(JSON_OPTIONS)
    if any_whitespace is not None:
        options["whitespace_flexible"] = any_whitespace
    if whitespace_pattern is not None:
        options["whitespace_pattern"] = whitespace_pattern
    return options


def json_schema(tokenizer, schema, *, options: Optional[dict] = None, vocab_size: Optional[int] = None,
                eos_token_ids: Optional[Sequence[int]] = None) -> Grammar:
    """A Grammar of the JSON texts that satisfy `schema` (a dict or its JSON text; llguidance's JSON Schema
    support); `options`: llguidance's JSON compile options (`json_options`), compact by default. GrammarError:
    llguidance refused the schema."""
    _llguidance()  # without it, MissingDependency whatever the schema
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return _json(tokenizer, schema, "JSON schema", options, vocab_size, eos_token_ids)


def json_object(tokenizer, *, options: Optional[dict] = None, vocab_size: Optional[int] = None,
                eos_token_ids: Optional[Sequence[int]] = None) -> Grammar:
    """A Grammar of any JSON object (OpenAI's JSON mode, response_format {"type": "json_object"})."""
    return _json(tokenizer, {"type": "object"}, "JSON object grammar", options, vocab_size, eos_token_ids)


def _json(tokenizer, schema: dict, description: str, options: Optional[dict], vocab_size: Optional[int],
          eos_token_ids: Optional[Sequence[int]]) -> Grammar:
    try:
        grammar = _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=options or JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid {description}: {e}") from None
    return _matcher(tokenizer, grammar, description, vocab_size, eos_token_ids)


# vLLM's structured_outputs constraints besides JSON -> (llguidance's grammar_from format, what an error calls it)
FORMATS = {"regex": ("regex", "regular expression"), "choice": ("choice", "choice"),
           "grammar": ("grammar", "grammar (Lark or GBNF)")}


def from_spec(tokenizer, kind: str, value, *, options: Optional[dict] = None, vocab_size: Optional[int] = None,
              eos_token_ids: Optional[Sequence[int]] = None) -> Grammar:
    """A Grammar of one of vLLM's structured_outputs constraints: "json" (a JSON schema, `json_schema`, with
    `options`), "json_object" (any JSON object; `value` unused), "regex" (llguidance's regex syntax, Rust's `regex`
    crate without look-around: the whole output matches), "choice" (a list of strings: the output is one of them) or
    "grammar" (a Lark or a GBNF grammar, which llguidance tells apart). GrammarError: llguidance refused it."""
    if kind == "json":
        return json_schema(tokenizer, value, options=options, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
    if kind == "json_object":
        return json_object(tokenizer, options=options, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
    form, description = FORMATS[kind]
    llguidance = _llguidance()
    try:
        grammar = llguidance.grammar_from(form, json.dumps(value) if kind == "choice" else value)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid {description}: {e}") from None
    return _matcher(tokenizer, grammar, description, vocab_size, eos_token_ids)

"""The OpenAI request bodies, parsed field by field, and the error object every refusal carries.

A request is parsed into a `Job`: token-id prompts, the engine's per-request options, and what the response needs
(stop strings, logprobs, echo, stream). This module checks the shape of the JSON (types, the OpenAI-only fields: n,
stop strings, echo, stream options); the values the engine takes (temperature, top_p, top_k, seed, stop ids, the
number of logprobs, max_tokens, the prompt's ids) are checked once, by the engine, whose `InvalidRequest` names the
setting (`Job.param` maps it to this request's field). Every problem becomes a `RequestError`:
`{"error": {"message", "type", "param", "code"}}` with its status (400, 404 for an unknown model, 503 when full).

Unknown fields are refused, as OpenAI's API does ("Unrecognized request argument supplied: x"), so a misspelled
option never silently does nothing. Fields of the OpenAI schema that this server does not implement are accepted
only at their no-op values (`best_of` = n, `suffix: ""`, ...) and refused otherwise. `presence_penalty`,
`frequency_penalty` and `logit_bias` ({"token id": bias in [-100, 100]}, at most 300) are applied (the engine's), as
are vLLM's `repetition_penalty` and `min_p`. `response_format` {"type": "json_object"} or {"type": "json_schema", ...}
(chat and completions, as vLLM's) constrains the output by guided decoding (llguidance, `_response_format`), and so
does vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object": ..., and its options;
`_structured_outputs`) or its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` fields
(`_guided`); one of them per request (`_output_grammar`), whose errors name the field the client used.
vLLM's `allowed_token_ids` (a non-empty list of token ids: only those may be sampled; the engine's constant mask,
which costs a request no step) and `bad_words` (a list of strings, tokenized as vLLM does, `_bad_words`: a word's
last token is banned after its other tokens; a host-side mask, so such a request runs every other engine step) apply
on both endpoints, with a grammar too (all of them together); neither needs llguidance.
vLLM's extensions that lm-eval, guidellm and vLLM's own benchmark send are accepted: `top_k`, `stop_token_ids`,
`ignore_eos`, `min_tokens` (no stop id sampled and no stop string ending in the text of the first min_tokens tokens,
as vLLM's; see `_min_tokens`), `max_completion_tokens` on completions too, `stream_options.continuous_usage_stats`,
and echo with logprobs (the prompt's own logprobs, computed at full depth) with `max_tokens: 0` (the prompt scored,
nothing generated).
vLLM's text options (`TEXT_FIELDS`), on both endpoints: `include_stop_str_in_output` (default false: a stop string
that ends a choice stays in its text, whole and streamed; as vLLM's detokenizer, a stop id that ends it is decoded
too, where an EOS, a special token, is skipped unless skip_special_tokens is false), `skip_special_tokens` (true) and
`spaces_between_special_tokens` (true), the options of the output's decode (`text.Detokenizer`; logprobs' token
strings stay each token's raw text either way, as vLLM's), `add_special_tokens` (completions default true: a text
prompt gets the tokenizer's BOS; chat default false: the template writes it, true adds another) and
`truncate_prompt_tokens` (`_truncation`: an integer >= 1 keeps each prompt's last k tokens, a text's as vLLM's
tokenizer truncates it, on the left with its BOS kept; chat's of the rendered prompt; -1 as many as the context holds
beside max_tokens; more than that is a 400; usage counts the tokens kept).
Chat takes vLLM's template fields too (`template_options`: add_generation_prompt, continue_final_message,
chat_template_kwargs). Chat's tool calling is vLLM's (`--enable-auto-tool-choice --tool-call-parser`): `tools` and
the messages' `tool_calls` and `tool_call_id` go to the chat template; `tool_choice` picks the parser (`_tool_parser`;
`tool_calls.py` parses); "required" and a named function force calls by guided decoding (`_tool_grammar`).

A request that omits temperature, top_p, top_k, repetition_penalty or min_p takes the server's sampling defaults
(`sampling_defaults`: the model's generation_config.json, as vLLM's `--generation-config auto`), else 1, 1 and off;
the file's max_new_tokens caps every request's max_tokens, given or not, on both endpoints (vLLM takes the least of
the context's room, the request's and this "server limit"). `parse_tokenize` and `parse_detokenize` are vLLM's
/tokenize and /detokenize bodies.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from typing import Any, Optional

MAX_N = 64
MAX_STOP = 16
MAX_STOP_CHARS = 1024  # each stop string's (the text held back while it could still become one is up to this long)
SHOWN = 80  # characters of a refused value an error message quotes (a value may be megabytes)
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400, code: Optional[str] = None,
                 type: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def shown(value) -> str:
    """`value`'s repr for an error message, cut to SHOWN characters (saying how long it was)."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


@dataclasses.dataclass
class Job:
    """One request, checked: what goes to the engine for each choice and what the response needs."""

    kind: str                       # "completion" | "chat"
    prompts: list                   # token ids, one list per prompt
    prompt_texts: list              # the prompt as text (for echo), one per prompt
    n: int
    engine: dict                    # add_request options common to every choice (max_tokens set per prompt)
    max_tokens: Optional[int]       # None: what is left of the context (chat)
    seed: Optional[int]
    stop: list
    logprobs: bool
    top_logprobs: int
    echo: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk (vLLM's)
    max_tokens_field: str = "max_tokens"  # the field the client set (or would have): errors name it
    max_tokens_cap: Optional[int] = None  # generation_config's max_new_tokens: at most this many, whatever max_tokens
    tool_parser: Optional[str] = None  # chat with tools, tool_choice not "none": the parser its outputs go through
    grammar: Optional[Any] = None   # the output's `structured.Grammar`, pristine: each choice runs a copy
    grammar_field: Optional[str] = None  # the field that set it (response_format, structured_outputs, guided_*, ...)
    include_stop: bool = False      # include_stop_str_in_output: a stop string that ends a choice stays in its text
    decode: dict = dataclasses.field(default_factory=dict)  # the detokenizer's skip_special_tokens, spaces_between_...

    @property
    def prompt_logprobs(self) -> Optional[int]:
        """echo with logprobs: the prompt's logprobs and top `logprobs` at each position, from the engine."""
        return self.top_logprobs if self.echo and self.logprobs else None

    def param(self, engine_param: Optional[str]) -> Optional[str]:
        """The request field an engine `InvalidRequest` is about."""
        if engine_param == "max_tokens":
            return self.max_tokens_field
        if engine_param == "prompt":
            return "messages" if self.kind == "chat" else "prompt"
        if engine_param in ("top_logprobs", "prompt_logprobs") and self.kind == "completion":
            return "logprobs"
        if engine_param == "grammar":
            return self.grammar_field
        if engine_param == "bad_words_ids":
            return "bad_words"
        return engine_param


# no-op values of OpenAI fields that are not implemented: field -> predicate on the value
NO_OP = {
    "suffix": lambda v: v in (None, ""),
    "user": lambda v: True,
    "metadata": lambda v: True,
    "store": lambda v: v in (None, False),
    "service_tier": lambda v: True,
}
# the sampling options besides temperature and top_p: vLLM's extensions (top_k, min_p, repetition_penalty) and
# OpenAI's penalties -> (the server's default when omitted, unless generation_config.json sets it)
SAMPLING_OPTIONS = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}
# vLLM's older names of structured_outputs (removed in vLLM 0.12, still sent by older clients): field -> its kind
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
GUIDED_BACKENDS = ("auto", "guidance", "llguidance")
# vLLM's options of how the prompt is tokenized and the output detokenized (`_text_options`, `_truncation`)
TEXT_FIELDS = {"include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
               "add_special_tokens", "truncate_prompt_tokens"}
COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
          "stream_options", "stop", "seed", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias",
          "response_format", "structured_outputs", "guided_whitespace_pattern", "guided_decoding_backend",
          "allowed_token_ids", "bad_words"} | set(SAMPLING_OPTIONS) | set(GUIDED) | TEXT_FIELDS
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo", "best_of"} | {"suffix", "user"}
# vLLM's chat extensions that shape the prompt (`template_options`)
TEMPLATE_FIELDS = {"add_generation_prompt", "continue_final_message", "chat_template_kwargs"}
CHAT_FIELDS = COMMON | {"messages", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"} | set(
    NO_OP) - {"suffix"} | TEMPLATE_FIELDS


def _number(body: dict, name: str, default, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or \
            (isinstance(value, float) and not math.isfinite(value)):
        raise RequestError(f"{name} must be {kind}, got {shown(value)}", name)
    if not integer:
        try:
            return float(value)
        except OverflowError:  # an integer past float's range
            raise RequestError(f"{name} must be a finite number, got an integer of {len(str(value))} digits",
                               name) from None
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {shown(value)}", name)
    return value


def _check_fields(body: dict, allowed: set) -> None:
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):  # OpenAI's type, unused
        raise RequestError(f"user must be a string, got {shown(body['user'])}", "user")
    unknown = sorted(set(body) - allowed)
    if unknown:
        names = ", ".join(name if len(name) <= SHOWN else shown(name) for name in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise RequestError(f"Unrecognized request argument supplied: {names}{more}", unknown[0][:SHOWN],
                           code="unrecognized_argument")
    for name, ok in NO_OP.items():
        if name in body and name in allowed and not ok(body[name]):
            raise RequestError(f"{name}={shown(body[name])} is not supported by this server (only its default)", name,
                               code="unsupported_parameter")


# generation_config.json: the fields vLLM takes as request defaults (`--generation-config auto`) -> the request's
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_new_tokens": "max_tokens",
                     "repetition_penalty": "repetition_penalty", "min_p": "min_p"}
# ... and those it takes that this server does not implement, with their no-op values (they are not applied): none
# since the engine applies repetition_penalty and min_p
NOT_APPLIED: dict = {}
# transformers' GenerationConfig defaults: vLLM reads the file through GenerationConfig.to_diff_dict(), so a value
# equal to one of these is no override there (a file's top_k of 50 included), nor here
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def sampling_defaults(generation_config: dict, source: str) -> tuple[dict, dict]:
    """(request defaults, not applied) of a generation_config.json's content: {request field: value} of the
    temperature, top_p, top_k (-1 or 0: off), repetition_penalty, min_p and max_new_tokens (max_tokens: a cap on
    every request's) it sets, and {name: value} of the parameters vLLM would also take from it that this server does
    not implement (`NOT_APPLIED`, none now). A value the engine would refuse raises ValueError naming `source` (else
    every request that omits the field would be refused for a value it did not send)."""
    from swiftkv_jax.serving.errors import InvalidRequest
    from swiftkv_jax.serving.sampling import SamplingParams, check_penalties

    given = {k: v for k, v in generation_config.items()
             if v is not None and (isinstance(v, bool) or HF_DEFAULTS.get(k, object()) != v)  # True == 1.0
             and not (k == "min_p" and v == 0)}  # off (transformers' default is None)
    defaults, ignored = {}, {}
    for name, field in GENERATION_FIELDS.items():
        if name not in given:
            continue
        value = given[name]
        integer = name in ("top_k", "max_new_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or \
                (name == "max_new_tokens" and value < 1) or (name == "top_k" and value < -1):
            what = {"top_k": "an integer >= -1", "max_new_tokens": "an integer >= 1"}.get(name, "a number")
            raise ValueError(f"{source}: {name} must be {what}, got {shown(value)}")
        defaults[field] = 0 if name == "top_k" and value == -1 else value
    try:
        SamplingParams(**{k: defaults[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in defaults})
        check_penalties(defaults.get("repetition_penalty", 1.0))
    except InvalidRequest as e:
        raise ValueError(f"{source}: {e}") from None
    for name, no_op in NOT_APPLIED.items():
        if name in given and given[name] not in no_op:
            ignored[name] = given[name]
    return defaults, ignored


def _id_list(body: dict, name: str) -> Optional[list]:
    """A list of token ids (integers; their range is the engine's to check), or None: omitted."""
    ids = body.get(name)
    if ids is not None and (not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                                             for t in ids)):
        raise RequestError(f"{name} must be a list of token ids (integers), got {shown(ids)}", name)
    return ids


def _bad_words(body: dict, tokenizer) -> Optional[list]:
    """vLLM's bad_words (a list of strings) as the token-id words the engine bans (`token_masks.bad_words_ids`: each
    word as is and with a leading space, no special tokens), or None: omitted or empty."""
    from swiftkv_jax.serving import token_masks

    value = body.get("bad_words")
    if value is None:
        return None
    if not isinstance(value, list) or any(not isinstance(w, str) or not w.strip() for w in value):
        raise RequestError(f"bad_words must be a list of non-empty strings, got {shown(value)}", "bad_words")
    return token_masks.bad_words_ids(value, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]) or None


def _sampling(body: dict, defaults: dict, tokenizer) -> dict:
    """The engine's sampling options, typed (their ranges are the engine's to check); an omitted one is the server's
    default (`sampling_defaults`), else off."""
    top_k = _number(body, "top_k", defaults.get("top_k", 0), integer=True)
    stop_ids = _id_list(body, "stop_token_ids")
    options = {name: _number(body, name, defaults.get(name, off)) for name, off in SAMPLING_OPTIONS.items()
               if name != "top_k"}
    return dict(temperature=_number(body, "temperature", defaults.get("temperature", 1.0)),
                top_p=_number(body, "top_p", defaults.get("top_p", 1.0)),
                top_k=0 if top_k == -1 else top_k,  # -1: vLLM's "off"
                extra_stop_ids=stop_ids or [], ignore_eos=_bool(body, "ignore_eos"), logit_bias=_logit_bias(body),
                min_tokens=_min_tokens(body), allowed_token_ids=_id_list(body, "allowed_token_ids"),
                bad_words_ids=_bad_words(body, tokenizer), **options)


def _logit_bias(body: dict) -> Optional[dict]:
    """OpenAI's logit_bias, a JSON object {"token id": bias}, as {int id: float bias} (None: omitted); the ids'
    range and the biases' ([-100, 100]) are the engine's to check, the number of entries (MAX_LOGIT_BIAS) here."""
    from swiftkv_jax.serving.sampling import MAX_LOGIT_BIAS

    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must be an object mapping token ids to biases, got {shown(bias)}",
                           "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}", "logit_bias")
    out = {}
    for key, value in bias.items():
        text = key.strip() if isinstance(key, str) else ""
        if not text.lstrip("-").isdigit() or not text.isascii():
            raise RequestError(f"logit_bias keys must be token ids (integers as strings), got {shown(key)}",
                               "logit_bias")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            out[int(text)] = float(value) if number else math.nan
        except OverflowError:  # an integer past float's range
            out[int(text)] = math.inf
        if not math.isfinite(out[int(text)]):
            raise RequestError(f"logit_bias values must be finite numbers, got {shown(value)} for token {text}",
                               "logit_bias")
    return out


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = {"name", "description", "schema", "strict"}


def _response_format(body: dict) -> Optional[tuple]:
    """OpenAI's response_format (vLLM's, on chat and completions): {"type": "text"} (or omitted) is free text,
    {"type": "json_object"} any JSON object (JSON mode), {"type": "json_schema", "json_schema": {"name", "schema",
    "description"?, "strict"?}} the JSON texts that satisfy the schema; both by guided decoding with llguidance
    (`structured`: its grammar of the schema, compact JSON), whose refusal of a schema is a 400 naming
    response_format, as is a server without llguidance. Returns the constraint (`_output_grammar`), or None."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        raise RequestError(f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMATS)}, "
                           f"got {shown(value)}", "response_format")
    kind = value["type"]
    if set(value) - {"type", kind}:
        raise RequestError(f"response_format of type {kind!r} takes no {sorted(set(value) - {'type', kind})[0]!r}",
                           "response_format")
    if kind == "text":
        return None
    spec = value.get("json_schema")
    if kind == "json_schema":
        if not isinstance(spec, dict):
            raise RequestError(f"response_format.json_schema must be an object with a name and a schema, got "
                               f"{shown(spec)}", "response_format")
        unknown = sorted(set(spec) - JSON_SCHEMA_FIELDS)
        if unknown:
            raise RequestError(f"response_format.json_schema takes {', '.join(sorted(JSON_SCHEMA_FIELDS))}, got "
                               f"{unknown[0][:SHOWN]!r}", "response_format")
        if not isinstance(spec.get("name"), str):
            raise RequestError(f"response_format.json_schema.name must be a string, got {shown(spec.get('name'))}",
                               "response_format")
        if not isinstance(spec.get("schema"), dict):
            raise RequestError(f"response_format.json_schema.schema must be a JSON Schema object, got "
                               f"{shown(spec.get('schema'))}", "response_format")
    if kind == "json_schema":
        return "response_format", "json", spec["schema"], None
    return "response_format", "json_object", True, None


# vLLM's structured_outputs: exactly one constraint (structured.from_spec's kinds) and its options
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
JSON_KINDS = ("json", "json_object")
STRUCTURED_OPTIONS = ("disable_any_whitespace", "whitespace_pattern", "disable_fallback",
                      "disable_additional_properties")
# each kind's value: (is it one, what it must be)
CONSTRAINT_VALUES = {
    "json": (lambda v: isinstance(v, (dict, str)), "a JSON schema (an object, or its JSON text)"),
    "regex": (lambda v: isinstance(v, str) and v != "", "a non-empty string (a regex)"),
    "choice": (lambda v: isinstance(v, list) and v != [] and all(isinstance(c, str) for c in v),
               "a non-empty list of strings"),
    "grammar": (lambda v: isinstance(v, str) and v != "", "a non-empty string (a Lark or GBNF grammar)"),
    "json_object": (lambda v: v is True, "true (any JSON object; omit it otherwise)"),
}


def _constraint_value(where: str, param: str, kind: str, value):
    """A structured_outputs constraint's value, checked: `where` names it in the message, `param` is the field."""
    ok, what = CONSTRAINT_VALUES[kind]
    if not ok(value):
        raise RequestError(f"{where} must be {what}, got {shown(value)}", param)
    return value


def _json_options(param: str, kind: str, pattern_name: str, pattern, disable_any_whitespace=None) -> dict:
    """llguidance's JSON options of a json / json_object constraint: compact (`structured.JSON_OPTIONS`) unless
    disable_any_whitespace is false (JSON's whitespace) or a whitespace pattern is given (`pattern_name`: the
    request's name for it). Whitespace in a regex, choice or grammar is what it says: a pattern there is refused,
    disable_any_whitespace does nothing."""
    from swiftkv_jax.serving import structured

    if pattern is None:
        return structured.json_options(None if disable_any_whitespace is None else not disable_any_whitespace)
    if not isinstance(pattern, str):
        raise RequestError(f"{pattern_name} must be a string (a regex of the whitespace allowed), got {shown(pattern)}",
                           param)
    if kind not in JSON_KINDS:
        raise RequestError(f"{pattern_name} applies to JSON only, not to {kind}", param)
    if disable_any_whitespace:
        raise RequestError(f"{pattern_name} sets the whitespace allowed, disable_any_whitespace: true allows none: "
                           f"send one", param)
    return structured.json_options(whitespace_pattern=pattern)


def _structured_outputs(body: dict) -> Optional[tuple]:
    """vLLM's structured_outputs (docs.vllm.ai/en/latest/features/structured_outputs): exactly one of json (a JSON
    schema), regex, choice (a list of strings), grammar (Lark or GBNF) and json_object (true), with the options
    disable_any_whitespace (JSON: compact unless false is given), whitespace_pattern (JSON), disable_fallback and
    disable_additional_properties; a null key is an omitted one (a client that dumps vLLM's whole
    StructuredOutputsParams). structural_tag is not supported. Returns the constraint (`_output_grammar`), or
    None."""
    value = body.get("structured_outputs")
    if value is None:
        return None
    param, kinds = "structured_outputs", ", ".join(STRUCTURED_KINDS)
    if not isinstance(value, dict):
        raise RequestError(f"structured_outputs must be an object with exactly one of {kinds}, got {shown(value)}",
                           param)
    if value.get("structural_tag") is not None:
        raise RequestError(f"structured_outputs.structural_tag is not supported here: use one of {kinds}", param,
                           code="unsupported_parameter")
    unknown = sorted(set(value) - set(STRUCTURED_KINDS) - set(STRUCTURED_OPTIONS) - {"structural_tag"})
    if unknown:
        raise RequestError(f"structured_outputs takes {', '.join(STRUCTURED_KINDS + STRUCTURED_OPTIONS)}, got "
                           f"{shown(unknown[0])}", param)
    given = [k for k in STRUCTURED_KINDS if value.get(k) is not None]
    if len(given) != 1:
        raise RequestError(f"structured_outputs takes exactly one of {kinds}, got "
                           f"{', '.join(given) if given else 'none'}", param)
    for name in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
        if value.get(name) is not None and not isinstance(value[name], bool):
            raise RequestError(f"structured_outputs.{name} must be true or false, got {shown(value[name])}", param)
    # disable_fallback: a no-op, there is one backend (llguidance) and nothing to fall back to
    if value.get("disable_additional_properties"):  # llguidance's JSON options have no such switch
        raise RequestError("structured_outputs.disable_additional_properties: true is not supported here: set "
                           '"additionalProperties": false in the schema\'s objects', param,
                           code="unsupported_parameter")
    kind = given[0]
    return (param, kind, _constraint_value(f"structured_outputs.{kind}", param, kind, value[kind]),
            _json_options(param, kind, "structured_outputs.whitespace_pattern", value.get("whitespace_pattern"),
                          value.get("disable_any_whitespace")))


def _guided(body: dict) -> Optional[tuple]:
    """vLLM's older guided_json, guided_regex, guided_choice and guided_grammar (one of them), with
    guided_whitespace_pattern (guided_json's) and guided_decoding_backend (a backend's name: llguidance's, or
    auto). Returns the constraint (`_output_grammar`), or None."""
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise RequestError(f"this server guides with llguidance: guided_decoding_backend must be one of "
                           f"{', '.join(GUIDED_BACKENDS)}, got {shown(backend)}", "guided_decoding_backend",
                           code="unsupported_parameter")
    given = [name for name in GUIDED if body.get(name) is not None]
    pattern = body.get("guided_whitespace_pattern")
    if len(given) > 1:
        raise RequestError(f"{given[1]} and {given[0]} both constrain the output: send one", given[1])
    if not given:
        if pattern is not None:
            raise RequestError("guided_whitespace_pattern applies to guided_json only", "guided_whitespace_pattern")
        return None
    field = given[0]
    kind = GUIDED[field]
    return (field, kind, _constraint_value(field, field, kind, body[field]),
            _json_options("guided_whitespace_pattern", kind, "guided_whitespace_pattern", pattern))


def _output_grammar(body: dict, tokenizer, forced: bool = False) -> tuple[Optional[Any], Optional[str]]:
    """The request's output constraint, from response_format, structured_outputs or the guided_* fields (at most
    one of them; none when a tool_choice is `forced`): (its pristine `structured.Grammar`, the field), or (None,
    None). Every field's shape is checked first, each into a constraint: (the field, `structured.from_spec`'s kind,
    its value, llguidance's JSON options or None)."""
    given = [c for c in (_response_format(body), _structured_outputs(body), _guided(body)) if c is not None]
    if forced and given:
        field = given[0][0]
        besides = " besides 'text'" if field == "response_format" else ""
        raise RequestError(f"tool_choice 'required' or a named function takes no {field}{besides}: both constrain "
                           f"the output", field)
    if len(given) > 1:
        raise RequestError(f"{given[1][0]} and {given[0][0]} both constrain the output: send one", given[1][0])
    if not given:
        return None, None
    field, kind, value, options = given[0]
    return _grammar(field, kind, tokenizer, value, options), field


def _grammar(param: str, kind: str, tokenizer, value=None, options: Optional[dict] = None):
    """The `structured.Grammar` of a constraint (`structured.from_spec`'s kind and value, JSON `options`); 400s
    naming `param`: no llguidance on the server, or a schema, regex or grammar it refuses."""
    from swiftkv_jax.serving import structured

    try:
        return structured.from_spec(tokenizer, kind, value, options=options)
    except structured.MissingDependency as e:
        raise RequestError(f"{param} needs guided decoding, which needs llguidance on the server: "
                           f"{structured.INSTALL}", param, code="unsupported_parameter") from e
    except structured.GrammarError as e:
        raise RequestError(f"{param}: {e}", param) from None


def _min_tokens(body: dict) -> int:
    """vLLM's min_tokens (0: off): no stop before that many generated tokens. The engine masks the request's stop
    ids (the EOS ids unless ignore_eos, and stop_token_ids) while it has generated fewer (`sk.Engine.add_request`),
    and a stop string that ends in the text of those first tokens does not stop it (`text.ChoiceText`), as vLLM's.
    An integer >= 0, at most the max_tokens (or max_completion_tokens) given (vLLM's messages); the engine checks it
    against the max_tokens the request runs with (the context's room, generation_config's cap)."""
    min_tokens = _number(body, "min_tokens", 0, integer=True)
    if min_tokens < 0:
        raise RequestError(f"min_tokens must be greater than or equal to 0, got {min_tokens}", "min_tokens")
    given = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    if isinstance(given, int) and not isinstance(given, bool) and 1 <= given < min_tokens:  # a bad one: its own 400
        raise RequestError(f"min_tokens must be less than or equal to max_tokens={given}, got {min_tokens}",
                           "min_tokens")
    return min_tokens


def _stop_strings(body: dict) -> list:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or any(not isinstance(s, str) or not s for s in stop):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {shown(stop)}", "stop")
    if len(stop) > MAX_STOP:
        raise RequestError(f"stop takes at most {MAX_STOP} strings, got {len(stop)}", "stop")
    longest = max(len(s) for s in stop)
    if longest > MAX_STOP_CHARS:
        raise RequestError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}", "stop")
    return stop


def _common(body: dict, defaults: dict, tokenizer) -> dict:
    n = _number(body, "n", 1, integer=True)
    if not 1 <= n <= MAX_N:
        raise RequestError(f"n must lie in [1, {MAX_N}], got {n}", "n")
    seed = _number(body, "seed", None, integer=True)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"} or \
                any(not isinstance(v, bool) for v in options.values()):
            raise RequestError(f"stream_options takes {{'include_usage': bool, 'continuous_usage_stats': bool}}, got "
                               f"{shown(options)}", "stream_options")
    options = options or {}
    sampling, stop = _sampling(body, defaults, tokenizer), _stop_strings(body)
    return dict(n=n, seed=seed, stream=stream, include_usage=options.get("include_usage", False),
                continuous_usage=options.get("continuous_usage_stats", False), sampling=sampling, stop=stop,
                include_stop=_bool(body, "include_stop_str_in_output"),
                decode={name: _bool(body, name, True) for name in ("skip_special_tokens",
                                                                   "spaces_between_special_tokens")})


def _truncation(body: dict, max_model_len: Optional[int], max_tokens: Optional[int], field: str) -> Optional[int]:
    """vLLM's truncate_prompt_tokens: how many of each prompt's last tokens to keep (None: all). An integer >= 1, or
    -1: as many as the context holds beside the max_tokens asked for (`field`: the client's name for it); more than
    that is a 400, as vLLM's (max_model_len - max_tokens, where max_tokens is the request's, completions' default 16,
    chat's 0 when omitted). Without `max_model_len` (a parse outside a server) -1 keeps all."""
    keep = _number(body, "truncate_prompt_tokens", None, integer=True)
    if keep is None:
        return None
    if keep < -1 or keep == 0:
        raise RequestError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (as many tokens as the context "
                           f"holds), got {keep}", "truncate_prompt_tokens")
    if max_model_len is None:
        return None if keep == -1 else keep
    room = max_model_len - (max_tokens or 0)
    if keep == -1:
        return max(room, 1)  # none: the context check refuses the max_tokens
    if keep > room:
        limit = f"max_model_len - {field} = {max_model_len} - {max_tokens}" if max_tokens else "max_model_len"
        raise RequestError(f"truncate_prompt_tokens={keep} cannot be greater than {limit} = {room}: ask for a "
                           f"smaller truncation size", "truncate_prompt_tokens")
    return keep


def _encode(tokenizer, text: str, add_special_tokens: bool, keep: Optional[int] = None) -> tuple[list, bool]:
    """(`text`'s token ids, whether they were cut short): with `keep`, at most that many, as vLLM's tokenizer
    truncates them (`truncation=True, max_length=keep`, on the left: the last tokens, its special tokens kept, a BOS
    first)."""
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    if keep is None or len(ids) <= keep:
        return ids, False
    side = tokenizer.truncation_side
    tokenizer.truncation_side = "left"  # this thread's tokenizer (`routes.Server.parser_tokenizer`)
    try:
        ids = tokenizer(text, add_special_tokens=add_special_tokens, truncation=True, max_length=keep)["input_ids"]
    finally:
        tokenizer.truncation_side = side
    return ids[-keep:], True


def _max_tokens(body: dict, default_field: str, zero_ok: bool = False) -> tuple[Optional[int], str]:
    """(max_tokens or None, the field it came from, else `default_field`): max_completion_tokens wins over
    max_tokens, as OpenAI's. 0 only where `zero_ok` (echo: the prompt scored, nothing generated)."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = _number(body, name, None, integer=True)
        if value is not None:
            if value < 1 and not (zero_ok and value == 0):
                raise RequestError(f"{name} must be >= 1" + (" (or 0 with echo)" if zero_ok else "") +
                                   f", got {value}", name)
            return value, name
    return None, default_field


def _prompts(prompt: Any, tokenizer, add_special_tokens: bool = True, keep: Optional[int] = None) -> tuple[list, list]:
    """(token ids, texts) of the prompt field: a string (tokenized with the tokenizer's special tokens, a BOS,
    unless not `add_special_tokens`), a list of strings, token ids, or a list of token-id lists; with `keep`
    (truncate_prompt_tokens) at most each one's last `keep` tokens (`_encode`), and a text cut short is echoed as
    the text of the tokens kept."""
    def ids_ok(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        items = [prompt]
    elif ids_ok(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids_ok(p) for p in prompt):
        items = prompt
    else:
        raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                           f"token ids (none empty), got {str(prompt)[:80]!r}", "prompt")
    vocab = len(tokenizer)
    for i, p in enumerate(items):  # the tokenizer cannot decode an id outside its vocabulary (vLLM refuses them too)
        if not isinstance(p, str) and not all(0 <= t < vocab for t in p):
            raise RequestError(f"prompt {i}: token ids must lie in [0, {vocab}) (this model's vocabulary), got "
                               f"{[t for t in p if not 0 <= t < vocab][:5]}", "prompt")
    ids, texts = [], []
    for p in items:
        cut = True
        if isinstance(p, str):
            tokens, cut = _encode(tokenizer, p, add_special_tokens, keep)
        else:
            tokens = list(p)[-(keep or 0):]
        ids.append(tokens)
        texts.append(tokenizer.decode(tokens, skip_special_tokens=True) if cut else p)
    for i, p in enumerate(ids):
        if not p:
            raise RequestError(f"prompt {i} is empty after tokenization", "prompt")
    return ids, texts


def parse_completion(body: dict, tokenizer, defaults: Optional[dict] = None,
                     max_model_len: Optional[int] = None) -> Job:
    """A completion request; `defaults`: the server's sampling defaults (`sampling_defaults`). An omitted max_tokens
    is OpenAI's 16 (as vLLM's completions), capped by the file's max_new_tokens as any other. `max_model_len`: the
    server's, which truncate_prompt_tokens may not pass (`_truncation`)."""
    _check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt", code="missing_required_parameter")
    common = _common(body, defaults or {}, tokenizer)
    best_of = body.get("best_of")
    if best_of is not None and best_of != common["n"]:
        raise RequestError(f"best_of={shown(best_of)} is not supported (only best_of = n)", "best_of",
                           code="unsupported_parameter")
    from swiftkv_jax.serving.scheduler import MAX_TOP_LOGPROBS

    logprobs = _number(body, "logprobs", None, integer=True)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", "logprobs")
    echo = _bool(body, "echo")
    max_tokens, field = _max_tokens(body, "max_tokens", zero_ok=echo)
    max_tokens = 16 if max_tokens is None else max_tokens
    keep = _truncation(body, max_model_len, max_tokens, field)
    prompts, texts = _prompts(body["prompt"], tokenizer, _bool(body, "add_special_tokens", True), keep)
    grammar, grammar_field = _output_grammar(body, tokenizer)
    return Job("completion", prompts, texts, common["n"], common["sampling"], max_tokens,
               common["seed"], common["stop"], logprobs is not None, logprobs or 0, echo, common["stream"],
               common["include_usage"], common["continuous_usage"], field, (defaults or {}).get("max_tokens"),
               grammar=grammar, grammar_field=grammar_field, include_stop=common["include_stop"],
               decode=common["decode"])


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                                   f"supported, got {str(part)[:80]!r}", f"messages[{i}].content")
            parts.append(part["text"])
        return "\n".join(parts)  # vLLM's: the parts one per line
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts, got {shown(content)}",
                       f"messages[{i}].content")


# fields of a message besides role, content and name, by role; any other is refused unless null (the openai client's
# model_dump of a response's message carries audio, function_call, annotations: None)
MESSAGE_FIELDS = {"assistant": {"tool_calls", "refusal"}, "tool": {"tool_call_id"}}
TOOL_PARSER_FLAGS = "--enable-auto-tool-choice --tool-call-parser llama3_json|hermes"


def _object(value, param: str, what: str) -> dict:
    if not isinstance(value, dict):
        raise RequestError(f"{param} must be {what}, got {shown(value)}", param)
    return value


def _string(value, param: str, optional: bool = False) -> Optional[str]:
    if (value is None and optional) or (isinstance(value, str) and value):
        return value
    raise RequestError(f"{param} must be a non-empty string, got {shown(value)}", param)


def _arguments(value, param: str) -> dict:
    """A tool call's arguments as the chat templates take them: a dict (OpenAI sends a JSON string). As vLLM's, a
    string that is not a JSON object becomes {} (failing it would fail every later turn of the conversation)."""
    if isinstance(value, dict):
        return value
    if value is None or isinstance(value, str):
        try:
            parsed = json.loads(value) if value else {}
        except ValueError:
            parsed = None
        return parsed if isinstance(parsed, dict) else {}
    raise RequestError(f"{param} must be a JSON string (or an object), got {shown(value)}", param)


def _tool_calls(value, param: str) -> list:
    """An assistant message's tool_calls, checked, with arguments as dicts (as vLLM hands them to the template)."""
    if not isinstance(value, list):
        raise RequestError(f"{param} must be a list of tool calls, got {shown(value)}", param)
    calls = []
    for j, call in enumerate(value):
        call = _object(call, f"{param}[{j}]", "an object {'id', 'type': 'function', 'function'}")
        if call.get("type", "function") != "function":
            raise RequestError(f"{param}[{j}].type must be 'function', got {shown(call['type'])}", f"{param}[{j}].type")
        function = _object(call.get("function"), f"{param}[{j}].function", "an object {'name', 'arguments'}")
        name = _string(function.get("name"), f"{param}[{j}].function.name")
        out = dict(type="function", function=dict(
            name=name, arguments=_arguments(function.get("arguments"), f"{param}[{j}].function.arguments")))
        if call.get("id") is not None:
            out["id"] = _string(call["id"], f"{param}[{j}].id")
        calls.append(out)
    return calls


def parse_tools(value) -> Optional[list]:
    """The request's tools, [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}],
    checked, as the chat template gets them (None: none)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise RequestError(f"tools must be a list of {{'type': 'function', 'function': ...}}, got {shown(value)}",
                           "tools")
    for i, tool in enumerate(value):
        tool = _object(tool, f"tools[{i}]", "an object {'type': 'function', 'function': {...}}")
        if tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}} (only function tools "
                               f"are supported), got {shown(tool)}", f"tools[{i}].type")
        function = _object(tool.get("function"), f"tools[{i}].function", "an object {'name', 'description', "
                                                                           "'parameters'}")
        extra = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if extra:
            raise RequestError(f"tools[{i}].function has unknown fields: {', '.join(map(str, extra))[:SHOWN]}",
                               f"tools[{i}].function")
        _string(function.get("name"), f"tools[{i}].function.name")
        if not isinstance(function.get("description", ""), str):
            raise RequestError(f"tools[{i}].function.description must be a string", f"tools[{i}].function.description")
        if function.get("parameters") is not None:
            _object(function["parameters"], f"tools[{i}].function.parameters", "a JSON Schema object")
    return value or None


def _tool_parser(body: dict, tools: Optional[list], server_parser: Optional[str]) -> Optional[str]:
    """The parser this request's outputs go through, from tool_choice (default "auto" with tools, as vLLM's):
    "none", the tools are still in the prompt (vLLM's default) and the output is plain content; "auto", the server's
    parser (a server started without one refuses, as vLLM's). "required" and a named function ({"type":
    "function", "function": {"name"}}) force calls by guided decoding (`_tool_grammar`), as vLLM's, whatever the
    server's parser: "required" (`tool_calls.REQUIRED`) and "function:NAME" (`tool_calls.FUNCTION`). Without tools
    "none" and "auto" do nothing; "required" and a named function need tools."""
    from swiftkv_jax.serving.http.tool_calls import FUNCTION, REQUIRED

    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        if not tools:
            raise RequestError(f"tool_choice={shown(choice)} needs tools", "tool_choice")
        if choice == "required":
            return REQUIRED
        function = choice.get("function")
        if choice.get("type") != "function" or set(choice) - {"type", "function"} or not isinstance(
                function, dict) or set(function) != {"name"} or not isinstance(function["name"], str):
            raise RequestError(f"a named tool_choice must be {{'type': 'function', 'function': {{'name': ...}}}}, got "
                               f"{shown(choice)}", "tool_choice")
        names = [tool["function"]["name"] for tool in tools]
        if function["name"] not in names:
            raise RequestError(f"tool_choice names the function {shown(function['name'])}, which is not among the "
                               f"tools ({', '.join(names)})", "tool_choice")
        return FUNCTION + function["name"]
    if choice not in (None, "none", "auto"):
        raise RequestError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {shown(choice)}",
                           "tool_choice")
    if not tools or choice == "none":
        return None
    if server_parser is None:
        raise RequestError(f'"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set: '
                           f"start the server with `infer.py serve ... {TOOL_PARSER_FLAGS}`",
                           "tools" if choice is None else "tool_choice")
    return server_parser


def _tool_grammar(parser: Optional[str], tools: Optional[list], tokenizer, parallel: bool = True) -> Optional[Any]:
    """tool_choice "required" or a named function: the grammar of the calls, vLLM's JSON schemas (a named function:
    its parameters; "required": a non-empty array of {"name": one of the tools', "parameters": its parameters}, and
    nothing else in a call; one call at most with parallel_tool_calls false)."""
    from swiftkv_jax.serving.http.tool_calls import FUNCTION, REQUIRED

    if parser != REQUIRED and not (parser or "").startswith(FUNCTION):
        return None
    parameters = {tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object", "properties": {}}
                  for tool in tools}
    if parser == REQUIRED:
        calls = [{"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in parameters.items()]
        schema = {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
                  "items": {"type": "object", "anyOf": calls}}
    else:
        schema = parameters[parser[len(FUNCTION):]]
    return _grammar("tool_choice", "json", tokenizer, schema)


def _clean_message(message, i: int) -> dict:
    """The message as the chat template gets it: role, content (a string) and, by role, tool_calls or tool_call_id."""
    if not isinstance(message, dict) or "role" not in message:
        raise RequestError(f"messages[{i}] must be an object with a 'role' and a 'content'", f"messages[{i}]")
    role = message["role"]
    if role not in ROLES:
        raise RequestError(f"messages[{i}].role {shown(role)} is not a chat role: use one of {', '.join(ROLES)}",
                           f"messages[{i}].role")
    allowed = {"role", "content", "name"} | MESSAGE_FIELDS.get(role, set())
    extra = {k for k, v in message.items() if v is not None} - allowed
    if extra:
        raise RequestError(f"messages[{i}] has fields this server does not support: {', '.join(sorted(extra))}",
                           f"messages[{i}]")
    if message.get("content") is None and role != "assistant":  # OpenAI's: only an assistant turn may have none
        raise RequestError(f"messages[{i}].content is required in a {role} message", f"messages[{i}].content",
                           code="missing_required_parameter")
    clean = {"role": role, "content": _content(message, i)}
    if message.get("tool_calls"):  # [] is dropped, as vLLM's: the template takes the plain path
        clean["tool_calls"] = _tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")
    if message.get("tool_call_id") is not None:
        clean["tool_call_id"] = _string(message["tool_call_id"], f"messages[{i}].tool_call_id")
    return clean


def _escaped(text: str) -> list[str]:
    """`text` as it stands in the rendered prompt: as is, or inside a JSON string (a template's tojson)."""
    return [text, json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1]]


def _check_rendered(text: str, messages: list) -> None:
    """Refuse messages the template left out (a template that ignores a role drops its content): each message's
    content, or each of its tool calls' names, must appear in order, as is or JSON-escaped (Llama 3.1's template
    writes a tool result as {"output": content}, and drops the content of an assistant turn of tool calls)."""
    cursor = 0
    for i, message in enumerate(messages):
        if "tool_calls" in message:
            wanted, field, unknown = [c["function"]["name"] for c in message["tool_calls"]], "tool_calls", "tool calls"
        else:
            content = message["content"].strip()
            wanted, field, unknown = [content] if content else [], "role", "that role"
        for item in wanted:
            found = [(at, len(form)) for form in _escaped(item) for at in [text.find(form, cursor)] if at >= 0]
            if not found:
                raise RequestError(f"the chat template does not render messages[{i}] (role {message['role']!r}): "
                                   f"this model's template does not know {unknown}", f"messages[{i}].{field}")
            at, length = min(found)
            cursor = at + length


def template_options(body: dict, tokenizer) -> dict:
    """vLLM's chat extensions that shape the prompt: `add_generation_prompt` (default true: the assistant's header
    ends the prompt, unless continue_final_message), `continue_final_message` (the prompt ends inside the last
    message, an assistant's, which the model continues: a prefilled answer; not with add_generation_prompt) and
    `chat_template_kwargs` (more variables for the template, e.g. a date or Qwen3's enable_thinking)."""
    cont = _bool(body, "continue_final_message")
    add = _bool(body, "add_generation_prompt", not cont)  # omitted with continue_final_message: false (vLLM: a 400)
    if add and cont:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true: set "
                           "add_generation_prompt: false to continue the last message", "continue_final_message")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError(f"chat_template_kwargs must be an object, got {shown(kwargs)}", "chat_template_kwargs")
    # apply_chat_template's own arguments (and the messages) are set by the request's fields, not as template variables
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"self", "kwargs"}
    reserved = sorted(set(kwargs) & (own | {"messages"}))
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)}: use the request's own field",
                           "chat_template_kwargs")
    return dict(add_generation_prompt=add, continue_final_message=cont, template_kwargs=kwargs)


def render_messages(messages: Any, tokenizer, add_generation_prompt: bool = True, add_special_tokens: bool = False,
                    tools: Optional[list] = None, continue_final_message: bool = False,
                    template_kwargs: Optional[dict] = None, keep: Optional[int] = None) -> tuple[list[int], str]:
    """The conversation (and `tools`, as `parse_tools` checks them) through the tokenizer's chat template, with the
    assistant's header unless not `add_generation_prompt`, or ending inside the last message with
    `continue_final_message`; `template_kwargs`: the template's other variables (`template_options`): (token ids,
    text). The template writes the special tokens (a BOS) itself: `add_special_tokens` adds the tokenizer's again
    (vLLM's default is false). `keep` (truncate_prompt_tokens): at most the rendered prompt's last `keep` tokens."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template: use /v1/completions with a plain prompt",
                           "messages")
    clean = [_clean_message(message, i) for i, message in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(clean, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **(template_kwargs or {}))
    except Exception as e:  # jinja2's TemplateError, raise_exception() in the template: the messages are refused
        raise RequestError(f"the chat template refused these messages: {e}", "messages") from None
    _check_rendered(text, clean)
    return _encode(tokenizer, text, add_special_tokens, keep)[0], text


def parse_chat(body: dict, tokenizer, defaults: Optional[dict] = None, tool_parser: Optional[str] = None,
               max_model_len: Optional[int] = None) -> Job:
    """A chat request; `defaults`: the server's sampling defaults (`sampling_defaults`), max_tokens among them;
    `tool_parser`: the server's (--tool-call-parser), which tool_choice "auto" needs; `max_model_len`: the server's,
    which truncate_prompt_tokens may not pass (`_truncation`)."""
    defaults = defaults or {}
    _check_fields(body, CHAT_FIELDS)
    if "messages" not in body:
        raise RequestError("messages is required", "messages", code="missing_required_parameter")
    common = _common(body, defaults, tokenizer)
    logprobs = _bool(body, "logprobs")
    top = _number(body, "top_logprobs", 0, integer=True)
    if top and not logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens, field = _max_tokens(body, "max_completion_tokens")
    tools = parse_tools(body.get("tools"))
    parser = _tool_parser(body, tools, tool_parser)
    # the model decides how many calls it makes, as vLLM's; but tool_choice "required" with false makes one
    parallel = _bool(body, "parallel_tool_calls", True)
    keep = _truncation(body, max_model_len, max_tokens, field)
    ids, text = render_messages(body["messages"], tokenizer, add_special_tokens=_bool(body, "add_special_tokens"),
                                tools=tools, keep=keep, **template_options(body, tokenizer))
    forced = _tool_grammar(parser, tools, tokenizer, parallel)
    grammar, grammar_field = _output_grammar(body, tokenizer, forced=forced is not None)
    if forced is not None:
        grammar, grammar_field = forced, "tool_choice"
    return Job("chat", [ids], [text], common["n"], common["sampling"], max_tokens, common["seed"], common["stop"],
               logprobs, top, False, common["stream"], common["include_usage"], common["continuous_usage"], field,
               defaults.get("max_tokens"), parser, grammar, grammar_field, common["include_stop"], common["decode"])


# ---- vLLM's /tokenize and /detokenize --------------------------------------------------------------------------------
TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT_FIELDS = {"model", "messages", "add_special_tokens", "return_token_strs", "tools"} | TEMPLATE_FIELDS


def _token_ids(value: Any, name: str, tokenizer) -> list:
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise RequestError(f"{name} must be a list of token ids (integers), got {shown(value)}", name)
    vocab = len(tokenizer)
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"{name}: token ids must lie in [0, {vocab}) (this model's vocabulary), got {bad[:5]}", name)
    return value


def parse_tokenize(body: dict, tokenizer, max_model_len: int) -> dict:
    """vLLM's POST /tokenize: {"prompt", "add_special_tokens": true} or {"messages", "add_generation_prompt": true,
    "add_special_tokens": false} (the ids chat would run) -> {"count", "max_model_len", "tokens", "token_strs"}
    (the tokens' strings with `return_token_strs`)."""
    chat = "messages" in body
    _check_fields(body, TOKENIZE_CHAT_FIELDS if chat else TOKENIZE_FIELDS)
    special = _bool(body, "add_special_tokens", not chat)
    if chat:
        ids, _ = render_messages(body["messages"], tokenizer, add_special_tokens=special,
                                 tools=parse_tools(body.get("tools")), **template_options(body, tokenizer))
    elif isinstance(body.get("prompt"), str):
        ids = tokenizer(body["prompt"], add_special_tokens=special)["input_ids"]
    else:
        raise RequestError(f"/tokenize takes a prompt (a string) or messages, got prompt={shown(body.get('prompt'))}",
                           "prompt", code=None if "prompt" in body else "missing_required_parameter")
    strs = tokenizer.convert_ids_to_tokens(ids) if _bool(body, "return_token_strs") else None
    return dict(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def parse_detokenize(body: dict, tokenizer) -> dict:
    """vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": their text} (special tokens included, as vLLM's)."""
    _check_fields(body, {"model", "tokens"})
    if "tokens" not in body:
        raise RequestError("tokens is required", "tokens", code="missing_required_parameter")
    return dict(prompt=tokenizer.decode(_token_ids(body["tokens"], "tokens", tokenizer)))

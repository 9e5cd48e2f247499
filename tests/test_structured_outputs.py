"""Structured outputs (guided decoding with llguidance) in `sk.Engine` and the OpenAI server: a random tiny model's
outputs under a JSON schema parse and satisfy it (llguidance's own matcher replaying the tokens, and `jsonschema` or
a check by hand); the masked greedy token is the argmax over the allowed ids of the model's full-forward logits
(`sk.logits`, numpy, llguidance's mask), padding ids past the tokenizer never allowed; unguided requests in a mixed
batch are unchanged; preemption and prefix-cache hits; the official `openai` client against a real server on
127.0.0.1 (chat and completions, json_schema and json_object, whole and streamed, n = 2); bad schemas and a server
without llguidance give 400s naming response_format; vLLM's `structured_outputs` (json, regex, choice, a GBNF or Lark
grammar, json_object, the whitespace options) and its older guided_* fields, whose outputs match their constraint,
and their refusals (400s naming the field the client used). CPU, fp32."""

from __future__ import annotations

import dataclasses
import json
import re
import os
import sys

import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.data.chat import load_tokenizer
from swiftkv_jax.serving import structured
from swiftkv_jax.serving.http.routes import make_app
from swiftkv_jax.tiny_assets import make_tiny_assets

from server_process import serve_app

# the `structured` extra (pip install -e ".[test,clients,lint,structured]", as CI does); outside CI (the GPU pack's
# `pytest -m gpu` collects this module) a checkout without it skips
llguidance = __import__("llguidance") if os.environ.get("CI") else pytest.importorskip("llguidance")
bitmasks = pytest.importorskip("llguidance.numpy")
ll_hf = pytest.importorskip("llguidance.hf")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 120  # the schema's longest text is well under this many tokens of the tiny tokenizer
PAD = 40  # the padded model's ids past the tokenizer's vocabulary


def satisfies(value) -> None:
    """SCHEMA's constraints on a parsed value (jsonschema's validator when installed, and by hand either way)."""
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        jsonschema.validate(value, SCHEMA)
    assert isinstance(value, dict) and set(value) == {"name", "age", "color", "tags"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert type(value["age"]) is int and 0 <= value["age"] <= 999
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 2
    assert all(isinstance(t, str) and len(t) <= 3 for t in value["tags"])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """(tokenizer, the tiny teacher, the same config with PAD padding ids past the tokenizer, randomly initialised)."""
    root = make_tiny_assets(tmp_path_factory.mktemp("structured"), num_examples=60)
    tokenizer = load_tokenizer(str(root / "teacher"))
    teacher = sk.load(root / "teacher")
    padded = sk.init(dataclasses.replace(teacher.config, vocab_size=len(tokenizer) + PAD), 3)
    return tokenizer, teacher, padded, root


def make_engine(model, **settings):
    options = dict(cache_dtype="float32", page_size=8, num_pages=96, max_num_seqs=4, max_num_batched_tokens=32,
                   single_buckets=(4,), prompt_buckets=(32,), max_model_len=256)
    return sk.Engine(model, **{**options, **settings})


def run(engine, requests: list[dict]) -> list:
    """Add every request, step to the end: the finished outputs in order."""
    ids = [engine.add_request(**r) for r in requests]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def replay(tokenizer, tokens: list) -> None:
    """A fresh matcher of SCHEMA accepts every token and is complete after them."""
    g = structured.json_schema(tokenizer, SCHEMA)
    for t in tokens:
        g.accept(t)
    assert g.accepting


def test_grammar_row_is_llguidances_bitmask_and_refuses_what_it_does_not_allow(assets):
    tokenizer = assets[0]
    g = structured.json_schema(tokenizer, SCHEMA)
    row = np.full(structured.words(len(tokenizer) + PAD), -1, np.int32)
    g.fill(row)
    ref = bitmasks.allocate_token_bitmask(1, len(tokenizer))
    bitmasks.fill_next_token_bitmask(g._matcher, ref)
    n = ref.shape[1]
    np.testing.assert_array_equal(row[:n], ref[0])
    assert not row[n:].any()  # past the tokenizer: never allowed
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
    assert tokenizer.decode(allowed.tolist()).startswith("{")  # only "{" starts an object
    refused = next(t for t in range(len(tokenizer)) if t not in set(allowed.tolist()))
    with pytest.raises(RuntimeError, match="refused token"):
        g.accept(refused)


def test_masked_greedy_is_the_argmax_over_allowed_ids_of_the_full_forward(assets):
    """The padded model (its ids past the tokenizer's are padding, here each given a +100 logit bias, which the
    grammar's mask, applied first, still refuses): each engine token is the argmax of sk.logits over the ids
    llguidance allows; the request ends when the JSON is complete, which parses and satisfies the schema."""
    tokenizer, _, model, _ = assets
    prompt = tokenizer("a person:")["input_ids"]
    bias = {len(tokenizer) + i: 100.0 for i in range(0, PAD, 7)}
    eng = make_engine(model)
    (out,) = run(eng, [dict(prompt=prompt, max_tokens=MAX_TOKENS, grammar=structured.json_schema(tokenizer, SCHEMA),
                            logit_bias=bias, logprobs=True, stop_token_ids=[tokenizer.eos_token_id])])
    assert out.finish_reason == "stop"
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(ll_hf.from_tokenizer(tokenizer), grammar)
    logits = np.asarray(sk.logits(model, np.array([prompt + out.token_ids])))[0, len(prompt) - 1:]
    mask = bitmasks.allocate_token_bitmask(1, len(tokenizer))
    for i, token in enumerate(out.token_ids):
        bitmasks.fill_next_token_bitmask(matcher, mask)
        row = logits[i].copy()
        row[len(tokenizer):] = -np.inf  # padding ids
        bitmasks.apply_token_bitmask_inplace(row[None, :len(tokenizer)], mask)
        assert token == int(np.argmax(row)), i
        # the logprobs stay the model's own
        np.testing.assert_allclose(out.logprobs[i], logits[i][token] - np.logaddexp.reduce(logits[i]), atol=2e-4)
        assert matcher.consume_token(token)
    assert matcher.is_stopped()
    satisfies(json.loads(tokenizer.decode(out.token_ids)))


def test_sampled_outputs_parse_and_satisfy_the_schema_and_json_object_gives_objects(assets):
    tokenizer, teacher, _, _ = assets
    prompt = tokenizer("hello")["input_ids"]
    eng = make_engine(teacher)
    outs = run(eng, [dict(prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=s, top_p=0.95,
                          grammar=structured.json_schema(tokenizer, SCHEMA), stop_token_ids=[tokenizer.eos_token_id])
                     for s in range(6)])
    for out in outs:
        assert out.finish_reason == "stop"
        satisfies(json.loads(tokenizer.decode(out.token_ids)))
        replay(tokenizer, out.token_ids)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # sampled: not all the same
    outs = run(eng, [dict(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.7, seed=s, repetition_penalty=1.3,
                          grammar=structured.json_object(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
                     for s in range(3)])
    for out in outs:  # a random model's JSON object may be long: complete ones parse, every one is a prefix
        if out.finish_reason == "stop":
            assert isinstance(json.loads(tokenizer.decode(out.token_ids)), dict)
        assert tokenizer.decode(out.token_ids).startswith("{")


def test_unguided_requests_in_a_mixed_batch_are_unchanged_and_preemption_and_prefix_hits_keep_it_right(assets):
    """Guided and unguided requests together (a guided one runs every other step): the unguided outputs equal a run
    without the guided ones; the guided ones equal each alone; then the same batch in a pool so small that sequences
    are preempted (and prompts repeat: prefix-cache hits) gives the same outputs."""
    tokenizer, teacher, _, _ = assets
    shared = "the cat and the dog went to the market with a fox and a bird, "  # two pages and more: cached
    prompts = [tokenizer(shared + t)["input_ids"] for t in ("one two", "a cat and a dog", "three", "a fox")]
    assert min(map(len, prompts)) > 16
    stop = [tokenizer.eos_token_id]
    plain = [dict(prompt=p, max_tokens=24, temperature=0.8, seed=i, logprobs=True, stop_token_ids=[])
             for i, p in enumerate(prompts)]

    def guided(p):
        return dict(prompt=p, max_tokens=100, grammar=structured.json_schema(tokenizer, SCHEMA),
                    stop_token_ids=stop)

    alone_plain = run(make_engine(teacher), plain)
    alone_guided = [run(make_engine(teacher), [guided(p)])[0] for p in prompts[:2]]
    for pool in (96, 24):
        eng = make_engine(teacher, num_pages=pool)
        mixed = run(eng, [plain[0], guided(prompts[0]), plain[1], plain[2], guided(prompts[1]), plain[3],
                          guided(prompts[0])])
        for got, want in zip([mixed[i] for i in (0, 2, 3, 5)], alone_plain):
            assert got.token_ids == want.token_ids
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
        for got, want in zip([mixed[1], mixed[4], mixed[6]], alone_guided + alone_guided[:1]):
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
            satisfies(json.loads(tokenizer.decode(got.token_ids)))
        assert eng.stats()["preemptions"] > 0 or pool == 96
        assert eng.stats()["prefix_cache_hits"] > 0


def test_the_engine_refuses_what_is_not_a_grammar_and_a_larger_tokenizer(assets):
    tokenizer, teacher, _, _ = assets
    eng = make_engine(teacher)
    with pytest.raises(ValueError, match="grammar must have fill"):
        eng.add_request([1, 2], grammar=object())
    small = sk.init(dataclasses.replace(teacher.config, vocab_size=len(tokenizer) - 8), 0)
    with pytest.raises(ValueError, match="more than the model's vocab_size"):
        make_engine(small).add_request([1, 2], grammar=structured.json_object(tokenizer))
    assert not eng._live_ids  # a refused request's id is free again


class _Failing:
    """A grammar that allows every token and fails (as llguidance past one of its parser's limits) at its third mask."""

    done = False

    def __init__(self):
        self.masks = 0

    def fill(self, row):
        self.masks += 1
        if self.masks == 3:
            raise RuntimeError("the JSON schema failed: lexer fuel exhausted")
        row[:] = -1

    def accept(self, token):
        pass


def test_a_grammar_that_fails_finishes_its_request_alone(assets):
    tokenizer, teacher, _, _ = assets
    prompt = tokenizer("hello there")["input_ids"]
    plain = dict(prompt=prompt, max_tokens=8, temperature=0.8, seed=1, stop_token_ids=[])
    want = run(make_engine(teacher), [plain])[0]
    failed, got = run(make_engine(teacher), [dict(prompt=prompt, max_tokens=8, grammar=_Failing()), plain])
    assert failed.finish_reason == "error" and "lexer fuel exhausted" in failed.error
    assert len(failed.token_ids) == 2  # the tokens of its first two masks
    assert got.token_ids == want.token_ids and got.finish_reason == "length"


# ---- the server ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(assets):
    tokenizer, _, _, root = assets
    engine = make_engine(sk.load(root / "teacher"), max_num_seqs=4)
    with serve_app(make_app(engine, tokenizer, "m", max_waiting=16)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "a person, as JSON"}]


def test_openai_client_json_schema_chat_whole_and_streamed_and_n(client):
    r = client.chat.completions.create(model="m", messages=MESSAGES, response_format=SCHEMA_FORMAT,
                                       max_tokens=MAX_TOKENS, temperature=0.9, seed=1, n=2)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        satisfies(json.loads(choice.message.content))
    chunks = client.chat.completions.create(model="m", messages=MESSAGES, response_format=SCHEMA_FORMAT,
                                            max_tokens=MAX_TOKENS, temperature=0.9, seed=1, stream=True)
    text, reasons = "", []
    for chunk in chunks:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    assert text == r.choices[0].message.content  # the same seed: the same text, streamed
    satisfies(json.loads(text))


def test_openai_client_json_object_and_completions(client):
    r = client.chat.completions.create(model="m", messages=MESSAGES, response_format={"type": "json_object"},
                                       max_tokens=200, temperature=0)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    r = client.completions.create(model="m", prompt="a person:", max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"response_format": SCHEMA_FORMAT})
    assert r.choices[0].finish_reason == "stop"
    satisfies(json.loads(r.choices[0].text))
    r = client.chat.completions.create(model="m", messages=MESSAGES, response_format={"type": "text"}, max_tokens=3)
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "nonsense"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "nowhere"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name must be a string"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "yaml"}, "must be an object whose type is one of"),
    ("json", "must be an object whose type is one of"),
])
def test_bad_response_formats_are_400s_naming_the_field(client, response_format, message):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4,
                                       extra_body={"response_format": response_format})
    assert e.value.body["param"] == "response_format" and message in e.value.body["message"]


def test_without_llguidance_structured_output_is_a_400_saying_how_to_install_it(client, monkeypatch):
    openai = pytest.importorskip("openai")
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ImportError
    assert not structured.available()
    for param, extra in [("response_format", {"response_format": SCHEMA_FORMAT}),
                         ("response_format", {"response_format": {"type": "json_object"}}),
                         ("structured_outputs", {"structured_outputs": {"regex": "a+"}}),
                         ("structured_outputs", {"structured_outputs": {"json": SCHEMA}}),
                         ("guided_choice", {"guided_choice": ["a", "b"]})]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == param and "pip install llguidance" in e.value.body["message"]
        assert e.value.body["code"] == "unsupported_parameter"
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)  # the rest still serves
    assert r.choices[0].finish_reason == "length"


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


def check_call(call) -> None:
    """A forced call: one of the tools, its arguments a JSON string satisfying the tool's parameters."""
    arguments = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    if call.function.name == "clock":
        assert arguments == {}
    else:
        assert call.function.name == "weather" and set(arguments) == {"city", "days"}
        assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 5 and 1 <= arguments["days"] <= 7


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_tool_choice_required_and_named_force_calls(client, stream):
    """tool_choice "required" (a JSON array of calls, one with parallel_tool_calls false) and a named function (its
    arguments), by guided decoding, without a server tool-call parser: tool_calls, finish_reason "tool_calls" for
    "required" and "stop" for a named function (vLLM's and OpenAI's), whole or streamed (the openai client's
    accumulated stream state)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    def ask(**extra):
        request = dict(model="m", messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=MAX_TOKENS, temperature=0.8,
                       seed=3, **extra)
        if not stream:
            return client.chat.completions.create(**request).choices[0]
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(stream=True, **request):
            state.handle_chunk(chunk)
        return state.current_completion_snapshot.choices[0]

    required = ask(tool_choice="required", parallel_tool_calls=False)
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    assert not required.message.content
    check_call(required.message.tool_calls[0])
    named = ask(tool_choice={"type": "function", "function": {"name": "weather"}})
    assert named.finish_reason == "stop" and len(named.message.tool_calls) == 1 and not named.message.content
    assert named.message.tool_calls[0].function.name == "weather"
    check_call(named.message.tool_calls[0])


def test_tool_choice_refusals(client):
    openai = pytest.importorskip("openai")
    for extra, words in [(dict(tool_choice="required"), "needs tools"),
                         (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "clock"}}),
                          "not among the tools (weather)"),
                         (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
                          "takes no response_format")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, **extra)
        assert words in e.value.body["message"], e.value.body


# ---- vLLM's structured_outputs and its older guided_* fields ---------------------------------------------------------
CHOICES = ["red apple", "green", "blue sky"]
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
GBNF = 'root ::= answer ("," answer)? ("," answer)?\nanswer ::= "yes" | "no"'
GBNF_TEXT = r"(yes|no)(,(yes|no)){0,2}"
LARK = 'start: NUM (OP NUM)?\nNUM: /[0-9]{1,2}/\nOP: "+" | "-" | "*"'
LARK_TEXT = r"[0-9]{1,2}([-+*][0-9]{1,2})?"


def guided_texts(client, extra: dict, n: int = 2, max_tokens: int = 24) -> list[str]:
    """Chat (n choices, sampled) and completions (a sampled and a greedy one) under `extra`: every output text, each
    of which finished because its grammar did."""
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=max_tokens, temperature=1.0, seed=5,
                                       n=n, extra_body=extra)
    texts = [c.message.content for c in r.choices]
    reasons = [c.finish_reason for c in r.choices]
    for temperature in (1.0, 0.0):
        r = client.completions.create(model="m", prompt="an answer:", max_tokens=max_tokens, temperature=temperature,
                                      seed=7, extra_body=extra)
        texts.append(r.choices[0].text)
        reasons.append(r.choices[0].finish_reason)
    assert reasons == ["stop"] * len(texts), (reasons, texts)
    return texts


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}])
def test_choice_outputs_exactly_one_of_the_choices(client, extra):
    texts = guided_texts(client, extra, n=3)
    assert all(text in CHOICES for text in texts), texts


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": REGEX}},
                                   {"guided_regex": REGEX, "guided_decoding_backend": "guidance"}])
def test_regex_outputs_match_it_whole(client, extra):
    texts = guided_texts(client, extra)
    assert all(re.fullmatch(REGEX, text) for text in texts), texts


@pytest.mark.parametrize("grammar, pattern", [(GBNF, GBNF_TEXT), (LARK, LARK_TEXT)], ids=["gbnf", "lark"])
@pytest.mark.parametrize("field", ["structured_outputs", "guided_grammar"])
def test_gbnf_and_lark_grammars(client, grammar, pattern, field):
    extra = {"structured_outputs": {"grammar": grammar}} if field == "structured_outputs" else {field: grammar}
    texts = guided_texts(client, extra)
    assert all(re.fullmatch(pattern, text) for text in texts), texts


def test_json_by_structured_outputs_and_guided_json_and_whitespace(client, assets):
    """structured_outputs.json (an object or its JSON text) and guided_json give the same JSON as response_format's
    json_schema (the same seed: the same grammar, the same text); disable_any_whitespace false (JSON's whitespace: a
    random model wanders off into blanks, so here its whitespace-only tokens are biased away) and a
    whitespace_pattern still give valid JSON, the pattern's spaces in it."""
    tokenizer = assets[0]
    blanks = [i for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()][:300]

    def ask(**extra):
        r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.9,
                                           seed=2, extra_body=extra)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return r.choices[0].message.content

    want = ask(response_format=SCHEMA_FORMAT)
    satisfies(json.loads(want))
    assert json.dumps(json.loads(want), separators=(",", ":"), ensure_ascii=False) == want  # compact by default
    assert ask(structured_outputs={"json": SCHEMA}) == want
    assert ask(structured_outputs={"json": json.dumps(SCHEMA), "disable_any_whitespace": True,
                                   "disable_fallback": True}) == want
    assert ask(guided_json=SCHEMA, guided_decoding_backend="auto") == want
    satisfies(json.loads(ask(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False},
                             logit_bias={str(i): -100 for i in blanks})))
    for extra in ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
                  {"guided_json": SCHEMA, "guided_whitespace_pattern": " "}):
        text = ask(**extra)
        satisfies(json.loads(text))
        assert text.startswith("{ ") and ", " in text and ": " in text, text


def test_disable_any_whitespace_false_allows_jsons_whitespace(assets):
    """The grammar of disable_any_whitespace false takes spaced JSON, the default's (compact) does not."""
    from swiftkv_jax.serving.http import protocol

    tokenizer = assets[0]
    spaced = '{\n  "name": "ab",\n  "age": 3, "color": "red", "tags": [ ]\n}'
    ids = tokenizer(spaced, add_special_tokens=False)["input_ids"]
    for option, accepted in [({"disable_any_whitespace": False}, True), ({}, False),
                             ({"disable_any_whitespace": True}, False)]:
        job = protocol.parse_completion({"model": "m", "prompt": "hi", "structured_outputs": {"json": SCHEMA,
                                                                                              **option}}, tokenizer)
        try:
            for t in ids:
                job.grammar.accept(t)
        except RuntimeError:
            assert not accepted, option
        else:
            assert accepted and job.grammar.accepting, option


def test_the_field_that_set_the_grammar_names_its_engine_errors(assets):
    """Job.param maps the engine's "grammar" to the field the client used."""
    from swiftkv_jax.serving.http import protocol

    tokenizer = assets[0]
    for extra, field in [({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
                         ({"guided_choice": ["x"]}, "guided_choice"),
                         ({"response_format": {"type": "json_object"}}, "response_format")]:
        job = protocol.parse_completion({"model": "m", "prompt": "hi", **extra}, tokenizer)
        assert job.grammar is not None and job.param("grammar") == field
    job = protocol.parse_chat({"model": "m", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"},
                              tokenizer)
    assert job.param("grammar") == "tool_choice"


TOOLS = {"tools": [WEATHER], "tool_choice": "required"}


@pytest.mark.parametrize("extra, param, words", [
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of json, regex, choice, grammar, json_object"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"], "grammar": None}}, "structured_outputs",
     "exactly one of json, regex, choice, grammar, json_object, got regex, choice"),
    ({"structured_outputs": "a+"}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"structural_tag": '{"structures": []}'}}, "structured_outputs", "not supported here"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs", "got 'backend'"),
    ({"structured_outputs": {"regex": "[a-c"}}, "structured_outputs", "unclosed character class"),
    ({"structured_outputs": {"regex": "a(?=b)"}}, "structured_outputs", "look-around"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", 'unknown name: "foo"'),
    ({"structured_outputs": {"grammar": 'root ::= ("yes"'}}, "structured_outputs", "GBNF"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not JSON"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs", "nonsense"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs", "structured_outputs.json must be a JSON schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list of strings"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs", "non-empty list of strings"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "json_object must be true"),
    ({"structured_outputs": {"json_object": True, "disable_additional_properties": True}}, "structured_outputs",
     '"additionalProperties": false'),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}}, "structured_outputs",
     "disable_any_whitespace must be true or false"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
     "applies to JSON only"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " ", "disable_any_whitespace": True}},
     "structured_outputs", "send one"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": "[ "}}, "structured_outputs",
     "unclosed character class"),
    ({"guided_regex": "[a-c"}, "guided_regex", "unclosed character class"),
    ({"guided_grammar": "start: foo"}, "guided_grammar", 'unknown name: "foo"'),
    ({"guided_json": {"type": "nonsense"}}, "guided_json", "nonsense"),
    ({"guided_choice": "yes"}, "guided_choice", "guided_choice must be a non-empty list of strings"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend",
     "this server guides with llguidance"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "both constrain the output"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "applies to JSON only"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "applies to guided_json only"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex",
     "guided_regex and structured_outputs both constrain the output"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "b"}}, "structured_outputs",
     "structured_outputs and response_format both constrain the output"),
    ({"response_format": SCHEMA_FORMAT, "guided_json": SCHEMA}, "guided_json", "both constrain the output"),
    ({**TOOLS, "structured_outputs": {"regex": "b"}}, "structured_outputs", "takes no structured_outputs"),
    ({**TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}}, "guided_choice": ["a"]},
     "guided_choice", "takes no guided_choice"),
])
def test_structured_outputs_refusals_are_400s_naming_the_field(client, extra, param, words):
    """On chat, and on completions too where the request is not a chat one (tools)."""
    openai = pytest.importorskip("openai")
    calls = [lambda: client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, extra_body=extra)]
    if "tools" not in extra:
        calls.append(lambda: client.completions.create(model="m", prompt="hi", max_tokens=4, extra_body=extra))
    for call in calls:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body
        unsupported = "not supported here" in words or "additionalProperties" in words or "guides with" in words
        assert (e.value.body["code"] == "unsupported_parameter") == unsupported, e.value.body

"""Structured outputs (guided decoding with llguidance) in `sk.Engine` and the OpenAI server: a random tiny model's
outputs under a JSON schema parse and satisfy it (llguidance's own matcher replaying the tokens, and `jsonschema` or
a check by hand); the masked greedy token is the argmax over the allowed ids of the model's full-forward logits
(`sk.logits`, numpy, llguidance's mask), padding ids past the tokenizer never allowed; unguided requests in a mixed
batch are unchanged; preemption and prefix-cache hits; the official `openai` client against a real server on
127.0.0.1 (chat and completions, json_schema and json_object, whole and streamed, n = 2); bad schemas and a server
without llguidance give 400s naming response_format. CPU, fp32."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time

import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.data.chat import load_tokenizer
from swiftkv_jax.serving import structured
from swiftkv_jax.serving.http.routes import make_app
from swiftkv_jax.tiny_assets import make_tiny_assets

from server_process import free_port

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
    import uvicorn

    tokenizer, _, _, root = assets
    engine = make_engine(sk.load(root / "teacher"), max_num_seqs=4)
    app = make_app(engine, tokenizer, "m", max_waiting=16)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


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
    for fmt in (SCHEMA_FORMAT, {"type": "json_object"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, response_format=fmt)
        assert e.value.body["param"] == "response_format" and "pip install llguidance" in e.value.body["message"]
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

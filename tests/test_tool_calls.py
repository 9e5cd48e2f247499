"""Tool calling on /v1/chat/completions, as vLLM's `--enable-auto-tool-choice --tool-call-parser llama3_json|hermes`.

The parsers on model outputs from vLLM's own parser tests; a stream, split anywhere, sends exactly what the whole
response holds; the request side (tools, assistant tool calls, tool results) through a Llama 3.1 JSON tool template
renders what transformers' apply_chat_template renders; and one server with the parser, driven by the openai client
through a multi-turn tool conversation (a random model writes no call: its text comes back as content).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from swiftkv_jax.data.chat import load_tokenizer
from swiftkv_jax.infer_cli import _tool_parser, parser
from swiftkv_jax.serving.http.protocol import RequestError, parse_chat
from swiftkv_jax.serving.http.responses import Choice, Chunks, TokenStrings, whole
from swiftkv_jax.serving.http.tool_calls import ToolText, parse
from swiftkv_jax.tiny_assets import make_tiny_assets

from server_process import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = Path(__file__).parent / "data" / "llama3.1_json_tools.jinja"
MODEL = "tiny-tools"
TOOLS = [{"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}]
# a user question, the assistant's call (OpenAI's format: arguments a JSON string, content null), the tool's result
CONVERSATION = [
    {"role": "user", "content": "What's the weather like in Boston?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "chatcmpl-tool-1", "type": "function", "function": {
        "name": "get_current_weather", "arguments": '{"location": "Boston, MA", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": 'It is 22 "C" and sunny\nin Boston.'}]


def _calls(calls) -> list:
    """Tool calls without their (random) ids."""
    return [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---- the parsers -----------------------------------------------------------------------------------------------------
# (parser, model output, content, calls). The llama3_json outputs are vLLM's
# tests/entrypoints/openai/tool_parsers/test_llama3_json_tool_parser.py's, the hermes ones its
# test_hermes_tool_parser.py's (vllm-project/vllm), with vLLM's answers except where marked.
Q1 = ("searchTool", {"query": "test1"})
OUTPUTS = [
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}', None,
     [("searchTool", {"query": "test query", "limit": 10})]),
    ("llama3_json", '{"name": "searchTool", "arguments": {"query": "test"}}', None,
     [("searchTool", {"query": "test"})]),
    ("llama3_json", "This is just some text without any tool calls", "This is just some text without any tool calls",
     []),
    ("llama3_json", '{"name": "invalidTool", "parameters": {invalid json}', '{"name": "invalidTool", "parameters": '
                                                                          '{invalid json}', []),
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test1"}}; {"name": "getOpenIncidentsTool", '
                    '"parameters": {}}; {"name": "searchTool", "parameters": {"query": "test2"}}', None,
     [Q1, ("getOpenIncidentsTool", {}), ("searchTool", {"query": "test2"})]),
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test1"}} ; {"name": "getOpenIncidentsTool", '
                    '"parameters": {}} ; {"name": "searchTool", "parameters": {"query": "test2"}}', None,
     [Q1, ("getOpenIncidentsTool", {}), ("searchTool", {"query": "test2"})]),
    # vLLM's non-streaming parser takes these calls after leading text; its streaming parser (and so ours) does not
    ("llama3_json", 'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know '
                    'more?', 'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to '
                             'know more?', []),
    # ours besides: <|python_tag|>, nesting deeper than vLLM's regex reaches, text after the calls dropped, no name
    ("llama3_json", ' <|python_tag|>{"name": "f", "parameters": {"a": {"b": [{"c": 1}]}}}; {"name": "g", '
                    '"parameters": {}} Anything else?', None, [("f", {"a": {"b": [{"c": 1}]}}), ("g", {})]),
    ("llama3_json", '{"a": 1} is JSON', '{"a": 1} is JSON', []),
    ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "param', '{"name": "f", "parameters": {}}; '
                                                                           '{"name": "g", "param', []),
    ("hermes", "This is not a tool call.", "This is not a tool call.", []),
    ("hermes", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>', None,
     [("final_answer", {"trigger": True})]),
    ("hermes", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}', None,
     [("final_answer", {"trigger": True})]),  # unclosed, until the EOS
    ("hermes", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}', '<tool_call>\n{"name": '
                                                                                     '"final_answer", "arguments": '
                                                                                     '{"trigger": true}', []),
    ("hermes", '<tool_call>{"name": "get_current_temperature","arguments": {"location":"San Francisco, California, '
               'United States", "unit": "celsius"}}</tool_call>', None, [("get_current_temperature", {
                   "location": "San Francisco, California, United States", "unit": "celsius"})]),
    # ours: the text before the first call is the content (vLLM's rule), two calls
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
               '{"name": "g", "arguments": {}}\n</tool_call>', "Let me check.\n", [("f", {"x": 1}), ("g", {})]),
    ("hermes", 'a <tool_call>{"name": "f"}</tool_call>', 'a <tool_call>{"name": "f"}</tool_call>', []),
]


@pytest.mark.parametrize("name, output, content, calls", OUTPUTS)
def test_parsers_find_the_calls_vllm_finds(name, output, content, calls):
    got_content, got_calls = parse(name, output)
    assert got_content == content
    assert _calls(got_calls) == [("function", n, args) for n, args in calls]
    assert all(c["id"].startswith("chatcmpl-tool-") and len(c["id"]) == 14 + 32 for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


def _stream(name: str, pieces) -> tuple[str, object, list]:
    """What a stream of `pieces` sends as content (all of it), and the response's content and calls."""
    tools = ToolText(name)
    sent = "".join(tools.add(p) for p in pieces)
    rest, content, calls = tools.finish()
    return sent + rest, content, calls


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(OUTPUTS + [("hermes", "<tool_c", "<tool_c", []), ("llama3_json", "  <|pyth", "  <|pyth",
                                                                             []), ("llama3_json", "", "", [])]),
       cuts=st.lists(st.integers(0, 200), max_size=8))
def test_a_stream_split_anywhere_sends_what_the_whole_response_holds(case, cuts):
    name, output, content, calls = case
    bounds = sorted({0, len(output), *(c for c in cuts if c < len(output))})
    sent, got_content, got_calls = _stream(name, [output[a:b] for a, b in zip(bounds, bounds[1:])])
    assert got_content == content and _calls(got_calls) == _calls(parse(name, output)[1])
    assert sent == (content or "")  # the content, and nothing of a call


def test_a_stream_sends_text_while_it_cannot_be_a_call():
    tools = ToolText("hermes")
    assert [tools.add(p) for p in ["Let", " me <", "tool", "_c", "all>{", '"name"']] == ["Let", " me ", "", "", "", ""]
    tools = ToolText("hermes")
    assert [tools.add(p) for p in ["a <", "b"]] == ["a ", "<b"]  # not a tag after all
    tools = ToolText("llama3_json")
    assert [tools.add(p) for p in ["\n ", " Sure", ", {"]] == ["", "\n  Sure", ", {"]
    tools = ToolText("llama3_json")
    assert [tools.add(p) for p in [" ", "<|py", "thon_tag|>", '{"name"']] == ["", "", "", ""]


# ---- the request -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tiny Llama and its tokenizer with the Llama 3.1 JSON tool template (a copy, for --tokenizer)."""
    root = make_tiny_assets(tmp_path_factory.mktemp("tools"), num_examples=200)
    tokenizer = load_tokenizer(str(root / "teacher"))
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(root / "tool_tokenizer")
    return root


@pytest.fixture(scope="module")
def tokenizer(assets):
    return load_tokenizer(str(assets / "tool_tokenizer"))


def _as_template_takes_them(messages) -> list:
    """OpenAI's messages as transformers' tool templates take them (and vLLM passes them): arguments as dicts."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def _template_ids(tokenizer, messages) -> list:
    return tokenizer.apply_chat_template(_as_template_takes_them(messages), tools=TOOLS, add_generation_prompt=True,
                                         return_dict=True)["input_ids"]


def test_tools_and_tool_turns_render_as_transformers_renders_them(tokenizer):
    job = parse_chat(dict(messages=CONVERSATION, tools=TOOLS), tokenizer, tool_parser="llama3_json")
    want = _template_ids(tokenizer, CONVERSATION)
    assert job.prompts == [want] and job.tool_parser == "llama3_json"
    text = job.prompt_texts[0]
    assert '"name": "get_current_weather"' in text and '"parameters": {"location": "Boston, MA"' in text
    assert '{"output": "It is 22 \\"C\\" and sunny\\nin Boston."}' in text  # a tool result, JSON-escaped
    # tool_choice "none": the tools are still in the prompt (vLLM's default), the output is not parsed
    none = parse_chat(dict(messages=CONVERSATION, tools=TOOLS, tool_choice="none"), tokenizer)
    assert none.prompts == [want] and none.tool_parser is None
    # a malformed arguments string is {} to the template (as vLLM's), and an echoed response message's nulls pass
    bad = [CONVERSATION[0], dict(CONVERSATION[1], refusal=None, audio=None, function_call=None, tool_calls=[
        dict(CONVERSATION[1]["tool_calls"][0], function=dict(name="get_current_weather", arguments="{oops"))])]
    assert '"parameters": {}}' in parse_chat(dict(messages=bad, tools=TOOLS), tokenizer, tool_parser="hermes"
                                             ).prompt_texts[0]


def test_content_parts_join_as_vllm_joins_them(tokenizer):
    """A message's list of text parts (a tool result, a user turn) is one string of the parts joined by newlines, as
    vLLM hands it to the template."""
    parts = lambda *texts: [{"type": "text", "text": t} for t in texts]  # noqa: E731
    joined = [dict(CONVERSATION[0], content="What's the weather\nlike in Boston?"), CONVERSATION[1],
              dict(CONVERSATION[2], content="22 C\nsunny")]
    split = [dict(CONVERSATION[0], content=parts("What's the weather", "like in Boston?")), CONVERSATION[1],
             dict(CONVERSATION[2], content=parts("22 C", "sunny"))]
    job = parse_chat(dict(messages=split, tools=TOOLS), tokenizer, tool_parser="llama3_json")
    assert job.prompts == [_template_ids(tokenizer, joined)]


def test_a_template_without_tool_calls_is_refused_not_silently_dropped(assets):
    plain = load_tokenizer(str(assets / "teacher"))  # Llama 3's plain chat format: no tool_calls in it
    with pytest.raises(RequestError, match=r"does not render messages\[1\].*tool calls") as e:
        parse_chat(dict(messages=CONVERSATION, tools=TOOLS), plain, tool_parser="llama3_json")
    assert e.value.param == "messages[1].tool_calls"
    job = parse_chat(dict(messages=[CONVERSATION[0]], tools=TOOLS), plain, tool_parser="hermes")  # tools unused
    assert job.tool_parser == "hermes"


BAD_REQUESTS = [
    (dict(tools=TOOLS), None, "tools", "--enable-auto-tool-choice and --tool-call-parser"),
    (dict(tools=TOOLS, tool_choice="auto"), None, "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
    (dict(tool_choice="required"), "hermes", "tool_choice", "needs tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}), "hermes",
     "tool_choice", "not among the tools (get_current_weather)"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "name": "get_current_weather"}), None, "tool_choice",
     "a named tool_choice must be"),
    (dict(tools=TOOLS, tool_choice="always"), "hermes", "tool_choice", "tool_choice must be"),
    (dict(tools={"type": "function"}), "hermes", "tools", "tools must be a list"),
    (dict(tools=[TOOLS[0], TOOLS[0], {"type": "function", "function": {"description": "x"}}]), "hermes",
     "tools[2].function.name", "must be a non-empty string"),
    (dict(tools=[{"type": "retrieval"}]), "hermes", "tools[0].type", "only function tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "hermes",
     "tools[0].function.parameters", "a JSON Schema object"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "returns": {}}}]), "hermes", "tools[0].function",
     "unknown fields: returns"),
    (dict(tools=TOOLS, parallel_tool_calls="yes"), "hermes", "parallel_tool_calls", "true or false"),
    (dict(messages=[CONVERSATION[0], dict(CONVERSATION[1], tool_calls=[{"type": "function", "function": {
        "name": "f", "arguments": 5}}])]), "hermes", "messages[1].tool_calls[0].function.arguments", "a JSON string"),
    (dict(messages=[CONVERSATION[0], dict(CONVERSATION[1], tool_calls=[{"function": {}}])]), "hermes",
     "messages[1].tool_calls[0].function.name", "non-empty string"),
    (dict(messages=[CONVERSATION[0], dict(CONVERSATION[2], tool_call_id=7)]), "hermes", "messages[1].tool_call_id",
     "non-empty string"),
    (dict(messages=[dict(CONVERSATION[0], tool_call_id="x")]), "hermes", "messages[0]", "not support: tool_call_id"),
]


@pytest.mark.parametrize("body, server_parser, param, words", BAD_REQUESTS)
def test_bad_tool_requests_get_a_400_naming_the_field(tokenizer, body, server_parser, param, words):
    with pytest.raises(RequestError) as e:
        parse_chat(dict(dict(messages=CONVERSATION), **body), tokenizer, tool_parser=server_parser)
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message, e.value.message


def test_without_tools_tool_choice_none_and_auto_change_nothing(tokenizer):
    plain = parse_chat(dict(messages=[CONVERSATION[0]]), tokenizer)
    for extra in (dict(tool_choice="none"), dict(tool_choice="auto"), dict(tools=[], tool_choice="auto"),
                  dict(parallel_tool_calls=False)):
        job = parse_chat(dict(messages=[CONVERSATION[0]], **extra), tokenizer)
        assert job.prompts == plain.prompts and job.tool_parser is None


def test_serve_flags_are_vllms():
    args = lambda *more: parser().parse_args(["serve", "--model", "m", *more])
    assert _tool_parser(args("--enable-auto-tool-choice", "--tool-call-parser", "hermes")) == "hermes"
    assert _tool_parser(args("--tool-call-parser", "llama3_json")) is None  # the parser alone: auto is refused
    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        _tool_parser(args("--enable-auto-tool-choice"))
    with pytest.raises(SystemExit):
        args("--enable-auto-tool-choice", "--tool-call-parser", "mistral")


def _respond(tokenizer, name: str, text: str, finish: str, n: int = 2):
    """The whole response and the stream's accumulation (the openai client's) of `text` generated for each of `n`
    choices, its tokens arriving two at a time, through the route's shaping (Choice.to_send, whole, Chunks)."""
    job = parse_chat(dict(messages=CONVERSATION[:1], tools=TOOLS, n=n, logprobs=True, stream=True), tokenizer,
                     tool_parser=name)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    choices = [Choice(k, 0, job.prompts[0], tokenizer, [], True, job.tool_parser) for k in range(n)]
    chunks = Chunks(job, choices, dict(id="chatcmpl-1", created=0, model=MODEL), TokenStrings(tokenizer))
    events = [chunks.opening(c) for c in choices]
    for at in range(0, len(ids), 2):
        for c in choices:
            rows = [(t, -1.0, {}, 0) for t in ids[at:at + 2]]
            c.tokens.extend(ids[at:at + 2])
            c.logprobs.extend(rows)
            delta = c.text.add(ids[at:at + 2])
            if at + 2 >= len(ids):
                c.finish_reason, c.done = finish, True
                delta += c.text.finish()
            events.append(chunks.piece(c, c.to_send(delta), rows, c.finish_reason if c.done else None, c.tool_calls))
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(event.removeprefix("data: "))))
    return whole(job, choices, chunks.base, chunks.strings), state.current_completion_snapshot


@pytest.mark.parametrize("name, text, content", [
    ("llama3_json", '{"name": "get_current_weather", "parameters": {"location": "Boston, MA"}}', None),
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Boston, MA"}}\n'
               '</tool_call>', "Checking.\n")])
def test_a_call_comes_back_whole_or_streamed_as_the_openai_client_reads_it(tokenizer, name, text, content):
    body, snapshot = _respond(tokenizer, name, text, "stop")
    for k, (whole_choice, streamed) in enumerate(zip(body["choices"], snapshot.choices)):
        message = whole_choice["message"]
        assert (message["content"], whole_choice["finish_reason"], streamed.finish_reason) == (
            content, "tool_calls", "tool_calls")
        assert _calls(message["tool_calls"]) == [("function", "get_current_weather", {"location": "Boston, MA"})]
        assert [c.model_dump(exclude_none=True) for c in streamed.message.tool_calls] == [
            dict(c, index=0) for c in message["tool_calls"]]
        assert (streamed.message.content or None) == content  # the stream's role chunk opens with content ""
        assert len(whole_choice["logprobs"]["content"]) == len(streamed.logprobs.content) == len(
            tokenizer(text, add_special_tokens=False)["input_ids"])
    assert body["choices"][0]["message"]["tool_calls"][0]["id"] != body["choices"][1]["message"]["tool_calls"][0]["id"]


def test_text_that_is_no_call_comes_back_as_content(tokenizer):
    text = '{"name": "get_current_weather", "parameters": {"location": "Bos'  # cut by max_tokens
    body, snapshot = _respond(tokenizer, "llama3_json", text, "length", n=1)
    assert body["choices"][0]["message"] == dict(role="assistant", content=text, refusal=None, tool_calls=[])
    assert snapshot.choices[0].message.content == text and snapshot.choices[0].finish_reason == "length"
    assert not snapshot.choices[0].message.tool_calls


# ---- a server with the parser ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(assets, tmp_path_factory):
    port, log_path = free_port(), tmp_path_factory.mktemp("log") / "server.log"
    argv = [sys.executable, str(REPO / "infer.py"), "serve", "--model", str(assets / "teacher"), "--tokenizer",
            str(assets / "tool_tokenizer"), "--port", str(port), "--served-model-name", MODEL, "--cache-dtype",
            "float32", "--page-size", "8", "--num-pages", "400", "--max-num-seqs", "4", "--max-num-batched-tokens",
            "512", "--single-buckets", "4", "--prompt-buckets", "512", "--max-model-len", "1536",
            "--generation-config", "vllm", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, url, log_path, timeout=240)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_tool_conversation_through_the_openai_client(server, tokenizer):
    """The conversation's prompt is transformers' rendering (vLLM's /tokenize with tools, and usage); the model's
    plain text comes back as content, streamed or not, with finish_reason stop or length; refusals are 400s."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    want = _template_ids(tokenizer, CONVERSATION)
    tokenized = httpx.post(f"{server}/tokenize", json=dict(model=MODEL, messages=CONVERSATION, tools=TOOLS), timeout=60)
    assert tokenized.json()["tokens"] == want
    first = client.chat.completions.create(model=MODEL, messages=CONVERSATION[:1], tools=TOOLS, max_tokens=8,
                                           temperature=0, n=2, logprobs=True)
    assert first.usage.prompt_tokens == len(_template_ids(tokenizer, CONVERSATION[:1]))
    answer = client.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=TOOLS, tool_choice="auto",
                                            max_tokens=8, temperature=0, parallel_tool_calls=True)
    assert answer.usage.prompt_tokens == len(want)
    for choice in first.choices + answer.choices:  # a random model writes no tool call
        assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls == []
        assert choice.message.content == parse("llama3_json", choice.message.content)[0]
    assert len(first.choices[0].logprobs.content) == first.usage.completion_tokens // 2
    state = ChatCompletionStreamState()  # what the openai client's stream helpers accumulate
    for chunk in client.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=TOOLS, max_tokens=8,
                                                temperature=0, stream=True):
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]
    assert streamed.message.content == answer.choices[0].message.content
    assert streamed.finish_reason == answer.choices[0].finish_reason and not streamed.message.tool_calls
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=TOOLS, tool_choice={
            "type": "function", "function": {"name": "f"}})
    assert e.value.body["param"] == "tool_choice" and "not among the tools" in e.value.body["message"]

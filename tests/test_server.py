"""`python infer.py serve` end to end: one server process on a tiny SwiftKV student (CPU, fp32), driven over real
sockets on 127.0.0.1 by the official `openai` client and by httpx.

Greedy outputs equal `sk.generate` on each prompt alone; 64 concurrent streams, a quarter of them hung up early,
leave every finished stream complete and the page pool full; bad input gets an OpenAI error object with its status;
/metrics parses and counts what was sent; SIGTERM exits 0 within the grace period. The server is started once for
the module (the last test stops it).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import swiftkv_jax as sk
from swiftkv_jax.checkpoints.sidecar import read_sidecar_files
from swiftkv_jax.data.chat import load_tokenizer
from swiftkv_jax.evaluation.harness import render_context
from swiftkv_jax.infer_cli import main
from swiftkv_jax.serving.http.protocol import RequestError, parse_chat, parse_completion, sampling_defaults
from swiftkv_jax.serving.http.responses import TokenStrings
from swiftkv_jax.serving.http.text import ChoiceText
from swiftkv_jax.tiny_assets import make_tiny_assets

from conftest import xla_flags
from server_process import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-swiftkv"
ALIAS = "gpt-3.5-turbo"  # a second --served-model-name, as deployments alias a model to the name their clients use
MAX_MODEL_LEN, MAX_SEQS, MAX_WAITING, GRACE = 128, 16, 64, 8
REF_TOKENS = 16   # every reference is 16 greedy tokens; a shorter request gets a prefix of it
PROMPTS = ["What is 4 + 5?", "Sort these words: fig apple pear", "Repeat 'owl' 2 times.", "Count from 3 to 9."]
# the server's --generation-config DIR: what a request that omits these fields gets (every other test names its
# temperature, and chat's max_tokens, or does not depend on them)
GENERATION = {"temperature": 0.0, "top_p": 0.95, "top_k": 40, "max_new_tokens": 5, "repetition_penalty": 1.1,
              "min_p": 0.05}
# ... less its repetition_penalty, which the server would apply to every request that omits it (the references are
# sk.generate's unpenalised greedy tokens; `test_generation_config_sets_what_an_omitted_field_gets` checks it), and
# with a max_new_tokens of the whole context, as it caps every request (test_server_limits checks the cap)
SERVED_GENERATION = {**{k: v for k, v in GENERATION.items() if k != "repetition_penalty"},
                     "max_new_tokens": MAX_MODEL_LEN}


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    root = make_tiny_assets(tmp_path_factory.mktemp("serve"), num_examples=200)
    model = sk.to_swiftkv(sk.load(root / "teacher"), 2, 1)
    sk.save(model, root / "student", "hf", extra_files=read_sidecar_files(root / "teacher"))
    return root


@pytest.fixture(scope="module")
def tokenizer(student):
    return load_tokenizer(str(student / "student"))


@pytest.fixture(scope="module")
def server(student, tokenizer, reference, tmp_path_factory):
    """`python infer.py serve` in a subprocess (the references are computed while it warms up); yields a handle
    with .url, .proc and .log. It serves tensor-parallel over 2 CPU devices: every answer is checked against
    `sk.generate` on one device (the engine on one device is `test_continuous_engine`'s)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    generation = tmp_path_factory.mktemp("generation")
    (generation / "generation_config.json").write_text(json.dumps(SERVED_GENERATION))
    env = dict(os.environ, XLA_FLAGS=xla_flags(2), JAX_PLATFORMS="cpu")
    argv = [sys.executable, str(REPO / "infer.py"), "serve", "--model", str(student / "student"), "--port", str(port),
            "--served-model-name", MODEL, ALIAS, "--cache-dtype", "float32", "--page-size", "8", "--num-pages", "257",
            "--max-num-seqs", str(MAX_SEQS), "--max-num-batched-tokens", "64", "--single-buckets", str(MAX_SEQS),
            "--prompt-buckets", "64", "--max-model-len", str(MAX_MODEL_LEN), "--max-waiting", str(MAX_WAITING),
            "--shutdown-grace", str(GRACE), "--tensor-parallel", "2", "--generation-config", str(generation)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        for text in PROMPTS:
            reference(tokenizer(text)["input_ids"])
            reference(_chat_ids(tokenizer, text))
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, url, log_path, timeout=180)
        yield type("Server", (), dict(url=url, proc=proc, log=log_path))()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(student, tokenizer):
    """reference(prompt ids, n) -> (the first n greedy tokens of sk.generate alone, their logprobs, their text)."""
    model = sk.load(student / "student")
    stops = [tokenizer.eos_token_id]

    @functools.lru_cache(maxsize=None)
    def alone(ids: tuple):
        out = sk.generate(model, [list(ids)], REF_TOKENS, cache_dtype="float32", stop_token_ids=stops, logprobs=True,
                          max_len=MAX_MODEL_LEN)
        return out.tokens[0], out.logprobs[0]

    def get(ids, n: int = REF_TOKENS):
        tokens, logprobs = alone(tuple(ids))
        tokens, logprobs = tokens[:n], logprobs[:n]
        return tokens, logprobs, tokenizer.decode(tokens, skip_special_tokens=True)

    return get


def _reason(tokens, tokenizer, n):
    return "stop" if tokens and tokens[-1] == tokenizer.eos_token_id and len(tokens) <= n else "length"


def _chat_ids(tokenizer, text):
    return render_context(tokenizer, text, True)  # what `infer.py generate --chat` runs


def _metrics(url) -> dict:
    """{(sample name, sorted labels): value} from /metrics, through prometheus_client's parser."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _wait_idle(url, timeout=20.0) -> dict:
    """Poll /metrics until nothing runs, waits or holds a page (bounded); returns the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        idle = (m[("swiftkv_num_requests_running", ())] == 0 and m[("swiftkv_num_requests_waiting", ())] == 0
                and m[("swiftkv_num_requests_in_flight", ())] == 0
                and m[("swiftkv_kv_pages_free", ())] == m[("swiftkv_kv_pages_total", ())])
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# ---- text as tokens arrive (no server) -------------------------------------------------------------------------------
def test_text_streams_whole_characters_and_cuts_at_stop_strings(tokenizer):
    text = "Café ☃ naïve 日本語 done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "some token should hold part of a character"
    for prompt in ([], tokenizer("Hi there")["input_ids"]):
        choice = ChoiceText(tokenizer, prompt, ["done!"])  # never matches, but "done" is held back until the end
        pieces = [choice.add([t]) for t in ids]
        assert not any("\ufffd" in p for p in pieces) and "done" not in "".join(pieces)
        assert "".join(pieces) + choice.finish() == text and not choice.stopped
    choice = ChoiceText(tokenizer, [], ["xyz", "日本"])  # a stop string spread over several tokens
    pieces = [choice.add([t]) for t in ids] + [choice.finish()]
    assert "".join(pieces) == "Café ☃ naïve " == choice.text and choice.stopped


def _llama2_style_tokenizer():
    """A SentencePiece-style tokenizer as transformers converts Llama 2's: "▁" for spaces (the decoded text's first one
    stripped), a byte token <0xNN> for each byte of a character the vocabulary lacks (byte fallback)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import LlamaTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in "▁abcdefghijklmnopqrstuvwxyzH,!é":
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "H"), ("▁H", "e"), ("l", "l"), ("▁He", "ll"), ("▁Hell", "o"), ("▁", "w"), ("o", "r"), ("▁w", "or")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return LlamaTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_text_streams_as_decoded_in_context_and_bytes_are_exact():
    """A Llama 2 style tokenizer: byte-fallback tokens join into whole characters, and the output's first token keeps
    its space after a prompt (the text is the prompt's continuation, as vLLM's), not the space-stripped decode of the
    output alone; chat logprobs give each token's exact bytes."""
    tokenizer = _llama2_style_tokenizer()
    ids = tokenizer("Hello world 日本 😀 é, wor!", add_special_tokens=False)["input_ids"]
    assert {"<0xF0>", "▁Hello", "▁wor"} <= set(tokenizer.convert_ids_to_tokens(ids))
    for prompt in ([tokenizer.bos_token_id], tokenizer("Hello")["input_ids"]):
        before = tokenizer.decode(prompt, skip_special_tokens=True)
        want = tokenizer.decode(prompt + ids, skip_special_tokens=True)[len(before):]
        choice = ChoiceText(tokenizer, prompt, ["😀 é."])
        pieces = [choice.add([t]) for t in ids] + [choice.finish()]
        assert not any("\ufffd" in p for p in pieces) and "".join(pieces) == want == choice.text
    assert want.startswith(" Hello world 日本")
    strings = TokenStrings(tokenizer)  # chat logprobs' bytes: each token's exact bytes, which add up to that text
    assert bytes(b for t in ids for b in strings(t)[1]).decode("utf-8") == want
    assert strings(tokenizer.convert_tokens_to_ids("<0xF0>"))[1] == [0xF0]


def test_token_bytes_are_exact_for_a_metaspace_decoder_and_a_byte_level_one():
    """A SentencePiece tokenizer whose decoder is Metaspace (tokenizers' SpmConverter's), and a byte-level one (GPT-2,
    Llama 3, Qwen2) whose tokens hold parts of a character: each token's bytes add up to the decoded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    metaspace = _llama2_style_tokenizer()
    metaspace.backend_tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    ids = metaspace("Hello world, wor!", add_special_tokens=False)["input_ids"]
    assert "▁wor" in metaspace.convert_ids_to_tokens(ids) and metaspace.decode(ids) == "Hello world, wor!"
    strings = TokenStrings(metaspace)
    assert bytes(b for t in ids for b in strings(t)[1]).decode("utf-8") == " Hello world, wor!"

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(byte_chars))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    byte_level = PreTrainedTokenizerFast(tokenizer_object=backend)
    ids = byte_level("é 日本", add_special_tokens=False)["input_ids"]
    assert len(ids) == len("é 日本".encode()) and "\ufffd" in byte_level.decode(ids[:1])
    strings = TokenStrings(byte_level)
    assert bytes(b for t in ids for b in strings(t)[1]).decode("utf-8") == "é 日本"


class _Chars:
    """A tokenizer of one character a token (the stop-string logic alone)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_stop_strings_cut_where_a_search_of_the_whole_text_cuts():
    """Random outputs over a small alphabet, tokens of 1-3 characters, stop strings that overlap: what is sent, and
    the text kept, equal the whole text cut before its first stop string (the choice keeps only a window of it)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        text = "".join(rng.choice(list("abc"), int(rng.integers(0, 40))))
        stop = ["".join(rng.choice(list("abc"), int(rng.integers(1, 5)))) for _ in range(int(rng.integers(0, 3)))]
        found = [i for i in (text.find(s_) for s_ in stop) if i >= 0]
        want = text[:min(found)] if found else text
        choice, ids, pieces = ChoiceText(_Chars(), [], stop), [ord(c) for c in text], []
        while ids:
            n = int(rng.integers(1, 4))
            pieces.append(choice.add(ids[:n]))
            ids = ids[n:]
        pieces.append(choice.finish())
        assert "".join(pieces) == want == choice.text and choice.stopped == bool(found), (text, stop)


# ---- the openai client -----------------------------------------------------------------------------------------------
def test_completions_equal_generate(client, tokenizer, reference):
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    tokens, _, text = reference(ids[0], 12)
    assert out.object == "text_completion" and out.model == MODEL and len(out.choices) == 1
    assert out.choices[0].text == text and out.choices[0].finish_reason == _reason(tokens, tokenizer, 12)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids[0]), len(tokens))
    # a batch of prompts, text and token ids mixed: choice i answers prompt i
    batch = client.completions.create(model=MODEL, prompt=[ids[1], ids[2], ids[3]], max_tokens=REF_TOKENS,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [reference(i)[2] for i in ids[1:]]
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids[1:])
    # streamed: the pieces add up to the same text; usage last when asked for
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=REF_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference(ids[1])[2]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference(ids[1])[0])
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_equals_generate(client, tokenizer, reference):
    question = PROMPTS[1]
    tokens, _, text = reference(_chat_ids(tokenizer, question), 10)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=10,
                                         temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text and out.usage.completion_tokens == len(tokens)
    assert out.usage.prompt_tokens == len(_chat_ids(tokenizer, question))
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                            max_completion_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == _reason(tokens, tokenizer, 10)


def test_echo_with_logprobs_scores_the_prompt_at_full_depth(client, student, tokenizer, reference):
    """echo + logprobs (what lm-eval's loglikelihood tasks send): each prompt token's logprob and top logprobs are
    the full forward's in SwiftKV wiring (sk.logits), the first null; then the generated tokens as usual. Token-id
    prompts in a batch, whole and streamed; max_tokens 0 scores the prompt and generates nothing."""
    import jax

    model = sk.load(student / "student")
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2)
    for prompt, choice in zip(ids, out.choices):
        want = np.asarray(jax.nn.log_softmax(sk.logits(model, np.asarray([prompt])), axis=-1))[0]
        lp = choice.logprobs
        assert choice.text == tokenizer.decode(prompt, skip_special_tokens=True) + reference(prompt, 1)[2]
        assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None
        assert lp.tokens[:len(prompt)] == [tokenizer.decode([t]) for t in prompt]
        np.testing.assert_allclose(lp.token_logprobs[1:len(prompt)], want[np.arange(len(prompt) - 1), prompt[1:]],
                                   atol=1e-4)
        for position, top in enumerate(lp.top_logprobs[1:len(prompt)]):
            best = np.argsort(-want[position])[:2]
            expected = {tokenizer.decode([int(t)]): want[position, t] for t in best}
            expected[tokenizer.decode([prompt[position + 1]])] = want[position, prompt[position + 1]]
            assert set(top) == set(expected)
            np.testing.assert_allclose([top[k] for k in expected], list(expected.values()), atol=1e-4)
        assert lp.token_logprobs[-1] == pytest.approx(reference(prompt, 1)[1][0], abs=1e-4)
        # text_offset (vLLM's): each token's at the end of the texts before it, where the echoed text leaves out
        # the BOS, and the generated tokens' from the end of the echoed prompt: each whole token is found there
        special, want, at = set(tokenizer.all_special_ids), [], 0
        for token, text in zip(prompt, lp.tokens):
            want.append(at)
            at += 0 if token in special else len(text)
        assert at == len(tokenizer.decode(prompt, skip_special_tokens=True))
        for text in lp.tokens[len(prompt):]:
            want.append(at)
            at += len(text)
        assert lp.text_offset == want
        assert all(choice.text[at:at + len(text)] == text for token, text, at in
                   zip(prompt + [None], lp.tokens, lp.text_offset) if token not in special and "\ufffd" not in text)
    scored = httpx.post(f"{client.base_url}completions", timeout=60, json=dict(
        model=MODEL, prompt=ids[0], max_tokens=0, echo=True, logprobs=0)).json()["choices"][0]
    assert scored["text"] == tokenizer.decode(ids[0], skip_special_tokens=True) and scored["finish_reason"] == "length"
    assert scored["logprobs"]["token_logprobs"] == out.choices[0].logprobs.token_logprobs[:len(ids[0])]
    chunks = list(client.completions.create(model=MODEL, prompt=ids[1], max_tokens=3, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    offsets = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    assert offsets[:len(ids[1]) + 1] == out.choices[1].logprobs.text_offset  # streamed: the same offsets
    assert streamed[:len(ids[1])] == out.choices[1].logprobs.token_logprobs[:len(ids[1])] and len(streamed) == \
        len(ids[1]) + 3
    assert "".join(c.choices[0].text for c in chunks if c.choices) == \
        tokenizer.decode(ids[1], skip_special_tokens=True) + reference(ids[1], 3)[2]


def test_vllm_fields_that_benchmarks_send(server, tokenizer, reference):
    """guidellm's and vLLM's benchmark requests: ignore_eos with min_tokens = max_tokens, max_completion_tokens on
    completions, and stream_options with continuous_usage_stats (usage on every chunk)."""
    ids = tokenizer(PROMPTS[3])["input_ids"]
    body = dict(model=MODEL, prompt=ids, max_completion_tokens=12, min_tokens=12, ignore_eos=True, temperature=0,
                stream=True, stream_options=dict(include_usage=True, continuous_usage_stats=True))
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    usages = [e["usage"] for e in events]
    assert usages[-1]["completion_tokens"] == 12 and events[-1]["choices"] == []
    assert [u["completion_tokens"] for u in usages] == sorted(u["completion_tokens"] for u in usages)
    assert all(u["prompt_tokens"] == len(ids) for u in usages)


def test_n_seed_and_logprobs(client, tokenizer, reference):
    ids = tokenizer(PROMPTS[2])["input_ids"]
    tokens, logprobs, text = reference(ids, 8)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in tokens] and out.choices[0].text == text
    np.testing.assert_allclose(lp.token_logprobs, logprobs, atol=1e-4)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the chosen token is the most likely
        assert len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-5)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(tokens))]
    # n samples with a seed: n different draws, the same again with the same seed
    sample = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, n=3, seed=7)
    first, again = client.completions.create(**sample), client.completions.create(**sample)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    # sampled, each token's top_logprobs hold the sampled token too (OpenAI's completions: up to logprobs + 1 of
    # them, as vLLM's), whole and streamed
    sample.update(n=1, logprobs=2, max_tokens=REF_TOKENS)
    lp = client.completions.create(**sample).choices[0].logprobs
    chunks = list(client.completions.create(**sample, stream=True))
    streamed = [top for c in chunks if c.choices[0].logprobs for top in c.choices[0].logprobs.top_logprobs]
    assert streamed == lp.top_logprobs and any(len(top) == 3 for top in lp.top_logprobs)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and top[token] == pytest.approx(chosen, abs=1e-5)
    # chat logprobs: each token's exact bytes add up to the text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    content = chat.choices[0].logprobs.content
    assert bytes(b for entry in content for b in entry.bytes).decode("utf-8", "replace") == \
        tokenizer.decode(reference(_chat_ids(tokenizer, PROMPTS[2]), 8)[0])
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    # usage, as OpenAI counts it: the prompt once, every choice's tokens
    chat_ids = _chat_ids(tokenizer, PROMPTS[2])
    want = (len(chat_ids), 2 * len(reference(chat_ids, 8)[0]))
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == want


def _penalised_greedy(model, ids, n, eos, repetition=1.0, presence=0.0, frequency=0.0, bias=None) -> list:
    """Greedy tokens (to eos or n), each the argmax of the full forward's last logits with the logit bias ({id:
    bias}) and vLLM's penalties in numpy: repetition on the prompt's and the output's tokens (transformers' rule),
    then OpenAI's presence and frequency on the output's."""
    tokens, out = list(ids), []
    while len(out) < n and (not out or out[-1] != eos):
        logits = np.asarray(sk.logits(model, np.asarray([tokens])), np.float64)[0, -1]
        for token, value in (bias or {}).items():
            logits[token] += value
        seen = np.isin(np.arange(len(logits)), tokens)
        logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
        counts = np.bincount(out, minlength=len(logits))
        out.append(int(np.argmax(logits - frequency * counts - presence * (counts > 0))))
        tokens.append(out[-1])
    return out


def test_penalties_through_the_openai_client(client, student, tokenizer, reference):
    """vLLM's repetition_penalty and min_p (extra_body) and OpenAI's presence_penalty and frequency_penalty, greedy
    on both endpoints: the tokens of the full forward penalised in numpy, not those without the penalties."""
    model = sk.load(student / "student")
    eos = tokenizer.eos_token_id
    ids = tokenizer(PROMPTS[2])["input_ids"]
    want = _penalised_greedy(model, ids, 12, eos, repetition=3.0, presence=1.0)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, presence_penalty=1.0,
                                    extra_body={"repetition_penalty": 3.0})
    assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    assert want != list(reference(ids, 12)[0])
    chat_ids = _chat_ids(tokenizer, PROMPTS[3])
    want = _penalised_greedy(model, chat_ids, 12, eos, frequency=2.0)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[3]}],
                                         max_tokens=12, temperature=0, frequency_penalty=2.0,
                                         extra_body={"min_p": 0.2, "repetition_penalty": 1.0})
    assert out.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert want != list(reference(chat_ids, 12)[0])


def test_logit_bias_through_the_openai_client(client, student, tokenizer, reference):
    """OpenAI's logit_bias ({"id": bias}) on both endpoints, greedy: -100 on the plain answer's first token gives the
    tokens of the full forward with the bias added in numpy; +100 on a token repeats it; logprobs stay the model's."""
    model = sk.load(student / "student")
    eos = tokenizer.eos_token_id
    ids = tokenizer(PROMPTS[0])["input_ids"]
    plain, logprobs, _ = reference(ids, 8)
    want = _penalised_greedy(model, ids, 8, eos, bias={int(plain[0]): -100})
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=0,
                                    logit_bias={str(plain[0]): -100})
    assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True) and want[0] != plain[0]
    forced = next(t for t in range(100, 200) if t != eos and t not in plain)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, logprobs=0,
                                    logit_bias={str(forced): 100})
    raw = np.asarray(sk.logits(model, np.asarray([ids])), np.float64)[0, -1]
    assert out.choices[0].text == tokenizer.decode([forced] * 3, skip_special_tokens=True)
    assert abs(out.choices[0].logprobs.token_logprobs[0] - (raw[forced] - np.logaddexp.reduce(raw))) < 1e-3
    chat_ids = _chat_ids(tokenizer, PROMPTS[3])
    plain = reference(chat_ids, 8)[0]
    bias = {int(plain[0]): -100, int(plain[1]): -5.5}
    want = _penalised_greedy(model, chat_ids, 8, eos, bias=bias)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[3]}],
                                         max_tokens=8, temperature=0, logit_bias={str(k): v for k, v in bias.items()})
    assert out.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert want != list(plain)


def _min_tokens_greedy(model, ids, n, stops, min_tokens) -> tuple[list, list]:
    """(greedy tokens to a stop id or n, their logprobs): each the argmax of the full forward's last logits with the
    stop ids at -inf while fewer than min_tokens are generated (vLLM's min_tokens); logprobs the model's own."""
    tokens, out, logprobs = list(ids), [], []
    while len(out) < n and not (out and out[-1] in stops):
        raw = np.asarray(sk.logits(model, np.asarray([tokens])), np.float64)[0, -1]
        logits = raw.copy()
        if len(out) < min_tokens:
            logits[sorted(stops)] = -np.inf
        out.append(int(np.argmax(logits)))
        logprobs.append(raw[out[-1]] - np.logaddexp.reduce(raw))
        tokens.append(out[-1])
    return out, logprobs


def test_min_tokens_through_the_openai_client(client, student, tokenizer, reference):
    """vLLM's min_tokens (extra_body), greedy: a stop id that plain greedy samples first (so it stops at once) is
    masked for the first min_tokens tokens, then stops it: the tokens of the masked full forward, the logprobs the
    model's own; chat's EOS is masked too; a stop string that ends in the first min_tokens tokens' text does not
    stop the request, one past it does (vLLM's), whole and streamed."""
    model = sk.load(student / "student")
    eos = tokenizer.eos_token_id
    ids = tokenizer(PROMPTS[3])["input_ids"]
    stop_id = int(reference(ids)[0][0])
    body = dict(model=MODEL, prompt=ids, max_tokens=12, temperature=0, logprobs=0)
    assert client.completions.create(**body, extra_body={"stop_token_ids": [stop_id]}).usage.completion_tokens == 1
    want, logprobs = _min_tokens_greedy(model, ids, 12, {stop_id, eos}, 4)
    out = client.completions.create(**body, extra_body={"stop_token_ids": [stop_id], "min_tokens": 4})
    stopped = want[-1] in (stop_id, eos)
    assert len(want) > 4 and out.usage.completion_tokens == len(want)
    assert out.choices[0].finish_reason == ("stop" if stopped else "length")
    assert out.choices[0].text == tokenizer.decode(want[:-1] if stopped else want, skip_special_tokens=True)
    np.testing.assert_allclose(out.choices[0].logprobs.token_logprobs, logprobs, atol=2e-3)
    # chat: the EOS and a stop id masked, with n = 2 and a seed beside (each choice its own request)
    chat_ids = _chat_ids(tokenizer, PROMPTS[0])
    stop_id = int(reference(chat_ids)[0][0])
    want, _ = _min_tokens_greedy(model, chat_ids, 8, {stop_id, eos}, 3)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                         max_tokens=8, temperature=0, n=2,
                                         extra_body={"stop_token_ids": [stop_id], "min_tokens": 3})
    stopped = want[-1] in (stop_id, eos)
    assert [c.message.content for c in out.choices] == [tokenizer.decode(want[:-1] if stopped else want,
                                                                         skip_special_tokens=True)] * 2
    # stop strings: one found in the first 4 tokens' text is passed over
    want, _ = _min_tokens_greedy(model, ids, 12, {eos}, 4)
    full = tokenizer.decode(want, skip_special_tokens=True)
    head = len(tokenizer.decode(want[:4], skip_special_tokens=True))
    start = next(i for i in range(head - 1) if full[i:i + 2].isascii() and full[i:i + 2].strip())
    stop = full[start:start + 2]
    cut = full.find(stop, head - 1)
    text = full[:cut] if cut >= 0 else full
    body = dict(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stop=[stop])
    plain = reference(ids, 12)[2]  # without min_tokens: cut at the first one (in the text of the first 4 tokens)
    assert client.completions.create(**body).choices[0].text == (plain[:plain.find(stop)] if stop in plain else plain)
    assert not plain.startswith(full[:head]) or plain.find(stop) < head - 1
    out = client.completions.create(**body, extra_body={"min_tokens": 4})
    assert out.choices[0].text == text and len(text) >= head
    chunks = list(client.completions.create(**body, stream=True, extra_body={"min_tokens": 4}))
    assert "".join(c.choices[0].text for c in chunks) == text


def test_stop_strings_cut_the_text(client, tokenizer, reference):
    ids = tokenizer(PROMPTS[3])["input_ids"]
    text = reference(ids)[2]
    start = next(i for i in range(3, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].strip())
    stop = text[start:start + 2]
    want = text[:text.find(stop)]
    body = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=REF_TOKENS, temperature=0, stop=["\u2603never", stop])
    out = client.completions.create(**body)
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"
    # stop_token_ids (vLLM's extension): the generation ends with that token, counted but not in the text (vLLM's,
    # as an EOS: a stop id's own text is never output), whole and streamed
    tokens = reference(ids)[0]
    stop_id = next(t for t in tokens[2:] if t not in tokenizer.all_special_ids and tokenizer.decode([t]).strip())
    body = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=REF_TOKENS, temperature=0,
                extra_body={"stop_token_ids": [stop_id]})
    out = client.completions.create(**body)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == tokens.index(stop_id) + 1
    assert out.choices[0].text == reference(ids, tokens.index(stop_id))[2]
    chunks = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    # ... and its logprob is there (README: "the stop id counts in usage and logprobs"), sk.generate's, whole and
    # streamed: the text left it out, the scores did not
    n = tokens.index(stop_id) + 1
    want = reference(ids, n)[1]
    lp = client.completions.create(**body, logprobs=1).choices[0].logprobs
    assert len(lp.tokens) == n and lp.tokens[-1] == tokenizer.decode([stop_id])
    assert lp.token_logprobs == pytest.approx(want, abs=2e-3) and lp.tokens[-1] in lp.top_logprobs[-1]
    chunks = list(client.completions.create(**body, logprobs=1, stream=True))
    assert [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs


def test_include_stop_str_in_output_keeps_the_stop_string(client, tokenizer, reference):
    """vLLM's include_stop_str_in_output: the text is the one without it plus the stop string, whole and streamed,
    on both endpoints; a stop id's own text is then decoded too (vLLM's detokenizer), an EOS skipped as special."""
    ids = tokenizer(PROMPTS[3])["input_ids"]
    text = reference(ids)[2]
    start = next(i for i in range(3, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].strip())
    stop = text[start:start + 2]
    body = dict(model=MODEL, prompt=ids, max_tokens=REF_TOKENS, temperature=0, stop=[stop])
    plain = client.completions.create(**body).choices[0]
    kept = client.completions.create(**body, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert plain.text == text[:text.find(stop)] and kept.text == plain.text + stop
    assert plain.finish_reason == kept.finish_reason == "stop"
    chunks = list(client.completions.create(**body, stream=True, extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].text for c in chunks) == kept.text and chunks[-1].choices[0].finish_reason == "stop"
    chat_ids = _chat_ids(tokenizer, PROMPTS[0])
    answer = reference(chat_ids)[2]
    stop = next(answer[i:i + 2] for i in range(2, len(answer) - 1) if answer[i:i + 2].strip())
    body = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=REF_TOKENS,
                temperature=0, stop=[stop])
    plain = client.chat.completions.create(**body).choices[0].message.content
    kept = client.chat.completions.create(**body, extra_body={"include_stop_str_in_output": True})
    assert plain == answer[:answer.find(stop)] and kept.choices[0].message.content == plain + stop
    chunks = list(client.chat.completions.create(**body, stream=True,
                                                 extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain + stop
    # a stop id (not special): its text follows, as vLLM's detokenizer decodes the last token with the option
    tokens = reference(ids)[0]
    stop_id = next(t for t in tokens[2:] if t not in tokenizer.all_special_ids and tokenizer.decode([t]).strip())
    n = tokens.index(stop_id) + 1
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=REF_TOKENS, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": True})
    assert out.usage.completion_tokens == n and out.choices[0].text == reference(ids, n)[2]


def test_skip_special_tokens_and_spaces_between_them(client, tokenizer):
    """vLLM's skip_special_tokens (default true) and spaces_between_special_tokens: special tokens generated (a
    logit bias makes the EOS, ignore_eos lets it run on) are left out by default and come out as the tokenizer's own
    decode of the ids with false, whole and streamed; logprobs' token strings are the raw tokens either way."""
    eos = tokenizer.eos_token_id
    body = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=0, logit_bias={str(eos): 100})
    raw = tokenizer.decode([eos])
    default = client.completions.create(**body, extra_body={"ignore_eos": True}).choices[0]
    assert default.logprobs.tokens == [raw] * 4 and default.text == tokenizer.decode([eos] * 4,
                                                                                     skip_special_tokens=True) == ""
    for spaces in (True, False):
        extra = {"ignore_eos": True, "skip_special_tokens": False, "spaces_between_special_tokens": spaces}
        out = client.completions.create(**body, extra_body=extra).choices[0]
        want = tokenizer.decode([eos] * 4, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert out.logprobs.tokens == [raw] * 4 and out.text == want and raw in want
        chunks = list(client.completions.create(**body, stream=True, extra_body=extra))
        assert "".join(c.choices[0].text for c in chunks) == want
    # chat's EOS ends the answer: not text with include_stop_str_in_output unless skip_special_tokens is false
    body = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=3, temperature=0,
                logit_bias={str(eos): 100})
    ended = client.chat.completions.create(**body, extra_body={"skip_special_tokens": False})
    assert ended.choices[0].message.content == "" and ended.usage.completion_tokens == 1
    kept = client.chat.completions.create(**body, extra_body={"skip_special_tokens": False,
                                                              "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == raw and kept.choices[0].finish_reason == "stop"


def test_add_special_tokens_and_truncate_prompt_tokens(client, tokenizer):
    """vLLM's add_special_tokens (completions default true: a BOS; chat default false: the template writes it) and
    truncate_prompt_tokens (the last k tokens: usage counts them, and greedy outputs equal those of the kept ids sent
    as the prompt; a text prompt is truncated as vLLM's tokenizer does, on the left with its BOS kept)."""
    text = PROMPTS[3]
    with_bos, without = (tokenizer(text, add_special_tokens=s)["input_ids"] for s in (True, False))
    assert with_bos == [tokenizer.bos_token_id] + without
    body = dict(model=MODEL, max_tokens=6, temperature=0)
    counts = [client.completions.create(**body, prompt=text, **extra).usage.prompt_tokens
              for extra in ({}, {"extra_body": {"add_special_tokens": True}},
                            {"extra_body": {"add_special_tokens": False}})]
    assert counts == [len(with_bos), len(with_bos), len(without)]
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat = [client.chat.completions.create(**body, messages=messages, **extra).usage.prompt_tokens
            for extra in ({}, {"extra_body": {"add_special_tokens": True}})]
    assert chat == [len(tokenizer(rendered, add_special_tokens=False)["input_ids"]),
                    len(tokenizer(rendered)["input_ids"])] and chat[1] == chat[0] + 1
    # truncation: token ids, a text (BOS + the last k - 1 of its own tokens) and chat's rendered prompt
    k = 4
    assert len(with_bos) > k + 1

    def completion(prompt, **extra):
        out = client.completions.create(**body, prompt=prompt, extra_body=extra)
        return out.choices[0].text, out.usage.prompt_tokens

    assert completion(with_bos, truncate_prompt_tokens=k) == (completion(with_bos[-k:])[0], k)
    assert completion(text, truncate_prompt_tokens=k) == (completion(with_bos[:1] + without[1 - k:])[0], k)
    assert completion(text, truncate_prompt_tokens=-1) == completion(text)  # the context's room: all of it
    chat_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    out = client.chat.completions.create(**body, messages=messages, extra_body={"truncate_prompt_tokens": k})
    assert (out.choices[0].message.content, out.usage.prompt_tokens) == (completion(chat_ids[-k:])[0], k)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**body, messages=messages,
                                       extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN + 1})
    assert refused.value.body["param"] == "truncate_prompt_tokens" and "max_model_len" in refused.value.message


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_models_health_and_an_idle_server_does_not_spin(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    if not Path(f"/proc/{server.proc.pid}/stat").exists():
        pytest.skip("no /proc here")
    _wait_idle(server.url)
    before = _cpu_seconds(server.proc.pid)
    time.sleep(1.5)
    assert _cpu_seconds(server.proc.pid) - before < 0.3, "the idle server keeps a core busy"


def test_every_served_name_is_a_model_and_a_response_carries_the_name_it_was_asked_by(server, client):
    """vLLM's --served-model-name A B: a request may name either (its response says which), one that names none gets
    the first, another name is a 404 listing both."""
    for model, want in ((ALIAS, ALIAS), (MODEL, MODEL)):
        assert client.completions.create(model=model, prompt="hi", max_tokens=1).model == want
        assert client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=1).model == want
    reply = httpx.post(f"{server.url}/v1/completions", json=dict(prompt="hi", max_tokens=1), timeout=60)
    assert reply.json()["model"] == MODEL
    with client.completions.create(model=ALIAS, prompt="hi", max_tokens=2, stream=True) as stream:
        assert {chunk.model for chunk in stream} == {ALIAS}
    with pytest.raises(openai.NotFoundError, match=f"`gpt-9` does not exist: this server serves `{MODEL}`, `{ALIAS}`"):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)


# ---- load: 64 concurrent streams, a quarter hung up ------------------------------------------------------------------
async def _stream(http, url, body, hang_up_after=None):
    """POST a streaming completion; returns (text, finish_reason, saw [DONE]) or None if it hung up."""
    text, finish, done, events = "", None, False, 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
            events += 1
            if hang_up_after is not None and events >= hang_up_after:
                return None  # leaving the block closes the connection mid-stream
    return text, finish, done


def test_concurrent_streams_with_hang_ups(server, tokenizer, reference):
    rng = random.Random(0)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    jobs = [(i % len(PROMPTS), rng.randint(4, REF_TOKENS), rng.randint(1, 3) if i % 4 == 0 else None)
            for i in range(64)]
    before = _metrics(server.url)

    async def run():
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.wait_for(asyncio.gather(*[
                _stream(http, server.url, dict(model=MODEL, prompt=ids[p], max_tokens=k, temperature=0, stream=True),
                        hang_up)
                for p, k, hang_up in jobs]), timeout=240)

    results = asyncio.run(run())
    for (p, k, hang_up), result in zip(jobs, results):
        if hang_up is not None:
            assert result is None
            continue
        tokens, _, text = reference(ids[p], k)
        assert result == (text, _reason(tokens, tokenizer, k), True), (p, k)
    # still answering, and afterwards nothing holds a page or a slot
    assert httpx.get(f"{server.url}/health").status_code == 200
    after = _wait_idle(server.url)
    assert after[("swiftkv_kv_pages_free", ())] == after[("swiftkv_kv_pages_total", ())]
    assert after[("swiftkv_num_requests_running", ())] == 0 and after[("swiftkv_num_requests_in_flight", ())] == 0
    key = ("swiftkv_engine_requests_finished_total", (("finish_reason", "abort"),))
    assert after.get(key, 0) - before.get(key, 0) >= 1, "no hung-up stream was aborted"
    ok = ("swiftkv_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    deadline = time.monotonic() + 10  # a hung-up stream is counted once the server has seen the hang-up
    while after[ok] - before.get(ok, 0) < 64 and time.monotonic() < deadline:
        time.sleep(0.1)
        after = _metrics(server.url)
    assert after[ok] - before.get(ok, 0) == 64


def test_a_client_that_hangs_up_before_a_whole_response_aborts_its_requests(server, tokenizer):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    n, max_tokens = 64, MAX_MODEL_LEN - len(ids)
    before = _metrics(server.url)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", timeout=0.3,
                   json=dict(prompt=ids, n=n, max_tokens=max_tokens, temperature=0, ignore_eos=True))
    after = _wait_idle(server.url, timeout=5)
    assert after[("swiftkv_num_requests_in_flight", ())] == 0
    aborted = ("swiftkv_engine_requests_finished_total", (("finish_reason", "abort"),))
    assert after.get(aborted, 0) - before.get(aborted, 0) >= 1
    generated = ("swiftkv_generation_tokens_total", ())
    assert after[generated] - before[generated] < n * max_tokens


def test_overload_gets_503_with_retry_after(server, tokenizer):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    limit = MAX_SEQS + MAX_WAITING

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            big = dict(model=MODEL, prompt=ids, max_tokens=MAX_MODEL_LEN - len(ids), temperature=0, stream=True,
                       n=limit // 2, ignore_eos=True)
            # a streaming response's headers come once its request is admitted (its sequences count from then on)
            async with http.stream("POST", f"{server.url}/v1/completions", json=big) as a:
                async with http.stream("POST", f"{server.url}/v1/completions", json=big) as b:
                    assert (a.status_code, b.status_code) == (200, 200)
                    refused = await http.post(f"{server.url}/v1/completions",
                                              json=dict(model=MODEL, prompt=ids, max_tokens=2))
            return refused  # both streams hung up: aborted

    refused = asyncio.run(asyncio.wait_for(run(), 120))
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "overloaded" and "at capacity" in refused.json()["error"]["message"]
    m = _wait_idle(server.url)
    assert m[("swiftkv_num_requests_in_flight", ())] == 0
    assert httpx.post(f"{server.url}/v1/completions", json=dict(prompt=ids, max_tokens=2)).status_code == 200


# ---- bad input -------------------------------------------------------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
BAD = [  # (path, body, status, param, words in the message)
    ("/v1/completions", b"{not json", 400, None, "could not parse the JSON body"),
    ("/v1/completions", b"[1, 2]", 400, None, "must be an object"),
    ("/v1/completions", dict(prompt="hi", bogus=1), 400, "bogus", "Unrecognized request argument supplied: bogus"),
    ("/v1/completions", dict(model="gpt-9", prompt="hi"), 404, "model", "`gpt-9` does not exist"),
    ("/v1/completions", dict(prompt=[5] * MAX_MODEL_LEN), 400, "prompt", "maximum context length is 128"),
    ("/v1/completions", dict(prompt="hi", max_tokens=500), 400, "max_tokens", "maximum context length is 128"),
    ("/v1/completions", dict(prompt="hi", max_tokens=0), 400, "max_tokens", "max_tokens must be >= 1"),
    ("/v1/completions", dict(prompt="hi", temperature=-1), 400, "temperature", "temperature must be >= 0"),
    ("/v1/completions", dict(prompt="hi", temperature="hot"), 400, "temperature", "temperature must be a number"),
    ("/v1/completions", dict(prompt="hi", top_p=0), 400, "top_p", "top_p must lie in (0, 1]"),
    ("/v1/completions", dict(prompt="hi", top_k=-3), 400, "top_k", "top_k must be >= 0"),
    ("/v1/completions", dict(prompt="hi", seed=-1), 400, "seed", "seed must lie in [0, 2**31)"),
    ("/v1/completions", dict(prompt="hi", n=0), 400, "n", "n must lie in"),
    ("/v1/completions", dict(prompt="hi", stop=5), 400, "stop", "stop must be a non-empty string"),
    ("/v1/completions", dict(prompt="hi", logprobs=50), 400, "logprobs", "logprobs must lie in [0, 20]"),
    ("/v1/completions", dict(prompt=[10**6]), 400, "prompt", "token ids must lie in"),
    ("/v1/completions", dict(prompt=[[5, 6], [5, -1]]), 400, "prompt", "prompt 1: token ids must lie in [0, "),
    ("/v1/completions", dict(prompt=[2**64]), 400, "prompt", "token ids must lie in [0, "),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt", "is not valid Unicode"),
    ("/v1/completions", dict(prompt="hi", temperature=10**400), 400, "temperature", "must be a finite number"),
    ("/v1/completions", dict(prompt=[]), 400, "prompt", "prompt must be a string"),
    ("/v1/completions", dict(prompt="hi", presence_penalty=2.5), 400, "presence_penalty",
     "presence_penalty must lie in [-2, 2]"),
    ("/v1/completions", dict(prompt="hi", frequency_penalty="x"), 400, "frequency_penalty",
     "frequency_penalty must be a number"),
    ("/v1/completions", dict(prompt="hi", repetition_penalty=0), 400, "repetition_penalty",
     "repetition_penalty must be > 0"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], min_p=1.5), 400, "min_p",
     "min_p must lie in [0, 1]"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], frequency_penalty=-2.5), 400,
     "frequency_penalty", "frequency_penalty must lie in [-2, 2]"),
    ("/v1/completions", dict(prompt="hi", min_tokens=-1), 400, "min_tokens",
     "min_tokens must be greater than or equal to 0, got -1"),
    ("/v1/completions", dict(prompt="hi", min_tokens="3"), 400, "min_tokens", "min_tokens must be an integer"),
    ("/v1/completions", dict(prompt="hi", max_tokens=4, min_tokens=5), 400, "min_tokens",
     "min_tokens must be less than or equal to max_tokens=4, got 5"),
    ("/v1/completions", dict(prompt="hi", min_tokens=17), 400, "min_tokens",  # the omitted max_tokens: 16
     "min_tokens must be less than or equal to max_tokens=16, got 17"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2,
                                  min_tokens=3), 400, "min_tokens", "less than or equal to max_tokens=2, got 3"),
    ("/v1/completions", dict(prompt="hi", stop_token_ids=[10**6]), 400, "stop_token_ids", "stop_token_ids must lie"),
    ("/v1/completions", dict(prompt="hi", stream=True, stream_options=dict(include_usage="yes")), 400,
     "stream_options", "stream_options takes"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=500), 400,
     "max_completion_tokens", "maximum context length is 128"),
    ("/v1/chat/completions", dict(messages=[]), 400, "messages", "messages must be a non-empty list"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', 400, "messages",
     "is not valid Unicode"),
    ("/v1/chat/completions", dict(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role",
     "'wizard' is not a chat role"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], top_logprobs=2), 400,
     "top_logprobs", "top_logprobs needs logprobs"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content", "only text parts"),
    ("/v1/completions", dict(prompt="hi", logit_bias={"1000000": 1}), 400, "logit_bias",
     "logit_bias token ids must lie in [0, "),
    ("/v1/completions", dict(prompt="hi", logit_bias={"5": 101}), 400, "logit_bias",
     "logit_bias values must lie in [-100, 100]"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], logit_bias={"five": 1}), 400,
     "logit_bias", "logit_bias keys must be token ids"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], logit_bias={"5": "x"}), 400,
     "logit_bias", "logit_bias values must be finite numbers"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}],
                                  logit_bias={str(i): 1 for i in range(301)}), 400, "logit_bias",
     "logit_bias takes at most 300 token ids"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], tools=[TOOL]), 400, "tools",
     "requires --enable-auto-tool-choice and --tool-call-parser"),  # a server started without them, as vLLM's
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], tool_choice="required"),
     400, "tool_choice", "needs tools"),
    ("/v1/completions", dict(prompt="hi", include_stop_str_in_output=1), 400, "include_stop_str_in_output",
     "include_stop_str_in_output must be true or false"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], skip_special_tokens="no"), 400,
     "skip_special_tokens", "skip_special_tokens must be true or false"),
    ("/v1/completions", dict(prompt="hi", spaces_between_special_tokens=[]), 400, "spaces_between_special_tokens",
     "spaces_between_special_tokens must be true or false"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], add_special_tokens="yes"), 400,
     "add_special_tokens", "add_special_tokens must be true or false"),
    ("/v1/completions", dict(prompt="hi", truncate_prompt_tokens=0), 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be an integer >= 1, or -1"),
    ("/v1/completions", dict(prompt="hi", truncate_prompt_tokens=-2), 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be an integer >= 1, or -1"),
    ("/v1/completions", dict(prompt="hi", truncate_prompt_tokens=2.5), 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be an integer"),
    ("/v1/completions", dict(prompt="hi", truncate_prompt_tokens=120), 400, "truncate_prompt_tokens",  # max_tokens 16
     "cannot be greater than max_model_len - max_tokens = 128 - 16 = 112"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], truncate_prompt_tokens=129), 400,
     "truncate_prompt_tokens", "cannot be greater than max_model_len = 128"),
    # a probe's finds (2026-11-28): each had a 500, a wrong field or no refusal
    ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None, "it nests too deeply"),
    ("/v1/completions", dict(prompt="hi", logprobs=100), 400, "logprobs", "logprobs must lie in [0, 20], got 100"),
    ("/v1/completions", dict(prompt="hi", max_tokens=-1), 400, "max_tokens", "max_tokens must be >= 1, got -1"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=-4), 400,
     "max_completion_tokens", "max_completion_tokens must be >= 1, got -4"),
    ("/v1/completions", dict(prompt="hi", temperature=1e308), 400, "temperature", "temperature must be at most"),
    ("/v1/completions", dict(prompt="hi", model=5), 400, "model", "model must be a string"),
    ("/v1/completions", dict(prompt="hi", user=5), 400, "user", "user must be a string, got 5"),
    ("/v1/chat/completions", dict(messages=[{"role": "user"}]), 400, "messages[0].content",
     "messages[0].content is required in a user message"),
]


def test_bad_input_gets_an_error_object(server, tokenizer, reference):
    ids = tokenizer(PROMPTS[1])["input_ids"]
    good = dict(model=MODEL, prompt=ids, max_tokens=REF_TOKENS, temperature=0, stream=True)

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            bystander = asyncio.create_task(_stream(http, server.url, good))  # one bad request disturbs no other
            answers = []
            for path, body, *_ in BAD:
                kwargs = dict(content=body, headers={"content-type": "application/json"}) \
                    if isinstance(body, bytes) else dict(json=body)
                answers.append(await http.post(f"{server.url}{path}", **kwargs))
            return answers, await bystander

    answers, bystander = asyncio.run(asyncio.wait_for(run(), 120))
    for (path, body, status, param, words), response in zip(BAD, answers):
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (status, param), (body, error)
        assert words in error["message"], (body, error)
        assert set(error) == {"message", "type", "param", "code"}
    assert bystander == (reference(ids)[2], _reason(reference(ids)[0], tokenizer, REF_TOKENS), True)
    missing = httpx.get(f"{server.url}/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert _wait_idle(server.url)[("swiftkv_num_requests_in_flight", ())] == 0


def test_metrics_count_what_was_sent(server):
    before = _metrics(server.url)
    for body in (dict(prompt="hi", max_tokens=3), dict(prompt="ho", max_tokens=2), dict(prompt="hi", top_p=2),
                 dict(model="nope", prompt="hi")):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    httpx.post(f"{server.url}/v1/chat/completions", json=dict(messages=[{"role": "user", "content": "hi"}],
                                                              max_tokens=2), timeout=60)
    after = _metrics(server.url)
    requests = lambda m, endpoint, status: m.get(("swiftkv_http_requests_total",
                                                  (("endpoint", endpoint), ("status", status))), 0)
    delta = lambda endpoint, status: requests(after, endpoint, status) - requests(before, endpoint, status)
    assert (delta("/v1/completions", "200"), delta("/v1/completions", "400"), delta("/v1/completions", "404"),
            delta("/v1/chat/completions", "200")) == (2, 1, 1, 1)
    ttft = lambda m: m[("swiftkv_time_to_first_token_seconds_count", ())]
    assert ttft(after) - ttft(before) == 3
    tokens = lambda m: m[("swiftkv_generation_tokens_total", ())]
    assert 3 <= tokens(after) - tokens(before) <= 7  # 3 + 2 + 2 unless one stopped at EOS
    for name in ("swiftkv_num_preemptions_total", "swiftkv_kv_cache_usage", "swiftkv_time_per_output_token_seconds_sum",
                 "swiftkv_num_requests_waiting", "swiftkv_prefix_cache_pages"):
        assert (name, ()) in after
    # the same long prompt twice: the second finds the first's full pages in the prefix cache
    prompt = "one two three four five six seven eight nine ten " * 2
    for _ in range(2):
        reply = httpx.post(f"{server.url}/v1/completions", json=dict(prompt=prompt, max_tokens=1), timeout=60)
        assert reply.status_code == 200, reply.text
    last = _metrics(server.url)
    hits = last[("swiftkv_prefix_cache_hits_total", ())] - after[("swiftkv_prefix_cache_hits_total", ())]
    queries = last[("swiftkv_prefix_cache_queries_total", ())] - after[("swiftkv_prefix_cache_queries_total", ())]
    assert queries > hits >= 16, (queries, hits)


def test_vllm_max_num_generation_tokens_is_a_requests_longest_choice():
    """vLLM's `request_max_num_generation_tokens` is the most tokens any of a request's n choices generated, once per
    request (its ParentRequest), not the max_tokens parameter (`request_params_max_tokens`, per choice)."""
    from types import SimpleNamespace

    from swiftkv_jax.serving.continuous import RequestOutput
    from swiftkv_jax.serving.http.metrics import Metrics

    metrics = Metrics(SimpleNamespace(model_name=MODEL, max_model_len=MAX_MODEL_LEN))
    for generated in (3, 7):  # the two choices of one request with n = 2
        metrics.on_finish(RequestOutput("r", [], [], True, "stop", [0] * generated, metrics=dict(
            max_tokens=100, generated_tokens=generated, prompt_tokens=4)))
    metrics.on_request([3, 7])
    sample = lambda name, kind: next(s.value for family in metrics.registry.collect() if family.name == name
                                     for s in family.samples if s.name == f"{name}_{kind}")
    assert (sample("vllm:request_params_max_tokens", "sum"), sample("vllm:request_params_max_tokens", "count")) == (
        200, 2)
    assert (sample("vllm:request_max_num_generation_tokens", "sum"),
            sample("vllm:request_max_num_generation_tokens", "count")) == (7, 1)
    assert (sample("vllm:request_params_n", "sum"), sample("vllm:request_params_n", "count")) == (2, 1)


def test_vllm_dashboards_read_the_metrics_under_vllms_names(server):
    """Every metric vLLM's example Grafana dashboard queries (its PromQL, tests/data) is here, labelled with the
    served model as vLLM labels it, and says what vLLM's does: the same counts as ours, one finish per request by
    reason, one inter-token interval per token after a request's first, each request's prompt and output lengths."""
    import re

    queries = json.loads((Path(__file__).parent / "data" / "vllm_grafana_queries.json").read_text())["exprs"]
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for q in queries for n in re.findall(r"vllm:[a-z0-9_]+", q)}
    _wait_idle(server.url)
    before = _metrics(server.url)
    lengths = [(body, httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["usage"])
               for body in (dict(prompt="hi there", max_tokens=4, ignore_eos=True),
                            dict(prompt="one two three", max_tokens=2, ignore_eos=True))]
    after = _wait_idle(server.url)
    vllm = {(name, dict(labels).get("model_name")) for name, labels in after if name.startswith("vllm:")}
    families = {re.sub(r"_(bucket|sum|count|total|created)$", "", name) for name, _ in vllm}
    missing = {n for n in names if re.sub(r"_total$", "", n) not in families}
    assert not missing, missing
    assert {model for _, model in vllm} == {MODEL}  # the dashboard's model_name variable: label_values(vllm:.*)

    label = (("engine", "0"), ("model_name", MODEL))
    delta = lambda name, labels=label: after.get((name, labels), 0) - before.get((name, labels), 0)
    for ours, theirs in (("swiftkv_generation_tokens_total", "vllm:generation_tokens_total"),
                         ("swiftkv_num_preemptions_total", "vllm:num_preemptions_total"),
                         ("swiftkv_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")):
        assert after[(theirs, label)] == after[(ours, ())], theirs
    prompt = sum(usage["prompt_tokens"] for _, usage in lengths)
    generated = sum(usage["completion_tokens"] for _, usage in lengths)
    assert (generated, delta("vllm:generation_tokens_total"), delta("vllm:prompt_tokens_total")) == (6, 6, prompt)
    assert delta("vllm:request_success_total", (*label[:1], ("finished_reason", "length"), *label[1:])) == 2
    assert delta("vllm:inter_token_latency_seconds_count") == delta("vllm:time_per_output_token_seconds_count") == 4
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == delta("vllm:request_max_num_generation_tokens_sum") == 6
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count"):
        assert delta(name) == 2, name
    assert after[("vllm:gpu_cache_usage_perc", label)] == after[("vllm:kv_cache_usage_perc", label)] == \
        after[("swiftkv_kv_cache_usage", ())]


# ---- generation_config.json's defaults, vLLM's /tokenize, /detokenize, /version and X-Request-Id --------------------
def test_vllms_template_fields_render_as_transformers_renders_them(tokenizer):
    """vLLM's chat extensions add_generation_prompt, continue_final_message (a prefilled answer the model continues)
    and chat_template_kwargs give the ids transformers' apply_chat_template gives with the same arguments; bad
    combinations are 400s naming the field."""
    import copy

    messages = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My answer is"}]
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = "{% if greeting %}{{ greeting }}{% endif %}" + tokenizer.chat_template
    cases = [(tokenizer, messages[:1], dict(add_generation_prompt=False), {}),
             (tokenizer, messages, dict(continue_final_message=True), dict(add_generation_prompt=False)),
             (tokenizer, messages, dict(continue_final_message=True, add_generation_prompt=False), {}),
             (templated, messages[:1], dict(chat_template_kwargs={"greeting": "Hello there. "}),
              dict(add_generation_prompt=True))]
    for tok, msgs, fields, implied in cases:
        job = parse_chat(dict(messages=msgs, **fields), tok)
        kwargs = dict(fields.pop("chat_template_kwargs", {}), **fields, **implied)
        want = tok.apply_chat_template(msgs, tokenize=True, return_dict=False, **kwargs)
        assert job.prompts[0] == want, fields
    continued = parse_chat(dict(messages=messages, continue_final_message=True), tokenizer).prompt_texts[0]
    assert continued.endswith("My answer is") and "Hello there" in parse_chat(
        dict(messages=messages[:1], chat_template_kwargs={"greeting": "Hello there. "}), templated).prompt_texts[0]
    for body, param, words in (
            (dict(continue_final_message=True, add_generation_prompt=True), "continue_final_message", "cannot both"),
            (dict(chat_template_kwargs=["x"]), "chat_template_kwargs", "must be an object"),
            (dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs", "may not set tools"),
            (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs", "may not set messages"),
            (dict(add_generation_prompt="yes"), "add_generation_prompt", "true or false")):
        with pytest.raises(RequestError, match=words) as e:
            parse_chat(dict(messages=messages, **body), tokenizer)
        assert e.value.param == param


def test_generation_config_sets_what_an_omitted_field_gets(tokenizer):
    """vLLM's --generation-config: the file's temperature, top_p, top_k (-1: off) and max_new_tokens (chat's
    max_tokens) are the defaults; values equal to transformers' defaults are none (vLLM reads the file's diff from
    them; min_p 0 is off); repetition_penalty and min_p too, as vLLM's; a request's own values win."""
    defaults, ignored = sampling_defaults(GENERATION, "gen.json")
    assert defaults == dict(temperature=0.0, top_p=0.95, top_k=40, max_tokens=5, repetition_penalty=1.1, min_p=0.05)
    assert ignored == {}
    assert sampling_defaults(dict(temperature=1.0, top_p=1.0, top_k=50, repetition_penalty=1.0, min_p=0.0,
                                  do_sample=True, eos_token_id=[1, 2]), "f") == ({}, {})
    assert sampling_defaults(dict(top_k=-1, temperature=0.6, max_new_tokens=None), "f") == \
        (dict(temperature=0.6, top_k=0), {})
    for bad, words in ((dict(temperature=-1), "temperature must be >= 0"), (dict(top_p=0), "top_p must lie in"),
                       (dict(top_k="40"), "top_k must be an integer"), (dict(max_new_tokens=0), "max_new_tokens must"),
                       (dict(temperature=True), "temperature must be a number"),
                       (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
                       (dict(min_p=2), r"min_p must lie in \[0, 1\]")):
        with pytest.raises(ValueError, match=f"gen.json: .*{words}"):
            sampling_defaults(bad, "gen.json")
    job = parse_completion(dict(prompt="hi"), tokenizer, defaults)
    assert (job.engine["temperature"], job.engine["top_p"], job.engine["top_k"], job.max_tokens) == (0.0, 0.95, 40, 16)
    assert job.max_tokens_cap == 5  # the file's max_new_tokens caps completions too (Server.engine_options)
    assert (job.engine["repetition_penalty"], job.engine["min_p"], job.engine["presence_penalty"]) == (1.1, 0.05, 0)
    job = parse_chat(dict(messages=[{"role": "user", "content": "hi"}], repetition_penalty=1, min_p=0,
                          presence_penalty=0.5), tokenizer, defaults)
    assert (job.engine["repetition_penalty"], job.engine["min_p"], job.engine["presence_penalty"]) == (1, 0, 0.5)
    job = parse_completion(dict(prompt="hi", temperature=0.7, top_p=1, top_k=-1, max_tokens=3), tokenizer, defaults)
    assert (job.engine["temperature"], job.engine["top_p"], job.engine["top_k"], job.max_tokens) == (0.7, 1.0, 0, 3)
    chat = dict(messages=[{"role": "user", "content": "hi"}])
    job = parse_chat(chat, tokenizer, defaults)
    assert (job.engine["temperature"], job.max_tokens, job.max_tokens_cap) == (0.0, None, 5)
    assert parse_chat(dict(chat, max_tokens=9, temperature=1), tokenizer, defaults).max_tokens == 9
    job = parse_chat(chat, tokenizer)  # no file: 1, 1, off, the rest of the context
    assert (job.engine["temperature"], job.engine["top_p"], job.engine["top_k"], job.max_tokens_cap) == \
        (1.0, 1.0, 0, None)


def test_the_servers_generation_config_is_the_default_of_omitted_fields(server, client, tokenizer, reference):
    """The module's server runs with --generation-config DIR (SERVED_GENERATION: temperature 0, max_new_tokens the
    whole context): an omitted temperature is greedy, completions' omitted max_tokens is OpenAI's 16 (as vLLM's), a
    request's own max_tokens is kept (its own temperature: test_n_seed_and_logprobs samples at 1). The cap of a
    smaller max_new_tokens: test_server_limits."""
    ids = tokenizer(PROMPTS[0])["input_ids"]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0])
    assert out.choices[0].text == reference(ids)[2] and out.usage.completion_tokens == len(reference(ids)[0])
    chat_ids = _chat_ids(tokenizer, PROMPTS[1])
    messages = [{"role": "user", "content": PROMPTS[1]}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert out.choices[0].message.content == reference(chat_ids, 8)[2]
    log = server.log.read_text()
    assert "Default sampling parameters have been overridden by the model's generation config" in log
    assert f"temperature=0.0, top_p=0.95, top_k=40, max_tokens={MAX_MODEL_LEN}, min_p=0.05" in log
    assert "NOT applied" not in log


def test_tokenize_detokenize_version_and_request_ids(server, tokenizer):
    """vLLM's /tokenize (a prompt, or messages as chat runs them), /detokenize and /version; bad input is an error
    object; every response carries the request's X-Request-Id back."""
    post = lambda path, **body: httpx.post(f"{server.url}{path}", json=body, timeout=60)
    out = post("/tokenize", model=MODEL, prompt=PROMPTS[0]).json()
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert out == dict(count=len(ids), max_model_len=MAX_MODEL_LEN, tokens=ids, token_strs=None)
    out = post("/tokenize", prompt=PROMPTS[0], add_special_tokens=False, return_token_strs=True).json()
    assert out["tokens"] == tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"] != ids
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat_ids = _chat_ids(tokenizer, PROMPTS[1])
    assert post("/tokenize", model=MODEL, messages=messages).json()["tokens"] == chat_ids
    bare = post("/tokenize", messages=messages, add_generation_prompt=False).json()["tokens"]
    assert bare == tokenizer.apply_chat_template(messages, add_generation_prompt=False, return_dict=True)["input_ids"]
    assert chat_ids[:len(bare)] == bare and len(bare) < len(chat_ids)  # without the assistant's header
    assert post("/detokenize", model=MODEL, tokens=ids).json() == dict(prompt=tokenizer.decode(ids))
    for path, body, status, param, words in (
            ("/tokenize", dict(model="gpt-9", prompt="hi"), 404, "model", "`gpt-9` does not exist"),
            ("/tokenize", dict(prompt=[1, 2]), 400, "prompt", "takes a prompt (a string) or messages"),
            ("/tokenize", dict(), 400, "prompt", "takes a prompt (a string) or messages"),
            ("/tokenize", dict(prompt="hi", add_special_tokens="yes"), 400, "add_special_tokens", "true or false"),
            ("/tokenize", dict(messages=[]), 400, "messages", "messages must be a non-empty list"),
            ("/tokenize", dict(prompt="hi", bogus=1), 400, "bogus", "Unrecognized request argument supplied: bogus"),
            ("/detokenize", dict(tokens=[5, 10**6]), 400, "tokens", "token ids must lie in [0, "),
            ("/detokenize", dict(tokens="5"), 400, "tokens", "tokens must be a list of token ids"),
            ("/detokenize", dict(tokens=[True]), 400, "tokens", "tokens must be a list of token ids"),
            ("/detokenize", dict(), 400, "tokens", "tokens is required")):
        response = post(path, **body)
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (status, param), (body, error)
        assert words in error["message"], (body, error)
    assert httpx.get(f"{server.url}/version").json() == {"version": importlib.metadata.version("swiftkv-jax")}
    for response in (httpx.get(f"{server.url}/health", headers={"X-Request-Id": "probe-1"}),
                     httpx.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "abc-2"},
                                json=dict(prompt="hi", max_tokens=1)),
                     httpx.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "bad-3"}, json={})):
        assert response.headers["x-request-id"] == response.request.headers["x-request-id"]
    assert "x-request-id" not in httpx.get(f"{server.url}/health").headers


# ---- the command line ------------------------------------------------------------------------------------------------
def test_serve_cli_errors(student, capsys):
    code = main(["serve", "--model", str(student / "teacher"), "--teacher-mode"])
    assert code == 2 and "not a SwiftKV model" in capsys.readouterr().err
    code = main(["serve", "--model", str(student / "student"), "--single-buckets", "4,x"])
    assert code == 2 and "--single-buckets takes comma-separated integers" in capsys.readouterr().err


def test_serve_reads_generation_config_and_api_key_as_vllm(tmp_path, monkeypatch, caplog):
    """--generation-config auto reads the model folder's file, vllm none, DIR that folder's (which must have one);
    --api-key, else $SWIFTKV_API_KEY, else $VLLM_API_KEY (a deployment moved from vLLM stays closed)."""
    from swiftkv_jax.infer_cli import _api_key, _sampling_defaults, parser

    (tmp_path / "generation_config.json").write_text(json.dumps(dict(temperature=0.6, top_p=0.9, min_p=0.1)))
    args = lambda *more: parser().parse_args(["serve", "--model", str(tmp_path), *more])
    monkeypatch.setattr(logging.getLogger("swiftkv_jax"), "propagate", True)  # main(["serve"...]) turned it off
    with caplog.at_level("INFO", logger="swiftkv_jax"):
        assert _sampling_defaults(args()) == dict(temperature=0.6, top_p=0.9, min_p=0.1)
    assert "overridden by the model's generation config" in caplog.text and "min_p=0.1" in caplog.text
    assert _sampling_defaults(args("--generation-config", "vllm")) == {}
    assert _sampling_defaults(args("--generation-config", str(tmp_path))) == dict(temperature=0.6, top_p=0.9,
                                                                                 min_p=0.1)
    with pytest.raises(ValueError, match="--generation-config .*: no generation_config.json there"):
        _sampling_defaults(args("--generation-config", str(tmp_path / "nowhere")))
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(top_p=2.0)))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must lie in \(0, 1\]"):
        _sampling_defaults(args())
    monkeypatch.delenv("SWIFTKV_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _api_key(args()) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert _api_key(args()) == "from-vllm"
    monkeypatch.setenv("SWIFTKV_API_KEY", "ours")
    assert _api_key(args()) == "ours" and _api_key(args("--api-key", "flag")) == "flag"
    monkeypatch.setenv("SWIFTKV_API_KEY", " ")
    with pytest.raises(ValueError, match="SWIFTKV_API_KEY is empty"):
        _api_key(args())


def test_sigterm_finishes_in_flight_requests_and_exits_0(server, tokenizer, reference):
    """Last: stops the module's server. A stream in flight at SIGTERM completes; the process exits 0 in the grace."""
    ids = tokenizer(PROMPTS[0])["input_ids"]
    started, result = threading.Event(), {}

    def stream():
        body = dict(model=MODEL, prompt=ids, max_tokens=MAX_MODEL_LEN - len(ids), temperature=0, stream=True)
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json=body) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    started.set()
        chunks = [json.loads(x[6:]) for x in lines[:-1]]
        result.update(text="".join(c["choices"][0]["text"] for c in chunks), done=lines[-1] == "data: [DONE]",
                      finish=chunks[-1]["choices"][0]["finish_reason"])

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert started.wait(30), "the stream did not start"
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=GRACE + 15)
    thread.join(30)
    assert code == 0, server.log.read_text()[-3000:]
    assert time.monotonic() - start < GRACE + 5
    assert result["done"] and result["finish"] in ("stop", "length"), result
    assert result["text"].startswith(reference(ids)[2])
    log = server.log.read_text()
    assert "pages wide: compiled in" in log and "warm-up: compiled 2 step buckets" in log

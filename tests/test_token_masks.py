"""vLLM's allowed_token_ids and bad_words in `sk.Engine` and the OpenAI server, without llguidance
(`serving.token_masks`): the bitmask rows and vLLM's bad-words rule on their own; greedy under allowed_token_ids is
the argmax over the allowed ids of the model's full-forward logits (`sk.logits`, numpy) at every step, the request
gets a token every step (its mask is constant: no pipeline break) and plain rows beside it are unchanged; bad_words
bans a word the greedy run produced (its last token only after its other tokens, checked against the rule in numpy at
every step) and runs every other step; a grammar-like host mask, allowed_token_ids and bad_words together apply
their AND, and one that leaves no token finishes its request with an error; the engine's refusals; both fields
through the `openai` client on chat and completions, and their 400s naming the field. CPU, fp32."""

from __future__ import annotations

import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.data.chat import load_tokenizer
from swiftkv_jax.serving import token_masks
from swiftkv_jax.serving.errors import InvalidRequest
from swiftkv_jax.serving.http.routes import make_app
from swiftkv_jax.serving.structured import words
from swiftkv_jax.tiny_assets import make_tiny_assets

from server_process import serve_app

ENGINE = dict(cache_dtype="float32", page_size=8, num_pages=64, max_num_seqs=4, max_num_batched_tokens=32,
              single_buckets=(4,), prompt_buckets=(32,), max_model_len=128)
N = 8  # tokens a request generates


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """(tokenizer, the tiny teacher, an engine on it, the assets' folder)."""
    root = make_tiny_assets(tmp_path_factory.mktemp("masks"), num_examples=60)
    model = sk.load(root / "teacher")
    return load_tokenizer(str(root / "teacher")), model, sk.Engine(model, **ENGINE), root


def encoder(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def steps_run(engine, requests: list[dict]) -> tuple[list, list]:
    """Add every request, step to the end: (the finished outputs in order, per request the numbers of the steps whose
    outputs gave it a token)."""
    ids = [engine.add_request(**r) for r in requests]
    done, when = {}, {i: [] for i in ids}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                when[out.request_id].append(step)
            if out.finished:
                done[out.request_id] = out
        step += 1
    return [done[i] for i in ids], [when[i] for i in ids]


def check_greedy(model, prompt: list, tokens: list, allowed) -> None:
    """Each greedy token is the argmax of the full forward's logits over `allowed(i, tokens before it)` ([V] bool)."""
    logits = np.asarray(sk.logits(model, np.array([prompt + tokens])))[0, len(prompt) - 1:]
    for i, token in enumerate(tokens):
        row = np.where(allowed(i, tokens[:i]), logits[i], -np.inf)
        assert token == int(np.argmax(row)), i


def banned_by_rule(word_ids: list, generated: list, vocab: int) -> np.ndarray:
    """vLLM's bad-words rule in plain numpy ([V] bool: allowed): a word's last token is banned where the generated
    tokens end with its other tokens (a one-token word: always)."""
    allowed = np.ones(vocab, bool)
    for word in word_ids:
        prefix = word[:-1]
        if len(generated) >= len(prefix) and generated[len(generated) - len(prefix):] == prefix:
            allowed[word[-1]] = False
    return allowed


def allowed_ids(row: np.ndarray) -> list:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist()


class _Only:
    """A grammar-like host mask that allows a fixed set of ids (no llguidance); counts its fills."""

    done = False

    def __init__(self, ids, vocab: int):
        self.row, self.fills = token_masks.allowed_row(ids, vocab), 0

    def fill(self, row):
        row[:] = self.row
        self.fills += 1

    def accept(self, token):
        pass


def test_rows_and_vllms_bad_words_rule():
    row = token_masks.allowed_row([0, 31, 32, 99], 100)
    assert row.dtype == np.int32 and row.shape == (words(100),) and allowed_ids(row) == [0, 31, 32, 99]
    token_masks.ban(row, [31, 99])  # bit 31: the sign bit of its word
    assert allowed_ids(row) == [0, 32]
    bad = token_masks.BadWords([[7], [3, 4, 5], [4, 9]], 40)
    full = np.zeros(words(40), np.int32)

    def banned():
        bad.fill(full)
        return sorted(set(range(40)) - set(allowed_ids(full)))

    assert banned() == [7]  # a one-token word: always; a longer one's last token: not before its prefix
    for token, want in [(3, [7]), (4, [5, 7, 9]), (5, [7]), (4, [7, 9]), (4, [7, 9]), (1, [7])]:
        bad.accept(token)
        assert banned() == want, token
    both = token_masks.Intersection([token_masks.BadWords([[2]], 40), _Only([1, 2, 3], 40)])
    both.fill(full)
    assert allowed_ids(full) == [1, 3] and not both.done
    # vLLM's tokenization: as is and with a leading space, the latter only where new and as long
    fake = {"cat": [5], " cat": [6], "two words": [1, 2], " two words": [3, 4], "x": [7], " x": [8, 9]}.get
    assert token_masks.bad_words_ids(["cat", "  two words", "x"], fake) == [[5], [6], [1, 2], [3, 4], [7]]


def test_allowed_greedy_is_the_argmax_over_allowed_ids_every_step_and_plain_rows_are_unchanged(assets):
    tokenizer, model, engine, _ = assets
    vocab = model.config.vocab_size
    allowed = sorted(np.random.default_rng(0).choice(vocab, 40, replace=False).tolist())
    prompts = [tokenizer(t)["input_ids"] for t in ("hello there", "the cat and the dog", "a fox")]
    plain = [dict(prompt=prompts[1], max_tokens=N, temperature=0.8, seed=1, logprobs=True, stop_token_ids=[]),
             dict(prompt=prompts[2], max_tokens=N, stop_token_ids=[])]
    (want_b, want_c), (steps_b, _) = steps_run(engine, plain)
    masked = dict(prompt=prompts[0], max_tokens=N, stop_token_ids=[], logprobs=True, allowed_token_ids=allowed)
    (a, b, c), (steps_a, _, _) = steps_run(engine, [masked] + plain)
    assert a.finish_reason == "length" and set(a.token_ids) <= set(allowed)
    mask = np.zeros(vocab, bool)
    mask[allowed] = True
    check_greedy(model, prompts[0], a.token_ids, lambda i, before: mask)
    for got, want in ((b, want_b), (c, want_c)):
        assert got.token_ids == want.token_ids
    np.testing.assert_allclose(b.logprobs, want_b.logprobs, atol=1e-4)
    # a token every step, as a plain request (a guided one: every other step, see the bad_words test)
    assert steps_a == list(range(steps_a[0], steps_a[0] + N)) and np.all(np.diff(steps_b) == 1)


def test_allowed_rows_survive_preemption_and_slot_reuse(assets):
    """A pool too small for the batch: sequences are preempted and come back in other slots, whose rows other
    requests (masked or not) held; each allowed request still gets the argmax over its own ids."""
    tokenizer, model, _, _ = assets
    vocab = model.config.vocab_size
    engine = sk.Engine(model, **{**ENGINE, "num_pages": 8})
    rng = np.random.default_rng(1)
    sets = [sorted(rng.choice(vocab, 30, replace=False).tolist()) for _ in range(3)]
    prompts = [tokenizer(t)["input_ids"] for t in ("one two three", "the dog", "a bird and a fox", "hello")]
    requests = [dict(prompt=p, max_tokens=20, stop_token_ids=[], **({"allowed_token_ids": ids} if ids else {}))
                for p, ids in zip(prompts, sets[:2] + [None] + sets[2:])]
    outs, _ = steps_run(engine, requests)
    assert engine.stats()["preemptions"] > 0
    for request, out in zip(requests, outs):
        mask = np.zeros(vocab, bool)
        mask[request.get("allowed_token_ids", slice(None))] = True
        check_greedy(model, request["prompt"], out.token_ids, lambda i, before: mask)


def test_bad_words_ban_a_word_greedy_produced_and_its_last_token_only_after_its_prefix(assets):
    tokenizer, model, engine, _ = assets
    vocab = model.config.vocab_size
    prompt = tokenizer("hello there")["input_ids"]
    (base,), _ = steps_run(engine, [dict(prompt=prompt, max_tokens=N, stop_token_ids=[])])
    base = base.token_ids
    # a two-token word of the greedy output that vLLM's tokenization of its text gives back
    k, word_ids = next((k, ids) for k in range(N - 1)
                       for ids in [token_masks.bad_words_ids([tokenizer.decode(base[k:k + 2])], encoder(tokenizer))]
                       if base[k:k + 2] in ids)
    (out,), (steps,) = steps_run(engine, [dict(prompt=prompt, max_tokens=N, stop_token_ids=[],
                                                bad_words_ids=word_ids)])
    got = out.token_ids
    assert got[:k + 1] == base[:k + 1] and got[k + 1] != base[k + 1]  # its first token still comes, not its second
    assert not any(got[i:i + 2] == base[k:k + 2] for i in range(N - 1))
    check_greedy(model, prompt, got, lambda i, before: banned_by_rule(word_ids, before, vocab))
    assert np.all(np.diff(steps) == 2)  # a host-side mask: every other step
    # words of one token each: a constant mask (folded into the allowed row), so every step, as allowed_token_ids
    (one,), (steps,) = steps_run(engine, [dict(prompt=prompt, max_tokens=N, stop_token_ids=[],
                                                bad_words_ids=[[base[0]], [base[1]]])])
    assert not {base[0], base[1]} & set(one.token_ids) and one.finish_reason == "length"
    check_greedy(model, prompt, one.token_ids, lambda i, before: banned_by_rule([[base[0]], [base[1]]], before, vocab))
    assert np.all(np.diff(steps) == 1)
    (both,), _ = steps_run(engine, [dict(prompt=prompt, max_tokens=N, stop_token_ids=[], bad_words_ids=[[base[0]]],
                                         allowed_token_ids=[base[0], base[1]])])
    assert both.token_ids == [base[1]] * N  # the allowed ids less the banned one


def test_a_grammar_allowed_ids_and_bad_words_apply_together_and_an_empty_mask_is_an_error(assets):
    tokenizer, model, engine, _ = assets
    vocab = model.config.vocab_size
    prompt = tokenizer("the cat")["input_ids"]
    grammar_ids, allowed = list(range(60, 140)), list(range(100, 200))
    (free,), _ = steps_run(engine, [dict(prompt=prompt, max_tokens=1, stop_token_ids=[], grammar=_Only(
        range(100, 140), vocab))])
    banned = free.token_ids[0]  # what the intersection alone picks first: bad_words removes it
    grammar = _Only(grammar_ids, vocab)
    (out,), _ = steps_run(engine, [dict(prompt=prompt, max_tokens=N, stop_token_ids=[], grammar=grammar,
                                        allowed_token_ids=allowed, bad_words_ids=[[banned]])])
    assert grammar.fills == N and set(out.token_ids) <= set(range(100, 140)) - {banned}
    mask = np.zeros(vocab, bool)
    mask[100:140] = True
    mask[banned] = False
    check_greedy(model, prompt, out.token_ids, lambda i, before: mask)
    plain = dict(prompt=prompt, max_tokens=4, stop_token_ids=[])
    (want,), _ = steps_run(engine, [plain])
    (empty, got), _ = steps_run(engine, [dict(prompt=prompt, max_tokens=N, grammar=_Only([1, 2], vocab),
                                              allowed_token_ids=[3, 4]), plain])
    assert empty.finish_reason == "error" and "allow no token" in empty.error and not empty.token_ids
    assert empty.error_param == "allowed_token_ids"  # the request's own settings: a server's 400
    assert got.token_ids == want.token_ids and got.finish_reason == "length"
    # min_tokens masks the stop ids: allowing only them leaves nothing (refused at once when static)
    (stopped,), _ = steps_run(engine, [dict(prompt=prompt, max_tokens=N, stop_token_ids=[5], min_tokens=2,
                                            grammar=_Only([5], vocab))])
    assert stopped.finish_reason == "error" and "min_tokens" in stopped.error and stopped.error_param == "min_tokens"
    (banned_all,), _ = steps_run(engine, [dict(prompt=prompt, max_tokens=N, grammar=_Only([7], vocab),
                                               bad_words_ids=[[7]])])
    assert banned_all.finish_reason == "error" and banned_all.error_param == "bad_words_ids"


@pytest.mark.parametrize("request_, param, message", [
    (dict(allowed_token_ids=[]), "allowed_token_ids", "must not be empty"),
    (dict(allowed_token_ids=[3, 10**6]), "allowed_token_ids", "must lie in"),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids", "integers"),
    (dict(allowed_token_ids=[5], stop_token_ids=[5], min_tokens=1), "allowed_token_ids", "min_tokens masks"),
    (dict(bad_words_ids=[[]]), "bad_words_ids", "non-empty list"),
    (dict(bad_words_ids=[[1, 10**6]]), "bad_words_ids", "non-empty list of ids in"),
    (dict(bad_words_ids="no"), "bad_words_ids", "list of lists"),
])
def test_engine_refusals_name_the_setting(assets, request_, param, message):
    engine = assets[2]
    with pytest.raises(InvalidRequest, match=message) as e:
        engine.add_request([1, 2, 3], **request_)
    assert e.value.param == param and not engine._live_ids


# ---- the server ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(assets):
    openai = pytest.importorskip("openai")
    tokenizer, _, _, root = assets
    with serve_app(make_app(sk.Engine(sk.load(root / "teacher"), **ENGINE), tokenizer, "m", max_waiting=16)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_allowed_token_ids_on_chat_and_completions(client, assets):
    tokenizer = assets[0]
    abc = tokenizer.convert_tokens_to_ids(["a", "b", "c"])
    extra = {"allowed_token_ids": abc}
    r = client.completions.create(model="m", prompt="hello", max_tokens=N, temperature=1.0, seed=3, extra_body=extra)
    text = r.choices[0].text
    assert len(text) == N and set(text) <= set("abc")
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=N,
                                       temperature=1.0, seed=4, n=2, extra_body=extra)
    for choice in r.choices:
        assert len(choice.message.content) == N and set(choice.message.content) <= set("abc")


def test_openai_client_bad_words_bans_a_word_greedy_produced(client, assets):
    tokenizer = assets[0]
    base = client.completions.create(model="m", prompt="hello there", max_tokens=N, temperature=0, logprobs=0)
    tokens = base.choices[0].logprobs.tokens
    # a token whose text vLLM's tokenization bans as one token (its text as is, or with the leading space)
    first = next(i for i, t in enumerate(tokens) if t.strip() and len(encoder(tokenizer)(t)) == 1
                 and [encoder(tokenizer)(t)] == token_masks.bad_words_ids([t.strip()], encoder(tokenizer))[-1:])
    r = client.completions.create(model="m", prompt="hello there", max_tokens=N, temperature=0, logprobs=0,
                                  extra_body={"bad_words": [tokens[first].strip()]})
    got = r.choices[0].logprobs.tokens
    assert got[:first] == tokens[:first] and tokens[first] not in got
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=N,
                                          temperature=0, extra_body={"bad_words": [tokens[first], "zz top"]})
    assert chat.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra, param, message", [
    ({"allowed_token_ids": "1,2"}, "allowed_token_ids", "list of token ids"),
    ({"allowed_token_ids": [1, True]}, "allowed_token_ids", "list of token ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids", "must lie in"),
    ({"bad_words": "cat"}, "bad_words", "list of non-empty strings"),
    ({"bad_words": ["cat", " "]}, "bad_words", "list of non-empty strings"),
    ({"bad_words": [3]}, "bad_words", "list of non-empty strings"),
])
def test_bad_values_are_400s_naming_the_field(client, extra, param, message):
    openai = pytest.importorskip("openai")
    for call in (lambda: client.completions.create(model="m", prompt="hi", max_tokens=2, extra_body=extra),
                 lambda: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=2, extra_body=extra)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param and message in e.value.body["message"]


def test_settings_that_leave_no_token_are_a_400_naming_one_and_the_server_goes_on(client, assets):
    """Settings each fine alone that together allow nothing are the request's error (400), not the server's (500):
    allowed_token_ids whose every token one-token bad_words ban, refused at once (constant masks); a choice grammar
    whose first tokens allowed_token_ids exclude, found at the first step (an error event once a stream has begun)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("llguidance")
    tokenizer = assets[0]
    word = next(w for w in ("a", "b", "c", "the") if len(encoder(tokenizer)(w)) == 1)
    chat = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    banned = {"allowed_token_ids": encoder(tokenizer)(word), "bad_words": [word]}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**chat, stream=stream, extra_body=banned)
        assert e.value.body["param"] == "bad_words" and "no token could be sampled" in e.value.body["message"]
    other = next(t for t in encoder(tokenizer)("zqx") if not tokenizer.decode([t]).startswith(("h", " h")))
    excluded = {"allowed_token_ids": [other], "structured_outputs": {"choice": ["hello"]}}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="hi", max_tokens=4, extra_body=excluded)
    assert e.value.body["param"] == "allowed_token_ids" and "allow no token" in e.value.body["message"]
    with pytest.raises(openai.APIError, match="allow no token"):
        list(client.chat.completions.create(**chat, stream=True, extra_body=excluded))
    assert client.completions.create(model="m", prompt="hi", max_tokens=2).choices[0].finish_reason == "length"

"""vLLM's min_tokens in the continuous engine (`sk.Engine`) and the server's text: per row against transformers'
MinNewTokensLengthLogitsProcessor; no masked stop id ever drawn (greedy, temperature, top-k, top-p, min_p); end to
end against full forwards (`sk.logits`) with the stop ids masked, the request then stopping at its stop id, the
logprobs the model's own; per-row isolation in mixed batches, preemption, slot reuse, the prefix cache; stop strings
that end in the text of the first min_tokens tokens do not stop it (vLLM's detokenizer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.serving import continuous
from swiftkv_jax.serving.errors import InvalidRequest
from swiftkv_jax.serving.http.text import ChoiceText
from swiftkv_jax.serving.ragged_step import mask_stops, sample_penalised, sample_rows
from swiftkv_jax.serving.sampling import MAX_MASKED_STOP_IDS

from test_continuous_engine import MAX_TOKENS, PROMPTS, alone, engine
from test_logit_bias import bias_table
from test_penalties import V, rows
from test_serving import MODELS

torch = pytest.importorskip("torch")
logits_process = pytest.importorskip("transformers.generation.logits_process")

K = 5  # width of the test's stop-id tables (the engine's: MAX_MASKED_STOP_IDS)


def stop_table(stops: list) -> jnp.ndarray:
    """The engine's per-slot stop ids [S, K], padded with V."""
    table = np.full((len(stops), K), V, np.int32)
    for slot, ids in enumerate(stops):
        table[slot, :len(ids)] = sorted(ids)
    return jnp.asarray(table)


def masked_rows(n: int, count, min_tokens, **settings):
    """`rows` with the flag the engine's host sets: fewer tokens generated than min_tokens."""
    count, min_tokens = np.broadcast_to(count, (n,)), np.broadcast_to(min_tokens, (n,))
    return rows(n, count=count, **settings).replace(masked=(count < min_tokens).astype(np.int32))


def test_mask_stops_per_row_is_transformers_min_new_tokens():
    """Each row its own slot's stop ids, count and min_tokens (some past it, some without any): the logits of
    MinNewTokensLengthLogitsProcessor; a row not masked, or a padding row (slot -1), is bit-identical."""
    rng = np.random.default_rng(0)
    n = 8
    logits = (rng.standard_normal((n, V)) * 3).astype(np.float32)
    stops = [rng.choice(V, int(rng.integers(1, K + 1)), replace=False).tolist() for _ in range(n)]
    count = np.array([0, 2, 5, 3, 0, 7, 1, 0])
    min_tokens = np.array([1, 3, 5, 0, 4, 9, 2, 3])
    slots = rng.permutation(n).astype(np.int32)
    slots[-1] = -1
    s = masked_rows(n, count, min_tokens)
    got = np.asarray(jax.jit(mask_stops)(jnp.asarray(logits), stop_table(stops), s, slots))
    prompt = 4
    for i in range(n):
        if slots[i] < 0 or count[i] >= min_tokens[i]:
            np.testing.assert_array_equal(got[i], logits[i])
            continue
        processor = logits_process.MinNewTokensLengthLogitsProcessor(prompt, int(min_tokens[i]), stops[slots[i]])
        ids = torch.zeros((1, prompt + int(count[i])), dtype=torch.long)
        want = processor(ids, torch.tensor(logits[i:i + 1])).numpy()[0]
        np.testing.assert_array_equal(got[i], want)
        assert np.isneginf(got[i, stops[slots[i]]]).all()


def test_no_sampling_draws_a_masked_stop_id():
    """4,000 rows of one distribution whose two most likely tokens are the stop ids, at temperature 1 with top-k,
    top-p, min_p or none, and greedy: a masked row never draws a stop id (nor with a +100 bias on one), and draws
    from the rest as `sample_rows` of the masked logits; rows past min_tokens draw the plain tokens, the stop ids
    among them. One cond over the whole step."""
    n = 4000
    row = np.log(np.array([0.3, 0.25, 0.15, 0.1, 0.08, 0.05, 0.04, 0.03] + [1e-4] * (V - 8)))
    logits = jnp.asarray(np.tile(row, (n, 1)), jnp.float32)
    slots = np.arange(n, dtype=np.int32) % 2  # slot 0 with a +100 bias on stop id 0, slot 1 without
    table = stop_table([[0, 1], [0, 1]])
    bias = bias_table([{0: 100.0}, {}])
    counts = jnp.zeros((2, V), jnp.int32)
    pick = np.arange(n) % 5
    settings = dict(temperature=np.where(pick == 4, 0.0, 1.0), top_k=np.where(pick == 1, 3, 0),
                    top_p=np.where(pick == 2, 0.8, 1.0), min_p=np.where(pick == 3, 0.2, 0.0), seed=3)
    count = np.arange(n) % 7
    s = masked_rows(n, count, 4, **settings)  # rows of count 4, 5, 6 are past it
    got = np.asarray(jax.jit(sample_penalised)(logits, s, counts, slots, bias, table))
    masked = count < 4
    assert not np.isin(got[masked], [0, 1]).any()
    assert (got[masked & (pick == 4)] == 2).all()  # greedy: the most likely token left
    assert np.isin(got[~masked], [0, 1]).mean() > 0.5  # the bias of slot 0 and the stop ids' own mass
    want = sample_rows(jnp.where(jnp.isin(jnp.arange(V), jnp.array([0, 1])), -jnp.inf, logits), s)
    unbiased = masked & (slots == 1)
    np.testing.assert_array_equal(got[unbiased], np.asarray(want)[unbiased])
    plain = np.asarray(sample_rows(logits, s))
    np.testing.assert_array_equal(got[~masked & (slots == 1)], plain[~masked & (slots == 1)])
    # no row masked (nor penalised, nor biased): the plain tokens, the tables unread
    off = masked_rows(n, count, 0, **settings)
    np.testing.assert_array_equal(np.asarray(sample_penalised(logits, off, counts, np.ones(n, np.int32), None,
                                                              table)), plain)
    jaxpr = jax.make_jaxpr(sample_penalised)(logits, s, counts, slots, bias, table)
    conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 1 and [v.aval.shape for v in conds[0].outvars] == [(n,)]


def masked_reference(prompt, max_tokens: int, stops, min_tokens: int):
    """(greedy tokens, their logprobs) to a stop id or max_tokens: each the argmax of the full forward's (sk.logits)
    last row through transformers' MinNewTokensLengthLogitsProcessor; logprobs the model's own."""
    model, swiftkv = MODELS["swiftkv-g1"]
    processor = logits_process.MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, sorted(stops))
    tokens, out, logprobs = list(prompt), [], []
    while len(out) < max_tokens and not (out and out[-1] in stops):
        raw = np.asarray(sk.logits(model, np.asarray([tokens]), swiftkv=swiftkv), np.float32)[0, -1:]
        masked = processor(torch.tensor([tokens]), torch.tensor(raw)).numpy()[0]
        out.append(int(np.argmax(masked)))
        logprobs.append(float(jax.nn.log_softmax(raw[0].astype(np.float64))[out[-1]]))
        tokens.append(out[-1])
    return out, logprobs


# (prompt, min_tokens): the stop id is the prompt's plain greedy first token (so without min_tokens it stops at once)
GREEDY = [(3, 3), (5, 2), (7, 3)]


@pytest.mark.parametrize("index, min_tokens", GREEDY)
def test_greedy_min_tokens_is_the_masked_full_forward_then_stops_at_the_stop_id(index, min_tokens):
    prompt = PROMPTS[index]
    stop = int(alone("swiftkv-g1", tuple(prompt))[0][0])
    eng = engine("swiftkv-g1")
    out = eng.generate([prompt], max_tokens=MAX_TOKENS, stop_token_ids=[stop], min_tokens=min_tokens,
                       logprobs=True)[0]
    want, logprobs = masked_reference(prompt, MAX_TOKENS, {stop}, min_tokens)
    assert out.token_ids == want and out.finish_reason == "stop"
    assert len(want) > min_tokens and want[-1] == stop and stop not in want[:-1]
    np.testing.assert_allclose(out.logprobs, logprobs, atol=1e-4)
    assert eng.generate([prompt], max_tokens=MAX_TOKENS, stop_token_ids=[stop])[0].token_ids == [stop]


def test_min_tokens_masks_the_configs_eos_ids_by_default():
    """No stop_token_ids: the config's EOS ids are the ones masked (and those that stop it after)."""
    model, swiftkv = MODELS["swiftkv-g1"]
    prompt = PROMPTS[7]
    stop = int(alone("swiftkv-g1", tuple(prompt))[0][0])
    eos = sk.Engine(model.replace(config=model.config.replace(eos_token_id=[stop])), swiftkv=swiftkv, page_size=4,
                    num_pages=40, max_num_seqs=4, max_num_batched_tokens=16, cache_dtype="float32",
                    single_buckets=(4,), prompt_buckets=(64,), max_model_len=96)
    out = eos.generate([prompt], max_tokens=MAX_TOKENS, min_tokens=3)[0]
    assert out.token_ids == masked_reference(prompt, MAX_TOKENS, {stop}, 3)[0] and out.finish_reason == "stop"


def run_mixed(num_pages: int, max_num_seqs: int = 4):
    """8 requests over the slots (reused), rows with min_tokens between plain rows that have the same stop id (their
    greedy first token: they stop at once) or none: each gets exactly its own reference."""
    firsts = [int(alone("swiftkv-g1", tuple(PROMPTS[i]))[0][0]) for i in range(8)]
    settings = [dict(min_tokens=MAX_TOKENS, stop_token_ids=[firsts[0]]), dict(stop_token_ids=[firsts[1]]),
                dict(min_tokens=3, stop_token_ids=[firsts[3]]), dict(stop_token_ids=[]),
                dict(min_tokens=2, stop_token_ids=[firsts[5]]), dict(stop_token_ids=[firsts[5]]),
                dict(min_tokens=6, stop_token_ids=[firsts[2], firsts[6]]), dict(stop_token_ids=[firsts[7]])]
    prompts = [PROMPTS[[0, 1, 3, 2, 5, 5, 6, 7][i]] for i in range(8)]
    eng = engine("swiftkv-g1", num_pages=num_pages, max_num_seqs=max_num_seqs,
                 **(dict(single_buckets=(1,), mixed_single_buckets=(1,)) if max_num_seqs == 1 else {}))
    ids = [eng.add_request(p, max_tokens=MAX_TOKENS, **kw) for p, kw in zip(prompts, settings)]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    for rid, prompt, kw in zip(ids, prompts, settings):
        stops = set(kw["stop_token_ids"])
        if "min_tokens" in kw:
            assert done[rid].token_ids == masked_reference(prompt, MAX_TOKENS, stops, kw["min_tokens"])[0], kw
        elif stops:  # the plain greedy first token is its stop id
            assert done[rid].token_ids == [alone("swiftkv-g1", tuple(prompt))[0][0]] and \
                done[rid].finish_reason == "stop", kw
        else:
            assert done[rid].token_ids == list(alone("swiftkv-g1", tuple(prompt))[0])
    return eng


def test_a_batch_of_min_tokens_and_plain_requests_keeps_each_rows_own():
    assert run_mixed(40).stats()["preemptions"] == 0


def test_preempted_requests_keep_masking_until_min_tokens():
    """A pool of 14 pages preempts: a recomputed request takes a slot again, its stop ids written there again, and
    its count of tokens goes on from what it had."""
    assert run_mixed(14).stats()["preemptions"] > 0


def test_one_slot_reused_by_requests_with_and_without_min_tokens():
    run_mixed(40, max_num_seqs=1)


def test_a_prefix_cache_hit_masks_as_a_miss():
    prompt = PROMPTS[2]  # 40 tokens: 9 pages of 4 cached
    stop = int(alone("swiftkv-g1", tuple(prompt))[0][0])
    eng = engine("swiftkv-g1")
    request = dict(max_tokens=MAX_TOKENS, stop_token_ids=[stop], min_tokens=4)
    miss = eng.generate([prompt], **request)[0].token_ids
    hits = eng.stats()["prefix_cache_hits"]
    hit = eng.generate([prompt], **request)[0].token_ids
    assert eng.stats()["prefix_cache_hits"] - hits >= 36
    assert hit == miss == masked_reference(prompt, MAX_TOKENS, {stop}, 4)[0]


def test_sampled_requests_never_stop_before_min_tokens():
    """Temperature 1 over 24 seeds with half the vocabulary as stop ids: without min_tokens most stop within 4
    tokens; with min_tokens=4 none does, and each that stops after ends on a stop id."""
    stops = list(range(0, 96, 2))
    eng = engine("swiftkv-g1")

    def outputs(**kw):
        ids = [eng.add_request(PROMPTS[seed % len(PROMPTS)], seed=seed, max_tokens=MAX_TOKENS, temperature=1.0,
                               stop_token_ids=stops, **kw) for seed in range(24)]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o for o in eng.step() if o.finished})
        return [done[i] for i in ids]

    assert sum(len(o.token_ids) <= 4 for o in outputs()) > 12
    masked = outputs(min_tokens=4)
    for out in masked:
        assert len(out.token_ids) > 4 and not set(out.token_ids[:4]) & set(stops)
        assert out.finish_reason == "length" or out.token_ids[-1] in stops and not set(out.token_ids[4:-1]) & set(
            stops)
    assert sum(o.finish_reason == "stop" for o in masked) > 12


@pytest.mark.parametrize("value, message", [
    (-1, "min_tokens must be greater than or equal to 0, got -1"),
    (MAX_TOKENS + 1, f"min_tokens must be less than or equal to max_tokens={MAX_TOKENS}, got {MAX_TOKENS + 1}"),
    (1.5, "min_tokens must be an integer"),
    ("2", "min_tokens must be an integer"),
    (True, "min_tokens must be an integer"),
])
def test_bad_min_tokens_is_refused_by_name(value, message):
    with pytest.raises(InvalidRequest, match=message) as e:
        engine("swiftkv-g1").add_request([1, 2, 3], max_tokens=MAX_TOKENS, min_tokens=value)
    assert e.value.param == "min_tokens"


def test_too_many_stop_ids_to_mask_are_refused_only_with_min_tokens(monkeypatch):
    """The engine's table holds MAX_MASKED_STOP_IDS (128) stop ids a slot: 4 here, the test model's vocabulary being
    96 (no step runs)."""
    assert MAX_MASKED_STOP_IDS == 128
    monkeypatch.setattr(continuous, "MAX_MASKED_STOP_IDS", 4)
    eng = engine("swiftkv-g1")
    assert eng.stops.shape == (4, 4)
    many = [5, 6, 7, 8, 9, 9]
    eng.add_request([1, 2, 3], stop_token_ids=many)
    eng.add_request([1, 2, 3], stop_token_ids=many[1:], min_tokens=2)
    with pytest.raises(InvalidRequest, match="min_tokens masks at most 4 stop token ids, but this request has 5") as e:
        eng.add_request([1, 2, 3], stop_token_ids=many, min_tokens=2)
    assert e.value.param == "min_tokens"


def test_sk_generate_refuses_min_tokens_naming_the_engine():
    model, swiftkv = MODELS["swiftkv-g1"]
    with pytest.raises(InvalidRequest, match="use sk.Engine") as e:
        sk.generate(model, [PROMPTS[0]], 2, swiftkv=swiftkv, min_tokens=1)
    assert e.value.param == "min_tokens"
    with pytest.raises(InvalidRequest, match="min_tokens must be less than or equal to max_tokens=2"):
        sk.generate(model, [PROMPTS[0]], 2, swiftkv=swiftkv, min_tokens=3)
    assert list(sk.generate(model, [PROMPTS[0]], MAX_TOKENS, swiftkv=swiftkv, cache_dtype="float32", min_tokens=0,
                            stop_token_ids=[], max_len=80).tokens[0]) == list(alone("swiftkv-g1", tuple(PROMPTS[0]))[0])


# ---- stop strings (the server's text) ----------------------------------------------------------------------------
class _Words:
    """A tokenizer whose token i is WORDS[i]."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(WORDS[i] for i in ids)


# vLLM's own case (tests/detokenizer/test_min_tokens.py): " is Lee, and I'm a student in the college of engineering"
WORDS = [" is", " Lee", ",", " and", " I", "'m", " a", " stud", "ent", " in", " the", " college", " of", " engineering"]


@pytest.mark.parametrize("min_tokens, stop, want", [
    (0, "e", " is L"),
    (5, "e", " is Lee, and I'm a stud"),   # the e's of " Lee" are in the first 5 tokens' text
    (2, "Lee,", " is "),                   # begins in that text, ends past it: it stops
    (2, "Lee", " is Lee, and I'm a student in the college of engineering"),
    (14, "e", " is Lee, and I'm a student in the college of engineering"),
])
def test_a_stop_string_in_the_first_min_tokens_tokens_text_does_not_stop(min_tokens, stop, want):
    """As vLLM's detokenizer: token by token and all at once, streamed pieces adding up to the text."""
    for pieces in ([[i] for i in range(len(WORDS))], [list(range(len(WORDS)))], [[0, 1, 2], list(range(3, 14))]):
        text = ChoiceText(_Words(), [], [stop, "\u2603never"], min_tokens)
        sent = "".join(text.add(p) for p in pieces) + text.finish()
        assert sent == text.text == want and text.stopped == (want != "".join(WORDS)), pieces

"""vLLM's sampling penalties and min_p in the continuous engine (`sk.Engine`): per row against transformers'
RepetitionPenaltyLogitsProcessor and MinPLogitsWarper and OpenAI's presence / frequency formula; end to end against
full forwards (`sk.logits`) with the penalties applied in numpy, per-row isolation, slot reuse, preemption and the
prefix cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.serving.errors import InvalidRequest
from swiftkv_jax.serving.ragged_step import (PROMPT_BIT, Sampled, apply_penalties, count_tokens,
                                             sample_penalised, sample_rows)
from swiftkv_jax.serving.sampling import SamplingParams, sample

from test_continuous_engine import MAX_TOKENS, PROMPTS, alone, engine
from test_serving import MODELS

torch = pytest.importorskip("torch")
logits_process = pytest.importorskip("transformers.generation.logits_process")

V = 50


def rows(n: int, **settings) -> Sampled:
    """n rows, greedy and every setting off, but `settings` ([n] arrays or scalars)."""
    full = lambda name, value, dtype: np.broadcast_to(np.asarray(settings.get(name, value), dtype), (n,)).copy()
    return Sampled(full("temperature", 0, np.float32), full("top_k", 0, np.int32), full("top_p", 1, np.float32),
                   full("seed", 0, np.int32), full("count", 0, np.int32), full("min_p", 0, np.float32),
                   full("repetition_penalty", 1, np.float32), full("presence_penalty", 0, np.float32),
                   full("frequency_penalty", 0, np.float32))


def random_history(rng, n: int):
    """Per row a prompt and an output (token ids, repeats included) and the engine's counts rows [n, V]."""
    prompts = [rng.integers(0, V, rng.integers(1, 12)).tolist() for _ in range(n)]
    outputs = [rng.integers(0, V, rng.integers(0, 15)).tolist() for _ in range(n)]
    counts = np.zeros((n, V), np.int32)
    for i in range(n):
        counts[i, prompts[i]] = PROMPT_BIT
        np.add.at(counts[i], outputs[i], 1)
    return prompts, outputs, counts


def test_penalties_per_row_are_transformers_repetition_penalty_and_openais_formula():
    """Each row its own penalties (off in some): repetition as transformers' RepetitionPenaltyLogitsProcessor over
    the prompt and the output, then OpenAI's logit - presence x (n > 0) - frequency x n over the output only."""
    rng = np.random.default_rng(0)
    n = 8
    logits = (rng.standard_normal((n, V)) * 3).astype(np.float32)
    prompts, outputs, counts = random_history(rng, n)
    repetition = np.array([1.0, 1.3, 0.7, 5.0, 1.0, 1.0, 2.0, 1.0], np.float32)
    presence = np.array([0.0, 0.0, 0.0, 0.0, 1.5, 0.0, -0.5, 2.0], np.float32)
    frequency = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.7, 0.3, -2.0], np.float32)
    s = rows(n, repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency)
    slots = rng.permutation(n).astype(np.int32)  # the rows read their own slot's counts
    table = np.zeros_like(counts)
    table[slots] = counts
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), s, jnp.asarray(table), slots))
    for i in range(n):
        scores = torch.tensor(logits[i:i + 1])
        seen = torch.tensor([prompts[i] + outputs[i]])
        want = logits_process.RepetitionPenaltyLogitsProcessor(float(repetition[i]))(seen, scores).numpy()[0]
        output = np.bincount(outputs[i], minlength=V)
        want = want - frequency[i] * output - presence[i] * (output > 0)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    # no row penalised: the logits as they are
    np.testing.assert_array_equal(np.asarray(apply_penalties(jnp.asarray(logits), rows(n), jnp.asarray(table), slots)),
                                  logits)


def test_sample_penalised_branches_give_tokens_not_logits():
    """The engine step's sampling: the penalised rows' tokens are `sample_rows` of the penalised logits, the plain
    ones' of the logits; the lax.cond that skips the penalties when no row has one returns only tokens [U], so its
    plain branch does not copy the [U, V] logits (which the step keeps for the logprobs)."""
    rng = np.random.default_rng(1)
    n = 6
    logits = jnp.asarray((rng.standard_normal((n, V)) * 3).astype(np.float32))
    _, _, counts = random_history(rng, n)
    slots = np.arange(n, dtype=np.int32)
    for s in (rows(n), rows(n, repetition_penalty=[1.0, 3.0, 1.0, 0.5, 1.0, 1.0], frequency_penalty=[0.0] * 5 + [2.0])):
        want = sample_rows(apply_penalties(logits, s, jnp.asarray(counts), slots), s)
        got = jax.jit(sample_penalised)(logits, s, jnp.asarray(counts), slots)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    jaxpr = jax.make_jaxpr(sample_penalised)(logits, rows(n), jnp.asarray(counts), slots)
    conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 1 and [v.aval.shape for v in conds[0].outvars] == [(n,)]


def test_count_tokens_adds_the_penalised_rows_tokens_only():
    counts = jnp.zeros((4, V), jnp.int32).at[2, 7].set(PROMPT_BIT)
    s = rows(4, repetition_penalty=[1.0, 1.2, 1.0, 1.0], presence_penalty=[0.0, 0.0, 0.5, 0.5])
    got = np.asarray(count_tokens(counts, s, np.array([0, 1, 2, -1], np.int32), np.array([3, 4, 7, 9], np.int32)))
    want = np.zeros((4, V), np.int32)
    want[1, 4], want[2, 7] = 1, PROMPT_BIT + 1  # row 0: no penalty; row 3: padding (slot -1)
    np.testing.assert_array_equal(got, want)


def minp_distribution(row, temperature: float, min_p: float) -> np.ndarray:
    """transformers' TemperatureLogitsWarper then MinPLogitsWarper on one row: probabilities [V]."""
    scores = torch.tensor(np.asarray(row, np.float32)[None])
    scores = logits_process.TemperatureLogitsWarper(temperature)(None, scores)
    scores = logits_process.MinPLogitsWarper(min_p)(None, scores)
    return torch.softmax(scores.double(), -1)[0].numpy()


@pytest.mark.parametrize("temperature, min_p", [(1.0, 0.1), (1.0, 0.35), (0.5, 0.05), (2.0, 0.3), (1.0, 1.0)])
def test_min_p_draws_from_transformers_distribution(temperature, min_p):
    """4,000 draws of one row (each its own count), by the engine's `sample_rows` and the static `sample`: only
    tokens MinPLogitsWarper keeps after the temperature, at its frequencies."""
    n = 4000
    row = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]))
    want = minp_distribution(row, temperature, min_p)
    logits = jnp.asarray(np.tile(row, (n, 1)), jnp.float32)
    engine_draws = np.asarray(jax.jit(sample_rows)(logits, rows(n, temperature=temperature, min_p=min_p, seed=3,
                                                                 count=np.arange(n))))
    static_draws = np.asarray(sample(logits, jax.random.key(0), SamplingParams(temperature, min_p=min_p)))
    for tokens in (engine_draws, static_draws):
        assert set(np.unique(tokens).tolist()) <= set(np.nonzero(want)[0].tolist())
        assert 0.5 * np.abs(np.bincount(tokens, minlength=len(row)) / n - want).sum() < 0.03


def penalised_reference(name, prompt, n, repetition=1.0, presence=0.0, frequency=0.0):
    """Greedy tokens, each the argmax of the full forward's (sk.logits) last row with the penalties in numpy."""
    model, swiftkv = MODELS[name]
    tokens = list(prompt)
    out = []
    for _ in range(n):
        logits = np.asarray(sk.logits(model, np.asarray([tokens]), swiftkv=swiftkv), np.float64)[0, -1]
        seen = np.zeros(len(logits), bool)
        seen[tokens] = True
        logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
        counts = np.bincount(out, minlength=len(logits))
        logits = logits - frequency * counts - presence * (counts > 0)
        out.append(int(np.argmax(logits)))
        tokens.append(out[-1])
    return out


REPEATS = PROMPTS[0]  # its plain greedy tokens repeat (checked below)


def test_greedy_repetition_penalty_is_the_full_forward_penalised_and_stops_the_repeats():
    """Greedy with repetition_penalty=5: the argmax of the penalised full-forward logits at each step; where plain
    greedy repeats a token, it repeats none (nor its prompt's)."""
    plain = alone("swiftkv-g1", tuple(REPEATS))[0]
    assert len(set(plain)) < len(plain)
    got = engine("swiftkv-g1").generate([REPEATS], max_tokens=MAX_TOKENS, stop_token_ids=[],
                                        repetition_penalty=5.0)[0].token_ids
    assert got == penalised_reference("swiftkv-g1", REPEATS, MAX_TOKENS, repetition=5.0)
    assert len(set(got)) == len(got) and not set(got) & set(REPEATS)


PENALISED = [dict(repetition_penalty=5.0), dict(presence_penalty=2.0, frequency_penalty=1.0),
             dict(repetition_penalty=1.5, frequency_penalty=-0.5, presence_penalty=0.5)]


def lone(prompt, **kw):
    return engine("swiftkv-g1").generate([prompt], max_tokens=MAX_TOKENS, stop_token_ids=[], **kw)[0].token_ids


def run_mixed(num_pages: int, settings=None, reference=None):
    """8 requests over 4 slots (slots reused), plain ones between penalised ones, sampled ones too: the plain get
    the exact tokens of a run without penalties, the penalised those of their full-forward reference (greedy) or of
    their run alone (sampled: a seed), whatever slot held which request before. settings: the 8 requests' options
    (default: the penalties'), reference(prompt, options): a greedy one's tokens (default: `penalised_reference`)."""
    sampled = dict(temperature=1.0, seed=5, min_p=0.05, repetition_penalty=1.3, presence_penalty=1.0)
    settings = settings or [PENALISED[0], {}, PENALISED[1], {}, sampled, PENALISED[2], {}, PENALISED[0]]
    reference = reference or (lambda prompt, kw: penalised_reference(
        "swiftkv-g1", prompt, MAX_TOKENS, repetition=kw.get("repetition_penalty", 1.0),
        presence=kw.get("presence_penalty", 0.0), frequency=kw.get("frequency_penalty", 0.0)))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    eng = engine("swiftkv-g1", num_pages=num_pages)
    ids = [eng.add_request(p, max_tokens=MAX_TOKENS, stop_token_ids=[], **kw) for p, kw in zip(prompts, settings)]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    for rid, prompt, kw in zip(ids, prompts, settings):
        if not kw:
            assert done[rid].token_ids == alone("swiftkv-g1", tuple(prompt))[0]
        elif "temperature" in kw:
            assert done[rid].token_ids == lone(prompt, **kw)
        else:
            assert done[rid].token_ids == reference(prompt, kw), kw
        if kw:  # the settings change what it says
            assert done[rid].token_ids != alone("swiftkv-g1", tuple(prompt))[0] or "temperature" in kw
    return eng


def test_a_batch_of_penalised_and_plain_requests_keeps_each_rows_own():
    assert run_mixed(40).stats()["preemptions"] == 0


def test_preempted_penalised_requests_recount_what_they_had():
    """A pool of 14 pages preempts: the recomputed requests' counts are rebuilt from their tokens so far."""
    assert run_mixed(14).stats()["preemptions"] > 0


def test_a_reused_slot_starts_from_its_own_requests_tokens():
    """One slot, one request after another: the second's penalties see its own tokens, not the first's (whose
    output and prompt would otherwise be penalised in it)."""
    eng = engine("swiftkv-g1", max_num_seqs=1, single_buckets=(1,), mixed_single_buckets=(1,))
    first = eng.generate([REPEATS], max_tokens=MAX_TOKENS, stop_token_ids=[], **PENALISED[1])[0].token_ids
    second = eng.generate([PROMPTS[2]], max_tokens=MAX_TOKENS, stop_token_ids=[], repetition_penalty=5.0)[0]
    assert second.token_ids == penalised_reference("swiftkv-g1", PROMPTS[2], MAX_TOKENS, repetition=5.0)
    assert first == penalised_reference("swiftkv-g1", REPEATS, MAX_TOKENS, presence=2.0, frequency=1.0)


def test_a_prefix_cache_hit_gives_what_a_miss_gives():
    """A penalised prompt found in the prefix cache (its pages never run through a step) penalises its whole prompt
    as the miss did: the same tokens, equal to the engine without the cache."""
    prompt = PROMPTS[2]  # 40 tokens: 9 pages of 4 cached
    eng = engine("swiftkv-g1")
    miss = eng.generate([prompt], max_tokens=MAX_TOKENS, stop_token_ids=[], repetition_penalty=5.0)[0].token_ids
    hits = eng.stats()["prefix_cache_hits"]
    hit = eng.generate([prompt], max_tokens=MAX_TOKENS, stop_token_ids=[], repetition_penalty=5.0)[0].token_ids
    assert eng.stats()["prefix_cache_hits"] - hits >= 36
    assert hit == miss == penalised_reference("swiftkv-g1", prompt, MAX_TOKENS, repetition=5.0) == engine(
        "swiftkv-g1", enable_prefix_caching=False).generate([prompt], max_tokens=MAX_TOKENS, stop_token_ids=[],
                                                            repetition_penalty=5.0)[0].token_ids


@pytest.mark.parametrize("setting, value, message", [
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("repetition_penalty", -1.0, "repetition_penalty must be > 0"),
    ("presence_penalty", 2.5, r"presence_penalty must lie in \[-2, 2\]"),
    ("frequency_penalty", -3, r"frequency_penalty must lie in \[-2, 2\]"),
    ("min_p", 1.5, r"min_p must lie in \[0, 1\]"),
    ("min_p", float("nan"), "min_p must be a finite number"),
    ("repetition_penalty", "2", "repetition_penalty must be a finite number"),
])
def test_bad_penalties_are_refused_by_name(setting, value, message):
    with pytest.raises(InvalidRequest, match=message) as e:
        engine("swiftkv-g1").add_request([1, 2, 3], **{setting: value})
    assert e.value.param == setting


def test_sk_generate_takes_min_p_and_refuses_penalties_naming_the_engine():
    model, swiftkv = MODELS["swiftkv-g1"]
    request = dict(swiftkv=swiftkv, cache_dtype="float32", stop_token_ids=[], max_len=80)
    # min_p=1 keeps the most likely token only: greedy, whatever the temperature
    got = sk.generate(model, [PROMPTS[0]], MAX_TOKENS, temperature=1.5, min_p=1.0, seed=3, **request).tokens[0]
    assert list(got) == list(alone("swiftkv-g1", tuple(PROMPTS[0]))[0])
    for setting in (dict(repetition_penalty=1.2), dict(presence_penalty=0.5), dict(frequency_penalty=-1.0)):
        with pytest.raises(InvalidRequest, match="use sk.Engine") as e:
            sk.generate(model, [PROMPTS[0]], 2, **setting, **request)
        assert e.value.param == next(iter(setting))
    with pytest.raises(InvalidRequest, match="min_p must lie in"):
        sk.generate(model, [PROMPTS[0]], 2, min_p=-0.1, **request)

"""OpenAI's logit_bias in the continuous engine (`sk.Engine`): per row against transformers'
SequenceBiasLogitsProcessor (single-token biases) and a numpy reference, in vLLM V1's order (the bias, then the
penalties, then the temperature and the rest); end to end against full forwards (`sk.logits`) with the bias added in
numpy, per-row isolation in mixed batches, slot reuse, preemption, and the model's own logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.serving.errors import InvalidRequest
from swiftkv_jax.serving.ragged_step import apply_bias, apply_penalties, sample_penalised, sample_rows
from swiftkv_jax.serving.sampling import MAX_LOGIT_BIAS

from test_continuous_engine import MAX_TOKENS, PROMPTS, alone, engine
import test_penalties as penalties
from test_penalties import V, lone, random_history, rows
from test_serving import MODELS

torch = pytest.importorskip("torch")
logits_process = pytest.importorskip("transformers.generation.logits_process")

K = 6  # entries of the test's bias tables (the engine's: MAX_LOGIT_BIAS)


def bias_table(biases: list[dict]):
    """The engine's sparse table (ids [S, K] padded with V, values [S, K]) of per-slot {id: bias}."""
    ids, values = np.full((len(biases), K), V, np.int32), np.zeros((len(biases), K), np.float32)
    for slot, bias in enumerate(biases):
        ids[slot, :len(bias)], values[slot, :len(bias)] = list(bias), list(bias.values())
    return jnp.asarray(ids), jnp.asarray(values)


def random_biases(rng, n: int) -> list[dict]:
    """n slots' biases: some none, some -100 / +100, some small, some on several ids."""
    out = []
    for i in range(n):
        ids = rng.choice(V, int(rng.integers(0, K + 1)) if i % 3 else 0, replace=False)
        out.append({int(t): float(rng.choice([-100.0, 100.0, rng.uniform(-5, 5)])) for t in ids})
    return out


def test_apply_bias_per_row_is_transformers_sequence_bias():
    """Each row its own slot's bias (some rows none, padding rows none) is SequenceBiasLogitsProcessor with those
    single-token biases; a row with no bias is bit-identical to the logits."""
    rng = np.random.default_rng(0)
    n = 9
    logits = (rng.standard_normal((n, V)) * 3).astype(np.float32)
    biases = random_biases(rng, n)
    slots = rng.permutation(n).astype(np.int32)
    slots[-1] = -1  # padding: slot 0's bias must not leak into it
    got = np.asarray(jax.jit(apply_bias)(jnp.asarray(logits), bias_table(biases), slots))
    for i in range(n):
        bias = biases[slots[i]] if slots[i] >= 0 else {}
        if not bias:
            np.testing.assert_array_equal(got[i], logits[i])
            continue
        processor = logits_process.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
        want = processor(torch.tensor([[1, 2]]), torch.tensor(logits[i:i + 1])).numpy()[0]
        np.testing.assert_allclose(got[i], want, rtol=0, atol=1e-5)
        reference = logits[i].copy()
        reference[list(bias)] += np.array(list(bias.values()), np.float32)
        np.testing.assert_array_equal(got[i], reference)


def test_sample_penalised_applies_the_bias_before_the_penalties_and_leaves_unbiased_rows_alone():
    """Greedy and sampled rows, biased or not, penalised or not: tokens of `sample_rows` over the numpy biased then
    penalised logits (vLLM V1: logit bias among the logits processors, before the penalties); one cond, tokens out."""
    rng = np.random.default_rng(1)
    n = 8
    logits = jnp.asarray((rng.standard_normal((n, V)) * 3).astype(np.float32))
    _, _, counts = random_history(rng, n)
    slots = np.arange(n, dtype=np.int32)
    biases = random_biases(rng, n)
    s = rows(n, temperature=[0, 0, 1.0, 0.7, 0, 1.0, 0, 1.2], seed=7, count=np.arange(n),
             repetition_penalty=[1.0, 2.0, 1.0, 1.5, 1.0, 1.0, 1.0, 1.0], presence_penalty=[0.0] * 6 + [1.0, 0.0])
    table = bias_table(biases)
    biased = np.asarray(logits).copy()
    for i, bias in enumerate(biases):
        biased[i, list(bias)] += np.array(list(bias.values()), np.float32)
    want = sample_rows(apply_penalties(jnp.asarray(biased), s, jnp.asarray(counts), slots), s)
    got = jax.jit(sample_penalised)(logits, s, jnp.asarray(counts), slots, table)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    plain = sample_rows(apply_penalties(logits, s, jnp.asarray(counts), slots), s)
    unbiased = [i for i, b in enumerate(biases) if not b]
    assert unbiased and (np.asarray(got)[unbiased] == np.asarray(plain)[unbiased]).all()
    # no row penalised, one row biased: the bias alone; no row biased either: the plain tokens
    only = [{}] * (n - 1) + [{3: 100.0}]
    got = np.asarray(sample_penalised(logits, rows(n), jnp.asarray(counts), slots, bias_table(only)))
    assert got[-1] == 3 and (got[:-1] == np.asarray(sample_rows(logits, rows(n)))[:-1]).all()
    jaxpr = jax.make_jaxpr(sample_penalised)(logits, rows(n), jnp.asarray(counts), slots, table)
    conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 1 and [v.aval.shape for v in conds[0].outvars] == [(n,)]


def test_the_bias_comes_before_the_repetition_penalty():
    """A seen token of logit 1 biased +2 under repetition_penalty 2: (1 + 2) / 2 = 1.5 loses to an unseen 2.0 (vLLM
    V1's order); penalised first it would win (1 / 2 + 2 = 2.5)."""
    logits = jnp.full((1, V), -1.0).at[0, 4].set(1.0).at[0, 9].set(2.0)
    counts = jnp.zeros((1, V), jnp.int32).at[0, 4].set(1)  # token 4 generated once
    got = sample_penalised(logits, rows(1, repetition_penalty=2.0), counts, np.zeros(1, np.int32),
                           bias_table([{4: 2.0}]))
    assert int(got[0]) == 9


def biased_reference(prompt, n, bias: dict, repetition=1.0):
    """(greedy tokens, their logprobs): each the argmax of the full forward's (sk.logits) last row plus the bias, then
    the repetition penalty, in numpy; logprobs the model's own (log-softmax of the raw row)."""
    model, swiftkv = MODELS["swiftkv-g1"]
    tokens, out, logprobs = list(prompt), [], []
    for _ in range(n):
        raw = np.asarray(sk.logits(model, np.asarray([tokens]), swiftkv=swiftkv), np.float64)[0, -1]
        logits = raw.copy()
        logits[list(bias)] += list(bias.values())
        seen = np.isin(np.arange(len(logits)), tokens)
        logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
        out.append(int(np.argmax(logits)))
        logprobs.append(raw[out[-1]] - raw.max() - np.log(np.exp(raw - raw.max()).sum()))
        tokens.append(out[-1])
    return out, logprobs


def test_minus_100_on_greedys_first_token_takes_the_next_best_and_logprobs_stay_the_models():
    prompt = PROMPTS[0]
    plain = list(alone("swiftkv-g1", tuple(prompt))[0])
    bias = {plain[0]: -100.0}
    out = engine("swiftkv-g1").generate([prompt], max_tokens=MAX_TOKENS, stop_token_ids=[], logit_bias=bias,
                                        logprobs=True)[0]
    want, logprobs = biased_reference(prompt, MAX_TOKENS, bias)
    assert out.token_ids == want and want[0] != plain[0] and plain[0] not in want
    np.testing.assert_allclose(out.logprobs, logprobs, atol=1e-4)


def test_plus_100_forces_a_token_every_step():
    prompt = PROMPTS[3]
    forced = next(t for t in range(6, 96) if t not in alone("swiftkv-g1", tuple(prompt))[0])
    got = lone(prompt, logit_bias={forced: 100, forced + 1: 1.5})  # an int bias is a number too
    assert got == [forced] * MAX_TOKENS == biased_reference(prompt, MAX_TOKENS, {forced: 100})[0]


def run_mixed(num_pages: int):
    """`test_penalties.run_mixed` of biased requests (one also penalised, one sampled) between plain ones: the plain
    get the exact tokens of a run without a bias, the biased those of their full-forward reference (greedy) or of
    their run alone (sampled)."""
    first = [int(alone("swiftkv-g1", tuple(PROMPTS[i % len(PROMPTS)]))[0][0]) for i in range(8)]
    settings = [dict(logit_bias={first[0]: -100.0}), {}, dict(logit_bias={first[2]: -100.0, 50: 4.0},
                                                              repetition_penalty=3.0), {},
                dict(logit_bias={20: 3.0, 21: -100.0}, temperature=1.0, seed=5), dict(logit_bias={33: 100.0}), {},
                dict(logit_bias={first[7]: -50.0})]
    return penalties.run_mixed(num_pages, settings, lambda prompt, kw: biased_reference(
        prompt, MAX_TOKENS, kw["logit_bias"], kw.get("repetition_penalty", 1.0))[0])


def test_a_batch_of_biased_and_plain_requests_keeps_each_rows_own():
    assert run_mixed(40).stats()["preemptions"] == 0


def test_preempted_biased_requests_keep_their_bias():
    """A pool of 14 pages preempts: a recomputed request takes a slot again, its bias written there again."""
    assert run_mixed(14).stats()["preemptions"] > 0


def test_a_reused_slot_drops_the_former_requests_bias():
    eng = engine("swiftkv-g1", max_num_seqs=1, single_buckets=(1,), mixed_single_buckets=(1,))
    request = dict(max_tokens=MAX_TOKENS, stop_token_ids=[])
    assert eng.generate([PROMPTS[0]], logit_bias={40: 100.0}, **request)[0].token_ids == [40] * MAX_TOKENS
    assert eng.generate([PROMPTS[2]], **request)[0].token_ids == list(alone("swiftkv-g1", tuple(PROMPTS[2]))[0])
    assert eng.generate([PROMPTS[3]], logit_bias={41: 100.0}, **request)[0].token_ids == [41] * MAX_TOKENS


@pytest.mark.parametrize("bias, message", [
    ({96: 1.0}, r"logit_bias token ids must lie in \[0, 96\)"),
    ({-1: 1.0}, r"logit_bias token ids must lie in \[0, 96\)"),
    ({5: 100.5}, r"logit_bias values must lie in \[-100, 100\]"),
    ({5: float("nan")}, "logit_bias must be a finite number"),
    ({5: "1"}, "logit_bias must be a finite number"),
    ({"5": 1.0}, "logit_bias keys must be token ids"),
    ({True: 1.0}, "logit_bias keys must be token ids"),
    ([(5, 1.0)], "logit_bias must be a dict"),
    ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids"),
])
def test_bad_logit_bias_is_refused_by_name(bias, message):
    with pytest.raises(InvalidRequest, match=message) as e:
        engine("swiftkv-g1").add_request([1, 2, 3], logit_bias=bias)
    assert e.value.param == "logit_bias"


def test_sk_generate_refuses_logit_bias_naming_the_engine():
    model, swiftkv = MODELS["swiftkv-g1"]
    with pytest.raises(InvalidRequest, match="use sk.Engine") as e:
        sk.generate(model, [PROMPTS[0]], 2, swiftkv=swiftkv, logit_bias={5: -100})
    assert e.value.param == "logit_bias"
    assert list(sk.generate(model, [PROMPTS[0]], MAX_TOKENS, swiftkv=swiftkv, cache_dtype="float32", logit_bias={},
                            stop_token_ids=[], max_len=80).tokens[0]) == list(alone("swiftkv-g1", tuple(PROMPTS[0]))[0])

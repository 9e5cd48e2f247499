"""Scoring on the serving engine against the model's own teacher-forced forward (fp32, CPU)."""

import numpy as np
import pytest
from scipy.special import log_softmax

import swiftkv_jax as sk
from swiftkv_jax.evaluation.scoring import rolling_loglikelihood, score_continuations

CFG = sk.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, initializer_range=0.3)
BASE = sk.init(CFG, 1)
MODELS = {  # name -> (model, wiring)
    "plain": (BASE, None),
    "swiftkv-g1": (sk.to_swiftkv(BASE, 2, 1), None),
    "swiftkv-g2": (sk.to_swiftkv(BASE, 2, 2), None),
    "swiftkv-g2-as-teacher": (sk.to_swiftkv(BASE, 2, 2), False),
}
RNG = np.random.default_rng(0)
CONTEXTS = [RNG.integers(0, 64, n).tolist() for n in (5, 17, 1)]
# shared contexts, continuations of 1 token, a few, and more than the few-query path takes (16)
REQUESTS = [(CONTEXTS[0], RNG.integers(0, 64, 3).tolist()), (CONTEXTS[1], RNG.integers(0, 64, 20).tolist()),
            (CONTEXTS[0], RNG.integers(0, 64, 1).tolist()), (CONTEXTS[2], RNG.integers(0, 64, 7).tolist()),
            (CONTEXTS[0], RNG.integers(0, 64, 9).tolist())]


def forward_logprobs(model, swiftkv, ids):
    """log p of ids[1:] under one full forward, in float64."""
    logits = np.asarray(sk.logits(model, np.asarray([ids]), swiftkv=swiftkv), np.float64)[0]
    return np.take_along_axis(log_softmax(logits[:-1], axis=-1), np.asarray(ids[1:])[:, None], axis=-1)[:, 0], logits


@pytest.mark.parametrize("name", list(MODELS))
def test_continuation_scores_equal_the_full_forward(name):
    model, swiftkv = MODELS[name]
    got = score_continuations(model, REQUESTS, swiftkv=swiftkv, batch_size=4, cache_dtype="float32")
    for (context, continuation), (total, greedy) in zip(REQUESTS, got):
        logprobs, logits = forward_logprobs(model, swiftkv, context + continuation)
        tail = slice(len(context) - 1, None)
        np.testing.assert_allclose(total, logprobs[tail].sum(), rtol=1e-5, atol=1e-4)
        assert greedy == bool(np.all(np.argmax(logits[:-1][tail], -1) == continuation))


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_a_quantised_cache_scores_a_request_batched_as_it_does_alone(cache_dtype):
    """Per-token-head scales are each row's own: contexts batched together (their continuations taken from the
    prefilled rows by `KVCache.take`, scales with them) score as each alone. Another row's scales move a score by
    ~2 nats here; batching alone by ~1e-5."""
    model, _ = MODELS["swiftkv-g2"]
    together = score_continuations(model, REQUESTS, batch_size=8, cache_dtype=cache_dtype)
    alone = [score_continuations(model, [r], cache_dtype=cache_dtype)[0] for r in REQUESTS]
    np.testing.assert_allclose([t for t, _ in together], [t for t, _ in alone], atol=2e-4)
    assert [g for _, g in together] == [g for _, g in alone]


def test_greedy_flag_is_true_for_the_models_own_continuation():
    model, _ = MODELS["swiftkv-g1"]
    context = CONTEXTS[1]
    own = sk.generate(model, [context], max_new_tokens=6, cache_dtype="float32", stop_token_ids=[]).tokens[0]
    [(_, greedy)] = score_continuations(model, [(context, own)], cache_dtype="float32")
    assert greedy


def test_swiftkv_scores_differ_from_teacher_wiring():
    """The fast path scores the SwiftKV model, not its teacher (a guard against silently using one wiring)."""
    model, _ = MODELS["swiftkv-g2"]
    fast = score_continuations(model, REQUESTS[:1], cache_dtype="float32")[0][0]
    teacher = score_continuations(model, REQUESTS[:1], swiftkv=False, cache_dtype="float32")[0][0]
    assert abs(fast - teacher) > 1e-4


def test_rolling_loglikelihood_equals_the_forward_when_one_window():
    model, swiftkv = MODELS["swiftkv-g2"]
    docs = [RNG.integers(0, 64, n).tolist() for n in (9, 30, 17, 33)]  # 17, 33: 16, 32 targets fill a bucket
    got = rolling_loglikelihood(model, docs, max_length=64, swiftkv=swiftkv)
    for ids, (total, count) in zip(docs, got):
        assert count == len(ids) - 1
        np.testing.assert_allclose(total, forward_logprobs(model, swiftkv, ids)[0].sum(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("length", [23, 25, 30])
def test_rolling_windows_are_lm_evals(length):
    """A document cut into windows scores as lm-eval's own windows (`get_rolling_token_windows` with context 1,
    `make_disjoint_window`), each scored alone by a full forward: the last, shorter one conditions on as many
    tokens as fill max_length, not one."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    model, swiftkv = MODELS["plain"]
    ids = RNG.integers(0, 64, length).tolist()
    [(total, count)] = rolling_loglikelihood(model, [ids], max_length=8, swiftkv=swiftkv, batch_size=2)
    expected = 0.0
    for context, continuation in map(make_disjoint_window, get_rolling_token_windows(ids[1:], ids[0], 8, 1)):
        expected += forward_logprobs(model, swiftkv, context + continuation)[0][-len(continuation):].sum()
    assert count == length - 1
    np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-4)


def test_bad_requests_are_refused():
    model, _ = MODELS["plain"]
    with pytest.raises(ValueError, match="empty continuation"):
        score_continuations(model, [([1, 2], [])])
    with pytest.raises(ValueError, match=r"context token ids must lie in \[0, 64\)"):
        score_continuations(model, [([1, 99], [3])])
    with pytest.raises(ValueError, match="at least 2"):
        rolling_loglikelihood(model, [[4]], max_length=8)


@pytest.mark.parametrize("scorer", [lambda model, **kw: score_continuations(model, REQUESTS[:1], **kw),
                                    lambda model, **kw: rolling_loglikelihood(model, [CONTEXTS[1]], max_length=8,
                                                                              **kw)])
def test_a_swiftkv_flag_that_is_not_a_bool_is_refused_by_the_scorers(scorer):
    """bool("false") is True: swiftkv="false" scored a SwiftKV model in the wiring it asked to turn off."""
    model, _ = MODELS["swiftkv-g2"]
    with pytest.raises(ValueError, match=r"swiftkv must be True, False or None .* got 'false'"):
        scorer(model, swiftkv="false")

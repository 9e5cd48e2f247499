"""Student-vs-teacher scores against numpy on the models' own logits."""

import numpy as np
from scipy.special import log_softmax

import swiftkv_jax as sk
from swiftkv_jax.evaluation.quality import greedy_agreement, held_out_scores

CFG = sk.ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, initializer_range=0.3)
TEACHER = sk.init(CFG, 0)
STUDENT = sk.to_swiftkv(TEACHER, 2, 2)
RNG = np.random.default_rng(0)
TOKENS = RNG.integers(0, 48, (3, 16)).astype(np.int32)
SEGMENTS = np.array([[1] * 9 + [2] * 7, [1] * 16, [1] * 10 + [0] * 6], np.int32)
POSITIONS = np.array([list(range(9)) + list(range(7)), list(range(16)), list(range(10)) + [0] * 6], np.int32)
BATCH = {"tokens": TOKENS, "positions": POSITIONS, "segment_ids": SEGMENTS, "loss_mask": np.ones_like(TOKENS)}


def test_held_out_scores_match_numpy():
    teacher = np.asarray(sk.logits(TEACHER, TOKENS, positions=POSITIONS, segment_ids=SEGMENTS), np.float64)
    student = np.asarray(sk.logits(STUDENT, TOKENS, positions=POSITIONS, segment_ids=SEGMENTS), np.float64)
    nll, correct, kl, n = 0.0, 0, 0.0, 0
    for b in range(3):
        for t in range(15):
            if SEGMENTS[b, t] and SEGMENTS[b, t + 1] == SEGMENTS[b, t]:
                p, q = log_softmax(teacher[b, t]), log_softmax(student[b, t])
                nll -= q[TOKENS[b, t + 1]]
                correct += int(np.argmax(q) == TOKENS[b, t + 1])
                kl += np.sum(np.exp(p) * (p - q))
                n += 1
    got = held_out_scores(TEACHER, STUDENT,
                          [{k: v[:2] for k, v in BATCH.items()}, {k: v[2:] for k, v in BATCH.items()}])
    assert got["tokens"] == n == 8 + 6 + 15 + 9
    np.testing.assert_allclose([got["val_loss"], got["accuracy"], got["kl_to_teacher"]], [nll / n, correct / n, kl / n],
                               rtol=1e-5)


def test_a_model_agrees_with_itself_and_its_kl_is_zero():
    assert held_out_scores(TEACHER, TEACHER, [BATCH])["kl_to_teacher"] == 0.0
    prompts = [TOKENS[0, :5].tolist(), TOKENS[1, :9].tolist()]
    assert greedy_agreement(TEACHER, TEACHER, prompts, 8) == {"greedy_agreement": 1.0, "common_prefix": 8.0}
    other = sk.init(CFG, 7)
    got = greedy_agreement(TEACHER, other, prompts, 8)
    assert got["greedy_agreement"] < 1.0 and got["common_prefix"] < 8
    # teacher-forced: the other model's argmax along the teacher's own greedy continuation
    expected = []
    for p, cont in zip(prompts, sk.generate(TEACHER, prompts, 8, stop_token_ids=[], cache_dtype="float32").tokens):
        picks = np.argmax(np.asarray(sk.logits(other, np.asarray([p + cont[:-1]])))[0, len(p) - 1:], -1)
        expected.append(np.mean(picks == np.asarray(cont)))
    assert got["greedy_agreement"] == np.mean(expected)

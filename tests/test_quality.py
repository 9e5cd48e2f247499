"""Student-vs-teacher scores against numpy on the models' own logits."""

import numpy as np
import pytest
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


def test_greedy_agreement_and_common_prefix_match_transformers_generate(tmp_path):
    """Both numbers against transformers' own greedy `generate` and forward on two tiny random Llamas (the student a
    slightly perturbed teacher, so the continuations agree for a while and then part): prompts of different lengths,
    3 of them in batches of 2 (a short last batch). common_prefix counts tokens before the first difference (a
    count of agreeing positions, or the first difference's index + 1, once passed the other tests)."""
    import torch
    from hf_models import make_hf_model

    teacher_hf = make_hf_model(tmp_path / "teacher", seed=0)
    student_hf = make_hf_model(tmp_path / "student", seed=0)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for p in student_hf.parameters():
            p.add_(0.003 * torch.randn(p.shape, generator=generator))
    student_hf.save_pretrained(tmp_path / "student")
    teacher, student = sk.load(str(tmp_path / "teacher"), "float32"), sk.load(str(tmp_path / "student"), "float32")
    prompts = [np.random.default_rng(s).integers(0, 320, n).tolist() for s, n in ((1, 3), (2, 11), (3, 6))]
    new = 10
    agree, prefix = [], []
    for p in prompts:
        x = torch.tensor([p])
        with torch.no_grad():
            t, s = (m.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(p):]
                    for m in (teacher_hf, student_hf))
            picks = student_hf(torch.cat([x[0], t[:-1]])[None]).logits[0, len(p) - 1:].argmax(-1)
        agree.append((picks == t).double().mean().item())
        same = (t == s).numpy()
        prefix.append(len(same) if same.all() else int(np.argmin(same)))
    got = greedy_agreement(teacher, student, prompts, new, batch_size=2)
    assert 0 < got["greedy_agreement"] < 1 and 0 < got["common_prefix"] < new  # neither trivial
    assert got["greedy_agreement"] == pytest.approx(np.mean(agree), abs=1e-12)
    assert got["common_prefix"] == pytest.approx(np.mean(prefix), abs=1e-12)

"""How close a student is to its teacher on held-out packed text: validation loss and next-token accuracy of
the student, KL(teacher ‖ student) per token, and greedy agreement over generated continuations.

Positions are those the pretraining objective scores (`next_token_targets`): every token that has a next
token in its own document. The student runs in its own wiring (SwiftKV for a SwiftKV model).
"""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from swiftkv_jax.distill.loss import kl_per_position
from swiftkv_jax.distill.step import next_token_targets
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.model import Model, forward, logits
from swiftkv_jax.serving.generate import generate


@functools.partial(jax.jit, static_argnames=("teacher_config", "student_config"))
def _batch_sums(teacher_params, student_params, batch, *, teacher_config: ModelConfig, student_config: ModelConfig):
    targets, weights = next_token_targets(batch)
    weights = weights.astype(jnp.float32)
    inputs = (batch["tokens"], batch["positions"], batch["segment_ids"])
    teacher = forward(teacher_params, *inputs, config=teacher_config, swiftkv=False)
    student = forward(student_params, *inputs, config=student_config, swiftkv=student_config.is_swiftkv)
    logp = jax.nn.log_softmax(student, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    correct = jnp.argmax(student, axis=-1) == targets
    kl = kl_per_position(teacher, student, 1.0)
    return jnp.stack([jnp.sum(weights * nll), jnp.sum(weights * correct), jnp.sum(weights * kl), jnp.sum(weights)])


def held_out_scores(teacher: Model, student: Model, batches: Iterable[dict]) -> dict:
    """{val_loss (nats/token), accuracy, kl_to_teacher, tokens} of `student` over packed batches
    {tokens, positions, segment_ids, loss_mask} [B, T] (the teacher may be the student itself)."""
    if teacher.config.vocab_size != student.config.vocab_size:
        raise ValueError(f"teacher and student vocabularies differ ({teacher.config.vocab_size} vs "
                         f"{student.config.vocab_size}): compare a student with its own teacher")
    total = np.zeros(4, np.float64)
    for batch in batches:
        batch = {k: jnp.asarray(np.asarray(batch[k], np.int32)) for k in ("tokens", "positions", "segment_ids",
                                                                         "loss_mask")}
        total += np.asarray(jax.device_get(_batch_sums(teacher.params, student.params, batch,
                                                       teacher_config=teacher.config,
                                                       student_config=student.config)), np.float64)
    nll, correct, kl, count = total
    if count == 0:
        raise ValueError("no scored positions in the held-out batches")
    return {"val_loss": nll / count, "accuracy": correct / count, "kl_to_teacher": kl / count, "tokens": int(count)}


def greedy_agreement(teacher: Model, student: Model, prompts: Sequence[Sequence[int]], new_tokens: int = 64,
                     batch_size: int = 16) -> dict:
    """The teacher continues each prompt greedily for `new_tokens` tokens (no stop). greedy_agreement: the
    fraction of those positions where the student, fed the same text, picks the teacher's token (its own
    greedy choice, teacher-forced, so one early miss does not decide the rest); common_prefix: the mean
    number of tokens the two free-running greedy continuations share before they first differ."""
    agree, prefix = [], []
    for start in range(0, len(prompts), batch_size):
        batch = [list(p) for p in prompts[start: start + batch_size]]
        runs = [generate(m, batch, new_tokens, stop_token_ids=[], cache_dtype="float32").tokens
                for m in (teacher, student)]
        for prompt, t, s in zip(batch, *runs):
            text = np.asarray([prompt + t[:-1]], np.int32)
            picks = np.asarray(jnp.argmax(logits(student, text)[0, len(prompt) - 1:], axis=-1))
            agree.append(float(np.mean(picks == np.asarray(t))))
            same = np.asarray(t) == np.asarray(s)
            prefix.append(int(np.argmin(same)) if not same.all() else len(same))
    return {"greedy_agreement": float(np.mean(agree)), "common_prefix": float(np.mean(prefix))}

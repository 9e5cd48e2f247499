"""Distillation losses (../shared/SWIFTKV.md §4) and the pretraining cross-entropy, computed in sequence chunks.

The KL needs fp32 logits of teacher and student: 2 x [B, T, V] at T = 8K and V = 128K is 8 GiB per
sequence. Chunking over T with a rematerialised chunk body keeps one chunk's logits alive, forward and
backward, and gives the same sums.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def kl_per_position(teacher_logits, student_logits, temperature: float):
    """KL(teacher || student) of the temperature-softened distributions, per position, in fp32."""
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.sum(jnp.exp(t) * (t - s), axis=-1)


def chunked_sum(fn: Callable, arrays: tuple, chunk_size: int):
    """sum over sequence chunks of fn(*chunk) for arrays [B, T, ...]; each chunk rematerialised in the
    backward pass, so one chunk's logits are alive at a time. chunk_size 0 (or >= T): one call."""
    batch, length = arrays[0].shape[:2]
    if chunk_size <= 0 or chunk_size >= length:
        return fn(*arrays)
    pad = -length % chunk_size  # padded positions must carry weight 0 in fn
    pad_t = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    chunks = lambda a: jnp.moveaxis(pad_t(a).reshape((batch, -1, chunk_size) + a.shape[2:]), 1, 0)
    per_chunk = jax.lax.map(lambda xs: jax.checkpoint(fn, prevent_cse=False)(*xs), tuple(map(chunks, arrays)))
    return jnp.sum(per_chunk, axis=0)


def chunked_kl_sum(head: Callable, student_hidden, teacher_hidden, weights, temperature: float,
                   chunk_size: int):
    """sum_t weights[b, t] * KL_t over hidden states [B, T, D]; `head` maps hidden -> fp32 logits.

    chunk_size 0 (or >= T) computes the logits of the whole sequence at once. Gradients flow into
    `student_hidden` only.
    """
    def chunk_sum(hs, ht, w):
        # One head call for both: identical hidden states give bit-identical logits (KL exactly 0).
        teacher_logits, student_logits = jnp.split(head(jnp.concatenate([ht, hs])), 2)
        return jnp.sum(w * kl_per_position(teacher_logits, student_logits, temperature))

    return chunked_sum(chunk_sum, (student_hidden, jax.lax.stop_gradient(teacher_hidden),
                                   weights.astype(jnp.float32)), chunk_size)


def chunked_cross_entropy_sums(head: Callable, hidden, targets, weights, chunk_size: int):
    """(sum of weights * -log p(target), sum of weights * [argmax == target]) over hidden states [B, T, D]."""
    def chunk_sums(h, t, w):
        logits = head(h).astype(jnp.float32)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), t[..., None], axis=-1)[..., 0]
        return jnp.stack([jnp.sum(w * nll), jnp.sum(w * (jnp.argmax(logits, axis=-1) == t))])

    return tuple(chunked_sum(chunk_sums, (hidden, targets, weights.astype(jnp.float32)), chunk_size))


def hidden_sq_error_sum(student_hidden, teacher_hidden, weights):
    """sum over weighted positions and features of (student - teacher)^2, in fp32."""
    diff = student_hidden.astype(jnp.float32) - jax.lax.stop_gradient(teacher_hidden).astype(jnp.float32)
    return jnp.sum(weights.astype(jnp.float32)[..., None] * diff * diff)

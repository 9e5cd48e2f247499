"""Distillation losses (../shared/SWIFTKV.md §4) and the pretraining cross-entropy, computed in sequence chunks.

The KL needs fp32 logits of teacher and student: 2 x [B, T, V] at T = 8K and V = 128K is 8 GiB per
sequence. Both losses go over sequence chunks, and each chunk's gradient (hidden states and, when they are
differentiated, the head's weights) is computed in the forward pass, right after its logits: only one chunk's
logits are ever alive, and no logits are recomputed in the backward pass (which scales the stored gradient). The
KL's head runs three times a token (teacher, student, the student's activation gradient) instead of five with a
rematerialised chunk; the cross-entropy's twice plus its weight gradient. The "fused linear cross-entropy" of
Liger-Kernel and Apple's cut-cross-entropy, in jax.custom_vjp.
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


def _chunked(arrays: tuple, chunk_size: int) -> tuple:
    """[B, T, ...] -> [C, B, chunk, ...], T padded to C chunks (padded positions must carry weight 0)."""
    length = arrays[0].shape[1]
    chunk = length if chunk_size <= 0 or chunk_size >= length else chunk_size
    pad = -length % chunk
    def split(a):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape((a.shape[0], -1, chunk) + a.shape[2:]), 1, 0)
    return tuple(map(split, arrays))


def _unchunked(a, length: int):
    """[C, B, chunk, ...] -> [B, T, ...]."""
    a = jnp.moveaxis(a, 0, 1)
    return a.reshape((a.shape[0], -1) + a.shape[3:])[:, :length]


def fused_chunked_sums(chunk_sums: Callable, head: Callable, head_params, hidden, rest: tuple, chunk_size: int):
    """sums [K]: the sum over sequence chunks of `chunk_sums`, with the gradient of sums[0] computed chunk by chunk
    in the forward pass.

    head(head_params, h) maps hidden states [B, c, D] to fp32 logits. chunk_sums(logits_of, h, logits, *rest) ->
    (sums [K], dlogits): `logits` is the head at the chunk's hidden states h, logits_of(x) the head at any hidden
    states (the KL stacks teacher and student into one call instead), dlogits the gradient of sums[0] with respect
    to `logits`. `hidden` and `head_params` are differentiable through sums[0], and only what is differentiated
    is computed; `rest` [B, T, ...] (targets, weights, the teacher's hidden states) must not be differentiated
    (it raises), and sums[1:] are statistics without a gradient. chunk_size 0 (or >= T): one chunk.
    """
    length = hidden.shape[1]
    param_dtypes = jax.tree.map(lambda p: p.dtype, head_params)

    def forward(hidden, head_params, rest, grad_hidden: bool, grad_params: bool):
        def one_chunk(params_grad, xs):
            h, *rest_c = xs
            logits, pull = jax.vjp(head, head_params, h)  # a loss that does not read `logits` leaves it dead code
            sums, dlogits = chunk_sums(lambda x: head(head_params, x), h, logits, *rest_c)
            if not (grad_hidden or grad_params):
                return params_grad, (sums, None)
            d_params, d_hidden = pull(dlogits.astype(logits.dtype))
            if grad_params:
                params_grad = jax.tree.map(lambda acc, d: acc + d.astype(jnp.float32), params_grad, d_params)
            return params_grad, (sums, d_hidden if grad_hidden else None)

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), head_params) if grad_params else None
        params_grad, (sums, d_hidden) = jax.lax.scan(one_chunk, zeros, _chunked((hidden,) + tuple(rest), chunk_size))
        return jnp.sum(sums, axis=0), (_unchunked(d_hidden, length) if grad_hidden else None, params_grad)

    @jax.custom_vjp
    def sums_of(hidden, head_params, rest):
        return forward(hidden, head_params, rest, False, False)[0]

    def sums_fwd(hidden, head_params, rest):
        is_primal = lambda p: isinstance(p, jax.custom_derivatives.CustomVJPPrimal)
        perturbed = lambda tree: any(p.perturbed for p in jax.tree.leaves(tree, is_leaf=is_primal))
        value = lambda tree: jax.tree.map(lambda p: p.value, tree, is_leaf=is_primal)
        if perturbed(rest):
            raise ValueError("fused_chunked_sums: only the hidden states and the head's weights have a gradient; "
                             "wrap the other inputs (targets, weights, the teacher's hidden states) in "
                             "jax.lax.stop_gradient")
        return forward(hidden.value, value(head_params), value(rest), hidden.perturbed, perturbed(head_params))

    def sums_bwd(grads, g):
        d_hidden, d_params = grads
        scale = g[0]
        d_hidden = None if d_hidden is None else (scale * d_hidden).astype(d_hidden.dtype)
        d_params = None if d_params is None else jax.tree.map(lambda d, t: (scale * d).astype(t), d_params,
                                                               param_dtypes)
        return d_hidden, d_params, None

    sums_of.defvjp(sums_fwd, sums_bwd, symbolic_zeros=True)
    return sums_of(hidden, head_params, tuple(rest))


def chunked_kl_sum(head: Callable, head_params, student_hidden, teacher_hidden, weights, temperature: float,
                   chunk_size: int):
    """sum_t weights[b, t] * KL_t over hidden states [B, T, D]; head(head_params, h) maps hidden -> fp32 logits.

    chunk_size 0 (or >= T) computes the logits of the whole sequence at once. Gradients flow into
    `student_hidden` (and `head_params` where they are differentiated), never into the teacher's side.
    """
    def chunk_sums(logits_of, hs, _, ht, w):
        # One head call for both: identical hidden states give bit-identical logits (KL exactly 0). The student's
        # logits from the chunk's own call would be the same numbers, so that call is left unread (and dropped).
        teacher_logits, student_logits = jnp.split(logits_of(jnp.concatenate([ht, hs])), 2)
        kl = lambda s: jnp.sum(w * kl_per_position(teacher_logits, s, temperature))
        value, dlogits = jax.value_and_grad(kl)(student_logits)
        return value[None], dlogits

    rest = (jax.lax.stop_gradient(teacher_hidden), jax.lax.stop_gradient(weights.astype(jnp.float32)))
    return fused_chunked_sums(chunk_sums, head, head_params, student_hidden, rest, chunk_size)[0]


def chunked_cross_entropy_sums(head: Callable, head_params, hidden, targets, weights, chunk_size: int):
    """(sum of weights * -log p(target), sum of weights * [argmax == target]) over hidden states [B, T, D];
    head(head_params, h) maps hidden -> fp32 logits. Gradients flow into `hidden` and `head_params`."""
    def chunk_sums(_, __, logits, t, w):
        def nll_sum(logits):
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), t[..., None], axis=-1)[..., 0]
            return jnp.sum(w * nll)
        nll, dlogits = jax.value_and_grad(nll_sum)(logits)
        return jnp.stack([nll, jnp.sum(w * (jnp.argmax(logits, axis=-1) == t))]), dlogits

    rest = (targets, jax.lax.stop_gradient(weights.astype(jnp.float32)))
    return tuple(fused_chunked_sums(chunk_sums, head, head_params, hidden, rest, chunk_size))


def hidden_sq_error_sum(student_hidden, teacher_hidden, weights):
    """sum over weighted positions and features of (student - teacher)^2, in fp32."""
    diff = student_hidden.astype(jnp.float32) - jax.lax.stop_gradient(teacher_hidden).astype(jnp.float32)
    return jnp.sum(weights.astype(jnp.float32)[..., None] * diff * diff)

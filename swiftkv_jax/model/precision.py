"""Contractions accumulated in fp32 whose backward runs in the operands' dtype (mixed-precision training).

`jnp.einsum(..., preferred_element_type=float32)` on bf16 operands gives fp32 scores or logits, but its autodiff
casts the operands to fp32 and runs both backward contractions in fp32: at bf16 compute, the output head's backward
(2 x 1 GFLOP a token at V = 128K) and the XLA attention's dQ and dK, at a fraction of the bf16 rate. Here the
cotangent is rounded to the operands' dtype first, as mixed-precision frameworks do (FlashAttention's dS,
autocast's backward matmuls); cuBLAS still accumulates in fp32. fp32 operands are unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum_fp32(equation: str, a, b):
    """einsum(equation, a, b) accumulated and returned in fp32; its backward contracts in a's and b's dtype."""
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)


def _forward(equation, a, b):
    return einsum_fp32(equation, a, b), (a, b)


def _backward(equation, residuals, g):
    a, b = residuals
    _, pull = jax.vjp(functools.partial(jnp.einsum, equation), a, b)
    return pull(g.astype(jnp.result_type(a, b)))


einsum_fp32.defvjp(_forward, _backward)

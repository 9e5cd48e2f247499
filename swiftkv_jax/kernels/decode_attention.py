"""Attention of a few ("decode") or many (a prompt chunk) queries over a KV cache: a split-K Pallas kernel, its jnp
reference, and exact merges.

Shapes (one letter per dimension): q ``[B, T, N, H]`` (T query tokens: 1 for decode, a few for speculative or
SwiftKV steps, a prompt chunk over its cached context), k_cache / v_cache ``[B, S, K, H]``, ``lengths [B]`` int32 and
``q_positions [B, T]`` int32. G = N // K query heads share one KV head (GQA).

Masking: cache index == position. Query token t of sequence b sees key s iff
``s < lengths[b]`` and ``s <= q_positions[b, t]``. The mask is built from positions, never from a
top-left-aligned ``is_causal`` flag, so it is right when T < S. A query that sees no key (empty cache,
``lengths[b] == 0``, or ``q_positions[b, t] < 0``: -1 marks a row that must see nothing) gets an all-zero output
(residuals: out 0, max ``MASK_VALUE``, sum 0), never NaN.

Scale: the scores are ``q . k / sqrt(H)``, applied inside (in fp32, on the scores). Do not pre-scale q.

Kernel: the split-K launch of split_k.py (shared with the paged kernel; its layout, backend and quantised-cache
notes are there), reading each split of the dense cache in place (no transpose or pad of the cache per call). The
same ``merge_partials`` combines two KV segments (SwiftKV: prompt KV + decode KV), see
``decode_attention(..., return_residuals=True)``. Mosaic GPU (warpgroup, TMA) is Hopper's native path (jax's
``attention_mgpu``); whether it or this kernel (or plain XLA) is faster for decode must be measured on the GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from swiftkv_jax.kernels.split_k import (MASK_VALUE, AttentionResiduals, DecodeBlockSizes, attend_split,
                                         check_queries, check_scales, dequantize, kernel_settings, merge_partials,
                                         no_keys, normalize, scale_inputs, split_k_attention)
from swiftkv_jax.kernels.tuning import call_shapes

__all__ = [
    "MASK_VALUE", "AttentionResiduals", "DecodeBlockSizes", "decode_attention", "decode_attention_reference",
    "merge_partials", "normalize",
]


def _visible(lengths, q_positions, num_keys: int) -> jax.Array:
    """[B, T, S] bool: key s visible to query t of sequence b."""
    key = jnp.arange(num_keys)[None, None, :]
    return (key < lengths[:, None, None]) & (key <= q_positions[:, :, None])


def decode_attention_reference(q, k_cache, v_cache, lengths, q_positions, *, return_residuals: bool = False,
                               k_scale=None, v_scale=None):
    """Plain-jnp decode attention with an fp32 softmax; same contract as ``decode_attention`` (a quantised cache
    is dequantised in memory first)."""
    B, T, N, H = q.shape
    _, S, K, _ = k_cache.shape
    check_scales(k_cache, v_cache, k_scale, v_scale, k_cache.shape[:3], "[B, S, K]")
    k_cache, v_cache = dequantize(k_cache, k_scale), dequantize(v_cache, v_scale)
    f32 = jnp.float32
    qg = q.astype(f32).reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BTKGS", qg, k_cache.astype(f32), precision=lax.Precision.HIGHEST)
    scores = scores * (1.0 / math.sqrt(H))
    visible = _visible(lengths, q_positions, S)[:, :, None, None, :]
    scores = jnp.where(visible, scores, MASK_VALUE)
    m = jnp.max(scores, axis=-1, initial=MASK_VALUE)
    p = jnp.where(visible, jnp.exp(scores - m[..., None]), 0.0)
    out = jnp.einsum("BTKGS,BSKH->BTKGH", p, v_cache.astype(f32), precision=lax.Precision.HIGHEST)
    residuals = AttentionResiduals(out.reshape(B, T, N, H), m.reshape(B, T, N), p.sum(-1).reshape(B, T, N))
    return residuals if return_residuals else normalize(residuals, q.dtype)


def _dense_key_index(i, idx, in_range):
    """Block i of this split of the dense cache (k_ref, v_ref [split_len, H]: the split, may run past S)."""
    del in_range  # the masked load
    rows = pl.ds(i * idx.shape[0], idx.shape[0])
    return (rows, slice(None)), rows


def _check_shapes(q, k_cache, v_cache, lengths, q_positions):
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"q must be [B, T, N, H] and k_cache [B, S, K, H], got {q.shape} and {k_cache.shape}")
    B, _, _, H = q.shape
    if v_cache.shape != k_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != H:
        raise ValueError(f"k_cache and v_cache must both be [B={B}, S, K, H={H}], got {k_cache.shape} and "
                         f"{v_cache.shape}")
    check_queries(q, k_cache.shape[2], lengths, q_positions)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def _decode_attention(q, k_cache, v_cache, lengths, q_positions, block_sizes: DecodeBlockSizes, interpret: bool,
                      k_scale=None, v_scale=None):
    _, S, K, H = k_cache.shape
    dequantize, token_scales, static_scales = scale_inputs(k_scale, v_scale)

    def kv_specs(split_len):  # this split of the cache, in place (the last one may run past S: masked loads)
        spec = pl.BlockSpec((None, split_len, None, H), lambda b, k, i, j: (b, j, k, 0))
        scale_spec = pl.BlockSpec((None, split_len, None), lambda b, k, i, j: (b, j, k))  # [B, S, K] scales
        return [spec, spec] + [scale_spec] * len(token_scales)

    kernel = functools.partial(attend_split, key_index=_dense_key_index)
    return split_k_attention(kernel, q, lengths, q_positions, (k_cache, v_cache, *token_scales), kv_specs,
                              num_kv_heads=K, num_keys=S, block_sizes=block_sizes, interpret=interpret,
                              name="swiftkv_decode_attention", dequantize=dequantize, static_scales=static_scales)


def decode_attention(q, k_cache, v_cache, lengths, q_positions, *, block_sizes: DecodeBlockSizes | None = None,
                     interpret: bool | None = None, return_residuals: bool = False, k_scale=None, v_scale=None):
    """Attention of a few or many query tokens over a KV cache, by the split-K Pallas kernel.

    Args:
      q: ``[B, T, N, H]`` queries (not pre-scaled: the kernel applies 1/sqrt(H)).
      k_cache, v_cache: ``[B, S, K, H]``, N % K == 0, H a power of two >= 16.
      lengths: ``[B]`` int, keys with index < lengths[b] are valid.
      q_positions: ``[B, T]`` int, query t sees keys with index <= q_positions[b, t] (none if negative).
      block_sizes: ``DecodeBlockSizes``; default ``DecodeBlockSizes()``.
      interpret: None = interpret mode on CPU, compiled on GPU. Compiled on any other backend fails loudly.
      return_residuals: return ``AttentionResiduals`` (fp32, unnormalised; merge with ``merge_partials``,
        finish with ``normalize``) instead of the output.
      k_scale, v_scale: None (a bf16 / fp16 / fp32 cache) or the scales of a quantised (int8, float8_e4m3fn)
        cache, both a ``()`` per-layer scale or both ``[B, S, K]`` per token and KV head: key s reads
        ``k_cache[b, s, k].astype(f32) * k_scale[b, s, k]``. The kernel loads the cache in its storage dtype, casts
        it to q's dtype in registers (exact) and puts the scales on the scores' and P's columns (split_k.py).

    Returns:
      ``[B, T, N, H]`` in q's dtype (zeros for a query that sees no key), or ``AttentionResiduals``.
    """
    _check_shapes(q, k_cache, v_cache, lengths, q_positions)
    check_scales(k_cache, v_cache, k_scale, v_scale, k_cache.shape[:3], "[B, S, K]")
    tune = call_shapes("decode", q, k_cache.shape[2], k_cache.dtype)
    block_sizes, interpret = kernel_settings(block_sizes, interpret, "decode_attention",
                                             (k_cache.dtype, v_cache.dtype), tune)
    if k_cache.shape[1] == 0:  # no cache at all: nothing to attend to
        residuals = no_keys(q)
    else:
        residuals = _decode_attention(q, k_cache, v_cache, lengths, q_positions, block_sizes, interpret, k_scale,
                                      v_scale)
    return residuals if return_residuals else normalize(residuals, q.dtype)

"""Attention dispatch and the plain XLA path, the reference every kernel is checked against.

Masking is by positions and segment ids, never by array index: a query at position p attends to keys of
its own segment at positions <= p. This stays right when queries are fewer than keys (decode, chunked
prefill, SwiftKV's later layers), where an index-aligned `is_causal` mask would pick the wrong keys, and it
keeps packed documents (positions restarting per segment) from attending to each other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids) -> jnp.ndarray:
    """[B, T, S] bool: same segment and key position <= query position."""
    causal = kv_positions[:, None, :] <= q_positions[:, :, None]
    same_segment = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return causal & same_segment


def xla_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids) -> jnp.ndarray:
    """Grouped-query attention by einsum, softmax in fp32.

    q [B, T, N, H], k and v [B, S, K, H] with N = K * G; positions and segment ids [B, T] / [B, S].
    Returns [B, T, N, H] in q's dtype. A query with no visible key (impossible for a token's own
    position in a full forward) gets zeros, not NaN.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32) * (h ** -0.5)
    mask = attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids)[:, None, None]
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask, probs, 0.0).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(b, t, n, h)


QUERY_CHUNK = 512


def xla_chunked_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                          chunk: int = QUERY_CHUNK) -> jnp.ndarray:
    """`xla_attention` over blocks of `chunk` queries, each rematerialised in the backward pass.

    Same result; the fp32 logits alive at once shrink from [B, N, T, S] to [B, N, chunk, S] (at T = 8K,
    32 heads: 8 GiB -> 0.5 GiB per sequence), forward and backward. For training on long sequences.
    """
    t = q.shape[1]
    if t <= chunk:
        return xla_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    pad = -t % chunk  # padded queries: segment -1 matches no key, so their rows are zeros
    pad_t = lambda a, value=0: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=value)
    blocks = lambda a: jnp.moveaxis(a.reshape((a.shape[0], -1, chunk) + a.shape[2:]), 1, 0)
    body = jax.checkpoint(
        lambda xs: xla_attention(xs[0], k, v, xs[1], kv_positions, xs[2], kv_segment_ids), prevent_cse=False)
    out = jax.lax.map(body, (blocks(pad_t(q)), blocks(pad_t(q_positions)), blocks(pad_t(q_segment_ids, -1))))
    out = jnp.moveaxis(out, 0, 1).reshape((q.shape[0], t + pad) + q.shape[2:])
    return out[:, :t]


def _pallas_flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    from swiftkv_jax.kernels.flash_attention import flash_attention  # Pallas imports only when chosen

    return flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)


def cudnn_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`), NVIDIA GPUs only.

    Our position/segment mask goes in as a boolean mask, which jax hands to cuDNN as an additive bias
    [B, 1, T, S]: exact for any positions (chunked prefill, packed documents) at the price of reading
    that bias. cuDNN takes fp16/bf16 only. Unsupported setups raise, there is no fallback to XLA.
    """
    backend = jax.default_backend()
    if backend != "gpu":
        raise ValueError(f"attention_impl='cudnn' needs an NVIDIA GPU with cuDNN, but JAX's backend is "
                         f"{backend!r}: use attention_impl='xla' (or 'pallas')")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"attention_impl='cudnn' takes bfloat16 or float16 activations, got {q.dtype}: set the "
                         f"model's dtype to bfloat16, or use attention_impl='xla'")
    mask = attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids)[:, None]
    try:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise ValueError(f"attention_impl='cudnn' does not support this case ({e}); use attention_impl='xla' "
                         f"or 'pallas'") from e


# A name not in this table raises, there is no fallback. "pallas" and "cudnn" serve prefill only: neither
# is validated for training (cuDNN's backward is untested here, no GPU in CI).
_IMPLS = {"xla": xla_attention, "xla_chunked": xla_chunked_attention, "pallas": _pallas_flash_attention,
          "cudnn": cudnn_attention}
DIFFERENTIABLE_IMPLS = ("xla", "xla_chunked")
ATTENTION_IMPLS = tuple(_IMPLS)


def attend(impl: str, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids) -> jnp.ndarray:
    """Run the named attention implementation; an unknown name raises, there is no fallback."""
    try:
        fn = _IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown attention_impl {impl!r}: available are {', '.join(_IMPLS)}") from None
    return fn(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)


# Few-query attention over a KV cache (decode, and SwiftKV's later layers in prefill): q [B, q, N, H] against
# the cache [B, S, K, H] whose first kv_lengths[b] entries are valid, entry i holding position i.
def cache_positions(kv_lengths, length: int):
    """(positions, segment_ids) [B, S] of a cache: entry i is position i; entries >= length get segment -1,
    which no query (segment 0) matches."""
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (kv_lengths.shape[0], length))
    return positions, jnp.where(positions < kv_lengths[:, None], 0, -1)


def _xla_cache_attention(q, k, v, q_positions, kv_lengths):
    kv_positions, kv_segments = cache_positions(kv_lengths, k.shape[1])
    return xla_attention(q, k, v, q_positions, kv_positions, jnp.zeros_like(q_positions), kv_segments)


def _pallas_cache_attention(q, k, v, q_positions, kv_lengths):
    from swiftkv_jax.kernels.decode_attention import decode_attention  # Pallas imports only when chosen

    return decode_attention(q, k, v, kv_lengths, q_positions)


_DECODE_IMPLS = {"xla": _xla_cache_attention, "pallas": _pallas_cache_attention}
DECODE_ATTENTION_IMPLS = tuple(_DECODE_IMPLS)
FEW_QUERIES = 16  # at most this many query tokens over a cache take the few-query path


def attend_cache(impl: str, q, k, v, q_positions, kv_lengths) -> jnp.ndarray:
    """Few-query attention over a cache by the named implementation; an unknown name raises."""
    try:
        fn = _DECODE_IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown decode_attention_impl {impl!r}: available are {', '.join(_DECODE_IMPLS)}") from None
    return fn(q, k, v, q_positions, kv_lengths)

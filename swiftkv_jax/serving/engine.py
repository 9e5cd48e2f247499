"""Prefill and decode over the KV cache, as pure functions of (params, cache, tokens).

SwiftKV prefill (SWIFTKV.md §2): layers < l run on every prompt token and write their own K/V; the K/V
of every later layer come from `norm_swiftkv(h_l)` by each group owner's projections, written for
every prompt token; layers >= l run for the last prompt token of each sequence only. Chunked prefill
bounds activation memory: chunks run layers < l and the owners' projections; only the last token of each
sequence goes through the later layers, once, at the end. Teacher wiring (a plain Llama, or a SwiftKV
model run as its teacher) sends every prompt token through every layer. Decode runs every layer for one
new token per sequence; `extend` runs every layer for several new tokens (scoring continuations).

`params` is the model's parameter tree, stacked or in serving layout (`unstack_layers`): a caller that runs
many steps inside one jitted program (the decode loop) unstacks once, outside its loop.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from swiftkv_jax.model.cached import cached_lower, cached_upper, head, swiftkv_cache_kv, unstack_layers
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.layers import CacheWrite
from swiftkv_jax.serving.cache import KVCache


def prefill(params, cache: KVCache, tokens, prompt_lengths, *, config: ModelConfig, swiftkv: bool,
            chunk_size: Optional[int] = None):
    """Fill an empty cache with right-padded prompts tokens [B, T] of lengths [B] (1 <= length <= T):
    (logits of each sequence's last prompt token [B, V] fp32, cache with lengths = prompt_lengths).

    chunk_size must divide T (None: one chunk).
    """
    params = unstack_layers(params, config)
    batch, length = tokens.shape
    chunk = chunk_size or length
    if length % chunk:
        raise ValueError(f"prefill chunk_size {chunk} must divide the padded prompt length {length}")
    last = prompt_lengths - 1

    def step(carry, start):
        lower, upper, h_last = carry
        chunk_tokens = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (batch, chunk))
        write = CacheWrite(jnp.full((batch,), start, jnp.int32), jnp.minimum(prompt_lengths, start + chunk))
        h, lower = cached_lower(params, config, chunk_tokens, positions, write, lower)
        if swiftkv:
            upper = swiftkv_cache_kv(params, config, h, positions, write, upper)
        else:  # the teacher wiring needs every token's K/V in every layer
            h, upper = cached_upper(params, config, h, positions, write, upper, swiftkv=False)
        # keep each sequence's last prompt token when it falls in this chunk
        index = jnp.clip(last - start, 0, chunk - 1)
        picked = jnp.take_along_axis(h, index[:, None, None], axis=1)
        inside = ((last >= start) & (last < start + chunk))[:, None, None]
        return (lower, upper, jnp.where(inside, picked, h_last)), None

    h_last = jnp.zeros((batch, 1, config.hidden_size), jnp.dtype(config.dtype))
    starts = jnp.arange(0, length, chunk, dtype=jnp.int32)
    (lower, upper, h_last), _ = jax.lax.scan(step, (cache.lower, cache.upper, h_last), starts)
    if swiftkv:  # the later layers, for the last prompt token only, reading the owners' K/V
        h_last, _ = cached_upper(params, config, h_last, last[:, None], CacheWrite(None, prompt_lengths), upper,
                                 swiftkv=True)
    logits = head(params, config, h_last)[:, 0]
    return logits, KVCache(lower, upper, prompt_lengths.astype(jnp.int32))


def extend(params, cache: KVCache, tokens, lengths, *, config: ModelConfig, swiftkv: bool):
    """Append right-padded tokens [B, T] (lengths [B] valid, 0 allowed) after each sequence's cache and run
    every layer on them: (logits [B, T, V] fp32, cache with lengths + lengths).

    Decode is T = 1; scoring continuations after a prefilled context (evaluation) is T > 1. The cache
    must hold max(cache.lengths) + T entries. Logits of padding positions are meaningless.
    """
    params = unstack_layers(params, config)
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    new_lengths = cache.lengths + lengths.astype(jnp.int32)
    write = CacheWrite(cache.lengths, new_lengths)
    h, lower = cached_lower(params, config, tokens, positions, write, cache.lower)
    upper = cache.upper
    if swiftkv:
        upper = swiftkv_cache_kv(params, config, h, positions, write, upper)
        h, _ = cached_upper(params, config, h, positions, CacheWrite(None, new_lengths), upper, swiftkv=True)
    else:
        h, upper = cached_upper(params, config, h, positions, write, upper, swiftkv=False)
    return head(params, config, h), KVCache(lower, upper, new_lengths)


def decode_step(params, cache: KVCache, tokens, *, config: ModelConfig, swiftkv: bool):
    """One new token per sequence, tokens [B] at position cache.lengths: (logits [B, V] fp32, cache)."""
    logits, cache = extend(params, cache, tokens[:, None], jnp.ones_like(cache.lengths), config=config,
                           swiftkv=swiftkv)
    return logits[:, 0], cache

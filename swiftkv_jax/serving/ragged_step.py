"""One jitted engine step over a flat, ragged batch of tokens and the paged KV cache.

Tokens [D + R] (see `swiftkv_jax.model.paged`): D single tokens, then R packed prompt tokens. Every token runs the
embedding and the layers < l, writing its K/V. SwiftKV wiring: the owners' K/V projection for every token, then
only the U tokens whose logits are wanted (the singles and each completed prompt's last token) are gathered and run
through the layers >= l, reading the group pages. Teacher wiring: every token runs every layer, and the U rows are
gathered before the head. Then the head and per-row sampling for those U rows only.

Shapes are static per (D, R) bucket; everything that varies per step is an array argument.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from swiftkv_jax.model.cached import cached_lower, cached_upper, head, swiftkv_cache_kv
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.paged import PagedBatch
from swiftkv_jax.serving.paged_cache import PagePool
from swiftkv_jax.serving.tensor_parallel import activation_sharding


@struct.dataclass
class Sampled:
    """Per logit row [U]: temperature (0 greedy), top_k (0 off), top_p (1 off), seed and the number of tokens the
    request generated before (the key is fold_in(key(seed), count): the same draw whatever else is in the batch)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    count: jax.Array


def sample_rows(logits, s: Sampled):
    """tokens [U] from fp32 logits [U, V], each row by its own settings (`sampling.sample`'s rules per row)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        scaled = logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
        order = jnp.argsort(-scaled, axis=-1)
        ranked = jnp.take_along_axis(scaled, order, axis=-1)
        rank = jnp.arange(logits.shape[-1])[None, :]
        keep = (s.top_k[:, None] == 0) | (rank < s.top_k[:, None])
        probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
        keep &= jnp.cumsum(probs, axis=-1) - probs < s.top_p[:, None]  # the smallest prefix reaching top_p
        keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(s.seed, s.count)
        pick = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, ranked, -jnp.inf))
        return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)

    sampled = jax.lax.cond(jnp.any(s.temperature > 0), draw, lambda: greedy)
    return jnp.where(s.temperature > 0, sampled, greedy)


MAX_TOP_LOGPROBS = 20  # as the OpenAI API allows


@functools.partial(jax.jit, static_argnames=("config", "swiftkv", "mesh"), donate_argnames=("pool",))
def ragged_step(params, pool: PagePool, tokens, positions, batch: PagedBatch, upper_index, upper: PagedBatch,
                sampling: Sampled, want_top, *, config: ModelConfig, swiftkv: bool, mesh: Optional[Mesh] = None):
    """(tokens [U], logprobs [U] fp32, (top logprobs, top ids) [U, MAX_TOP_LOGPROBS], pool). params in serving
    layout (`unstack_layers`, done once by the engine).

    tokens, positions [D + R]; upper_index [U] the rows to run to the head (into the D + R tokens); `upper` the
    PagedBatch of those U rows as single tokens (read only), used by SwiftKV's later layers. want_top []: whether
    any row asked for its top logprobs (else zeros, and no top-k over the vocabulary). mesh: the tensor-parallel
    mesh of params and pool, None for one device."""
    with activation_sharding(config, mesh):
        return _ragged_step(params, pool, tokens, positions, batch, upper_index, upper, sampling, want_top, config,
                            swiftkv)


def _ragged_step(params, pool, tokens, positions, batch, upper_index, upper, sampling, want_top, config, swiftkv):
    tokens, positions = tokens[None], positions[None]
    h, lower = cached_lower(params, config, tokens, positions, batch, pool.lower)
    upper_positions = positions[:, upper_index]
    if swiftkv:
        upper_pool = swiftkv_cache_kv(params, config, h, positions, batch, pool.upper)
        h, _ = cached_upper(params, config, h[:, upper_index], upper_positions, upper, upper_pool, swiftkv=True)
    else:
        h, upper_pool = cached_upper(params, config, h, positions, batch, pool.upper, swiftkv=False)
        h = h[:, upper_index]
    logits = head(params, config, h)[0]
    token = sample_rows(logits, sampling)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    logprob = jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0]
    k = min(MAX_TOP_LOGPROBS, logits.shape[-1])
    top = jax.lax.cond(want_top, lambda: tuple(jax.lax.top_k(log_probs, k)),
                       lambda: (jnp.zeros((logits.shape[0], k), log_probs.dtype), jnp.zeros((logits.shape[0], k),
                                                                                            jnp.int32)))
    return token, logprob, top, PagePool(lower, upper_pool)

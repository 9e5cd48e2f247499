"""A flat, ragged batch of tokens over a paged KV cache: the `cache_write` of the continuous-batching engine.

The layers see one row of T tokens from many sequences ([1, T, ...]); this module tells them where each token's
K/V goes in a pool of pages and what each token attends to. The row has two parts, in this order:

- D single tokens (decodes, the last prompt token of a recomputed or 1-token prompt, and in SwiftKV's later
  layers every token that runs them): token i belongs to a sequence whose block table is `tables[i]` and attends
  to its keys `< lengths[i]` (its own K/V included, written first). Few queries over a cache: the config's
  `decode_attention_impl` (`xla`: pages gathered into a dense view, the reference; `pallas`: the paged kernel,
  which follows the block table itself).
- R prompt tokens, packed: several prompts' chunks side by side with segment ids (no padding per prompt), each
  token attending causally within its segment. At most one segment (id 0) continues a prompt that earlier steps
  cached (`context_table`, `context_length`): its tokens also see those keys. The scheduler keeps that invariant
  (only the last prompt of a step can be cut short, and it comes first in the next). Many queries: the config's
  `attention_impl` over [cached context of segment 0 | the chunk's own new K/V], so the chunk never gathers any
  other sequence's pages.

Pools: one (k, v) pair of [P, page_size, K, H] arrays per cached layer; page 0 is never handed out, padding
tokens write there. A token at position p of a sequence lives in page `table[p // page_size]` at `p % page_size`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from swiftkv_jax.model.attention import _DECODE_IMPLS, _xla_cache_attention, attend

NULL_PAGE = 0  # written by padding tokens, read by nothing


def gather_pages(pages, table):
    """pages [P, page_size, K, H] through table [..., M] -> the dense keys [..., M * page_size, K, H]."""
    gathered = pages[table]
    return gathered.reshape(table.shape[:-1] + (-1,) + pages.shape[2:])


def _paged_xla(q, k_pages, v_pages, tables, lengths, q_positions):
    """Few queries q [D, T, N, H] over their sequences' pages, by a dense gather (the reference path).

    The gather is made to depend on this layer's queries (a zero that XLA cannot fold: a NaN test of one query).
    In SwiftKV's later layers the group pages are all written before the first of them runs, and XLA would
    otherwise hoist every layer's gathered copy to the start and hold them all at once (measured on CPU: 4.5x the
    temporaries and a 30% slower decode step; `lax.optimization_barrier` does not survive XLA:CPU's scheduling)."""
    probe = q.reshape(-1)[0]
    tables = tables + (probe != probe).astype(tables.dtype)
    k, v = (jnp.swapaxes(gather_pages(p, tables), 1, 2) for p in (k_pages, v_pages))  # [D, K, S, H]
    return _xla_cache_attention(q, k, v, q_positions, lengths)


def _paged_pallas(q, k_pages, v_pages, tables, lengths, q_positions):
    from swiftkv_jax.kernels.paged_attention import paged_attention  # Pallas imports only when chosen

    return paged_attention(q, k_pages, v_pages, tables, lengths, q_positions)


_PAGED_IMPLS = {"xla": _paged_xla, "pallas": _paged_pallas}
assert set(_PAGED_IMPLS) == set(_DECODE_IMPLS), "every decode_attention_impl needs its paged form"


def paged_attend(impl: str, q, k_pages, v_pages, tables, lengths, q_positions):
    try:
        fn = _PAGED_IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown decode_attention_impl {impl!r}: available are {', '.join(_PAGED_IMPLS)}") from None
    return fn(q, k_pages, v_pages, tables, lengths, q_positions)


@struct.dataclass
class PagedBatch:
    """One engine step's tokens [1, D + R] over the pools (see the module docstring). Host-built, int32."""

    write_pages: Optional[jax.Array]  # [D + R] page of each token's K/V (NULL_PAGE for padding); None: read only
    write_offsets: Optional[jax.Array]  # [D + R] slot in that page
    tables: jax.Array                 # [D, M] block table of each single token's sequence
    lengths: jax.Array                # [D] keys each single token sees (its position + 1; 0 for padding)
    segments: jax.Array               # [R] segment of each prompt token (0..; -1 for padding)
    context_table: jax.Array          # [M] block table of segment 0's sequence
    context_length: jax.Array         # [] keys cached for segment 0 before this step (0: none)

    @property
    def num_single(self) -> int:
        return self.tables.shape[0]

    def write(self, pair, k, v):
        """The layer's pools with new k, v [1, D + R, K, H] written at each token's page and offset (in place
        under jit when the pools are donated)."""
        return tuple(pool.at[self.write_pages, self.write_offsets].set(new[0].astype(pool.dtype))
                     for pool, new in zip(pair, (k, v)))

    def view(self, pair, k=None, v=None):
        return PagedView(pair[0], pair[1], self, k, v)


@struct.dataclass
class PagedView:
    """What one layer's attention reads: its pools, the batch, and this call's new K/V [1, D + R, K, H] (None in
    SwiftKV's later layers, which only read)."""

    k_pages: jax.Array
    v_pages: jax.Array
    batch: PagedBatch
    k_new: Optional[jax.Array]
    v_new: Optional[jax.Array]

    def attend(self, config, q, positions):
        """q [1, D + R, N, H] (rotated), positions [1, D + R] -> [1, D + R, N, H]."""
        batch, d = self.batch, self.batch.num_single
        parts = []
        if d:
            single = paged_attend(config.decode_attention_impl, jnp.swapaxes(q[:, :d], 0, 1), self.k_pages,
                                  self.v_pages, batch.tables, batch.lengths, positions[0, :d, None])
            parts.append(jnp.swapaxes(single, 0, 1))
        if q.shape[1] > d:
            parts.append(self._attend_prompts(config, q[:, d:], positions[:, d:]))
        return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

    def _attend_prompts(self, config, q, positions):
        """The packed prompt chunks: keys = segment 0's cached context, then the chunk's own new K/V."""
        batch, d = self.batch, self.batch.num_single
        context_k, context_v = (gather_pages(p, batch.context_table)[None] for p in (self.k_pages, self.v_pages))
        capacity = context_k.shape[1]
        context_positions = jnp.arange(capacity, dtype=jnp.int32)
        context_segments = jnp.where(context_positions < batch.context_length, 0, -2)
        new_segments = jnp.where(batch.segments < 0, -2, batch.segments)  # padding: no query matches it
        k = jnp.concatenate([context_k, self.k_new[:, d:].astype(context_k.dtype)], axis=1)
        v = jnp.concatenate([context_v, self.v_new[:, d:].astype(context_v.dtype)], axis=1)
        kv_positions = jnp.concatenate([context_positions, positions[0]])[None]
        kv_segments = jnp.concatenate([context_segments, new_segments])[None]
        return attend(config.attention_impl, q, k.astype(q.dtype), v.astype(q.dtype), positions,
                      kv_positions, batch.segments[None], kv_segments)

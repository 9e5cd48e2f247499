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

Pools: one (k, v) pair of [K, P, page_size, H] arrays per cached layer (KV heads first, as the dense cache keeps
them before positions: gathered pages are then [K, S, H] per sequence, what a batched product over KV heads reads,
with no transpose); page 0 is never handed out, padding tokens write there. A token at position p of a sequence
lives in page `table[p // page_size]` at `p % page_size`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from swiftkv_jax.model.attention import _DECODE_IMPLS, _MASKED, attend
from swiftkv_jax.model.kv_quant import dequantize_pair, write_pair
from swiftkv_jax.sharding import map_over_heads

NULL_PAGE = 0  # written by padding tokens, read by nothing


def gather_pages(pages, table):
    """pages [K, P, page_size, H] through table [..., M] -> the dense keys [K, ..., M * page_size, H]; a
    quantised pool's scales [K, P, page_size] -> [K, ..., M * page_size]."""
    gathered, rest = pages[:, table], pages.shape[3:]
    return gathered.reshape(gathered.shape[:gathered.ndim - 2 - len(rest)] + (-1,) + rest)


PAGES_PER_BLOCK = 4  # pages a loop step of the XLA path reads per sequence (64 keys at 16-token pages)


def xla_pages_per_block(num_table_pages: int) -> int:
    """Pages per step of the XLA path. On CPU, PAGES_PER_BLOCK: a loop that stops after the longest sequence
    costs the keys in use, where a gather of every table into a dense [D, M * page_size] copy first was 3-4x
    slower (XLA's gather writes the whole copy, then the products read it again). On a GPU, the whole table in
    one pass: each iteration of a loop whose trip count is data-dependent waits for its condition to come back
    to the host, and at 8B / 32 sequences / ~2.5K context that loop (~45 iterations x every layer) made the
    engine's decode step ~75 ms against the static engine's 8 ms (GPU pack, 2026-11-23)."""
    return PAGES_PER_BLOCK if jax.default_backend() == "cpu" else max(num_table_pages, 1)


def _paged_xla(q, k_pages, v_pages, tables, lengths, q_positions, pages_per_block: Optional[int] = None,
               k_scale=None, v_scale=None):
    """Few queries q [D, T, N, H] over their sequences' pages, in XLA: blocks of `pages_per_block` pages (default
    `xla_pages_per_block`) with an online softmax (flash-decoding's merge), fp32, each needed page read once in
    place. Several blocks run as a loop that stops after the longest sequence's last page; one block runs
    without a loop. A quantised pool comes with its scales (0-d, or [K, P, page_size]) and is dequantised block
    by block. `kernels.paged_attention_reference` is the plain gather."""
    d, t, n, h = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    per_block = pages_per_block or xla_pages_per_block(tables.shape[1])
    g, rows, block = n // kv_heads, t * (n // kv_heads), per_block * page_size
    blocks = -(-tables.shape[1] // per_block)
    tables = jnp.pad(tables, ((0, 0), (0, blocks * per_block - tables.shape[1]))).reshape(d, blocks, -1)
    scaled = q.astype(jnp.float32) * (h ** -0.5)
    query = jnp.einsum("DTKGH->KDTGH", scaled.reshape(d, t, kv_heads, g, h)).reshape(kv_heads, d, rows, h)
    row_positions = jnp.repeat(q_positions, g, axis=1)  # [D, R], row r = t * G + g
    limit = jnp.minimum(lengths[:, None], row_positions + 1)  # row r sees keys < limit

    def step(i, carry):
        out, row_max, row_sum = carry
        pages = tables[:, i]  # [D, per_block]
        k, v = dequantize_pair((k_pages, v_pages) + ((k_scale, v_scale) if k_scale is not None else ()),
                               lambda a: a[:, pages].reshape((kv_heads, d, block) + a.shape[3:]))
        scores = jax.lax.dot_general(k.astype(jnp.float32), query, (((3,), (3,)), ((0, 1), (0, 1))))  # [K, D, S, R]
        visible = (i * block + jnp.arange(block))[None, :, None] < limit[:, None, :]  # [D, S, R]
        scores = jnp.where(visible[None], scores, _MASKED)
        new_max = jnp.maximum(row_max, scores.max(axis=2))
        probs = jnp.where(visible[None], jnp.exp(scores - new_max[:, :, None]), 0.0)
        rescale = jnp.exp(row_max - new_max)
        out = out * rescale[..., None] + jax.lax.dot_general(probs, v.astype(jnp.float32),
                                                             (((2,), (2,)), ((0, 1), (0, 1))))  # [K, D, R, H]
        return out, new_max, row_sum * rescale + probs.sum(axis=2)

    shape = (kv_heads, d, rows)
    carry = (jnp.zeros(shape + (h,), jnp.float32), jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32))
    if blocks == 1:
        out, _, row_sum = step(0, carry)
    else:
        steps = jnp.minimum(-(-jnp.max(lengths, initial=0) // block), blocks)
        out, _, row_sum = jax.lax.fori_loop(0, steps, step, carry)
    out = out / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]  # a row that sees no key: zeros
    return jnp.einsum("KDTGH->DTKGH", out.reshape(kv_heads, d, t, g, h)).reshape(d, t, n, h).astype(q.dtype)


def _paged_pallas(q, k_pages, v_pages, tables, lengths, q_positions, k_scale=None, v_scale=None):
    from swiftkv_jax.kernels.paged_attention import paged_attention  # Pallas imports only when chosen

    def per_shard(q, k_pages, v_pages, tables, lengths, q_positions, *scales):
        return paged_attention(q, k_pages, v_pages, tables, lengths, q_positions,
                               **dict(zip(("k_scale", "v_scale"), scales)))

    scales = tuple(s for s in (k_scale, v_scale) if s is not None)
    return map_over_heads(per_shard, q, k_pages, v_pages, tables, lengths, q_positions, *scales,
                          heads=(2, 0, 0, None, None, None) + tuple(0 if s.ndim else None for s in scales),
                          out_heads=2)


_PAGED_IMPLS = {"xla": _paged_xla, "pallas": _paged_pallas}
assert set(_PAGED_IMPLS) == set(_DECODE_IMPLS), "every decode_attention_impl needs its paged form"


def paged_attend(impl: str, q, k_pages, v_pages, tables, lengths, q_positions, k_scale=None, v_scale=None):
    try:
        fn = _PAGED_IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown decode_attention_impl {impl!r}: available are {', '.join(_PAGED_IMPLS)}") from None
    return fn(q, k_pages, v_pages, tables, lengths, q_positions, k_scale=k_scale, v_scale=v_scale)


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
        under jit when the pools are donated); a quantised pair (k, v, k_scale, v_scale) gets its dynamic scales
        [K, P, page_size] written the same way (`kv_quant.write_pair`)."""
        put = lambda pool, new: pool.at[:, self.write_pages, self.write_offsets].set(jnp.swapaxes(new, 0, 1))
        return write_pair(pair, k[0], v[0], put, put)

    def view(self, pair, k=None, v=None):
        return PagedView(pair[0], pair[1], self, k, v, *(pair[2:] or (None, None)))


@struct.dataclass
class PagedView:
    """What one layer's attention reads: its pools, the batch, and this call's new K/V [1, D + R, K, H] (None in
    SwiftKV's later layers, which only read)."""

    k_pages: jax.Array
    v_pages: jax.Array
    batch: PagedBatch
    k_new: Optional[jax.Array]
    v_new: Optional[jax.Array]
    k_scale: Optional[jax.Array] = None  # a quantised pool's scales: 0-d (static) or [K, P, page_size]
    v_scale: Optional[jax.Array] = None

    def attend(self, config, q, positions):
        """q [1, D + R, N, H] (rotated), positions [1, D + R] -> [1, D + R, N, H]."""
        batch, d = self.batch, self.batch.num_single
        parts = []
        if d:
            single = paged_attend(config.decode_attention_impl, jnp.swapaxes(q[:, :d], 0, 1), self.k_pages,
                                  self.v_pages, batch.tables, batch.lengths, positions[0, :d, None],
                                  self.k_scale, self.v_scale)
            parts.append(jnp.swapaxes(single, 0, 1))
        if q.shape[1] > d:
            parts.append(self._attend_prompts(config, q[:, d:], positions[:, d:]))
        return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

    def _attend_prompts(self, config, q, positions):
        """The packed prompt chunks: keys = segment 0's cached context, then the chunk's own new K/V."""
        batch, d = self.batch, self.batch.num_single
        pair = (self.k_pages, self.v_pages) + ((self.k_scale, self.v_scale) if self.k_scale is not None else ())
        context_k, context_v = (jnp.swapaxes(x, 0, 1)[None]  # [1, S, K, H]
                                for x in dequantize_pair(pair, lambda a: gather_pages(a, batch.context_table)))
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

"""A flat, ragged batch of tokens over a paged KV cache: the `cache_write` of the continuous-batching engine.

The layers see one row of T tokens from many sequences ([1, T, ...]); this module tells them where each token's
K/V goes in a pool of pages and what each token attends to. The row has two parts, in this order:

- D single tokens (decodes, the last prompt token of a recomputed or 1-token prompt, and in SwiftKV's later
  layers every token that runs them): token i belongs to a sequence whose block table is `tables[i]` and attends
  to its keys `< lengths[i]` (its own K/V included, written first). Few queries over a cache: the config's
  `decode_attention_impl` (`xla`: blocks of pages read in place with an online softmax, the reference;
  `pallas`: the paged kernel, which follows the block table itself).
- R prompt tokens, packed: several prompts' chunks side by side with segment ids (no padding per prompt), each
  token attending causally within its segment. At most one segment (id 0) continues a prompt that earlier steps
  cached (`context_table`, `context_length`); the scheduler keeps that invariant (only the last prompt of a step
  can be cut short, and it comes first in the next). Many queries: the config's `attention_impl` over the chunks'
  own new K/V; the continued segment instead attends over its pages (its context and its own keys, written
  first) by the paged path, so its context is read in place, never copied into a dense view.

Work follows each sequence's own length, never the block tables' width: the Pallas kernel stops at each length;
the XLA path (the reference, and the CPU's default) walks blocks of pages with an online softmax, as a loop that
stops after the longest sequence (`xla_loop="dynamic"`, the CPU's form) or, off the CPU, a fixed number of blocks
over a table whose width the engine buckets to the step's longest sequence (`"static"`: a loop whose trip count
depends on the data returns its condition to the host at every iteration on a GPU).

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

from swiftkv_jax.model.attention import _DECODE_IMPLS, _MASKED, FEW_QUERIES, attend
from swiftkv_jax.model.kv_quant import dequantize_pair, write_pair
from swiftkv_jax.sharding import map_over_heads

NULL_PAGE = 0  # written by padding tokens, read by nothing
PAGES_PER_BLOCK = 4  # pages a loop step of the dynamic XLA path reads per sequence (64 keys at 16-token pages)
XLA_LOOPS = ("dynamic", "static")
STATIC_SCORES = 1 << 26  # fp32 scores alive per block of the static XLA path (256 MiB)


def default_xla_loop() -> str:
    """The XLA path's form: "dynamic" on the CPU (a loop that stops after the longest sequence costs the keys in
    use; a gather of whole tables was 3-4x slower there), "static" elsewhere: each iteration of a loop whose trip
    count depends on the data waits for its condition to come back to the host, and at 8B / 32 sequences / ~2.5K
    context that loop (~45 iterations x every layer) made the engine's decode step ~75 ms against the static
    engine's 8 ms (GPU pack, 2026-11-23)."""
    return "dynamic" if jax.default_backend() == "cpu" else "static"


def _static_pages_per_block(kv_heads: int, d: int, rows: int, page_size: int, num_pages: int) -> int:
    """Pages a block of the static path reads per sequence: as many as keep the scores within STATIC_SCORES (the
    whole table in one pass for few queries, blocks of it for a long continued prompt)."""
    return max(1, min(num_pages, STATIC_SCORES // max(1, kv_heads * d * rows * page_size)))


def _paged_xla(q, k_pages, v_pages, tables, lengths, q_positions, pages_per_block: Optional[int] = None,
               k_scale=None, v_scale=None, loop: str = "dynamic"):
    """Queries q [D, T, N, H] over their sequences' pages, in XLA: blocks of `pages_per_block` pages with an online
    softmax (flash-decoding's merge), fp32, each needed page read once in place. `loop` "dynamic": blocks of
    PAGES_PER_BLOCK pages in a loop that stops after the longest sequence's last page; "static": every block of
    the table, as few as the scores' budget allows (one pass for few queries). A query at position -1 sees nothing
    (zeros). A quantised pool comes with its scales (0-d, or [K, P, page_size]) and is dequantised block by block.
    `kernels.paged_attention_reference` is the plain gather."""
    if loop not in XLA_LOOPS:
        raise ValueError(f"unknown XLA paged loop {loop!r}: available are {', '.join(XLA_LOOPS)}")
    d, t, n, h = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    g, rows = n // kv_heads, t * (n // kv_heads)
    per_block = pages_per_block or (PAGES_PER_BLOCK if loop == "dynamic" else
                                    _static_pages_per_block(kv_heads, d, rows, page_size, tables.shape[1]))
    block = per_block * page_size
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
    elif loop == "static":  # a trip count known when compiling: no condition goes back to the host
        out, _, row_sum = jax.lax.fori_loop(0, blocks, step, carry)
    else:
        steps = jnp.minimum(-(-jnp.max(lengths, initial=0) // block), blocks)
        out, _, row_sum = jax.lax.fori_loop(0, steps, step, carry)
    out = out / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]  # a row that sees no key: zeros
    return jnp.einsum("KDTGH->DTKGH", out.reshape(kv_heads, d, t, g, h)).reshape(d, t, n, h).astype(q.dtype)


def _paged_pallas(q, k_pages, v_pages, tables, lengths, q_positions, k_scale=None, v_scale=None):
    from swiftkv_jax.kernels.decode_attention import DecodeBlockSizes
    from swiftkv_jax.kernels.paged_attention import paged_attention  # Pallas imports only when chosen

    # A continued prompt (many queries) spreads over its blocks of query rows: one split of the keys, so that the
    # partial results stay [rows, H] rather than num_splits times that.
    block_sizes = DecodeBlockSizes(num_splits=1) if q.shape[1] > FEW_QUERIES else None

    def per_shard(q, k_pages, v_pages, tables, lengths, q_positions, *scales):
        return paged_attention(q, k_pages, v_pages, tables, lengths, q_positions, block_sizes=block_sizes,
                               **dict(zip(("k_scale", "v_scale"), scales)))

    scales = tuple(s for s in (k_scale, v_scale) if s is not None)
    return map_over_heads(per_shard, q, k_pages, v_pages, tables, lengths, q_positions, *scales,
                          heads=(2, 0, 0, None, None, None) + tuple(0 if s.ndim else None for s in scales),
                          out_heads=2)


_PAGED_IMPLS = {"xla": _paged_xla, "pallas": _paged_pallas}
assert set(_PAGED_IMPLS) == set(_DECODE_IMPLS), "every decode_attention_impl needs its paged form"


def paged_attend(impl: str, q, k_pages, v_pages, tables, lengths, q_positions, k_scale=None, v_scale=None,
                 xla_loop: str = "dynamic"):
    """q [D, T, N, H] over the pages of D sequences (tables [D, M], lengths [D], q_positions [D, T]) by the named
    `decode_attention_impl`; `xla_loop` is the XLA path's form (`default_xla_loop`)."""
    if impl == "xla":
        return _paged_xla(q, k_pages, v_pages, tables, lengths, q_positions, k_scale=k_scale, v_scale=v_scale,
                          loop=xla_loop)
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
    xla_loop: str = struct.field(pytree_node=False, default="dynamic")  # the XLA path's form (static: a jit key)

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
                                  self.k_scale, self.v_scale, batch.xla_loop)
            parts.append(jnp.swapaxes(single, 0, 1))
        if q.shape[1] > d:
            parts.append(self._attend_prompts(config, q[:, d:], positions[:, d:]))
        return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

    def _attend_prompts(self, config, q, positions):
        """The packed prompt chunks over their own new K/V; the continued segment 0 over its pages instead."""
        batch, d = self.batch, self.batch.num_single
        continued = (batch.segments == 0) & (batch.context_length > 0)  # [R]
        kv_segments = jnp.where(batch.segments < 0, -2, batch.segments)[None]  # padding: no query matches it
        q_segments = jnp.where(continued, -1, batch.segments)[None]  # read below: no key here
        own = attend(config.attention_impl, q, self.k_new[:, d:].astype(q.dtype), self.v_new[:, d:].astype(q.dtype),
                     positions, positions, q_segments, kv_segments)

        def from_pages():  # one sequence, R query rows: those of segment 0 at their positions, the others see nothing
            q_positions = jnp.where(continued, positions[0], -1)
            out = paged_attend(config.decode_attention_impl, q, self.k_pages, self.v_pages, batch.context_table[None],
                               jnp.max(q_positions, keepdims=True) + 1, q_positions[None], self.k_scale, self.v_scale,
                               batch.xla_loop)
            return out.astype(q.dtype)

        if config.decode_attention_impl == "xla" and batch.xla_loop == "static":  # a fixed-cost loop: skip it
            paged = jax.lax.cond(jnp.any(continued), from_pages, lambda: jnp.zeros_like(q))  # when nothing continues
        else:  # the loop or the kernel stops at the length: no work when nothing continues
            paged = from_pages()
        return jnp.where(continued[None, :, None, None], paged, own)

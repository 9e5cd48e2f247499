"""A flat, ragged batch of tokens over a paged KV cache: the `cache_write` of the continuous-batching engine.

The layers see one row of T tokens from many sequences ([1, T, ...]); this module tells them where each token's
K/V goes in a pool of pages and what each token attends to. The row has two parts, in this order:

- D single tokens (decodes, the last prompt token of a recomputed or 1-token prompt, and in SwiftKV's later
  layers every token that runs them): each its own sequence's, attending to its keys `<= position` (its own K/V
  included, written first).
- R prompt tokens, packed: several prompts' chunks side by side with segment ids (no padding per prompt), each
  token attending causally within its sequence. A chunk that starts past position 0 continues a prompt whose start
  earlier steps cached (`continued`); any number of chunks in a step may (a prefix-cache hit is one).

Each token carries its sequence's slot, the row of the block tables [S, M]. Attention over the pages is one ragged
call (`ragged_attend`: the launches of `kernels.ragged_paged_attention`, decode-only, prefill-only or mixed) by the
config's `decode_attention_impl` (`xla`: blocks of pages read in place with an online softmax, the reference;
`pallas`: the paged kernel, which follows the block table itself). It serves the single tokens and the continued
chunks, whose context is read in place, never copied into a dense view; the other chunks attend over their own new
K/V by the config's `attention_impl` (cuDNN on a GPU, with segment ids). With `pallas` for both, every token reads
the pages in the one call, as vLLM's kernels do.

Work follows each sequence's own length, never the block tables' width: the Pallas kernel stops at each length;
the XLA path (the reference, and the CPU's default) walks blocks of pages with an online softmax, as a loop that
stops after the longest sequence (`xla_loop="dynamic"`, the CPU's form; blocks of prompt tokens run sorted by length
in a few groups, each a loop that stops at its own longest block) or, off the CPU, a fixed number of blocks
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

from swiftkv_jax.model.attention import DECODE_IMPLS, MASKED, FEW_QUERIES, attend
from swiftkv_jax.model.kv_quant import as_stored, dequantize_pair, write_pair
from swiftkv_jax.sharding import map_over_heads

NULL_PAGE = 0  # written by padding tokens, read by nothing
# Pages a loop step of the dynamic XLA path reads per single token's sequence (256 keys at 16-token pages): of 4-64
# on the CPU, 16 was the fastest for 8-32 decodes at 0.2-2K keys (0.65-0.75x the time of 4), 1.1x for one sequence.
PAGES_PER_BLOCK = 16
XLA_LOOPS = ("dynamic", "static")
STATIC_SCORES = 1 << 26  # fp32 scores alive per block of the static XLA path (256 MiB)
# Prompt tokens per block of the XLA path's ragged layout. Each block gathers its sequence's pages, so that traffic
# falls as blocks grow; every block row is computed, so the partial block of each run wastes more as they grow.
# 32 (32 pages, 512 keys, a loop step; blocks grouped by length) was the fastest of 16-64 tokens x 16-32 pages on
# the CPU, for 512-token steps of chunks continuing 0.2-2K-token prompts (the shared-prefix benchmark's single- and
# multi-turn steps, chunked prompts without caching): 0.6-0.9x the time of 16-token blocks of 16 pages, 1.0x for
# short contexts; those were 0.3-0.8x of 8-token blocks of 4 pages, ungrouped.
XLA_BLOCK_TOKENS = 32
PREFILL_PAGES_PER_BLOCK = 32  # pages a loop step of the dynamic XLA path reads per block of prompt tokens
# The dynamic path runs the prompt blocks sorted by length in groups of at least this many, each group a loop that
# stops at its own longest block: a block costs about its own keys, and one that reads no page (a fresh prompt's
# tokens, padding) nothing; at most MAX_LENGTH_GROUPS loops, so that the program stays small.
LENGTH_GROUP_BLOCKS = 4
MAX_LENGTH_GROUPS = 8


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
        scores = jnp.where(visible[None], scores, MASKED)
        new_max = jnp.maximum(row_max, scores.max(axis=2))
        probs = jnp.where(visible[None], jnp.exp(scores - new_max[:, :, None]), 0.0)
        rescale = jnp.exp(row_max - new_max)
        out = out * rescale[..., None] + jax.lax.dot_general(probs, v.astype(jnp.float32),
                                                             (((2,), (2,)), ((0, 1), (0, 1))))  # [K, D, R, H]
        return out, new_max, row_sum * rescale + probs.sum(axis=2)

    shape = (kv_heads, d, rows)
    carry = (jnp.zeros(shape + (h,), jnp.float32), jnp.full(shape, MASKED, jnp.float32), jnp.zeros(shape, jnp.float32))
    if blocks == 1:
        out, _, row_sum = step(0, carry)
    elif loop == "static":  # a trip count known when compiling: no condition goes back to the host
        out, _, row_sum = jax.lax.fori_loop(0, blocks, step, carry)
    else:
        steps = jnp.minimum(-(-jnp.max(lengths, initial=0) // block), blocks)
        out, _, row_sum = jax.lax.fori_loop(0, steps, step, carry)
    out = out / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]  # a row that sees no key: zeros
    return jnp.einsum("KDTGH->DTKGH", out.reshape(kv_heads, d, t, g, h)).reshape(d, t, n, h).astype(q.dtype)


def _paged_kernel(kernel, q, k_pages, v_pages, tables, lengths, q_positions, k_scale, v_scale, **options):
    """A paged kernel of `paged_attention`'s contract on each shard of KV heads (axis 0 of the pools and of
    per-token-head scales), a quantised pool's scales passed on."""
    def per_shard(q, k_pages, v_pages, tables, lengths, q_positions, *scales):
        return kernel(q, k_pages, v_pages, tables, lengths, q_positions, **options,
                      **dict(zip(("k_scale", "v_scale"), scales)))

    scales = tuple(s for s in (k_scale, v_scale) if s is not None)
    return map_over_heads(per_shard, q, k_pages, v_pages, tables, lengths, q_positions, *scales,
                          heads=(2, 0, 0, None, None, None) + tuple(0 if s.ndim else None for s in scales),
                          out_heads=2)


def _paged_pallas(q, k_pages, v_pages, tables, lengths, q_positions, k_scale=None, v_scale=None):
    from swiftkv_jax.kernels.decode_attention import DecodeBlockSizes
    from swiftkv_jax.kernels.paged_attention import paged_attention  # Pallas imports only when chosen

    # A continued prompt (many queries) spreads over its blocks of query rows: one split of the keys, so that the
    # partial results stay [rows, H] rather than num_splits times that.
    block_sizes = DecodeBlockSizes(num_splits=1) if q.shape[1] > FEW_QUERIES else None
    return _paged_kernel(paged_attention, q, k_pages, v_pages, tables, lengths, q_positions, k_scale, v_scale,
                         block_sizes=block_sizes)


def _paged_mosaic(q, k_pages, v_pages, tables, lengths, q_positions, k_scale=None, v_scale=None):
    from swiftkv_jax.kernels.decode_attention_mgpu import paged_attention_mgpu  # Pallas imports only when chosen

    # a quantised pool stays quantised (converted tile by tile in shared memory); q is cast to the kernel's dtype
    return _paged_kernel(paged_attention_mgpu, q, k_pages, v_pages, tables, lengths, q_positions, k_scale,
                         v_scale).astype(q.dtype)


_PAGED_IMPLS = {"xla": _paged_xla, "pallas": _paged_pallas, "mosaic": _paged_mosaic}
assert set(_PAGED_IMPLS) == set(DECODE_IMPLS), "every decode_attention_impl needs its paged form"


def _by_length(attend, q, tables, lengths, q_positions, group: int):
    """`attend` over D blocks in groups of `group`, longest first (each group a call of its own, e.g. a loop that
    stops at its longest block); the results back in the blocks' order."""
    d = q.shape[0]
    if d <= group:
        return attend(q, tables, lengths, q_positions)
    order = jnp.argsort(-lengths)
    pad = -d % group
    take = lambda x: jnp.pad(x[order], [(0, pad)] + [(0, 0)] * (x.ndim - 1))  # padding blocks: length 0
    q, tables, lengths, q_positions = map(take, (q, tables, lengths, q_positions))
    out = jnp.concatenate([attend(q[i:i + group], tables[i:i + group], lengths[i:i + group],
                                  q_positions[i:i + group]) for i in range(0, d + pad, group)])
    return out[jnp.argsort(order)]  # the inverse permutation: each block's result back in its place


def paged_attend(impl: str, q, k_pages, v_pages, tables, lengths, q_positions, k_scale=None, v_scale=None,
                 xla_loop: str = "dynamic", prefill: bool = False):
    """q [D, T, N, H] over the pages of D sequences (tables [D, M], lengths [D], q_positions [D, T]) by the named
    `decode_attention_impl`; `xla_loop` is the XLA path's form (`default_xla_loop`). `prefill`: the D are blocks of
    prompt tokens (many queries each), which the dynamic XLA path reads in larger steps, grouped by length."""
    if impl == "xla":
        if prefill and xla_loop == "dynamic":
            group = max(LENGTH_GROUP_BLOCKS, -(-q.shape[0] // MAX_LENGTH_GROUPS))
            return _by_length(lambda q, tables, lengths, q_positions: _paged_xla(
                q, k_pages, v_pages, tables, lengths, q_positions, PREFILL_PAGES_PER_BLOCK, k_scale, v_scale),
                q, tables, lengths, q_positions, group)
        return _paged_xla(q, k_pages, v_pages, tables, lengths, q_positions, k_scale=k_scale, v_scale=v_scale,
                          loop=xla_loop)
    try:
        fn = _PAGED_IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown decode_attention_impl {impl!r}: available are {', '.join(_PAGED_IMPLS)}") from None
    return fn(q, k_pages, v_pages, tables, lengths, q_positions, k_scale=k_scale, v_scale=v_scale)


def ragged_attend(impl: str, q, k_pages, v_pages, tables, slots, positions, *, num_single: int, max_runs: int,
                  k_scale=None, v_scale=None, xla_loop: str = "dynamic", xla_block_tokens: int = XLA_BLOCK_TOKENS):
    """One step's tokens q [T, N, H] over their sequences' pages (tables [S, M] a row per slot, slots [T] -1 for
    padding, positions [T]: token t sees keys <= positions[t]; -1 sees nothing) by the named
    `decode_attention_impl`, with the launches of `kernels.ragged_paged_attention`: the `num_single` leading single
    tokens a sequence each, then runs of prompt tokens in blocks of one sequence (`xla_block_tokens` tokens a block
    in the XLA path)."""
    from swiftkv_jax.kernels.ragged_paged_attention import ragged_layout, ragged_paged_attention

    if impl == "pallas":
        def per_shard(q, k_pages, v_pages, tables, slots, positions, *scales):
            return ragged_paged_attention(q, k_pages, v_pages, tables, slots, positions, num_single=num_single,
                                          max_runs=max_runs, **dict(zip(("k_scale", "v_scale"), scales)))

        scales = tuple(s for s in (k_scale, v_scale) if s is not None)
        return map_over_heads(per_shard, q, k_pages, v_pages, tables, slots, positions, *scales,
                              heads=(1, 0, 0, None, None, None) + tuple(0 if s.ndim else None for s in scales),
                              out_heads=1)

    def attend(q, tables, lengths, q_positions, prefill):
        run = lambda: paged_attend(impl, q, k_pages, v_pages, tables, lengths, q_positions, k_scale, v_scale,
                                   xla_loop, prefill)
        if prefill and impl == "xla" and xla_loop == "static":  # a fixed-cost loop: skipped when no block reads
            return jax.lax.cond(jnp.any(lengths > 0), run, lambda: jnp.zeros_like(q))
        return run()

    return ragged_layout(attend, q, tables, slots, positions, num_single=num_single, max_runs=max_runs,
                         block_tokens=xla_block_tokens)


@struct.dataclass
class PagedBatch:
    """One engine step's tokens [1, D + R] over the pools (see the module docstring), int32 unless noted."""

    write_pages: Optional[jax.Array]  # [D + R] page of each token's K/V (NULL_PAGE for padding); None: read only
    write_offsets: Optional[jax.Array]  # [D + R] slot in that page
    tables: jax.Array                 # [S, M] the block table of every slot
    slots: jax.Array                  # [D + R] each token's slot (row of tables); -1 for padding
    segments: jax.Array               # [R] segment of each prompt token (0..; -1 for padding)
    continued: jax.Array              # [R] bool: the token's chunk continues a prompt whose start is cached
    xla_loop: str = struct.field(pytree_node=False, default="dynamic")  # the XLA path's form (static: a jit key)
    max_runs: int = struct.field(pytree_node=False, default=0)  # runs of prompt tokens at most (with the padding)

    @property
    def num_single(self) -> int:
        return self.slots.shape[0] - self.segments.shape[0]

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
        """q [1, D + R, N, H] (rotated), positions [1, D + R] -> [1, D + R, N, H].

        The paged Pallas kernel for both kinds of attention reads every token from the pages (one ragged call, as
        vLLM's kernels do: the K/V of this step are written first). Otherwise the single tokens and the continued
        chunks read the pages (one ragged call) and the other prompt chunks attend over their own new K/V, as the
        pages hold them, by the config's `attention_impl` (packed, segment ids), which needs no page and reads each
        key once."""
        batch, d = self.batch, self.batch.num_single
        every_token = config.attention_impl == "pallas" and config.decode_attention_impl == "pallas"
        from_pages = jnp.ones_like(batch.continued) if every_token else batch.continued
        paged_positions = positions[0].at[d:].set(jnp.where(from_pages, positions[0, d:], -1))
        paged = ragged_attend(config.decode_attention_impl, q[0], self.k_pages, self.v_pages, batch.tables,
                              batch.slots, paged_positions, num_single=d, max_runs=batch.max_runs,
                              k_scale=self.k_scale, v_scale=self.v_scale, xla_loop=batch.xla_loop)[None]
        if every_token or q.shape[1] == d:
            return paged.astype(q.dtype)
        kv_segments = jnp.where(batch.segments < 0, -2, batch.segments)[None]  # padding: no query matches it
        q_segments = jnp.where(from_pages, -1, batch.segments)[None]  # read from the pages: no key here
        # the new K/V as the pages hold them (rounded or quantised): every read of a token, this one, a later chunk's,
        # a prefix-cache hit's or sk.generate's over its cache, sees the same values (vLLM's prefill attends to them
        # before quantisation, so its tokens depend on the chunking and on the prefix cache)
        k_own, v_own = (as_stored(new[:, d:], pages.dtype, scale, q.dtype) for new, pages, scale in
                        ((self.k_new, self.k_pages, self.k_scale), (self.v_new, self.v_pages, self.v_scale)))
        own = attend(config.attention_impl, q[:, d:], k_own, v_own, positions[:, d:], positions[:, d:], q_segments,
                     kv_segments)
        prompts = jnp.where(from_pages[None, :, None, None], paged[:, d:].astype(q.dtype), own)
        return jnp.concatenate([paged[:, :d].astype(q.dtype), prompts], axis=1)

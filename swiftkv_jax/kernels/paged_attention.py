"""Attention of a few or many queries over a PAGED KV cache: the split-K kernel following a block table, and its
reference.

Shapes (one letter per dimension): q ``[B, T, N, H]``, k_pages / v_pages ``[K, P, page_size, H]`` (a pool of P
pages of one layer, KV heads first as in jax's TPU paged attention: a gather of one sequence's pages is then
already in the ``[K, S, H]`` order that a batched product over KV heads reads, with no transpose), block_tables
``[B, M]`` int32, lengths ``[B]`` int32, q_positions ``[B, T]`` int32. Key s of sequence b lives in page
``block_tables[b, s // page_size]`` at offset ``s % page_size`` (``k_pages[k, page, offset]``); table entries past
the sequence's ``ceil(lengths[b] / page_size)`` pages may hold anything (0, stale or out-of-range ids) and are
never read. Masking, scale, GQA, empty rows and residuals are exactly those of ``decode_attention`` (see
decode_attention.py): query t of sequence b sees key s iff ``s < lengths[b]`` and ``s <= q_positions[b, t]``.

Kernel: the dense kernel's launch and program body (``split_k_attention``, ``attend_split``), with only the
addressing of a block's keys changed. One program per (b, kv head k, row block i, split j) holds up to ``block_q``
of the T*G query rows of its KV head (T may be a prompt chunk attending over its cached context: each row block
reads keys only up to its own rows' positions, none if they see nothing, e.g. ``q_positions == -1`` for rows of
another sequence) and the row of the block table of sequence b, the same for every row block and split (an ordinary
input block: Pallas' Triton backend has no scalar prefetch, and an input block is what both interpret mode and the
Triton lowering index). For each block of ``block_k`` keys it loads the page id of every key from that row
(``table[s // page_size]``) and then the keys themselves as one gather ``pool[page, s % page_size, :]`` from the
pool of its KV head, read in place: the cache is never copied into a dense layout. So a block may span several small
pages or part of a large one (any page size works with any ``block_k``), each K/V page is read once for the whole
GQA group, and keys past the split's last needed key are masked out of the loads. Blocks past ``lengths[b]`` (and
past every row's position) are not iterated at all, so their table entries and pages cost nothing and are not
touched. The splits (``num_splits`` pieces of the table's key capacity ``M * page_size``, in whole blocks) are
merged exactly with ``merge_partials``, so a long sequence still spreads over many programs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from swiftkv_jax.kernels.decode_attention import decode_attention_reference
from swiftkv_jax.kernels.split_k import (DecodeBlockSizes, attend_split, check_pages, check_queries, check_scales,
                                         dequantize, kernel_settings, no_keys, normalize, pltriton, scale_inputs,
                                         split_k_attention)
from swiftkv_jax.kernels.tuning import call_shapes

__all__ = ["paged_attention", "paged_attention_reference"]


def paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, q_positions, *,
                              return_residuals: bool = False, k_scale=None, v_scale=None):
    """Plain jnp: gathers the pages through the block table into a dense ``[B, M * page_size, K, H]`` view and
    calls ``decode_attention_reference`` (one reference for both layouts). Unused table entries read page 0 and
    keys past each length are zeroed, so nothing outside a sequence (not even a NaN) reaches the result. A
    quantised pool is dequantised (the whole pool, in memory) first."""
    B, M = block_tables.shape
    K, _, page_size, H = k_pages.shape
    check_scales(k_pages, v_pages, k_scale, v_scale, k_pages.shape[:3], "[K, P, page_size]")
    k_pages, v_pages = dequantize(k_pages, k_scale), dequantize(v_pages, v_scale)
    table = jnp.where(jnp.arange(M)[None, :] * page_size < lengths[:, None], block_tables, 0)  # entries in use
    valid = (jnp.arange(M * page_size)[None, :] < lengths[:, None])[:, :, None, None]

    def dense(pages):  # [K, B, M, page_size, H] -> [B, M * page_size, K, H]
        return jnp.where(valid, jnp.moveaxis(pages[:, table].reshape(K, B, M * page_size, H), 0, 2), 0)

    return decode_attention_reference(q, dense(k_pages), dense(v_pages), lengths, q_positions,
                                      return_residuals=return_residuals)


def _paged_kernel(limit_ref, q_ref, table_ref, k_ref, v_ref, *refs, page_size: int, **kwargs):
    """One (b, kv head, row block, split) program. table_ref [M]: the block table of sequence b; k_ref, v_ref
    [P, page_size, H]: the pool of this KV head (indexed in place); refs: the outputs of ``attend_split``, after
    the [P, page_size] scales of this KV head when they are per token and head."""
    last_entry = table_ref.shape[0] - 1
    head = jnp.arange(k_ref.shape[-1])[None, :]

    def key_index(i, idx, in_range):
        del i
        # Keys past the split's end are not loaded; their (clamped, in-bounds) entries are not read either.
        page = pltriton.load(table_ref.at[jnp.minimum(idx // page_size, last_entry)], mask=in_range, other=0)
        offset = idx % page_size
        return (page[:, None], offset[:, None], head), (page, offset)

    attend_split(limit_ref, q_ref, k_ref, v_ref, *refs, key_index=key_index, **kwargs)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def _paged_attention(q, k_pages, v_pages, block_tables, lengths, q_positions, block_sizes: DecodeBlockSizes,
                     interpret: bool, k_scale=None, v_scale=None):
    K, P, page_size, H = k_pages.shape
    M = block_tables.shape[1]
    dequantize, token_scales, static_scales = scale_inputs(k_scale, v_scale)
    # The same table row and pool of the KV head for every row block i and split j.
    table_spec = pl.BlockSpec((None, M), lambda b, k, i, j: (b, 0))
    pool_spec = pl.BlockSpec((None, P, page_size, H), lambda b, k, i, j: (k, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, P, page_size), lambda b, k, i, j: (k, 0, 0))  # [K, P, page_size] scales
    specs = [table_spec, pool_spec, pool_spec] + [scale_spec] * len(token_scales)
    kernel = functools.partial(_paged_kernel, page_size=page_size)
    return split_k_attention(kernel, q, lengths, q_positions,
                              (block_tables.astype(jnp.int32), k_pages, v_pages, *token_scales),
                              lambda split_len: specs, num_kv_heads=K, num_keys=M * page_size,
                              block_sizes=block_sizes, interpret=interpret, name="swiftkv_paged_attention",
                              dequantize=dequantize, static_scales=static_scales)


def paged_attention(q, k_pages, v_pages, block_tables, lengths, q_positions, *,
                    block_sizes: DecodeBlockSizes | None = None, interpret: bool | None = None,
                    return_residuals: bool = False, k_scale=None, v_scale=None):
    """Attention of a few or many query tokens over a paged KV cache, by the split-K Pallas kernel.

    Args:
      q: ``[B, T, N, H]`` queries (not pre-scaled: the kernel applies 1/sqrt(H)).
      k_pages, v_pages: ``[K, P, page_size, H]``, one layer's pool of pages; N % K == 0, H a power of two >= 16,
        any page_size >= 1.
      block_tables: ``[B, M]`` int, the page ids of sequence b in order; entries past its
        ``ceil(lengths[b] / page_size)`` pages are never read (any value).
      lengths: ``[B]`` int, keys with index < lengths[b] are valid (at most ``M * page_size`` are used).
      q_positions: ``[B, T]`` int, query t sees keys with index <= q_positions[b, t] (none if negative).
      block_sizes: ``DecodeBlockSizes`` (block_k keys per block, whatever the page size; num_splits pieces of
        the table's ``M * page_size`` keys; block_q query rows per program); default ``DecodeBlockSizes()``.
      interpret: None = interpret mode on CPU, compiled on GPU. Compiled on any other backend fails loudly.
      return_residuals: return ``AttentionResiduals`` (fp32, unnormalised; merge with ``merge_partials``,
        finish with ``normalize``) instead of the output.
      k_scale, v_scale: None (a bf16 / fp16 / fp32 pool) or the scales of a quantised (int8, float8_e4m3fn) pool,
        both a ``()`` per-layer scale or both ``[K, P, page_size]`` per token and KV head (laid out as the pool):
        ``k_pages[k, p, o].astype(f32) * k_scale[k, p, o]``. The kernel gathers the scales through the block table
        with the pages, loads the pool in its storage dtype and casts it to q's dtype in registers, the scales on
        the scores' and P's columns (split_k.py); softmax and accumulation in fp32.

    Returns:
      ``[B, T, N, H]`` in q's dtype (zeros for a query that sees no key), or ``AttentionResiduals``.
    """
    check_pages(q, k_pages, v_pages, block_tables)
    check_queries(q, k_pages.shape[0], lengths, q_positions)
    check_scales(k_pages, v_pages, k_scale, v_scale, k_pages.shape[:3], "[K, P, page_size]")
    tune = call_shapes("paged", q, k_pages.shape[0], k_pages.dtype)
    block_sizes, interpret = kernel_settings(block_sizes, interpret, "paged_attention", (k_pages.dtype,), tune)
    if block_tables.shape[1] == 0:  # a table of no pages: nothing to attend to
        residuals = no_keys(q)
    else:
        residuals = _paged_attention(q, k_pages, v_pages, block_tables, lengths, q_positions, block_sizes,
                                     interpret, k_scale, v_scale)
    return residuals if return_residuals else normalize(residuals, q.dtype)

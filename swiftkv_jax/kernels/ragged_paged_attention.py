"""Ragged paged attention: every token of one engine step over the paged KV cache, by one entry point.

A step is a flat row of T tokens ``q [T, N, H]``: first ``num_single`` single tokens (decodes; each its own sequence),
then packed runs of prompt tokens (each run the consecutive tokens of one sequence: a prompt chunk, with or without
a cached context before it). ``slots [T]`` names each token's row of ``block_tables [S, M]`` (-1: padding, which
sees nothing), ``positions [T]`` its position; every token's own K/V is already in the pages (the engine writes
first), so token t sees keys ``<= positions[t]`` of its sequence, read in place through the block table.

Launches specialised by the step's shape (static), as tpu-inference's ragged paged attention v3 does:

- decode-only (``num_single == T``): one row block per token (its G query heads), the keys split over many
  programs (``block_sizes.num_splits``), merged exactly;
- prefill-only (``num_single == 0``): the runs cut into blocks of ``block_q // G`` tokens of one sequence each; a
  block is one program per KV head that reads its sequence's pages only up to its own last token (causal block
  skipping), one split (a block's partial results would otherwise be ``num_splits`` times the output);
- mixed: both, one launch each.

Both launches are the paged kernel (``paged_attention.py``); this module lays the tokens out for it: a block of a
run is one "sequence" of the kernel with its own table row, so no program mixes tables. The layout costs a gather
of q and a scatter of the output (``T * N * H`` each, against attention's ``T * context * N * H``). The K/V write is
not fused: under the engine's donation XLA's scatter writes the step's ``T * K * H`` new values in place, a
small fraction of the pages the attention reads, and a fused write would need the pool as an aliased output of
every launch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from swiftkv_jax.kernels.paged_attention import paged_attention, paged_attention_reference
from swiftkv_jax.kernels.split_k import DecodeBlockSizes, kernel_settings
from swiftkv_jax.kernels.tuning import call_shapes

__all__ = ["RaggedBlocks", "ragged_blocks", "ragged_layout", "ragged_paged_attention",
           "ragged_paged_attention_reference"]


class RaggedBlocks(NamedTuple):
    """Runs of tokens laid out as ``NB`` blocks of ``BT`` tokens of one sequence each (see ``ragged_blocks``)."""

    index: jax.Array      # [NB, BT] the token in each block row; T (out of range) for none
    tables: jax.Array     # [NB, M] the block table of each block's sequence
    lengths: jax.Array    # [NB] keys a block reads: its last token's position + 1 (0: an empty or padding block)
    positions: jax.Array  # [NB, BT] position of each block row (-1: none, or padding)

    def gather(self, x):
        """x [T, ...] -> [NB, BT, ...] (rows of no token: zeros)."""
        return jnp.take(x, self.index, axis=0, mode="fill", fill_value=0)

    def scatter(self, blocks, num_tokens: int):
        """[NB, BT, ...] -> [num_tokens, ...]: each token's row back in its place."""
        out = jnp.zeros((num_tokens,) + blocks.shape[2:], blocks.dtype)
        return out.at[self.index.reshape(-1)].set(blocks.reshape((-1,) + blocks.shape[2:]), mode="drop")


def num_blocks(num_tokens: int, block_tokens: int, max_runs: int) -> int:
    """Blocks enough for any ``num_tokens`` tokens in at most ``max_runs`` runs: each run wastes at most one
    partial block."""
    return max(1, min(num_tokens, pl.cdiv(num_tokens, block_tokens) + max_runs))


def ragged_blocks(block_tables, slots, positions, *, block_tokens: int, max_runs: int | None = None) -> RaggedBlocks:
    """The blocks of ``block_tokens`` tokens that cut each run of ``slots [T]`` (consecutive tokens of one slot; -1
    padding, whose blocks see nothing). A run's tokens have consecutive positions. ``max_runs``: the most runs
    (padding runs included) the tokens can form, a static bound on the blocks (default T: any layout)."""
    T = slots.shape[0]
    nb = num_blocks(T, block_tokens, T if max_runs is None else max_runs)
    t = jnp.arange(T)
    new_run = jnp.concatenate([jnp.ones(1, bool), slots[1:] != slots[:-1]])
    offset = t - jax.lax.cummax(jnp.where(new_run, t, 0))  # index within its run
    block = jnp.cumsum(new_run | (offset % block_tokens == 0)) - 1
    row = offset % block_tokens
    index = jnp.full((nb, block_tokens), T, jnp.int32).at[block, row].set(t, mode="drop")
    slot = jnp.full((nb,), -1, jnp.int32).at[block].set(slots, mode="drop")
    real = jnp.take(slots, index, mode="fill", fill_value=-1) >= 0
    block_positions = jnp.where(real, jnp.take(positions, index, mode="fill", fill_value=-1), -1)
    lengths = jnp.max(block_positions, axis=1) + 1
    return RaggedBlocks(index, block_tables[jnp.maximum(slot, 0)], lengths, block_positions.astype(jnp.int32))


def block_tokens_for(num_heads: int, num_kv_heads: int, block_q: int) -> int:
    """Tokens in a prefill block: as many as fill ``block_q`` query rows of one KV head (G rows a token)."""
    return max(1, block_q // (num_heads // num_kv_heads))


def ragged_layout(attend, q, block_tables, slots, positions, *, num_single: int, block_tokens: int,
                  max_runs: int | None = None):
    """The entry point's launches for any paged attention ``attend(q [B, T', N, H], tables [B, M], lengths [B],
    q_positions [B, T'], prefill: bool) -> [B, T', N, H]`` (the kernel, or the engine's XLA path): the decode launch
    over the ``num_single`` single tokens (a token per sequence), the prefill launch over the runs' blocks of
    ``block_tokens`` (see the module docstring); ``[T, N, H]``."""
    parts = []
    if num_single:
        s, p = slots[:num_single], positions[:num_single]
        p = jnp.where(s >= 0, p, -1)
        parts.append(attend(q[:num_single, None], block_tables[jnp.maximum(s, 0)], p + 1, p[:, None], False)[:, 0])
    if num_single < q.shape[0]:
        blocks = ragged_blocks(block_tables, slots[num_single:], positions[num_single:], block_tokens=block_tokens,
                               max_runs=max_runs)
        out = attend(blocks.gather(q[num_single:]), blocks.tables, blocks.lengths, blocks.positions, True)
        parts.append(blocks.scatter(out, q.shape[0] - num_single))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def ragged_paged_attention(q, k_pages, v_pages, block_tables, slots, positions, *, num_single: int = 0,
                           max_runs: int | None = None, block_sizes: DecodeBlockSizes | None = None,
                           interpret: bool | None = None, k_scale=None, v_scale=None):
    """Attention of one step's tokens over a paged KV cache, by the paged Pallas kernel.

    Args:
      q: ``[T, N, H]`` (not pre-scaled): ``num_single`` single tokens, then runs of prompt tokens.
      k_pages, v_pages: ``[K, P, page_size, H]``, one layer's pool (the step's own K/V already written).
      block_tables: ``[S, M]`` int, a row per slot; slots: ``[T]`` int, each token's row (-1: padding);
      positions: ``[T]`` int, each token sees the keys ``<= positions[t]`` of its sequence (none if negative).
      num_single: how many leading tokens are single (static); the rest are runs.
      max_runs: the most runs (padding included) among the prompt tokens, static; default: any layout.
      block_sizes: ``DecodeBlockSizes`` of the decode launch; the prefill launch uses its block_k, block_q and
        compiler settings with one split.
      interpret, k_scale, v_scale: as ``paged_attention``.

    Returns:
      ``[T, N, H]`` in q's dtype (zeros for padding).
    """
    if q.ndim != 3 or slots.shape != q.shape[:1] or positions.shape != q.shape[:1]:
        raise ValueError(f"q must be [T, N, H] with slots and positions [T], got {q.shape}, {slots.shape} and "
                         f"{positions.shape}")
    if not 0 <= num_single <= q.shape[0]:
        raise ValueError(f"num_single must be in [0, T={q.shape[0]}], got {num_single}")
    tune = call_shapes("paged", q, k_pages.shape[0], k_pages.dtype, tokens=1)  # the decodes' blocks
    block_sizes, interpret = kernel_settings(block_sizes, interpret, "ragged_paged_attention", (k_pages.dtype,), tune)
    prefill_sizes = dataclasses.replace(block_sizes, num_splits=1)

    def attend(q, tables, lengths, q_positions, prefill):
        return paged_attention(q, k_pages, v_pages, tables, lengths, q_positions, interpret=interpret,
                               block_sizes=prefill_sizes if prefill else block_sizes, k_scale=k_scale,
                               v_scale=v_scale)

    return ragged_layout(attend, q, block_tables, slots, positions, num_single=num_single, max_runs=max_runs,
                         block_tokens=block_tokens_for(q.shape[1], k_pages.shape[0], block_sizes.block_q))


def ragged_paged_attention_reference(q, k_pages, v_pages, block_tables, slots, positions, *, k_scale=None,
                                     v_scale=None):
    """Plain jnp, token by token: each token a sequence of its own over its slot's table (no blocks)."""
    p = jnp.where(slots >= 0, positions, -1)
    out = paged_attention_reference(q[:, None], k_pages, v_pages, block_tables[jnp.maximum(slots, 0)], p + 1,
                                    p[:, None], k_scale=k_scale, v_scale=v_scale)
    return out[:, 0]

"""The ragged paged attention entry point (decode-only, prefill-only and mixed launches) against its token-by-token
jnp reference and the float64 walk of the block tables, in Pallas interpret mode; its block layout on its own.

A step's tokens are built as the engine lays them out: single tokens (decodes) of some slots, then runs of prompt
tokens (chunks with and without a cached context, runs longer than a block, a run of one token), then padding.
The pool is NaN wherever no sequence has a key, so a read outside a sequence shows."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from test_decode_attention_kernel import QUANTIZED, TOLERANCE, quantize
from test_paged_attention_kernel import numpy_paged_attention

from swiftkv_jax.kernels import DecodeBlockSizes
from swiftkv_jax.kernels.ragged_paged_attention import (block_tokens_for, num_blocks, ragged_blocks,
                                                        ragged_paged_attention, ragged_paged_attention_reference)


@dataclasses.dataclass(frozen=True)
class Step:
    singles: tuple[int, ...]             # context length (keys, own included) of each single token's sequence
    runs: tuple[tuple[int, int], ...]    # (cached keys before the run, tokens in the run) of each prompt run
    padding: int                         # padding tokens at the end
    page_size: int = 4
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    dtype: type = jnp.float32
    block_q: int = 16

    def __str__(self):
        return (f"D{len(self.singles)}_runs{'-'.join(f'{c}+{n}' for c, n in self.runs)}_pad{self.padding}"
                f"_ps{self.page_size}_G{self.heads // self.kv_heads}_{jnp.dtype(self.dtype).name}_bq{self.block_q}")

    @property
    def num_single(self):
        return len(self.singles)


STEPS = [
    # mixed: 3 decodes (one of an empty slot: padding), runs with and without context, one of 9 tokens over
    # blocks of 16 // G=4 = 4 tokens (3 blocks), a 1-token run; padding at the end
    Step((5, 17, 1), ((0, 9), (13, 3), (0, 1), (30, 6)), 3),
    Step((9, 33), (), 0),                      # decode-only
    Step((), ((0, 20), (7, 5)), 2),            # prefill-only, no GQA-sized block: G=8 -> 2 tokens a block
    Step((), ((40, 33),), 0, page_size=16, heads=8, kv_heads=8, head_dim=64, block_q=32),  # G=1: 32-token blocks
    Step((12,), ((3, 7),), 1, dtype=jnp.bfloat16, page_size=1),
]
STEPS[2] = dataclasses.replace(STEPS[2], heads=8, kv_heads=1)


def make_step(step: Step, seed: int = 0):
    """(q [T, N, H], k_pages, v_pages, block_tables [S, M], slots [T], positions [T]) with a shuffled page order,
    garbage table entries past each sequence's pages and NaN in every pool slot nobody holds."""
    rng = np.random.default_rng(seed)
    ps = step.page_size
    lengths = [*step.singles, *(c + n for c, n in step.runs)]
    slots, positions = [], []
    for s, length in enumerate(step.singles):
        slots.append(s if length else -1)
        positions.append(max(length - 1, 0))
    for r, (cached, n) in enumerate(step.runs):
        slots += [len(step.singles) + r] * n
        positions += list(range(cached, cached + n))
    slots += [-1] * step.padding
    positions += [0] * step.padding
    S = len(lengths)
    pages = [-(-length // ps) for length in lengths]
    M, P = max(pages, default=0) + 2, sum(pages) + 3
    order = rng.permutation(P)
    tables = rng.choice(np.concatenate([[0, 2**31 - 1, -1], order]), size=(S, M)).astype(np.int32)
    start = np.concatenate([[0], np.cumsum(pages)]).astype(int)
    needed = np.zeros((P, ps), bool)
    for s in range(S):
        tables[s, :pages[s]] = order[start[s]:start[s + 1]]
        keys = np.arange(lengths[s])
        needed[tables[s, keys // ps], keys % ps] = True

    def pool():
        x = rng.standard_normal((step.kv_heads, P, ps, step.head_dim))
        return jnp.asarray(np.where(needed[None, :, :, None], x, np.nan), step.dtype)

    q = jnp.asarray(rng.standard_normal((len(slots), step.heads, step.head_dim)), step.dtype)
    return q, pool(), pool(), jnp.asarray(tables), jnp.asarray(slots, jnp.int32), jnp.asarray(positions, jnp.int32)


def numpy_ragged(q, k_pages, v_pages, tables, slots, positions):
    """float64: each token a sequence of its own, walking its slot's table (zeros for padding)."""
    slots, positions = np.asarray(slots), np.asarray(positions)
    lengths = np.where(slots >= 0, positions + 1, 0)
    table = np.asarray(tables)[np.maximum(slots, 0)]
    return numpy_paged_attention(np.asarray(q, np.float64)[:, None], k_pages, v_pages, table, lengths,
                                 positions[:, None])[:, 0]


def block_sizes(step: Step):
    return DecodeBlockSizes(block_k=16, num_splits=3, block_q=step.block_q)


@pytest.mark.parametrize("step", STEPS, ids=str)
def test_matches_reference_and_numpy(step):
    inputs = make_step(step)
    runs = len(step.runs) + (step.padding > 0)
    out = ragged_paged_attention(*inputs, num_single=step.num_single, max_runs=runs, block_sizes=block_sizes(step))
    assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "read a key outside the sequences (the pools are NaN there)"
    tol = TOLERANCE[step.dtype]
    np.testing.assert_allclose(out, np.asarray(ragged_paged_attention_reference(*inputs), np.float32), atol=tol,
                               rtol=tol)
    np.testing.assert_allclose(out, numpy_ragged(*inputs), atol=tol, rtol=tol)
    assert not out[np.asarray(inputs[4]) < 0].any(), "padding must give zeros"


@pytest.mark.parametrize("dtype, per_token", QUANTIZED[1:], ids=lambda x: str(x))
def test_quantized_pool_matches_numpy(dtype, per_token):
    step = STEPS[0]
    q, k, v, tables, slots, positions = make_step(step, seed=5)
    (k, k_scale, k64), (v, v_scale, v64) = (quantize(x, dtype, per_token) for x in (k, v))
    out = ragged_paged_attention(q, k, v, tables, slots, positions, num_single=step.num_single,
                                 block_sizes=block_sizes(step), k_scale=k_scale, v_scale=v_scale)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, numpy_ragged(q, k64, v64, tables, slots, positions), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("step", [STEPS[0], STEPS[2], STEPS[3]], ids=str)
def test_blocks_hold_every_token_once_in_runs(step):
    """The layout: every token in exactly one block row, a block's tokens from one slot in position order, within
    the static bound; a block's length is its last real token's position + 1."""
    _, _, _, tables, slots, positions = make_step(step)
    slots, positions = slots[step.num_single:], positions[step.num_single:]
    runs = len(step.runs) + (step.padding > 0)
    bt = block_tokens_for(step.heads, step.kv_heads, step.block_q)
    blocks = ragged_blocks(tables, slots, positions, block_tokens=bt, max_runs=runs)
    index = np.asarray(blocks.index)
    T = slots.shape[0]
    assert index.shape == (num_blocks(T, bt, runs), bt)
    assert sorted(index[index < T].tolist()) == list(range(T))
    for row, length in zip(index, np.asarray(blocks.lengths)):
        tokens = row[row < T]
        if tokens.size == 0:
            assert length == 0
            continue
        assert len(set(np.asarray(slots)[tokens].tolist())) == 1
        assert (np.diff(tokens) == 1).all()
        real = np.asarray(slots)[tokens] >= 0
        assert length == (np.asarray(positions)[tokens[-1]] + 1 if real.all() else 0)
    np.testing.assert_array_equal(blocks.scatter(blocks.gather(jnp.arange(T) + 1), T), np.arange(T) + 1)


def test_rejects_bad_inputs():
    q, k, v, tables, slots, positions = make_step(STEPS[1])
    with pytest.raises(ValueError, match=r"\[T, N, H\]"):
        ragged_paged_attention(q[None], k, v, tables, slots, positions)
    with pytest.raises(ValueError, match="num_single"):
        ragged_paged_attention(q, k, v, tables, slots, positions, num_single=5)


@pytest.mark.parametrize("step", STEPS, ids=str)
@pytest.mark.parametrize("loop, block_tokens", [("dynamic", None), ("dynamic", 2), ("static", None)])
def test_engine_xla_path_matches_numpy(step, loop, block_tokens):
    """The engine's XLA form of the same launches (`model.paged.ragged_attend`), each loop, against the float64 walk;
    several chunks continuing cached prompts in one step included. 2-token blocks: many blocks, which the dynamic
    loop runs in groups sorted by length (empty blocks, short and long ones in one step)."""
    from swiftkv_jax.model.paged import XLA_BLOCK_TOKENS, ragged_attend

    q, k, v, tables, slots, positions = make_step(step)
    # whole blocks are read and masked: unused slots must be finite (the engine's are zeros or stale K/V)
    k, v = (jnp.where(jnp.isnan(x), 1e3, x).astype(x.dtype) for x in (k, v))
    out = ragged_attend("xla", q, k, v, tables, slots, positions, num_single=step.num_single,
                        max_runs=len(step.runs) + 1, xla_loop=loop, xla_block_tokens=block_tokens or XLA_BLOCK_TOKENS)
    tol = TOLERANCE[step.dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), numpy_ragged(q, k, v, tables, slots, positions), atol=tol,
                               rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("step", STEPS, ids=str)
def test_compiled_matches_numpy(step):
    inputs = make_step(step)
    out = ragged_paged_attention(*inputs, num_single=step.num_single, block_sizes=block_sizes(step), interpret=False)
    tol = TOLERANCE[step.dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), numpy_ragged(*inputs), atol=tol, rtol=tol)

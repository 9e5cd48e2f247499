"""Mosaic GPU (Hopper) decode-attention kernels, dense and paged, against the Triton kernels' references and float64
numpy loops.

The same checks run in jax's GPU interpret mode on the CPU (one warpgroup simulated per CTA: TMA, barriers, wgmma
with the K tile transposed) and compiled on an sm_90 GPU (`-m gpu`, both forms of the P V product, then at the
engine's shapes). The dense cache is in the model's layout [B, K, S, H] (the references take [B, S, K, H]); the paged
pools are the Triton paged tests' own: shuffled tables with garbage past each sequence's pages, NaN in every key
no sequence has.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_paged_attention_kernel as paged_tests
from swiftkv_jax.kernels import MASK_VALUE, AttentionResiduals, decode_attention_reference, paged_attention_reference
from swiftkv_jax.kernels.decode_attention_mgpu import (MosaicDecodeBlockSizes, _row_ranges, decode_attention_mgpu,
                                                       paged_attention_mgpu)
from test_decode_attention_kernel import QUANTIZED, chunk_positions, numpy_attention, quantize, quantized_id

from conftest import GPU_INTERPRET

pytestmark = pytest.mark.usefixtures("mgpu_interpreter_compiles_once")
TOLERANCE = 2e-2  # bf16 / fp16 inputs and P


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple[int, ...]  # one per sequence
    seq_len: int              # S
    num_queries: int          # T
    heads: int                # N
    kv_heads: int             # K
    head_dim: int             # H
    blocks: MosaicDecodeBlockSizes
    positions: str = "last"   # "last": the T newest tokens; "random": anywhere in [0, S); "chunk": see new_tokens
    new_tokens: tuple[int, ...] = ()
    dtype: type = jnp.bfloat16

    def __str__(self):
        return self.name


CASES = [
    # decode, GQA 4, S not a multiple of the block (the last block is read shifted), an empty and a length-1
    # sequence; automatic splits (5 of 64 keys: splits past a short sequence's context read nothing)
    Case("decode_gqa4_auto_splits", (304, 1, 157, 0), 304, 1, 8, 2, 64, MosaicDecodeBlockSizes(64, 2)),
    # three queries anywhere (some past the length), GQA 8, head dim 128, 128-key blocks in 2 splits
    Case("random_positions_h128", (264, 65), 264, 3, 8, 1, 128, MosaicDecodeBlockSizes(128, 2, 2), "random"),
    # a prompt chunk: 24 tokens x GQA 4 = 96 rows in two row blocks (the second half padding), a shorter chunk
    # padded with -1 rows, and a sequence of -1 rows only; three slots in flight
    Case("chunk_two_row_blocks", (104, 30, 0), 104, 24, 8, 2, 64, MosaicDecodeBlockSizes(64, 3, 1), "chunk",
         (24, 10, 0)),
    # one split of 10 blocks through 2 slots (each slot refilled 4 times), a context ending mid-block
    Case("long_split_two_slots", (600, 333), 600, 2, 4, 2, 64, MosaicDecodeBlockSizes(64, 2, 1)),
    # a cache shorter than one block (padded), float16
    Case("short_cache_fp16", (50, 17), 50, 1, 4, 2, 64, MosaicDecodeBlockSizes(64, 2), dtype=jnp.float16),
    # a small cache of a length TMA cannot tile, past a (tuned) 64-key block: padded as the default block pads it
    # (the H200's tuned entry refused S = 100, which the defaults take)
    Case("odd_small_cache", (100, 37), 100, 1, 8, 2, 64, MosaicDecodeBlockSizes(64, 2)),
    # a head dim that is a multiple of 64 but not a power of two (the Triton kernels' rule refused it here)
    Case("head_dim_192", (130, 7), 136, 1, 4, 2, 192, MosaicDecodeBlockSizes(64, 2)),
]
# Groups that are no power of two (every case above has G 2, 4 or 8: rows of KV head k taking query heads
# (k << log2(G)) + g, or row r taking token r >> log2(G)'s limit, passed them): the heads of Qwen2.5-0.5B (14 / 2,
# G 7), Qwen2.5-7B (28 / 4 cut to 14 / 2, G 7), Qwen2.5-1.5B (12 / 2, G 6) and Llama-3.2-3B (24 / 8 cut to 6 / 2,
# G 3), each model's head dim. T * G rows: 21 (written as 24), 7 (8), 72 (two row blocks, the second of 8 real
# rows and -1 rows) and 15 (16)
GROUP_CASES = [
    Case("qwen2.5-0.5b_gqa7_random", (130, 37), 136, 3, 14, 2, 64, MosaicDecodeBlockSizes(64, 2), "random"),
    Case("qwen2.5-7b_gqa7_decode", (200, 1), 200, 1, 14, 2, 128, MosaicDecodeBlockSizes(64, 2)),
    Case("qwen2.5-1.5b_gqa6_chunk", (90, 20, 0), 96, 12, 12, 2, 128, MosaicDecodeBlockSizes(64, 2, 1), "chunk",
         (12, 5, 0)),
    Case("llama3.2-3b_gqa3_last", (150, 64), 152, 5, 6, 2, 128, MosaicDecodeBlockSizes(128, 2, 2)),
]
CASES += GROUP_CASES
# (case, cache dtype, per-token scales): every quantised form on one case, one on each group above but Qwen2.5-7B's
QUANTIZED_CASES = [*(("long_split_two_slots", *x) for x in QUANTIZED), ("qwen2.5-0.5b_gqa7_random", jnp.int8, True),
                   ("qwen2.5-1.5b_gqa6_chunk", jnp.float8_e4m3fn, False), ("llama3.2-3b_gqa3_last", jnp.int8, False)]
BY_NAME = {case.name: case for case in CASES}


# Paged cases (bf16 pools, NaN outside the sequences' keys, garbage past their pages): pages of 16 with 4 copies a
# 64-key block (3 slots, 2 splits), a shared prefix page and queries anywhere; pages of 128 holding two 64-key
# blocks each; a prompt chunk of 20 tokens x GQA 4 (two row blocks) over pages of 8
PAGED_CASES = [
    (paged_tests.Case((0, 1, 16, 17, 150), 16, 1, 8, 2, 64, jnp.bfloat16, 16, 1), MosaicDecodeBlockSizes(64, 3, 2)),
    (paged_tests.Case((33, 64, 200), 16, 3, 8, 2, 128, jnp.bfloat16, 16, 1, "random", shared_first_page=True),
     MosaicDecodeBlockSizes(64, 2)),
    (paged_tests.Case((300, 129), 128, 1, 4, 1, 64, jnp.bfloat16, 16, 1), MosaicDecodeBlockSizes(64, 2, 1)),
    (paged_tests.Case((45, 20), 8, 20, 8, 2, 64, jnp.bfloat16, 16, 1, "chunk", new_tokens=(20, 7)),
     MosaicDecodeBlockSizes(64, 2, 1)),
]
# Per-token scales are copied a page at a time in 128-byte TMA copies: pages of 32 keys, two a 64-key block
PAGED_SCALE_CASE = (paged_tests.Case((45, 100, 1), 32, 2, 8, 2, 128, jnp.bfloat16, 16, 1, "random"),
                    MosaicDecodeBlockSizes(64, 2))
# GQA 7, 6 and 3 (as GROUP_CASES): three queries anywhere over pages of 16; a decode over pages of 32 (per-token
# scales fit them); a prompt chunk of 12 tokens x G 3 over pages of 8
PAGED_GROUP_CASES = [
    (paged_tests.Case((45, 130), 16, 3, 14, 2, 64, jnp.bfloat16, 16, 1, "random"), MosaicDecodeBlockSizes(64, 2)),
    (paged_tests.Case((100, 7), 32, 1, 12, 2, 128, jnp.bfloat16, 16, 1), MosaicDecodeBlockSizes(64, 2)),
    (paged_tests.Case((60, 33), 8, 12, 6, 2, 128, jnp.bfloat16, 16, 1, "chunk", new_tokens=(12, 4)),
     MosaicDecodeBlockSizes(64, 2, 1)),
]
PAGED_CASES += PAGED_GROUP_CASES


def make_inputs(case: Case, seed: int = 0):
    """q [B, T, N, H], k, v [B, K, S, H] (the kernel's layout), lengths, positions."""
    rng = np.random.default_rng(seed)
    b, s, t = len(case.lengths), case.seq_len, case.num_queries
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), case.dtype)  # noqa: E731
    q, k, v = normal(b, t, case.heads, case.head_dim), *(normal(b, case.kv_heads, s, case.head_dim) for _ in "kv")
    lengths = np.asarray(case.lengths, np.int32)
    if case.positions == "last":
        positions = np.maximum(lengths[:, None] - t + np.arange(t), 0)
    elif case.positions == "chunk":
        positions = chunk_positions(lengths, case.new_tokens, t)
    else:
        positions = rng.integers(0, s, size=(b, t))
    return q, k, v, jnp.asarray(lengths), jnp.asarray(positions, jnp.int32)


def bskh(x):
    return jnp.swapaxes(x, 1, 2)


class MosaicDecodeChecks:
    """The checks; subclasses choose interpreted (CPU) or compiled (GPU) and the form of P V."""

    interpret: bool
    interpreter_safe: bool

    def run(self, q, k, v, lengths, positions, blocks, **kwargs):
        return decode_attention_mgpu(q, k, v, lengths, positions, block_sizes=blocks, interpret=self.interpret,
                                     interpreter_safe=self.interpreter_safe, **kwargs)

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference_and_float64(self, case):
        q, k, v, lengths, positions = make_inputs(case)
        out = self.run(q, k, v, lengths, positions, case.blocks)
        assert out.shape == q.shape and out.dtype == q.dtype
        out = np.asarray(out, np.float32)
        assert np.isfinite(out).all()
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        reference = decode_attention_reference(f32(q), bskh(f32(k)), bskh(f32(v)), lengths, positions)
        np.testing.assert_allclose(out, np.asarray(reference), atol=TOLERANCE, rtol=TOLERANCE)
        expected = numpy_attention(q, bskh(k), bskh(v), np.asarray(lengths), np.asarray(positions))
        np.testing.assert_allclose(out, expected, atol=TOLERANCE, rtol=TOLERANCE)
        assert not out[np.asarray(positions) < 0].any(), "a query at position -1 must give zeros"
        assert not out[np.asarray(lengths) == 0].any(), "an empty cache must give zeros"

    def test_residuals_merge_like_the_reference(self):
        """The split residuals, merged: the same (out, max, sum) as the reference's, MASK_VALUE / 0 for rows that
        see nothing (what SwiftKV's two-segment merge relies on)."""
        case = BY_NAME["decode_gqa4_auto_splits"]
        q, k, v, lengths, positions = make_inputs(case, seed=1)
        got = self.run(q, k, v, lengths, positions, case.blocks, return_residuals=True)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        want = decode_attention_reference(f32(q), bskh(f32(k)), bskh(f32(v)), lengths, positions,
                                          return_residuals=True)
        assert isinstance(got, AttentionResiduals)
        # out and sum scale with exp(max): compare them normalised, and the maxes themselves
        np.testing.assert_allclose(got.max, want.max, rtol=1e-2, atol=2e-2)
        for name, a, b in (("out/sum", got.out / np.maximum(got.sum, 1e-30)[..., None],
                            want.out / np.maximum(want.sum, 1e-30)[..., None]),
                           ("sum*exp(max)", got.sum * np.exp(got.max), want.sum * np.exp(want.max))):
            np.testing.assert_allclose(a, b, rtol=3e-2, atol=TOLERANCE, err_msg=name)
        empty = np.asarray(lengths) == 0
        np.testing.assert_array_equal(np.asarray(got.max)[empty], np.float32(MASK_VALUE))
        np.testing.assert_array_equal(np.asarray(got.sum)[empty], 0.0)

    def test_nan_past_the_context_does_not_reach_the_result(self):
        """Keys past every sequence's length hold NaN (stale values of a freed slot may): masked, and their V rows
        zeroed before P V, so the result is that of a clean cache."""
        case = BY_NAME["long_split_two_slots"]
        q, k, v, lengths, positions = make_inputs(case, seed=2)
        past = (jnp.arange(case.seq_len)[None, :] >= lengths[:, None])[:, None, :, None]
        out = self.run(q, jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v), lengths, positions, case.blocks)
        clean = self.run(q, k, v, lengths, positions, case.blocks)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clean, np.float32))

    def test_rows_that_see_nothing_read_nothing(self):
        """Every row at position -1: no K/V tile is loaded (the cache is NaN, so any load would show)."""
        case = BY_NAME["chunk_two_row_blocks"]
        q, k, v, lengths, _ = make_inputs(case)
        positions = jnp.full((len(case.lengths), case.num_queries), -1, jnp.int32)
        out = self.run(q, jnp.full_like(k, jnp.nan), jnp.full_like(v, jnp.nan), lengths, positions, case.blocks)
        np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


    @pytest.mark.parametrize("name, dtype, per_token", QUANTIZED_CASES,
                             ids=[f"{name}-{quantized_id(*x)}" for name, *x in QUANTIZED_CASES])
    def test_quantized_cache_matches_numpy(self, name, dtype, per_token):
        """An int8 / FP8 cache with per-layer or per-token-head [B, K, S] scales, read in place and converted in
        SMEM (the scales on the scores and on P), against the float64 loop over the numpy-dequantised cache. Keys
        past every length are NaN before quantising (NaN scales per token, NaN FP8 values): none reaches the
        result."""
        case = BY_NAME[name]
        q, k, v, lengths, positions = make_inputs(case, seed=3)
        past = (jnp.arange(case.seq_len)[None, :] >= lengths[:, None])[:, None, :, None]
        poisoned = lambda x: jnp.where(past, jnp.nan, x.astype(jnp.float32))  # noqa: E731
        (k, k_scale, k64), (v, v_scale, v64) = (quantize(poisoned(x), dtype, per_token) for x in (k, v))
        assert k.dtype == dtype and k_scale.ndim == 3 * per_token
        out = self.run(q, k, v, lengths, positions, case.blocks, k_scale=k_scale, v_scale=v_scale)
        assert out.shape == q.shape and out.dtype == q.dtype
        out = np.asarray(out, np.float32)
        assert np.isfinite(out).all(), "a key past the lengths (NaN) reached the result"
        expected = numpy_attention(q, bskh(np.nan_to_num(k64)), bskh(np.nan_to_num(v64)), np.asarray(lengths),
                                   np.asarray(positions))
        np.testing.assert_allclose(out, expected, atol=TOLERANCE, rtol=TOLERANCE)

    @pytest.mark.parametrize("case, blocks, dtype, per_token", [
        (*PAGED_CASES[0], jnp.int8, False), (*PAGED_CASES[2], jnp.float8_e4m3fn, True),
        (*PAGED_CASES[3], jnp.float8_e4m3fn, False), (*PAGED_SCALE_CASE, jnp.int8, True),
        (*PAGED_GROUP_CASES[0], jnp.float8_e4m3fn, False), (*PAGED_GROUP_CASES[1], jnp.int8, True),
        (*PAGED_GROUP_CASES[2], jnp.int8, False)],
        ids=lambda x: jnp.dtype(x).name if isinstance(x, type) else None)
    def test_quantized_pool_matches_numpy(self, case, blocks, dtype, per_token):
        """An int8 / FP8 pool with per-layer or per-token-head [K, P, page_size] scales (copied a page at a time
        beside the tiles), poisoned outside the sequences, against the float64 walk of the dequantised pool."""
        q, k, v, tables, lengths, positions = paged_tests.make_inputs(case, seed=3)
        (k, k_scale, k64), (v, v_scale, v64) = (quantize(x, dtype, per_token) for x in (k, v))
        out = paged_attention_mgpu(q, k, v, tables, lengths, positions, block_sizes=blocks, interpret=self.interpret,
                                   interpreter_safe=self.interpreter_safe, k_scale=k_scale, v_scale=v_scale)
        assert out.shape == q.shape and out.dtype == q.dtype
        out = np.asarray(out, np.float32)
        assert np.isfinite(out).all(), "a key no sequence has (NaN) reached the result"
        expected = paged_tests.numpy_paged_attention(q, k64, v64, tables, lengths, positions)
        np.testing.assert_allclose(out, expected, atol=TOLERANCE, rtol=TOLERANCE)

    @pytest.mark.parametrize("case, blocks", PAGED_CASES, ids=str)
    def test_paged_matches_reference_and_float64(self, case, blocks):
        q, k_pages, v_pages, tables, lengths, positions = paged_tests.make_inputs(case)
        out = paged_attention_mgpu(q, k_pages, v_pages, tables, lengths, positions, block_sizes=blocks,
                                   interpret=self.interpret, interpreter_safe=self.interpreter_safe)
        assert out.shape == q.shape and out.dtype == q.dtype
        out = np.asarray(out, np.float32)
        assert np.isfinite(out).all(), "a key no sequence has (NaN) reached the result"
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        reference = paged_attention_reference(f32(q), f32(k_pages), f32(v_pages), tables, lengths, positions)
        np.testing.assert_allclose(out, np.asarray(reference), atol=TOLERANCE, rtol=TOLERANCE)
        expected = paged_tests.numpy_paged_attention(q, k_pages, v_pages, tables, lengths, positions)
        np.testing.assert_allclose(out, expected, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.skipif(GPU_INTERPRET is None, reason=f"jax {jax.__version__} has no Mosaic GPU interpret mode")
class TestMosaicDecodeInterpret(MosaicDecodeChecks):
    interpret = True
    interpreter_safe = True


@pytest.mark.gpu
class TestMosaicDecodeCompiled(MosaicDecodeChecks):
    """FA3's form (P from registers, accumulated in place), then at the engine's shapes."""

    interpret = False
    interpreter_safe = False

    @pytest.mark.parametrize("shape", [(32, 4096, 1), (8, 2048, 4), (2, 32768, 1)], ids=str)
    @pytest.mark.parametrize("blocks", [MosaicDecodeBlockSizes(), MosaicDecodeBlockSizes(64, 4),
                                        MosaicDecodeBlockSizes(128, 2, 4)], ids=str)
    def test_engine_shapes(self, shape, blocks):
        b, s, t = shape
        rng = np.random.default_rng(7)
        lengths = rng.integers(1, s + 1, size=b).astype(np.int32)
        case = Case("engine", tuple(int(x) for x in lengths), s, t, 32, 8, 128, blocks)
        q, k, v, lengths, positions = make_inputs(case, seed=7)
        out = self.run(q, k, v, lengths, positions, blocks)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        reference = decode_attention_reference(f32(q), bskh(f32(k)), bskh(f32(v)), lengths, positions)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference), atol=TOLERANCE,
                                   rtol=TOLERANCE)


@pytest.mark.gpu
class TestMosaicDecodeCompiledInterpreterForm(TestMosaicDecodeCompiled):
    """The form the interpreter runs (P through SMEM), compiled: the interpret tests' code on the GPU."""

    interpreter_safe = True


def test_row_ranges_read_to_the_largest_limit_and_skip_the_mask_below_the_smallest():
    limits = jnp.asarray([[5, 9, 7] + [6] * 61 + [3] + [0] * 63], jnp.int32)  # 2 row blocks; real rows: 65
    np.testing.assert_array_equal(_row_ranges(limits, 2, 65), [[[9, 5], [3, 3]]])
    # a real row at -1 (limit 0): every block is masked, none is skipped
    np.testing.assert_array_equal(_row_ranges(jnp.asarray([[4, 0] + [0] * 62], jnp.int32), 1, 2), [[[4, 0]]])


def test_automatic_splits_fill_the_gpu_and_never_outnumber_the_blocks():
    auto = MosaicDecodeBlockSizes(128, 2)
    assert auto.splits(32768, ctas=8, num_sms=132) == 33       # 1 sequence x 8 KV heads: 33 splits of 8 blocks
    assert auto.splits(4096, ctas=256, num_sms=132) == 2       # batch 32 x 8 KV heads
    assert auto.splits(4096, ctas=2048, num_sms=132) == 1      # batch 256: one split
    assert auto.splits(300, ctas=1, num_sms=132) == 3          # never more than the blocks
    assert MosaicDecodeBlockSizes(128, 2, 4).splits(32768, ctas=8) == 4  # an explicit count is kept
    four = MosaicDecodeBlockSizes(128, 2, ctas_per_sm=4)              # a tuned occupancy: 4 CTAs an SM
    assert four.splits(4096, ctas=256, num_sms=132) == 3 and four.splits(32768, ctas=8, num_sms=132) == 66


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_kv=96), "multiple of 64"), (dict(block_kv=512), "multiple of 64"),
    (dict(max_concurrent_steps=1), ">= 2"), (dict(num_splits=-1), ">= 0"), (dict(num_splits=True), ">= 0"),
    (dict(ctas_per_sm=0), "ctas_per_sm must be an int >= 1"),
])
def test_block_sizes_reject_invalid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MosaicDecodeBlockSizes(**kwargs)


def test_rejects_what_it_cannot_run():
    q, k, v, lengths, positions = make_inputs(BY_NAME["decode_gqa4_auto_splits"])
    with pytest.raises(ValueError, match="float8_e4m3fn cache"):
        decode_attention_mgpu(q, k.astype(jnp.float32), v.astype(jnp.float32), lengths, positions, interpret=True)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        decode_attention_mgpu(q, k.astype(jnp.int8), v.astype(jnp.int8), lengths, positions, interpret=True)
    with pytest.raises(ValueError, match="multiple of 8"):  # TMA tiles: S = 300 > block_kv
        decode_attention_mgpu(q, k[:, :, :300], v[:, :, :300], lengths, positions, interpret=True)
    with pytest.raises(ValueError, match="model's cache layout"):
        decode_attention_mgpu(q, bskh(k), bskh(v), lengths, positions, interpret=True)
    with pytest.raises(ValueError, match="cannot run in jax's GPU interpret mode"):
        decode_attention_mgpu(q, k, v, lengths, positions, interpret=True, interpreter_safe=False)
    with pytest.raises(ValueError, match="shared memory"):  # 2 x 4 slots x 256 keys x 256 x 2 bytes: 1 MiB
        decode_attention_mgpu(jnp.zeros((1, 1, 2, 256), jnp.bfloat16), jnp.zeros((1, 1, 512, 256), jnp.bfloat16),
                              jnp.zeros((1, 1, 512, 256), jnp.bfloat16), lengths[:1], positions[:1],
                              block_sizes=MosaicDecodeBlockSizes(256, 4), interpret=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        decode_attention_mgpu(q[..., :32], k[..., :32], v[..., :32], lengths, positions, interpret=True)
    with pytest.raises(ValueError, match="no query tokens"):
        decode_attention_mgpu(q[:, :0], k, v, lengths, positions[:, :0], interpret=True)
    with pytest.raises(TypeError, match="MosaicDecodeBlockSizes"):
        decode_attention_mgpu(q, k, v, lengths, positions, block_sizes=(64, 2), interpret=True)
    pool = jnp.zeros((2, 8, 12, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="page_size a multiple of 8"):
        paged_attention_mgpu(q, pool, pool, jnp.zeros((4, 3), jnp.int32), lengths, positions, interpret=True)
    pool = jnp.zeros((2, 8, 24, 64), jnp.bfloat16)  # a multiple of 8 that does not divide 64: tiles split pages
    with pytest.raises(ValueError, match="divides block_kv"):
        paged_attention_mgpu(q, pool, pool, jnp.zeros((4, 3), jnp.int32), lengths, positions, interpret=True,
                             block_sizes=MosaicDecodeBlockSizes(64, 2))
    with pytest.raises(ValueError, match="at least one page"):
        paged_attention_mgpu(q, pool[:, :0, :16], pool[:, :0, :16], jnp.zeros((4, 3), jnp.int32), lengths, positions,
                             interpret=True)
    with pytest.raises(ValueError, match="block_tables must be"):
        paged_attention_mgpu(q, pool, pool, jnp.zeros((4, 3), jnp.float32), lengths, positions, interpret=True)
    pool, scales = jnp.zeros((2, 8, 16, 64), jnp.int8), jnp.ones((2, 8, 16), jnp.float32)
    with pytest.raises(ValueError, match="page_size a multiple of 32"):  # per-token scales of 64 bytes a page
        paged_attention_mgpu(q, pool, pool, jnp.zeros((4, 3), jnp.int32), lengths, positions, interpret=True,
                             k_scale=scales, v_scale=scales)


@pytest.mark.skipif(GPU_INTERPRET is None, reason=f"jax {jax.__version__} has no Mosaic GPU interpret mode")
def test_model_picks_them_by_name():
    """decode_attention_impl="mosaic": the static cache [B, K, S, H] and the engine's pools (bf16 and int8 with its
    scales) run these kernels and agree with the XLA paths."""
    from swiftkv_jax.model.attention import DECODE_ATTENTION_IMPLS, attend_cache
    from swiftkv_jax.model.paged import paged_attend

    assert "mosaic" in DECODE_ATTENTION_IMPLS
    case = BY_NAME["decode_gqa4_auto_splits"]
    q, k, v, lengths, positions = make_inputs(case, seed=5)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    np.testing.assert_allclose(np.asarray(attend_cache("mosaic", q, k, v, positions, lengths), np.float32),
                               np.asarray(attend_cache("xla", f32(q), f32(k), f32(v), positions, lengths)),
                               atol=TOLERANCE, rtol=TOLERANCE)
    paged_case, _ = PAGED_CASES[0]
    q, k_pages, v_pages, tables, lengths, positions = paged_tests.make_inputs(paged_case, seed=5)
    got = paged_attend("mosaic", q, k_pages, v_pages, tables, lengths, positions)
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(paged_attention_reference(f32(q), f32(k_pages), f32(v_pages), tables,
                                                                    lengths, positions)),
                               atol=TOLERANCE, rtol=TOLERANCE)
    (k8, k_scale, _), (v8, v_scale, _) = (quantize(x, jnp.int8, False) for x in (k_pages, v_pages))
    np.testing.assert_allclose(
        np.asarray(paged_attend("mosaic", q, k8, v8, tables, lengths, positions, k_scale, v_scale), np.float32),
        np.asarray(paged_attention_reference(f32(q), k8, v8, tables, lengths, positions, k_scale=k_scale,
                                             v_scale=v_scale)), atol=TOLERANCE, rtol=TOLERANCE)


def test_shared_memory_counts_the_p_tile_only_in_the_form_that_has_it():
    """Four slots of 128 int8 keys at head dim 128 fit a Hopper block's shared memory with P in registers (the
    compiled form) but not with P's tile in SMEM (the interpreter's form): the compiled form lowers, the other is
    refused before launching."""
    from swiftkv_jax.kernels.mosaic_launch import SMEM_BYTES

    blocks = MosaicDecodeBlockSizes(block_kv=128, max_concurrent_steps=4)
    assert blocks.smem_bytes(128, 1, p_in_smem=False) <= SMEM_BYTES < blocks.smem_bytes(128, 1, p_in_smem=True)
    S, b, k, keys, h = jax.ShapeDtypeStruct, 4, 2, 1024, 128
    args = (S((b, 1, 4 * k, h), jnp.bfloat16), S((b, k, keys, h), jnp.int8), S((b, k, keys, h), jnp.int8),
            S((b,), jnp.int32), S((b, 1), jnp.int32), S((b, k, keys), jnp.float32), S((b, k, keys), jnp.float32))
    for interpreter_safe in (False, True):
        traced = lambda: jax.jit(lambda q, kc, vc, lengths, positions, ks, vs: decode_attention_mgpu(  # noqa: E731
            q, kc, vc, lengths, positions, block_sizes=blocks, interpret=False, interpreter_safe=interpreter_safe,
            k_scale=ks, v_scale=vs)).trace(*args)
        if interpreter_safe:
            with pytest.raises(ValueError, match="shared memory"):
                traced()
        else:
            assert "mosaic_gpu" in traced().lower(lowering_platforms=("cuda",)).as_text()


def test_shared_memory_is_what_the_lowering_requests_and_two_ctas_share_an_sm(monkeypatch):
    """smem_bytes is the SMEM jax's Mosaic GPU lowering itself requests for the kernel (its resource estimate, read
    during lowering for CUDA on the CPU: the scoped scratch, none for reductions, and the barriers), in both forms,
    over 16- and 8-bit caches. The epilogue's fp32 tile reuses the K / V slots' bytes, so 64-key blocks in 2 slots
    (3 over an 8-bit cache) let two CTAs share an SM; 128-key blocks do not."""
    lowering = pytest.importorskip("jax._src.pallas.mosaic_gpu.lowering")
    if not hasattr(lowering, "_estimate_resources"):
        pytest.skip("this jax's Mosaic GPU lowering has no _estimate_resources")
    from swiftkv_jax.kernels.decode_attention_mgpu import resident_ctas

    requested, original = [], lowering._estimate_resources

    def estimate(ctx, jaxpr):  # the scratch, then 8 bytes a barrier: the launch's dynamic SMEM
        resources = original(ctx, jaxpr)
        requested.append(resources.smem_scratch_bytes + 8 * sum(b.num_barriers for b in resources.barriers))
        return resources

    monkeypatch.setattr(lowering, "_estimate_resources", estimate)
    S, b, k, keys, h = jax.ShapeDtypeStruct, 4, 2, 1024, 128
    for dtype, block_kv, stages, resident in (("bfloat16", 128, 2, 1), ("bfloat16", 64, 2, 2), ("bfloat16", 64, 3, 1),
                                              ("int8", 128, 2, 1), ("int8", 64, 3, 2), ("int8", 64, 4, 1)):
        blocks = MosaicDecodeBlockSizes(block_kv=block_kv, max_concurrent_steps=stages)
        scales = (S((b, k, keys), jnp.float32),) * 2 if dtype == "int8" else ()
        for interpreter_safe in (False, True):
            requested.clear()
            jax.jit(lambda q, kc, vc, lengths, positions, *sc: decode_attention_mgpu(
                q, kc, vc, lengths, positions, block_sizes=blocks, interpret=False, interpreter_safe=interpreter_safe,
                **dict(zip(("k_scale", "v_scale"), sc)))).trace(
                S((b, 1, 4 * k, h), jnp.bfloat16), S((b, k, keys, h), dtype), S((b, k, keys, h), dtype),
                S((b,), jnp.int32), S((b, 1), jnp.int32), *scales).lower(lowering_platforms=("cuda",))
            smem = blocks.smem_bytes(h, jnp.dtype(dtype).itemsize, p_in_smem=interpreter_safe)
            assert max(requested) == smem, (dtype, block_kv, stages, interpreter_safe)
        assert resident_ctas(blocks.smem_bytes(h, jnp.dtype(dtype).itemsize, p_in_smem=False)) == resident


@pytest.mark.parametrize("interpreter_safe", [False, True], ids=["fa3_form", "interpreter_form"])
@pytest.mark.parametrize("cache", ["bfloat16", "int8-token", "int8-layer", "float8_e4m3fn-token",
                                   "float8_e4m3fn-layer"])
def test_compiled_kernels_lower_for_cuda(cache, interpreter_safe):
    """Without a GPU: jax's Mosaic GPU lowering accepts both kernels compiled at the engine's shapes (Llama-3.1-8B
    heads; 32 sequences over 4K keys, a chunk of 4 tokens, pools of 16- and 256-key pages). It checks what the
    interpreter does not: register layouts, SMEM tiling and swizzles, TMA copy sizes, wgmma operand shapes and
    dtype conversions. Compiling the module to machine code, and running it, needs the GPU (the gpu tests)."""
    name, _, granularity = cache.partition("-")
    dtype, S = jnp.dtype(name), jax.ShapeDtypeStruct
    b, n, k, h, keys, pages = 32, 32, 8, 128, 4096, 4096
    i32, f32 = jnp.int32, jnp.float32

    def lower(fn, *args):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text

    def scales(token_shape):  # k_scale and v_scale, if any
        return (S(token_shape if granularity == "token" else (), f32),) * 2 if granularity else ()

    run = dict(interpret=False, interpreter_safe=interpreter_safe)
    for t in (1, 4):
        lower(lambda q, kc, vc, lengths, positions, *sc: decode_attention_mgpu(
            q, kc, vc, lengths, positions, **run, **dict(zip(("k_scale", "v_scale"), sc))),
            S((b, t, n, h), jnp.bfloat16), S((b, k, keys, h), dtype), S((b, k, keys, h), dtype), S((b,), i32),
            S((b, t), i32), *scales((b, k, keys)))
    for page_size in (16, 256):
        if granularity == "token" and page_size < 32:
            continue  # refused with the fix (test_rejects_what_it_cannot_run)
        lower(lambda q, kp, vp, tables, lengths, positions, *sc: paged_attention_mgpu(
            q, kp, vp, tables, lengths, positions, **run, **dict(zip(("k_scale", "v_scale"), sc))),
            S((b, 1, n, h), jnp.bfloat16), S((k, pages, page_size, h), dtype), S((k, pages, page_size, h), dtype),
            S((b, keys // page_size), i32), S((b,), i32), S((b, 1), i32), *scales((k, pages, page_size)))


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "int8", "float8_e4m3fn"])
def test_static_engine_lowers_for_cuda_with_the_mosaic_kernels(cache_dtype, monkeypatch):
    """Without a GPU: the static engine's prefill (the Mosaic flash kernel; SwiftKV's later layers over the cache)
    and decode step (the Mosaic decode kernel over the cache in place, scales per token and head) lower for CUDA
    in bf16, through the model's wiring (head sharding, dtypes, the cache's length rounded to 8 by init_cache).
    The kernels pick compiled or interpreted by the default backend: it reads "gpu" here, as on a GPU machine."""
    import swiftkv_jax as sk
    from swiftkv_jax.serving import decode_step, init_cache, prefill

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")

    config = sk.ModelConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, dtype="bfloat16",
                            attention_impl="mosaic", decode_attention_impl="mosaic")
    model = sk.to_swiftkv(sk.init(config, 0), 2, 2)
    cache = init_cache(model.config, 2, 300, True, cache_dtype)  # 304 entries
    assert cache.lower[0][0].shape[2] == 304
    tokens, lengths = jnp.zeros((2, 256), jnp.int32), jnp.asarray([256, 100], jnp.int32)
    for fn, args in ((functools.partial(prefill, config=model.config, swiftkv=True, chunk_size=128),
                      (model.params, cache, tokens, lengths)),
                     (functools.partial(decode_step, config=model.config, swiftkv=True),
                      (model.params, cache, tokens[:, 0]))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and "triton" not in text

"""The paged few-query attention Pallas kernel against its jnp reference and an independent float64 numpy loop
that walks the block table itself.

One base class of checks, parametrised over cases; ``TestPagedAttentionInterpret`` runs it in Pallas interpret
mode on CPU, ``TestPagedAttentionCompiled`` runs the same checks compiled on a GPU (``-m gpu``). Every pool is
poisoned: each (page, offset) that holds no valid key of any sequence is NaN, and the table entries past each
sequence's pages are garbage (0, out of range, negative, other sequences' pages), so a result that reads
anything outside the sequences shows up as a NaN or a mismatch.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode_attention_kernel import QUANTIZED, TOLERANCE, chunk_positions, numpy_attention, quantize

from swiftkv_jax.kernels import (MASK_VALUE, AttentionResiduals, DecodeBlockSizes, decode_attention, merge_partials,
                                 normalize, paged_attention, paged_attention_reference)

GARBAGE = (0, 2**31 - 1, -1, 10**6)  # table entries past a sequence's pages, with the pages of others


@dataclasses.dataclass(frozen=True)
class Case:
    lengths: tuple[int, ...]   # one per sequence (B = len(lengths))
    page_size: int
    num_queries: int           # T
    heads: int                 # N
    kv_heads: int              # K
    head_dim: int              # H
    dtype: type
    block_k: int
    num_splits: int
    positions: str = "last"    # "last": the T newest; "random": anywhere in [0, M * page_size); "chunk": see new_tokens
    cache_dtype: type | None = None  # the pool's dtype when it differs from q's
    shared_first_page: bool = False  # sequence 1 starts with sequence 0's first page (prefix sharing)
    new_tokens: tuple[int, ...] = ()  # "chunk": sequence b's new_tokens[b] newest tokens, then rows at -1
    block_q: int = 64

    def __str__(self):
        names = [jnp.dtype(d).name for d in (self.dtype, self.cache_dtype) if d is not None]
        return (f"L{'-'.join(map(str, self.lengths))}_ps{self.page_size}_T{self.num_queries}"
                f"_G{self.heads // self.kv_heads}_H{self.head_dim}_{'-'.join(names)}_bk{self.block_k}x"
                f"{self.num_splits}_bq{self.block_q}_{self.positions}{'-'.join(map(str, self.new_tokens))}"
                f"{'_shared' if self.shared_first_page else ''}")

    @property
    def block_sizes(self):
        return DecodeBlockSizes(block_k=self.block_k, num_splits=self.num_splits, block_q=self.block_q)

    @property
    def tolerance(self):
        return max(TOLERANCE[self.dtype], TOLERANCE[self.cache_dtype or self.dtype])


CASES = [
    # page 8: empty, length 1, exactly two full pages, one past a page boundary, long; no GQA; one query.
    Case((0, 1, 16, 17, 100), 8, 1, 2, 2, 64, jnp.float32, 16, 3),
    # page 16, a block of two pages; GQA 4; head_dim 128; three queries anywhere; a shared prefix page.
    Case((33, 64, 0), 16, 3, 8, 2, 128, jnp.float32, 32, 2, "random", shared_first_page=True),
    # bf16, page 32 with a block of half a page; GQA 8; three queries; long and one past a boundary.
    Case((1, 200, 65), 32, 3, 8, 1, 64, jnp.bfloat16, 16, 4),
    # bf16, GQA 4, head_dim 128, one split; page 16 with a block of four pages; one query anywhere.
    Case((129, 0, 16), 16, 1, 8, 2, 128, jnp.bfloat16, 64, 1, "random"),
    # fp32 queries over a bf16 pool (the serving case); a page size that is not a power of two.
    Case((25, 36), 12, 3, 4, 2, 64, jnp.float32, 16, 2, cache_dtype=jnp.bfloat16),
]

# Prompt chunks over their cached context, GQA, several row blocks; rows at -1 (of other sequences, padding).
CHUNK_CASES = [
    # 300 new tokens over 37 cached (positions 37..336) in 10 row blocks of 64; a 40-token prompt, then -1 rows
    # (whole row blocks that see nothing).
    Case((337, 40), 16, 300, 4, 2, 32, jnp.float32, 32, 2, "chunk", new_tokens=(300, 40)),
    # 5 queries x G 4 in 2 row blocks of 16; a chunk of 2 then -1 rows; an empty sequence of only -1 rows.
    Case((12, 3, 0), 4, 5, 8, 2, 32, jnp.float32, 16, 2, "chunk", new_tokens=(5, 2, 0), block_q=16),
    # Page size 1, one query x G 4; a sequence whose only query is at -1.
    Case((9, 1), 1, 1, 4, 1, 32, jnp.float32, 16, 3, "chunk", new_tokens=(1, 0)),
]


def slow_cases():
    """Every page size x GQA x dtype, the other axes cycled through."""
    cycle = itertools.cycle([(1, 64, "last", 16, 4), (3, 128, "random", 32, 2), (3, 64, "last", 64, 1),
                             (1, 128, "random", 16, 8)])
    return [Case((page_size + 1, 1, 0, page_size, 5 * page_size - 3, 300), page_size, T, 8, 8 // group, H, dtype,
                 block_k, splits, positions, shared_first_page=True)
            for (page_size, group, dtype), (T, H, positions, block_k, splits)
            in zip(itertools.product((8, 16, 32), (1, 4, 8), (jnp.float32, jnp.bfloat16)), cycle)]


def make_inputs(case: Case, seed: int = 0):
    """q, the NaN-poisoned pools, a shuffled table with garbage past each sequence's pages, lengths, positions."""
    rng = np.random.default_rng(seed)
    B, T, ps = len(case.lengths), case.num_queries, case.page_size
    lengths = np.asarray(case.lengths, np.int32)
    pages = -(-lengths // ps)
    M = int(pages.max()) + 2
    P = int(pages.sum()) + 3  # three spare pages nobody uses
    order = rng.permutation(P)
    table = rng.choice(np.concatenate([GARBAGE, order]), size=(B, M)).astype(np.int32)
    start = np.concatenate([[0], np.cumsum(pages)])
    for b in range(B):
        table[b, :pages[b]] = order[start[b]:start[b + 1]]
    if case.shared_first_page:
        assert pages[0] and pages[1]
        table[1, 0] = table[0, 0]

    needed = np.zeros((P, ps), bool)
    for b in range(B):
        s = np.arange(lengths[b])
        needed[table[b, s // ps], s % ps] = True
    cache_dtype = case.cache_dtype or case.dtype

    def pool():  # [K, P, page_size, H]
        x = rng.standard_normal((case.kv_heads, P, ps, case.head_dim))
        return jnp.asarray(np.where(needed[None, :, :, None], x, np.nan), cache_dtype)

    q = jnp.asarray(rng.standard_normal((B, T, case.heads, case.head_dim)), case.dtype)
    if case.positions == "last":
        positions = np.maximum(lengths[:, None] - T + np.arange(T), 0)
    elif case.positions == "chunk":
        positions = chunk_positions(lengths, case.new_tokens, T)
    else:
        positions = rng.integers(0, M * ps, size=(B, T))
    return q, pool(), pool(), jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(positions, jnp.int32)


def walk_tables(pages, block_tables, lengths) -> np.ndarray:
    """float64 ``[B, max(lengths), K, H]``: key s of sequence b read from its page of the pool [K, P, page_size, H],
    ``pages[:, block_tables[b, s // page_size], s % page_size]``, one key at a time; zeros past each length."""
    pages, block_tables, lengths = np.asarray(pages, np.float64), np.asarray(block_tables), np.asarray(lengths)
    pages = np.moveaxis(pages, 0, 2)  # [P, page_size, K, H]: the key of one (page, offset) a row
    page_size = pages.shape[1]
    dense = np.zeros((len(lengths), max(lengths, default=0), *pages.shape[2:]))
    for b, length in enumerate(lengths):
        for s in range(length):
            dense[b, s] = pages[block_tables[b, s // page_size], s % page_size]
    return dense


def numpy_paged_attention(q, k_pages, v_pages, block_tables, lengths, positions):
    """float64 from the definition: the dense kernel's numpy loop over the keys found by walking the tables."""
    lengths = np.asarray(lengths)
    return numpy_attention(q, walk_tables(k_pages, block_tables, lengths), walk_tables(v_pages, block_tables, lengths),
                           lengths, np.asarray(positions))


class PagedAttentionChecks:
    """The checks; a subclass sets ``interpret``."""

    interpret: bool

    def attention(self, q, k_pages, v_pages, block_tables, lengths, positions, block_sizes=None, **kwargs):
        return paged_attention(q, k_pages, v_pages, block_tables, lengths, positions, block_sizes=block_sizes,
                               interpret=self.interpret, **kwargs)

    def check_against_reference_and_numpy(self, case: Case):
        inputs = make_inputs(case)
        out = self.attention(*inputs, case.block_sizes)
        q, lengths, positions = inputs[0], inputs[4], inputs[5]
        assert out.shape == q.shape and out.dtype == q.dtype
        out = np.asarray(out, np.float32)
        assert np.isfinite(out).all(), "read a key outside the sequences (the pools are NaN there)"
        reference = np.asarray(paged_attention_reference(*inputs), np.float32)
        np.testing.assert_allclose(out, reference, atol=case.tolerance, rtol=case.tolerance)
        np.testing.assert_allclose(out, numpy_paged_attention(*inputs), atol=case.tolerance, rtol=case.tolerance)
        assert not out[np.asarray(lengths) == 0].any(), "an empty sequence must give zeros"
        assert not out[np.asarray(positions) < 0].any(), "a query at position -1 must give zeros"

    @pytest.mark.parametrize("case", CASES + CHUNK_CASES, ids=str)
    def test_matches_reference_and_numpy(self, case):
        self.check_against_reference_and_numpy(case)

    @pytest.mark.slow
    @pytest.mark.parametrize("case", slow_cases(), ids=str)
    def test_sweep_matches_reference_and_numpy(self, case):
        self.check_against_reference_and_numpy(case)

    @pytest.mark.parametrize("case, dtype, per_token", [
        (CASES[0], *QUANTIZED[1]), (CASES[1], *QUANTIZED[3]), (CASES[4], *QUANTIZED[2]), (CASES[3], *QUANTIZED[0]),
        (CHUNK_CASES[1], *QUANTIZED[1])],
        ids=lambda x: str(x) if isinstance(x, Case) else None)
    def test_quantized_pool_matches_numpy(self, case, dtype, per_token):
        """An int8 / FP8 pool with per-layer or per-token-head [K, P, page_size] scales, gathered through the table:
        the kernel against the reference and the float64 walk of the numpy-dequantised pool. The pools' unused slots
        stay poisoned (NaN scales per token, NaN FP8 values)."""
        q, k, v, table, lengths, positions = make_inputs(case, seed=3)
        (k, k_scale, k64), (v, v_scale, v64) = (quantize(x, dtype, per_token) for x in (k, v))
        assert k.dtype == dtype and k_scale.ndim == 3 * per_token
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        out = self.attention(q, k, v, table, lengths, positions, case.block_sizes, **scales)
        assert out.shape == q.shape and out.dtype == q.dtype
        out = np.asarray(out, np.float32)
        assert np.isfinite(out).all(), "read a key outside the sequences (the pools are NaN there)"
        tol = TOLERANCE[case.dtype]
        reference = paged_attention_reference(q, k, v, table, lengths, positions, **scales)
        np.testing.assert_allclose(out, np.asarray(reference, np.float32), atol=tol, rtol=tol)
        expected = numpy_paged_attention(q, k64, v64, table, lengths, positions)
        np.testing.assert_allclose(out, expected, atol=tol, rtol=tol)
        assert not out[np.asarray(lengths) == 0].any(), "an empty sequence must give zeros"

    @pytest.mark.parametrize("dequant_dtype", ["float16", "float32"])
    @pytest.mark.parametrize("dtype, per_token", QUANTIZED, ids=lambda x: getattr(x, "__name__", str(x)))
    def test_fp16_and_fp32_dequantisation_match_numpy(self, dtype, per_token, dequant_dtype):
        """`dequant_dtype` (a tuning knob): a bf16 q over an int8 / FP8 pool, the pool's values, q and P in fp16, or
        in fp32 (int8 by integer arithmetic), for the two products; the same results within bf16's tolerance, on
        both bf16 cases."""
        for case in (CASES[2], CASES[3]):
            q, k, v, table, lengths, positions = make_inputs(case, seed=5)
            (k, k_scale, k64), (v, v_scale, v64) = (quantize(x, dtype, per_token) for x in (k, v))
            sizes = dataclasses.replace(case.block_sizes, dequant_dtype=dequant_dtype)
            out = self.attention(q, k, v, table, lengths, positions, sizes, k_scale=k_scale, v_scale=v_scale)
            assert out.dtype == q.dtype == jnp.bfloat16
            out = np.asarray(out, np.float32)
            expected = numpy_paged_attention(q, k64, v64, table, lengths, positions)
            np.testing.assert_allclose(out, expected, atol=TOLERANCE[jnp.bfloat16], rtol=TOLERANCE[jnp.bfloat16])

    @pytest.mark.parametrize("case", [CASES[1], CHUNK_CASES[0]], ids=str)
    def test_residuals_match_reference(self, case):
        """Also exactly empty residuals (out 0, max MASK_VALUE, sum 0) for the queries at -1, in both."""
        inputs = make_inputs(case, seed=1)
        got = self.attention(*inputs, case.block_sizes, return_residuals=True)
        want = paged_attention_reference(*inputs, return_residuals=True)
        assert isinstance(got, AttentionResiduals)
        unseen = np.asarray(inputs[5]) < 0
        for name, a, b in zip(AttentionResiduals._fields, got, want):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)
            for x in (a, b):
                empty = np.float32(MASK_VALUE) if name == "max" else 0.0
                np.testing.assert_array_equal(np.asarray(x)[unseen], empty, err_msg=name)

    def test_paged_prompt_and_dense_decode_segment_merge(self):
        """SwiftKV over a paged prompt cache: merge(paged prompt KV, dense decode KV) == attention over both."""
        case = Case((0, 23, 40), 8, 3, 8, 2, 64, jnp.float32, 16, 2, "random")
        q, k_pages, v_pages, table, lengths, _ = make_inputs(case, seed=2)
        rng = np.random.default_rng(3)
        B, new = len(case.lengths), 5
        k_new, v_new = (jnp.asarray(rng.standard_normal((B, new, 2, 64)), jnp.float32) for _ in range(2))
        positions = jnp.asarray(rng.integers(0, int(lengths.max()) + new, size=(B, 3)), jnp.int32)
        block_sizes = DecodeBlockSizes(block_k=16, num_splits=2)
        first = self.attention(q, k_pages, v_pages, table, lengths, positions, block_sizes, return_residuals=True)
        # The decode segment's cache index 0 is position lengths[b]; all `new` of its keys are valid.
        second = decode_attention(q, k_new, v_new, jnp.full((B,), new, jnp.int32), positions - lengths[:, None],
                                  block_sizes=block_sizes, interpret=self.interpret, return_residuals=True)
        merged = normalize(merge_partials(*(jnp.stack(pair) for pair in zip(first, second))), q.dtype)
        # Expected: the walked prompt keys with each sequence's new keys right after its last one.
        dense = [np.zeros((B, int(lengths.max()) + new, 2, 64)) for _ in range(2)]
        for x, pages, x_new in zip(dense, (k_pages, v_pages), (k_new, v_new)):
            walked = walk_tables(pages, table, lengths)
            for b, length in enumerate(np.asarray(lengths)):
                x[b, :length], x[b, length:length + new] = walked[b, :length], x_new[b]
        expected = numpy_attention(q, *dense, np.asarray(lengths) + new, np.asarray(positions))
        np.testing.assert_allclose(merged, expected, atol=2e-5, rtol=2e-5)

    def test_under_jit_with_traced_lengths_and_tables(self):
        """One trace serves every step of a continuous batch: other lengths, positions, tables and pool contents."""
        case = CASES[0]
        traces = []

        def step(*args):
            traces.append(None)
            return self.attention(*args, case.block_sizes)

        jitted = jax.jit(step)
        # The same numbers of pages in all (pool size P) and at most (table width M): the same shapes.
        for inputs in (make_inputs(case), make_inputs(dataclasses.replace(case, lengths=(97, 9, 24, 0, 8)), seed=1)):
            np.testing.assert_allclose(jitted(*inputs), numpy_paged_attention(*inputs), atol=2e-5, rtol=2e-5)
        assert len(traces) == 1


class TestPagedAttentionInterpret(PagedAttentionChecks):
    interpret = True


@pytest.mark.gpu
class TestPagedAttentionCompiled(PagedAttentionChecks):
    interpret = False


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("form", ["dynamic loop", "one pass", "static blocks"])
def test_engine_xla_path_matches_numpy(case, form):
    """The engine's XLA paged path, each form: the CPU's loop over 4-page blocks that stops after the longest
    sequence, and the GPU's fixed number of blocks (`xla_loop="static"`) as one pass over the whole table or as
    blocks of 2 pages, each against the float64 walk of the tables."""
    from swiftkv_jax.model.paged import _paged_xla

    inputs = list(make_inputs(case))
    # It reads whole blocks and masks the scores, so a pool's unused slots must be finite (the engine's are: zeros
    # or stale K/V); large values there instead of the kernel tests' NaN still show any key let through.
    for i in (1, 2):
        inputs[i] = jnp.where(jnp.isnan(inputs[i]), 1e3, inputs[i]).astype(inputs[i].dtype)
    per_block = {"dynamic loop": None, "one pass": inputs[3].shape[1], "static blocks": 2}[form]
    out = _paged_xla(*inputs, pages_per_block=per_block, loop="dynamic" if form == "dynamic loop" else "static")
    out = np.asarray(out, np.float32)
    np.testing.assert_allclose(out, numpy_paged_attention(*inputs), atol=case.tolerance, rtol=case.tolerance)


@pytest.mark.parametrize("q_shape, pool_shape, v_pool_shape, table_shape, positions_shape, message", [
    ((1, 1, 6, 64), (4, 4, 8, 64), None, (1, 2), (1, 1), "multiple of KV heads"),
    ((1, 1, 4, 80), (4, 4, 8, 80), None, (1, 2), (1, 1), "power of two"),
    ((1, 1, 4, 64), (4, 4, 8, 64), (4, 4, 16, 64), (1, 2), (1, 1), "k_pages and v_pages"),
    ((1, 1, 4, 64), (4, 4, 8, 32), None, (1, 2), (1, 1), "k_pages and v_pages"),
    ((1, 1, 4, 64), (4, 0, 8, 64), None, (1, 2), (1, 1), "at least one page"),
    ((1, 1, 4, 64), (4, 4, 8, 64), None, (2, 2), (1, 1), "block_tables"),
    ((1, 1, 4, 64), (4, 4, 8, 64), None, (2,), (1, 1), "block_tables"),
    ((1, 2, 4, 64), (4, 4, 8, 64), None, (1, 2), (1, 1), "q_positions"),
    ((1, 4, 64), (4, 8, 4, 64), None, (1, 2), (1, 1), r"\[B, T, N, H\]"),
    ((1, 1, 4, 64), (8, 4, 64), None, (1, 2), (1, 1), r"\[K, P, page_size, H\]"),
])
def test_rejects_bad_shapes(q_shape, pool_shape, v_pool_shape, table_shape, positions_shape, message):
    with pytest.raises(ValueError, match=message):
        paged_attention(jnp.zeros(q_shape), jnp.zeros(pool_shape), jnp.zeros(v_pool_shape or pool_shape),
                        jnp.zeros(table_shape, jnp.int32), jnp.zeros(q_shape[:1], jnp.int32),
                        jnp.zeros(positions_shape, jnp.int32), interpret=True)


@pytest.mark.parametrize("table_dtype, lengths_dtype, v_dtype, message", [
    (jnp.float32, jnp.int32, jnp.float32, "block_tables must be .* integers"),
    (jnp.int32, jnp.float32, jnp.float32, "lengths and q_positions must be integers"),
    (jnp.int32, jnp.int32, jnp.bfloat16, "one dtype"),
])
def test_rejects_bad_dtypes(table_dtype, lengths_dtype, v_dtype, message):
    pool = jnp.zeros((2, 4, 8, 64))
    with pytest.raises(ValueError, match=message):
        paged_attention(jnp.zeros((1, 1, 4, 64)), pool, pool.astype(v_dtype), jnp.zeros((1, 2), table_dtype),
                        jnp.zeros((1,), lengths_dtype), jnp.zeros((1, 1), jnp.int32), interpret=True)


@pytest.mark.parametrize("pool_dtype, k_scale_shape, v_scale_shape, message", [
    (jnp.int8, None, None, "int8 k cache needs k_scale and v_scale"),
    (jnp.float8_e4m3fn, None, None, r"needs k_scale and v_scale .*\[K, P, page_size\] \(2, 4, 8\)"),
    (jnp.int8, None, (), "k_scale and v_scale go together"),
    (jnp.int8, (2, 4, 8), (2, 4, 8, 1), r"v_scale must be a \(\) scalar or \[K, P, page_size\] \(2, 4, 8\)"),
    (jnp.int8, (1, 2, 8), (2, 4, 8), r"k_scale must be a \(\) scalar or \[K, P, page_size\] \(2, 4, 8\)"),
    (jnp.float8_e4m3fn, (2, 4, 8), (), "one shape"),
])
@pytest.mark.parametrize("function", [paged_attention, paged_attention_reference])
def test_rejects_bad_scales(function, pool_dtype, k_scale_shape, v_scale_shape, message):
    pool = jnp.zeros((2, 4, 8, 64), pool_dtype)
    k_scale, v_scale = (None if shape is None else jnp.ones(shape) for shape in (k_scale_shape, v_scale_shape))
    with pytest.raises(ValueError, match=message):
        function(jnp.zeros((1, 1, 4, 64)), pool, pool, jnp.zeros((1, 2), jnp.int32), jnp.zeros(1, jnp.int32),
                 jnp.zeros((1, 1), jnp.int32), k_scale=k_scale, v_scale=v_scale,
                 **({"interpret": True} if function is paged_attention else {}))


def test_rejects_other_block_sizes():
    pool = jnp.zeros((2, 4, 8, 64))
    with pytest.raises(TypeError, match="DecodeBlockSizes"):
        paged_attention(jnp.zeros((1, 1, 4, 64)), pool, pool, jnp.zeros((1, 2), jnp.int32), jnp.zeros(1, jnp.int32),
                        jnp.zeros((1, 1), jnp.int32), block_sizes={"block_k": 16}, interpret=True)


def test_empty_table_gives_zeros():
    q = jnp.ones((2, 1, 4, 64))
    pool = jnp.ones((2, 3, 8, 64))
    out = paged_attention(q, pool, pool, jnp.zeros((2, 0), jnp.int32), jnp.zeros(2, jnp.int32),
                          jnp.zeros((2, 1), jnp.int32), interpret=True)
    np.testing.assert_array_equal(out, jnp.zeros_like(q))


@pytest.mark.parametrize("q_dtype, num_queries", [(jnp.bfloat16, 3), (jnp.float32, 3), (jnp.bfloat16, 300)])
def test_compiled_lowers_to_a_triton_kernel(q_dtype, num_queries):
    """Without a GPU: the compiled path lowers for CUDA to a Triton custom call (not Mosaic GPU), also for fp32
    queries over a bf16 pool and for a prompt chunk (19 row blocks of 64: the 4-D grid)."""
    from swiftkv_jax.kernels.paged_attention import _paged_attention

    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in [
        ((2, num_queries, 8, 128), q_dtype), ((2, 40, 16, 128), jnp.bfloat16), ((2, 40, 16, 128), jnp.bfloat16),
        ((2, 7), jnp.int32), ((2,), jnp.int32), ((2, num_queries), jnp.int32)]]
    lowered = _paged_attention.trace(*args, DecodeBlockSizes(block_k=32, num_splits=4), False)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "num_warps = 4" in text


@pytest.mark.parametrize("dequant_dtype", [None, "float16", "float32"])
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
def test_compiled_quantized_pool_lowers_to_a_triton_kernel(dtype, dequant_dtype):
    """Without a GPU: an int8 / FP8 pool with per-token-head scales (gathered through the table) lowers for CUDA to
    a Triton custom call, its values converted to bf16 or (the tuning knob) straight to fp16 or to fp32, int8 by
    integer arithmetic (no int-to-float conversion of the tile)."""
    from swiftkv_jax.kernels.paged_attention import _paged_attention

    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in [
        ((2, 3, 8, 128), jnp.bfloat16), ((2, 40, 16, 128), dtype), ((2, 40, 16, 128), dtype),
        ((2, 7), jnp.int32), ((2,), jnp.int32), ((2, 3), jnp.int32), ((2, 40, 16), jnp.float32),
        ((2, 40, 16), jnp.float32)]]
    sizes = DecodeBlockSizes(block_k=32, num_splits=4, dequant_dtype=dequant_dtype)
    lowered = _paged_attention.trace(*args[:6], sizes, False, *args[6:])
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "num_warps = 4" in text
    # the conversions of a [block_k, H] = [32, 128] tile of K or V: straight to fp16, or to bf16 through fp32
    kernel = str(jax.make_jaxpr(lambda *a: _paged_attention(*a[:6], sizes, False, *a[6:]))(*args))
    tiles = set(re.findall(r"(\w+)\[32,128\] = convert_element_type", kernel))
    # int8 widens to an integer and is bitcast (no int-to-float conversion): to i16 for fp16, else i32 (then bf16)
    assert ("bitcast_convert_type" in kernel) == (dtype == jnp.int8)
    if dtype == jnp.int8:
        assert tiles == {"float16": {"i16"}, "float32": {"i32"}, None: {"i32", "bf16"}}[dequant_dtype]
    else:
        assert tiles == {"float16": {"f16"}, "float32": {"f32"}, None: {"f32", "bf16"}}[dequant_dtype]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU defaults")
def test_cpu_defaults_to_interpret_and_refuses_compiled():
    inputs = make_inputs(CASES[0])
    np.testing.assert_allclose(paged_attention(*inputs),  # default block sizes, interpret
                               paged_attention_reference(*inputs), atol=2e-5, rtol=2e-5)
    with pytest.raises(NotImplementedError, match="needs a GPU"):
        paged_attention(*inputs, interpret=False)

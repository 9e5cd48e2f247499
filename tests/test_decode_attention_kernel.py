"""The few-query (decode) attention Pallas kernel against its jnp reference and an independent float64 numpy loop.

One base class of checks, parametrised over shapes; ``TestDecodeAttentionInterpret`` runs it in Pallas interpret
mode on CPU, ``TestDecodeAttentionCompiled`` runs the same checks compiled on a GPU (``-m gpu``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from swiftkv_jax.kernels import (MASK_VALUE, AttentionResiduals, DecodeBlockSizes, decode_attention,
                                 decode_attention_reference, merge_partials, normalize)

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    lengths: tuple[int, ...]   # one per sequence (B = len(lengths))
    seq_len: int               # S, the cache size
    num_queries: int           # T
    heads: int                 # N
    kv_heads: int              # K
    head_dim: int              # H
    dtype: type
    block_k: int
    num_splits: int
    positions: str = "last"    # "last": the T newest tokens; "random": anywhere in [0, S); "chunk": see new_tokens
    new_tokens: tuple[int, ...] = ()  # "chunk": sequence b's new_tokens[b] newest tokens, then rows at -1
    block_q: int = 64

    def __str__(self):
        name = jnp.dtype(self.dtype).name
        return (f"L{'-'.join(map(str, self.lengths))}_S{self.seq_len}_T{self.num_queries}"
                f"_G{self.heads // self.kv_heads}_H{self.head_dim}_{name}_bk{self.block_k}x{self.num_splits}"
                f"_bq{self.block_q}_{self.positions}{'-'.join(map(str, self.new_tokens))}")

    @property
    def block_sizes(self):
        return DecodeBlockSizes(block_k=self.block_k, num_splits=self.num_splits, block_q=self.block_q)


CASES = [
    # length 1, full cache, odd length not a multiple of the block; no GQA; one query.
    Case((1, 300, 157), 300, 1, 2, 2, 64, jnp.float32, 32, 4),
    # empty cache, odd, full; GQA 4; three queries; head_dim 128; S not a multiple of the block.
    Case((0, 37, 100), 100, 3, 8, 2, 128, jnp.float32, 16, 3),
    # GQA 8, queries anywhere (some past the length, some before it), one split.
    Case((257, 65), 257, 3, 8, 1, 64, jnp.float32, 64, 1, "random"),
    # bf16: GQA 8, head_dim 128, empty and length-1 caches.
    Case((199, 0, 1), 200, 1, 16, 2, 128, jnp.bfloat16, 32, 8),
    # bf16: GQA 4, three queries, S=130 with block 16 and an uneven split.
    Case((130, 77), 130, 3, 4, 1, 64, jnp.bfloat16, 16, 3, "random"),
    # A prompt chunk of 40 tokens over 5 cached ones, GQA 2 in 5 row blocks of 16; a shorter chunk padded with -1
    # rows (whole row blocks that see nothing); a sequence of only -1 rows.
    Case((45, 20, 0), 64, 40, 4, 2, 32, jnp.float32, 16, 3, "chunk", (40, 20, 0), block_q=16),
]


def chunk_positions(lengths, new_tokens, num_queries: int) -> np.ndarray:
    """[B, T] int32: sequence b's queries are its new_tokens[b] newest tokens (causal positions up to
    lengths[b] - 1) and then rows at -1, which must see nothing (a packed batch's rows of other sequences)."""
    positions = np.full((len(lengths), num_queries), -1, np.int32)
    for b, (length, new) in enumerate(zip(lengths, new_tokens)):
        positions[b, :new] = np.arange(length - new, length)
    return positions


def make_inputs(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    B, S, T = len(case.lengths), case.seq_len, case.num_queries

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), case.dtype)

    q = normal(B, T, case.heads, case.head_dim)
    k = normal(B, S, case.kv_heads, case.head_dim)
    v = normal(B, S, case.kv_heads, case.head_dim)
    lengths = np.asarray(case.lengths, np.int32)
    if case.positions == "last":
        positions = np.maximum(lengths[:, None] - T + np.arange(T), 0)
    elif case.positions == "chunk":
        positions = chunk_positions(lengths, case.new_tokens, T)
    else:
        positions = rng.integers(0, S, size=(B, T))
    return q, k, v, jnp.asarray(lengths), jnp.asarray(positions, jnp.int32)


QUANTIZED_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
QUANTIZED = [(dtype, per_token) for dtype in (jnp.int8, jnp.float8_e4m3fn) for per_token in (False, True)]


def quantized_id(dtype, per_token: bool) -> str:
    return f"{jnp.dtype(dtype).name}-{'per_token_head' if per_token else 'static'}"


def quantize(x, dtype, per_token_head: bool):
    """Independent numpy quantisation of x [..., H] (NaN entries stay poison: a NaN scale per token, or an FP8
    NaN value): (values in dtype, fp32 scales ``()`` or ``x.shape[:-1]``, float64 values they read back)."""
    x = np.asarray(x, np.float64)
    qmax = QUANTIZED_MAX[jnp.dtype(dtype).name]
    amax = np.abs(x).max(axis=-1) if per_token_head else np.nanmax(np.abs(x))
    scale = np.asarray(np.maximum(amax / qmax, 1e-12), np.float32)
    y = np.clip(x / scale.astype(np.float64)[..., None], -qmax, qmax)
    values = np.round(np.nan_to_num(y)).astype(np.int8) if dtype == jnp.int8 else y.astype(jnp.float8_e4m3fn)
    return jnp.asarray(values), jnp.asarray(scale), values.astype(np.float64) * scale.astype(np.float64)[..., None]


def numpy_attention(q, k, v, lengths, positions):
    """float64, one (b, t, n) at a time, written from the definition; zeros when no key is visible."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    group = N // k.shape[2]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(k.shape[1]) if s < lengths[b] and s <= positions[b, t]]
            for n in range(N):
                if not keys:
                    continue
                scores = np.array([q[b, t, n] @ k[b, s, n // group] for s in keys]) / math.sqrt(H)
                weights = np.exp(scores - scores.max())
                out[b, t, n] = (weights / weights.sum()) @ v[b, keys, n // group]
    return out


class DecodeAttentionChecks:
    """The checks; a subclass sets ``interpret``."""

    interpret: bool

    def attention(self, q, k, v, lengths, positions, block_sizes=None, **kwargs):
        return decode_attention(q, k, v, lengths, positions, block_sizes=block_sizes, interpret=self.interpret,
                                **kwargs)

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference_and_numpy(self, case):
        q, k, v, lengths, positions = make_inputs(case)
        out = self.attention(q, k, v, lengths, positions, case.block_sizes)
        assert out.shape == q.shape and out.dtype == q.dtype
        out = np.asarray(out, np.float32)
        assert np.isfinite(out).all()
        tol = TOLERANCE[case.dtype]
        reference = np.asarray(decode_attention_reference(q, k, v, lengths, positions), np.float32)
        np.testing.assert_allclose(out, reference, atol=tol, rtol=tol)
        expected = numpy_attention(q, k, v, np.asarray(lengths), np.asarray(positions))
        np.testing.assert_allclose(out, expected, atol=tol, rtol=tol)
        empty = np.asarray(lengths) == 0
        assert not out[empty].any(), "an empty cache must give zeros"
        assert not out[np.asarray(positions) < 0].any(), "a query at position -1 must give zeros"

    @pytest.mark.parametrize("case, dtype, per_token", [
        (CASES[1], *QUANTIZED[1]), (CASES[3], *QUANTIZED[3]), (CASES[4], *QUANTIZED[0]), (CASES[2], *QUANTIZED[2])],
        ids=lambda x: str(x) if isinstance(x, Case) else None)
    def test_quantized_cache_matches_numpy(self, case, dtype, per_token):
        """An int8 / FP8 cache with per-layer or per-token-head scales: the kernel against the reference and the
        float64 loop over the numpy-dequantised cache."""
        q, k, v, lengths, positions = make_inputs(case, seed=3)
        (k, k_scale, k64), (v, v_scale, v64) = (quantize(x, dtype, per_token) for x in (k, v))
        assert k.dtype == dtype and k_scale.dtype == jnp.float32 and k_scale.ndim == 3 * per_token
        out = self.attention(q, k, v, lengths, positions, case.block_sizes, k_scale=k_scale, v_scale=v_scale)
        assert out.shape == q.shape and out.dtype == q.dtype
        out = np.asarray(out, np.float32)
        tol = TOLERANCE[case.dtype]
        reference = decode_attention_reference(q, k, v, lengths, positions, k_scale=k_scale, v_scale=v_scale)
        np.testing.assert_allclose(out, np.asarray(reference, np.float32), atol=tol, rtol=tol)
        expected = numpy_attention(q, k64, v64, np.asarray(lengths), np.asarray(positions))
        np.testing.assert_allclose(out, expected, atol=tol, rtol=tol)
        assert not out[np.asarray(lengths) == 0].any(), "an empty cache must give zeros"

    @pytest.mark.parametrize("case", CASES[1:3], ids=str)
    def test_residuals_match_reference(self, case):
        q, k, v, lengths, positions = make_inputs(case, seed=1)
        got = self.attention(q, k, v, lengths, positions, case.block_sizes, return_residuals=True)
        want = decode_attention_reference(q, k, v, lengths, positions, return_residuals=True)
        assert isinstance(got, AttentionResiduals)
        for name, a, b in zip(AttentionResiduals._fields, got, want):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)

    def test_queries_that_see_nothing_read_nothing(self):
        """Rows at position -1 (and empty sequences) give zero output, max MASK_VALUE and sum 0, in the kernel and the
        reference; the kernel's row blocks of such rows read no key (its cache is NaN, so any load would show)."""
        case = CASES[5]
        q, k, v, lengths, _ = make_inputs(case)
        positions = jnp.full((len(case.lengths), case.num_queries), -1, jnp.int32)
        nan_k, nan_v = jnp.full_like(k, jnp.nan), jnp.full_like(v, jnp.nan)
        for got in (self.attention(q, nan_k, nan_v, lengths, positions, case.block_sizes, return_residuals=True),
                    decode_attention_reference(q, k, v, lengths, positions, return_residuals=True)):
            np.testing.assert_array_equal(got.out, np.zeros(q.shape))
            np.testing.assert_array_equal(got.max, np.full(q.shape[:3], MASK_VALUE, np.float32))
            np.testing.assert_array_equal(got.sum, np.zeros(q.shape[:3]))

    @pytest.mark.parametrize("split", [64, 100, 129])
    def test_two_segments_merge_to_the_concatenation(self, split):
        """SwiftKV: attention over [prompt KV | decode KV] == merge of the two segments' residuals."""
        case = Case((0, 90, 150), 150, 3, 8, 2, 64, jnp.float32, 16, 2, "random")
        q, k, v, lengths, positions = make_inputs(case, seed=2)
        block_sizes = DecodeBlockSizes(block_k=16, num_splits=2)
        first = self.attention(q, k[:, :split], v[:, :split], jnp.minimum(lengths, split), positions, block_sizes,
                               return_residuals=True)
        # The second segment's cache index 0 is position `split`.
        second = self.attention(q, k[:, split:], v[:, split:], jnp.maximum(lengths - split, 0), positions - split,
                                block_sizes, return_residuals=True)
        merged = normalize(merge_partials(*(jnp.stack(pair) for pair in zip(first, second))), q.dtype)
        whole = self.attention(q, k, v, lengths, positions, block_sizes)
        np.testing.assert_allclose(merged, whole, atol=2e-5, rtol=2e-5)
        expected = numpy_attention(q, k, v, np.asarray(lengths), np.asarray(positions))
        np.testing.assert_allclose(merged, expected, atol=2e-5, rtol=2e-5)

    @pytest.mark.parametrize("head_dim", [64, 128])
    def test_scale_is_one_over_sqrt_head_dim(self, head_dim):
        """Two keys whose raw scores are 0 and sqrt(H) ln 3: with scale 1/sqrt(H) the weights are 1/4, 3/4."""
        q = jnp.zeros((1, 1, 1, head_dim), jnp.float32).at[..., 0].set(1.0)
        k = jnp.zeros((1, 2, 1, head_dim), jnp.float32).at[0, 1, 0, 0].set(math.sqrt(head_dim) * math.log(3.0))
        v = jnp.zeros((1, 2, 1, head_dim), jnp.float32).at[0, 1].set(1.0)
        out = self.attention(q, k, v, jnp.array([2], jnp.int32), jnp.array([[1]], jnp.int32))
        np.testing.assert_allclose(out, np.full((1, 1, 1, head_dim), 0.75), atol=1e-6)

    def test_under_jit_with_traced_lengths(self):
        case = CASES[1]
        q, k, v, lengths, positions = make_inputs(case)
        jitted = jax.jit(lambda *args: self.attention(*args, case.block_sizes))
        np.testing.assert_allclose(jitted(q, k, v, lengths, positions),
                                   decode_attention_reference(q, k, v, lengths, positions), atol=2e-5, rtol=2e-5)


class TestDecodeAttentionInterpret(DecodeAttentionChecks):
    interpret = True


@pytest.mark.gpu
class TestDecodeAttentionCompiled(DecodeAttentionChecks):
    interpret = False


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
def test_int8_reaches_float_exactly_by_integer_arithmetic(dtype):
    """Every int8 value, against numpy's conversion (the read of an int8 cache into fp32 or fp16)."""
    from swiftkv_jax.kernels.split_k import int8_to_float16, int8_to_float32

    values = np.arange(-128, 128).astype(np.int8).reshape(16, 16)
    out = (int8_to_float32 if dtype == np.float32 else int8_to_float16)(jnp.asarray(values))
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out), values.astype(dtype))


def test_merge_ignores_empty_partials():
    out = jnp.arange(8.0).reshape(1, 2, 4)
    maxes = jnp.array([[0.5, -1.0]])
    sums = jnp.array([[2.0, 3.0]])
    empty = AttentionResiduals(jnp.zeros_like(out), jnp.full_like(maxes, MASK_VALUE), jnp.zeros_like(sums))
    merged = merge_partials(*(jnp.stack(pair) for pair in zip(AttentionResiduals(out, maxes, sums), empty)))
    for name, a, b in zip(AttentionResiduals._fields, merged, (out, maxes, sums)):
        np.testing.assert_array_equal(a, b, err_msg=name)
    both_empty = merge_partials(*(jnp.stack(pair) for pair in zip(empty, empty)))
    np.testing.assert_array_equal(normalize(both_empty, jnp.float32), jnp.zeros_like(out))
    # one partial (a launch of one split) is itself, as two where the other is empty
    for name, a, b in zip(AttentionResiduals._fields, merge_partials(out[None], maxes[None], sums[None]), merged):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("field, value, message", [
    ("block_k", 48, "power of two"),
    ("block_q", 48, "block_q must be a power of two"),
    ("block_q", 8, ">= 16"),
    ("block_k", 8, ">= 16"),
    ("block_k", 0, "block_k"),
    ("block_k", 64.0, "block_k"),
    ("num_splits", 0, "num_splits"),
    ("num_splits", True, "num_splits"),
    ("num_warps", 3, "num_warps"),
    ("num_warps", 64, "num_warps"),
    ("num_stages", 0, "num_stages"),
])
def test_block_sizes_reject_invalid_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        DecodeBlockSizes(**{field: value})


@pytest.mark.parametrize("num_queries, group, num_keys, sizes, expected", [
    # Rows that fit in one block: today's decode launch, padded to a power of two >= 16.
    (1, 4, 300, DecodeBlockSizes(), (16, 1, 64, 5)),
    (3, 8, 300, DecodeBlockSizes(), (32, 1, 64, 5)),
    (16, 4, 300, DecodeBlockSizes(), (64, 1, 64, 5)),
    (1, 8, 4096, DecodeBlockSizes(block_q=16), (16, 1, 256, 16)),
    # More rows: blocks of block_q, the last one padded.
    (17, 4, 300, DecodeBlockSizes(), (64, 2, 64, 5)),
    (5, 4, 64, DecodeBlockSizes(block_k=16, num_splits=3, block_q=16), (16, 2, 32, 2)),
    (300, 2, 352, DecodeBlockSizes(block_k=32, num_splits=2), (64, 10, 192, 2)),
    (2048, 4, 4096, DecodeBlockSizes(), (64, 128, 256, 16)),
    (2048, 4, 4096, DecodeBlockSizes(num_splits=1, block_q=128), (128, 64, 4096, 1)),
])
def test_launch_arithmetic(num_queries, group, num_keys, sizes, expected):
    """(rows per program, row blocks, keys per split, splits): the grid is (B, K, row blocks, splits)."""
    from swiftkv_jax.kernels.split_k import launch as _launch

    launch = _launch(num_queries * group, num_keys, sizes)
    assert tuple(launch) == expected
    assert launch.row_blocks * launch.block_rows >= num_queries * group > (launch.row_blocks - 1) * launch.block_rows


def test_block_sizes_frozen_and_hashable():
    sizes = DecodeBlockSizes(block_k=32, num_splits=3)
    assert hash(sizes) == hash(DecodeBlockSizes(block_k=32, num_splits=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sizes.block_k = 64


@pytest.mark.parametrize("q_shape, kv_shape, lengths_shape, positions_shape, message", [
    ((1, 1, 6, 64), (1, 10, 4, 64), (1,), (1, 1), "multiple of KV heads"),
    ((1, 1, 4, 80), (1, 10, 4, 80), (1,), (1, 1), "power of two"),
    ((1, 1, 4, 64), (2, 10, 4, 64), (1,), (1, 1), "k_cache and v_cache"),
    ((1, 2, 4, 64), (1, 10, 4, 64), (1,), (1, 1), "q_positions"),
    ((1, 4, 64), (1, 10, 4, 64), (1,), (1, 1), r"\[B, T, N, H\]"),
])
def test_rejects_bad_shapes(q_shape, kv_shape, lengths_shape, positions_shape, message):
    kv = jnp.zeros(kv_shape)
    with pytest.raises(ValueError, match=message):
        decode_attention(jnp.zeros(q_shape), kv, kv, jnp.zeros(lengths_shape, jnp.int32),
                         jnp.zeros(positions_shape, jnp.int32), interpret=True)


@pytest.mark.parametrize("k_dtype, k_scale_shape, v_scale_shape, message", [
    (jnp.int8, None, None, "int8 k cache needs k_scale and v_scale"),
    (jnp.float8_e4m3fn, None, None, r"float8_e4m3fn k cache needs k_scale and v_scale .*\[B, S, K\] \(1, 10, 4\)"),
    (jnp.int8, (), None, "k_scale and v_scale go together"),
    (jnp.float32, None, (1, 10, 4), "k_scale and v_scale go together"),
    (jnp.int8, (1, 10, 4, 1), (1, 10, 4), r"k_scale must be a \(\) scalar or \[B, S, K\] \(1, 10, 4\)"),
    (jnp.int8, (1, 10, 4), (10, 4), r"v_scale must be a \(\) scalar or \[B, S, K\] \(1, 10, 4\)"),
    (jnp.int8, (), (1, 10, 4), "one shape"),
])
@pytest.mark.parametrize("function", [decode_attention, decode_attention_reference])
def test_rejects_bad_scales(function, k_dtype, k_scale_shape, v_scale_shape, message):
    k = jnp.zeros((1, 10, 4, 64), k_dtype)
    k_scale, v_scale = (None if shape is None else jnp.ones(shape) for shape in (k_scale_shape, v_scale_shape))
    with pytest.raises(ValueError, match=message):
        function(jnp.zeros((1, 1, 4, 64)), k, k, jnp.zeros((1,), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                 k_scale=k_scale, v_scale=v_scale, **({"interpret": True} if function is decode_attention else {}))


def test_empty_cache_axis_gives_zeros():
    q = jnp.ones((2, 1, 4, 64))
    kv = jnp.zeros((2, 0, 2, 64))
    out = decode_attention(q, kv, kv, jnp.zeros(2, jnp.int32), jnp.zeros((2, 1), jnp.int32), interpret=True)
    np.testing.assert_array_equal(out, jnp.zeros_like(q))


def test_compiled_lowers_to_a_triton_kernel():
    """Without a GPU: the compiled path lowers for CUDA to a Triton custom call (not Mosaic GPU)."""
    from swiftkv_jax.kernels.decode_attention import _decode_attention

    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in [
        ((2, 3, 8, 128), jnp.bfloat16), ((2, 100, 2, 128), jnp.bfloat16), ((2, 100, 2, 128), jnp.bfloat16),
        ((2,), jnp.int32), ((2, 3), jnp.int32)]]
    lowered = _decode_attention.trace(*args, DecodeBlockSizes(block_k=32, num_splits=4), False)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "num_warps = 4" in text


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
def test_compiled_quantized_cache_lowers_to_a_triton_kernel(dtype):
    """Without a GPU: an int8 / FP8 cache with per-token-head scales lowers for CUDA to a Triton custom call (the
    FP8 cast is checked against the GPU's compute capability only at run time: >= 8.9)."""
    from swiftkv_jax.kernels.decode_attention import _decode_attention

    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in [
        ((2, 3, 8, 128), jnp.bfloat16), ((2, 100, 2, 128), dtype), ((2, 100, 2, 128), dtype),
        ((2,), jnp.int32), ((2, 3), jnp.int32), ((2, 100, 2), jnp.float32), ((2, 100, 2), jnp.float32)]]
    lowered = _decode_attention.trace(*args[:5], DecodeBlockSizes(block_k=32, num_splits=4), False, *args[5:])
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "num_warps = 4" in text


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU defaults")
def test_cpu_defaults_to_interpret_and_refuses_compiled():
    case = CASES[0]
    q, k, v, lengths, positions = make_inputs(case)
    np.testing.assert_allclose(decode_attention(q, k, v, lengths, positions),  # default block sizes, interpret
                               decode_attention_reference(q, k, v, lengths, positions), atol=2e-5, rtol=2e-5)
    with pytest.raises(NotImplementedError, match="needs a GPU"):
        decode_attention(q, k, v, lengths, positions, interpret=False)


def test_kernels_stand_alone():
    """The kernels import nothing of the project outside swiftkv_jax.kernels (the model picks them by name): no
    import cycle with the model."""
    import ast
    import pathlib

    import swiftkv_jax.kernels

    outside = []
    for path in pathlib.Path(swiftkv_jax.kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            outside += [f"{path.name}: {n}" for n in names
                        if n.startswith("swiftkv_jax") and not n.startswith("swiftkv_jax.kernels")]
    assert not outside, outside

"""Prefill flash-attention kernel against its reference, the model's XLA attention and float64 numpy.

The same tests run on the kernel in interpret mode on CPU (CI) and compiled on a GPU (`-m gpu`).
Shapes stay small: interpret mode emulates every program of the grid.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from swiftkv_jax.kernels.flash_attention import (FlashBlockSizes, _kv_block_bounds, flash_attention,
                                                 flash_attention_reference)
from swiftkv_jax.model.attention import xla_attention

FP32_TOL = dict(atol=2e-5, rtol=2e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 inputs, bf16 probabilities into the PV dot, bf16 output


@dataclasses.dataclass(frozen=True)
class Case:
    """B sequences, T queries that are the last T of S keys (bottom-right), N query and K kv heads, head dim H.

    segments: lengths of the packed documents (summing to S; T == S then), positions restarting per document.
    kv_lengths: keys at index >= length are invisible (their positions are 0, as in a zeroed cache); the
        queries are the last T of the visible keys.
    """

    name: str
    b: int
    t: int
    s: int
    n: int
    kv_heads: int
    h: int
    block_q: int = 16
    block_k: int = 16
    segments: tuple[int, ...] | None = None
    kv_lengths: tuple[int, ...] | None = None

    def __str__(self):
        return self.name


CASES = [
    Case("one_token", b=1, t=1, s=1, n=4, kv_heads=4, h=64),
    Case("odd_equal_gqa4", b=2, t=37, s=37, n=4, kv_heads=1, h=64),
    Case("bottom_right_gqa8_d128", b=2, t=13, s=150, n=8, kv_heads=1, h=128, block_k=32),
    Case("not_block_multiple_mha", b=1, t=100, s=100, n=2, kv_heads=2, h=128, block_q=32, block_k=64),
    Case("packed_segments", b=2, t=90, s=90, n=4, kv_heads=1, h=64, segments=(30, 45, 15)),
    Case("kv_lengths_short", b=2, t=20, s=120, n=4, kv_heads=1, h=64, block_k=32, kv_lengths=(70, 120)),
    Case("single_query_decode_like", b=2, t=1, s=77, n=8, kv_heads=1, h=64),
    Case("head_dim_80_gqa2", b=1, t=33, s=33, n=4, kv_heads=2, h=80),
]
BY_NAME = {case.name: case for case in CASES}


def make_inputs(case: Case, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((case.b, case.t, case.n, case.h))
    k = rng.standard_normal((case.b, case.s, case.kv_heads, case.h))
    v = rng.standard_normal((case.b, case.s, case.kv_heads, case.h))
    kv_positions = np.broadcast_to(np.arange(case.s), (case.b, case.s))
    kv_segment_ids = np.ones((case.b, case.s), np.int32)
    if case.segments is not None:
        assert sum(case.segments) == case.s == case.t
        kv_positions = np.concatenate([np.arange(n) for n in case.segments])[None].repeat(case.b, 0)
        kv_segment_ids = np.repeat(np.arange(1, len(case.segments) + 1), case.segments)[None].repeat(case.b, 0)
    ends = np.full(case.b, case.s) if case.kv_lengths is None else np.array(case.kv_lengths)
    q_index = ends[:, None] - case.t + np.arange(case.t)[None]  # the last T visible keys' slots
    q_positions = np.take_along_axis(kv_positions, q_index, axis=1)
    q_segment_ids = np.take_along_axis(kv_segment_ids, q_index, axis=1)
    # A zero-initialised cache past the length: position 0, same segment; only kv_lengths hides those keys.
    kv_positions = np.where(np.arange(case.s)[None] < ends[:, None], kv_positions, 0)
    arrays = dict(q=q, k=k, v=v)
    inputs = {name: jnp.asarray(x, dtype) for name, x in arrays.items()}
    ids = dict(q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
               kv_segment_ids=kv_segment_ids)
    inputs.update({name: jnp.asarray(x, jnp.int32) for name, x in ids.items()})
    inputs["kv_lengths"] = None if case.kv_lengths is None else jnp.asarray(case.kv_lengths, jnp.int32)
    return inputs


def numpy_float64_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_lengths):
    """Independent float64 attention: loops over sequences and heads, softmax over visible keys only."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    s, group = k.shape[1], n // k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        length = s if kv_lengths is None else int(kv_lengths[bi])
        visible = ((np.asarray(kv_positions[bi])[None, :] <= np.asarray(q_positions[bi])[:, None])
                   & (np.asarray(kv_segment_ids[bi])[None, :] == np.asarray(q_segment_ids[bi])[:, None])
                   & (np.arange(s) < length)[None, :])
        for head in range(n):
            logits = q[bi, :, head] @ k[bi, :, head // group].T / np.sqrt(h)
            logits = np.where(visible, logits, -np.inf)
            row_max = np.max(logits, axis=1, keepdims=True)
            weights = np.where(visible, np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
            denom = weights.sum(axis=1, keepdims=True)
            out[bi, :, head] = (weights / np.where(denom == 0, 1.0, denom)) @ v[bi, :, head // group]
    return out


def xla_attention_per_sequence(inputs):
    """The model's xla_attention on each sequence's visible keys (it takes no kv_lengths)."""
    lengths = inputs["kv_lengths"]
    outs = []
    for bi in range(inputs["q"].shape[0]):
        end = inputs["k"].shape[1] if lengths is None else int(lengths[bi])
        row = lambda name, cut=None: inputs[name][bi:bi + 1, :cut]
        outs.append(xla_attention(row("q"), row("k", end), row("v", end), row("q_positions"),
                                  row("kv_positions", end), row("q_segment_ids"), row("kv_segment_ids", end)))
    return jnp.concatenate(outs, axis=0)


def assert_close(actual, expected, tol):
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    assert not np.isnan(actual).any()
    np.testing.assert_allclose(actual, np.asarray(jnp.asarray(expected, jnp.float32)), **tol)


def assert_unseen_blocks_unread(run, case: Case, dtype, block_q: int, block_k: int, tol) -> None:
    """Causal and document block skipping, and keys past kv_lengths: for each query block, K and V are NaN in every
    key block outside the range its queries see (numpy's count), and run(inputs)'s rows of that block still match
    float64 numpy. A kernel that read such a block, even masked, would put NaN into them (0 x NaN). The kernels'
    bounds are per block (a query block's largest position, its segment range), so documents must start on block
    edges: one that starts inside a query block makes that block read later documents' first blocks too."""
    inputs = make_inputs(case, dtype, seed=7)
    expected = numpy_float64_attention(**inputs)
    kv_pos, kv_seg = np.asarray(inputs["kv_positions"]), np.asarray(inputs["kv_segment_ids"])
    q_pos, q_seg = np.asarray(inputs["q_positions"]), np.asarray(inputs["q_segment_ids"])
    lengths = np.full(case.b, case.s) if case.kv_lengths is None else np.asarray(case.kv_lengths)
    block = np.arange(case.s) // block_k
    skipped_any = False
    for start in range(0, case.t, block_q):
        rows = slice(start, start + block_q)
        seen = ((kv_pos[:, None, :] <= q_pos[:, rows, None]) & (kv_seg[:, None, :] == q_seg[:, rows, None])
                & (np.arange(case.s)[None, None, :] < lengths[:, None, None])).any(axis=1)  # [B, S]
        lo = np.where(seen, block, block.max() + 1).min(1, keepdims=True)
        hi = np.where(seen, block, -1).max(1, keepdims=True)
        outside = (block[None] < lo) | (block[None] > hi)  # [B, S]: keys of the blocks this query block skips
        skipped_any |= bool(outside.any())
        poison = {n: jnp.where(outside[:, :, None, None], jnp.nan, inputs[n]).astype(dtype) for n in ("k", "v")}
        assert_close(run({**inputs, **poison})[:, rows], expected[:, rows], tol)
    assert skipped_any


class FlashAttentionKernelTests:
    """The kernel's tests; subclasses choose interpret mode (CPU) or compiled (GPU)."""

    interpret: bool

    def run(self, case: Case, inputs, **overrides):
        inputs = {**inputs, **overrides}
        return flash_attention(**inputs, block_sizes=FlashBlockSizes(case.block_q, case.block_k, 4, 2),
                               interpret=self.interpret)

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_fp32_matches_reference_and_xla_attention(self, case):
        inputs = make_inputs(case, jnp.float32)
        out = self.run(case, inputs)
        assert out.shape == inputs["q"].shape and out.dtype == jnp.float32
        assert_close(out, flash_attention_reference(**inputs), FP32_TOL)
        assert_close(out, xla_attention_per_sequence(inputs), FP32_TOL)

    @pytest.mark.parametrize("name", ["odd_equal_gqa4", "bottom_right_gqa8_d128", "packed_segments",
                                      "kv_lengths_short"])
    def test_bf16_matches_fp32_reference(self, name):
        case = BY_NAME[name]
        inputs = make_inputs(case, jnp.bfloat16, seed=1)
        out = self.run(case, inputs)
        assert out.dtype == jnp.bfloat16
        upcast = {key: (x.astype(jnp.float32) if key in ("q", "k", "v") else x) for key, x in inputs.items()}
        assert_close(out, flash_attention_reference(**upcast), BF16_TOL)

    @pytest.mark.parametrize("name", ["bottom_right_gqa8_d128", "packed_segments", "kv_lengths_short",
                                      "head_dim_80_gqa2"])
    def test_fp32_matches_float64_numpy(self, name):
        case = BY_NAME[name]
        inputs = make_inputs(case, jnp.float32, seed=2)
        assert_close(self.run(case, inputs), numpy_float64_attention(**inputs), FP32_TOL)

    def test_exact_without_monotone_positions(self):
        """Shuffled key and query order (positions no longer monotone): same rows, permuted."""
        case = BY_NAME["packed_segments"]
        inputs = make_inputs(case, jnp.float32, seed=3)
        rng = np.random.default_rng(3)
        key_order, query_order = rng.permutation(case.s), rng.permutation(case.t)
        shuffled = dict(inputs)
        for name in ("k", "v", "kv_positions", "kv_segment_ids"):
            shuffled[name] = inputs[name][:, key_order]
        for name in ("q", "q_positions", "q_segment_ids"):
            shuffled[name] = inputs[name][:, query_order]
        out = self.run(case, shuffled)
        assert_close(out, self.run(case, inputs)[:, query_order], FP32_TOL)
        assert_close(out, numpy_float64_attention(**shuffled), FP32_TOL)

    def test_query_with_no_visible_key_gets_zeros(self):
        case = BY_NAME["odd_equal_gqa4"]
        inputs = make_inputs(case, jnp.float32, seed=4)
        q_segment_ids = inputs["q_segment_ids"].at[0, 5].set(99)  # a segment no key belongs to
        kv_positions = inputs["kv_positions"].at[1].add(3)  # keys start at 3: queries at positions 0..2 see none
        out = np.asarray(self.run(case, inputs, q_segment_ids=q_segment_ids, kv_positions=kv_positions))
        assert not np.isnan(out).any()
        np.testing.assert_array_equal(out[0, 5], 0.0)
        np.testing.assert_array_equal(out[1, :3], 0.0)
        assert np.abs(out[1, 3:]).sum() > 0
        expected = flash_attention_reference(**{**inputs, "q_segment_ids": q_segment_ids,
                                                "kv_positions": kv_positions})
        assert_close(out, expected, FP32_TOL)

    def test_keys_past_kv_length_are_invisible(self):
        case = BY_NAME["kv_lengths_short"]
        inputs = make_inputs(case, jnp.float32, seed=5)
        past = jnp.arange(case.s)[None, :, None, None] >= inputs["kv_lengths"][:, None, None, None]
        garbage = {name: jnp.where(past, 1e4, inputs[name]) for name in ("k", "v")}
        assert_close(self.run(case, inputs, **garbage), self.run(case, inputs), FP32_TOL)


    @pytest.mark.parametrize("case", [BY_NAME["not_block_multiple_mha"], BY_NAME["kv_lengths_short"],
                                      Case("packed_block_aligned", b=2, t=96, s=96, n=4, kv_heads=1, h=64,
                                           segments=(32, 48, 16))], ids=str)
    def test_blocks_no_query_of_a_block_sees_are_never_read(self, case):
        assert_unseen_blocks_unread(lambda inputs: self.run(case, inputs), case, jnp.float32, case.block_q,
                                    case.block_k, FP32_TOL)


# (N, K, H) of the models users serve: every other case's group is a power of two, these are 7, 6 and 3 too
MODEL_HEADS = {"qwen2.5-7b": (28, 4, 128), "qwen2.5-1.5b": (12, 2, 128), "qwen2.5-0.5b": (14, 2, 64),
               "llama3.2-1b": (32, 8, 64), "llama3.2-3b": (24, 8, 128), "llama3.1-70b": (64, 8, 128),
               "phi3-mini": (32, 32, 96)}


@pytest.mark.parametrize("model", MODEL_HEADS)
def test_models_head_shapes_match_float64_numpy(model):
    """Packed documents (37 tokens, not a multiple of the 16-query blocks) at each model's heads, interpreted: query
    head h reads KV head h // G for any G, not only powers of two (a shift by log2(G) passed every case above)."""
    n, kv_heads, h = MODEL_HEADS[model]
    case = Case(model, b=1, t=37, s=37, n=n, kv_heads=kv_heads, h=h, segments=(23, 14))
    inputs = make_inputs(case, jnp.float32, seed=8)
    out = flash_attention(**inputs, block_sizes=FlashBlockSizes(16, 16, 4, 2), interpret=True)
    assert_close(out, numpy_float64_attention(**inputs), FP32_TOL)


class TestFlashAttentionInterpret(FlashAttentionKernelTests):
    interpret = True


@pytest.mark.gpu
class TestFlashAttentionCompiled(FlashAttentionKernelTests):
    interpret = False


def test_default_block_sizes_run():
    case = BY_NAME["odd_equal_gqa4"]
    inputs = make_inputs(case, jnp.float32)
    out = flash_attention(**inputs, interpret=True)
    assert_close(out, flash_attention_reference(**inputs), FP32_TOL)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_q=48), "block_q must be a power of two"),
    (dict(block_k=8), "block_k must be a power of two in \\[16, 1024\\]"),
    (dict(block_k=2048), "block_k must be a power of two"),
    (dict(block_q=64.0), "block_q must be a power of two"),
    (dict(num_warps=3), "num_warps must be one of"),
    (dict(num_warps=4.0), "num_warps must be one of"),
    (dict(num_stages=0), "num_stages must be an int >= 1"),
])
def test_block_sizes_reject_invalid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FlashBlockSizes(**kwargs)


def test_block_sizes_are_frozen_and_hashable():
    sizes = FlashBlockSizes.for_head_dim(128)
    assert sizes.num_warps == 8 and hash(sizes) == hash(FlashBlockSizes(128, 64, 8, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sizes.block_q = 32


def test_rejects_bad_shapes_and_block_sizes_type():
    inputs = make_inputs(BY_NAME["head_dim_80_gqa2"], jnp.float32)  # 2 kv heads
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(**{**inputs, "q": inputs["q"][:, :, :3]}, interpret=True)
    with pytest.raises(ValueError, match="kv_positions must be an integer array of shape"):
        flash_attention(**{**inputs, "kv_positions": inputs["kv_positions"][:, :-1]}, interpret=True)
    with pytest.raises(TypeError, match="FlashBlockSizes"):
        flash_attention(**inputs, block_sizes=(64, 64), interpret=True)


@pytest.mark.parametrize("empty", ["T", "S"])
def test_no_query_or_no_key_gives_zeros(empty):
    """As the reference (and `decode_attention` over an empty cache): T = 0 is an empty result, S = 0 rows that see
    nothing. Both kernels crashed inside jax (an argmax of an empty sequence, a zero division)."""
    from swiftkv_jax.kernels.flash_attention_mgpu import flash_attention_mgpu

    inputs = make_inputs(BY_NAME["head_dim_80_gqa2"], jnp.float32)
    cut = {"T": ("q", "q_positions", "q_segment_ids"), "S": ("k", "v", "kv_positions", "kv_segment_ids")}[empty]
    inputs = {name: x[:, :0] if name in cut else x for name, x in inputs.items()}
    for kernel, dtype in ((flash_attention, jnp.float32), (flash_attention_mgpu, jnp.bfloat16)):
        typed = {n: x.astype(dtype) if n in ("q", "k", "v") else x for n, x in inputs.items()}
        out = kernel(**typed, interpret=True)
        assert out.shape == inputs["q"].shape and out.dtype == dtype and not np.asarray(out).any()


def _bounds(q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_len, block):
    as_i32 = lambda x: jnp.asarray(x, jnp.int32)[None]
    lo, hi = _kv_block_bounds(as_i32(q_positions), as_i32(kv_positions), as_i32(q_segment_ids),
                              as_i32(kv_segment_ids), jnp.asarray([kv_len], jnp.int32), len(q_positions),
                              block, block)
    return np.asarray(lo[0]).tolist(), np.asarray(hi[0]).tolist()


def test_causal_prefill_skips_future_kv_blocks():
    positions, segments = np.arange(128), np.ones(128)
    assert _bounds(positions, positions, segments, segments, 128, 32) == ([0, 0, 0, 0], [1, 2, 3, 4])
    # keys past kv_length: the blocks holding none are never read
    assert _bounds(positions, positions, segments, segments, 40, 32) == ([0, 0, 0, 0], [1, 2, 2, 2])


def test_packed_documents_read_only_their_own_kv_blocks():
    positions = np.concatenate([np.arange(64), np.arange(64)])
    segments = np.repeat([1, 2], 64)
    assert _bounds(positions, positions, segments, segments, 128, 32) == ([0, 0, 2, 2], [1, 2, 3, 4])


def test_block_bounds_cover_every_visible_key_without_monotone_positions():
    rng = np.random.default_rng(6)
    positions, segments = rng.permutation(128), rng.integers(0, 3, 128)
    lo, hi = _bounds(positions, positions, segments, segments, 128, 32)
    visible = (positions[None, :] <= positions[:, None]) & (segments[None, :] == segments[:, None])
    for i in range(4):
        blocks = np.nonzero(visible[32 * i:32 * (i + 1)].reshape(32, 4, 32).any(axis=(0, 2)))[0]
        assert lo[i] <= blocks.min() and blocks.max() < hi[i]


@pytest.mark.parametrize("name, dtype", [("bottom_right_gqa8_d128", jnp.bfloat16), ("head_dim_80_gqa2", jnp.float32),
                                         ("one_token", jnp.bfloat16)])
def test_lowers_with_triton_for_cuda(name, dtype):
    """Cross-lowered on CPU for CUDA: the kernel goes through the Triton backend (not Mosaic GPU) and every
    op in it has a Triton lowering. Compiling and running it needs a GPU (the `gpu` tests above)."""
    inputs = make_inputs(BY_NAME[name], dtype)
    lower = jax.jit(functools.partial(flash_attention, interpret=False)).trace(**inputs).lower(
        lowering_platforms=("cuda",))
    text = lower.as_text()
    assert "xla.gpu.triton" in text and "mosaic" not in text.lower()

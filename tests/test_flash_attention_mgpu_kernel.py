"""Mosaic GPU (Hopper) flash-attention kernel against its reference and float64 numpy.

The same tests run in jax's GPU interpret mode on the CPU (simulated warpgroups, barriers, TMA and wgmma) and compiled
on an sm_90 GPU (`-m gpu`, both forms of the P V product). Interpreted, a kernel costs seconds even at these tiny shapes
(jax compiles the simulated kernel; conftest's `mgpu_interpreter_compiles_once` makes that once per kernel instead of
once per CTA and warpgroup), so the default suite runs one case and the rest are `slow`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from swiftkv_jax.kernels.flash_attention_mgpu import (MosaicFlashBlockSizes, block_ranges, _tile_ranges,
                                                      flash_attention_mgpu, flash_attention_mgpu_reference)
from test_flash_attention_kernel import (BF16_TOL, Case, assert_close, assert_unseen_blocks_unread, make_inputs,
                                        numpy_float64_attention)

from conftest import GPU_INTERPRET as _thread_map

pytestmark = pytest.mark.usefixtures("mgpu_interpreter_compiles_once")


# Tiny shapes for the interpreter: block_q 64 (a CTA holds 128 queries), block_kv 64, head dim 64.
CASES = [
    # the engines' layout: a chunk of 64 queries over 128 cached keys, GQA; the second warpgroup's queries are
    # padding (its range is empty: it only releases the slots), the context blocks are fully visible
    Case("chunk_over_context_gqa2", b=1, t=64, s=192, n=2, kv_heads=1, h=64),
    Case("causal_gqa2", b=1, t=128, s=128, n=2, kv_heads=1, h=64),
    Case("packed_segments", b=1, t=192, s=192, n=1, kv_heads=1, h=64, segments=(40, 100, 52)),
    Case("kv_lengths", b=2, t=64, s=192, n=1, kv_heads=1, h=64, kv_lengths=(100, 192)),
    Case("odd_lengths_head_dim_80", b=1, t=100, s=100, n=2, kv_heads=2, h=80),  # T, S and H padded
]
# Groups that are no power of two (every case above has G 1 or 2: a query head read KV head head >> log2(G) and
# passed them): the heads of Qwen2.5-0.5B (14 / 2, G 7), Qwen2.5-7B (28 / 4 cut to 14 / 2, G 7), Qwen2.5-1.5B
# (12 / 2, G 6) and Llama-3.2-3B (24 / 8 cut to 6 / 2, G 3), each model's head dim, causal or packed, one tile
GROUP_CASES = [
    Case("qwen2.5-0.5b_gqa7_packed", b=1, t=128, s=128, n=14, kv_heads=2, h=64, segments=(70, 58)),
    Case("qwen2.5-7b_gqa7_causal", b=1, t=128, s=128, n=14, kv_heads=2, h=128),
    Case("qwen2.5-1.5b_gqa6_packed", b=1, t=128, s=128, n=12, kv_heads=2, h=128, segments=(30, 98)),
    Case("llama3.2-3b_gqa3_chunk_over_context", b=1, t=64, s=192, n=6, kv_heads=2, h=128),
]
CASES += GROUP_CASES
BY_NAME = {case.name: case for case in CASES}
# the cases the default suite interprets: the engines' layout, two CTAs along the queries (the grid's q_tile
# order is reversed, longest tiles first), and the groups that are no power of two
DEFAULT = ("chunk_over_context_gqa2", "packed_segments", *(case.name for case in GROUP_CASES))
SLOW_IN_INTERPRET = [pytest.param(c.name, marks=[] if c.name in DEFAULT else pytest.mark.slow) for c in CASES]
BLOCKS = MosaicFlashBlockSizes(block_q=64, block_kv=64, max_concurrent_steps=2)


def upcast(inputs):
    return {key: (x.astype(jnp.float32) if key in ("q", "k", "v") else x) for key, x in inputs.items()}


class MosaicFlashKernelTests:
    """The kernel's tests; subclasses choose interpreted (CPU) or compiled (GPU) and the form of P V."""

    interpret: bool
    interpreter_safe: bool

    def run(self, inputs, **overrides):
        return flash_attention_mgpu(**{**inputs, **overrides}, block_sizes=BLOCKS, interpret=self.interpret,
                                    interpreter_safe=self.interpreter_safe)

    @pytest.mark.parametrize("name", SLOW_IN_INTERPRET)
    def test_matches_reference_and_float64(self, name):
        inputs = make_inputs(BY_NAME[name], jnp.bfloat16)
        out = self.run(inputs)
        assert out.shape == inputs["q"].shape and out.dtype == jnp.bfloat16
        assert_close(out, flash_attention_mgpu_reference(**upcast(inputs)), BF16_TOL)
        assert_close(out, numpy_float64_attention(**inputs), BF16_TOL)

    @pytest.mark.slow
    def test_not_causal_every_block_full(self):
        """Queries placed after every key (no mask anywhere: the unmasked path only), float16."""
        case = BY_NAME["causal_gqa2"]
        inputs = make_inputs(case, jnp.float16, seed=1)
        inputs["q_positions"] = jnp.full_like(inputs["q_positions"], case.s)
        lo, full_lo, full_hi, hi = self.ranges(inputs, case)
        assert (full_lo == lo).all() and (full_hi == hi).all() and (hi == 2).all()
        assert_close(self.run(inputs), numpy_float64_attention(**inputs), BF16_TOL)

    @pytest.mark.slow
    def test_exact_without_monotone_positions(self):
        case = BY_NAME["packed_segments"]
        inputs = make_inputs(case, jnp.bfloat16, seed=3)
        rng = np.random.default_rng(3)
        key_order, query_order = rng.permutation(case.s), rng.permutation(case.t)
        for name in ("k", "v", "kv_positions", "kv_segment_ids"):
            inputs[name] = inputs[name][:, key_order]
        for name in ("q", "q_positions", "q_segment_ids"):
            inputs[name] = inputs[name][:, query_order]
        assert_close(self.run(inputs), numpy_float64_attention(**inputs), BF16_TOL)

    @pytest.mark.slow
    def test_query_with_no_visible_key_gets_zeros(self):
        case = BY_NAME["causal_gqa2"]
        inputs = make_inputs(case, jnp.bfloat16, seed=4)
        inputs["q_segment_ids"] = inputs["q_segment_ids"].at[0, 5].set(99)  # a segment no key belongs to
        inputs["kv_positions"] = inputs["kv_positions"] + 3  # keys start at 3: queries at 0..2 see none
        out = np.asarray(self.run(inputs), np.float32)
        assert not np.isnan(out).any()
        np.testing.assert_array_equal(out[0, [0, 1, 2, 5]], 0.0)
        assert_close(out, numpy_float64_attention(**inputs), BF16_TOL)

    @pytest.mark.parametrize("case", [
        pytest.param(BY_NAME["causal_gqa2"], marks=pytest.mark.slow),
        pytest.param(BY_NAME["kv_lengths"], marks=pytest.mark.slow),
        Case("packed_block_aligned", b=1, t=192, s=192, n=1, kv_heads=1, h=64, segments=(64, 128))], ids=str)
    def test_blocks_no_query_of_a_tile_sees_are_never_read(self, case):
        """Per warpgroup tile of 64 queries (`_tile_ranges`), the key blocks it skips may hold NaN (the default
        suite interprets the packed case: a skipped document before, causal blocks after)."""
        assert_unseen_blocks_unread(self.run, case, jnp.bfloat16, BLOCKS.block_q, BLOCKS.block_kv, BF16_TOL)

    @staticmethod
    def ranges(inputs, case):
        kv_len = jnp.full((case.b,), case.s, jnp.int32)
        return (np.asarray(x) for x in block_ranges(inputs["q_positions"], inputs["kv_positions"],
                                                     inputs["q_segment_ids"], inputs["kv_segment_ids"], kv_len,
                                                     case.t, 64, 64))


@pytest.mark.skipif(_thread_map is None, reason=f"jax {jax.__version__} has no Mosaic GPU interpret mode")
class TestMosaicFlashInterpret(MosaicFlashKernelTests):
    interpret = True
    interpreter_safe = True


@pytest.mark.gpu
class TestMosaicFlashCompiled(MosaicFlashKernelTests):
    """FA3's form (P from registers, accumulated in place), then at realistic shapes."""

    interpret = False
    interpreter_safe = False

    @pytest.mark.parametrize("case", [
        Case("causal_8x2_d128", b=2, t=2048, s=2048, n=8, kv_heads=2, h=128),
        Case("chunk_over_context", b=1, t=512, s=4096, n=8, kv_heads=2, h=128),
        Case("packed", b=1, t=4096, s=4096, n=4, kv_heads=1, h=128, segments=(1000, 2048, 1048)),
    ], ids=str)
    @pytest.mark.parametrize("blocks", [MosaicFlashBlockSizes(), MosaicFlashBlockSizes(64, 64, 3),
                                        MosaicFlashBlockSizes(128, 128, 2)], ids=str)
    def test_realistic_shapes(self, case, blocks):
        inputs = make_inputs(case, jnp.bfloat16, seed=7)
        out = flash_attention_mgpu(**inputs, block_sizes=blocks, interpret=False,
                                   interpreter_safe=self.interpreter_safe)
        assert_close(out, flash_attention_mgpu_reference(**upcast(inputs)), BF16_TOL)


@pytest.mark.gpu
class TestMosaicFlashCompiledInterpreterForm(TestMosaicFlashCompiled):
    """The form the interpreter runs (P through SMEM), compiled: the interpret tests' code on the GPU."""

    interpreter_safe = True


def _ranges(q_positions, kv_positions, q_segments, kv_segments, kv_len, block):
    as_i32 = lambda x: jnp.asarray(x, jnp.int32)[None]  # noqa: E731
    out = block_ranges(as_i32(q_positions), as_i32(kv_positions), as_i32(q_segments), as_i32(kv_segments),
                        jnp.asarray([kv_len], jnp.int32), len(q_positions), block, block)
    return [np.asarray(x[0]).tolist() for x in out]


def test_causal_ranges_mask_only_the_diagonal():
    positions, segments = np.arange(256), np.ones(256)
    lo, full_lo, full_hi, hi = _ranges(positions, positions, segments, segments, 256, 64)
    # query block i reads blocks 0..i; blocks before i are fully visible (query block 0 has none: its run is
    # empty, parked at hi)
    assert (lo, full_lo, full_hi, hi) == ([0] * 4, [1, 0, 0, 0], [1, 1, 2, 3], [1, 2, 3, 4])


def test_chunk_over_context_ranges_skip_the_mask_on_the_context():
    kv_positions = np.arange(320)
    lo, full_lo, full_hi, hi = _ranges(kv_positions[-128:], kv_positions, np.ones(128), np.ones(320), 320, 64)
    assert (lo, full_lo, full_hi, hi) == ([0, 0], [0, 0], [3, 4], [4, 5])


def test_packed_ranges_read_only_their_own_document():
    positions = np.concatenate([np.arange(100), np.arange(156)])
    segments = np.repeat([1, 2], [100, 156])
    lo, full_lo, full_hi, hi = _ranges(positions, positions, segments, segments, 256, 64)
    # KV block 1 holds the end of the first document and the start of the second: masked wherever it is read.
    # Query block 1 spans both documents too: its range is conservative (flash_attention's bound) and all masked.
    assert (lo, hi) == ([0, 0, 1, 1], [2, 4, 3, 4])
    assert (full_lo, full_hi) == ([2, 4, 3, 2], [2, 4, 3, 3])


def test_keys_past_kv_length_are_never_full():
    positions, segments = np.arange(128), np.ones(128)
    lo, full_lo, full_hi, hi = _ranges(positions + 200, positions, segments, segments, 100, 64)
    assert (lo, full_lo, full_hi, hi) == ([0, 0], [0, 0], [1, 1], [2, 2])


def test_tile_ranges_cover_both_warpgroups_and_park_empty_ones():
    as_arr = lambda *rows: jnp.asarray([rows], jnp.int32)  # noqa: E731  [1, nq]
    tiles, ranges = _tile_ranges(as_arr(2, 0), as_arr(2, 0), as_arr(3, 0), as_arr(5, 0))  # second warpgroup empty
    assert np.asarray(tiles).tolist() == [[[2, 5]]]
    assert np.asarray(ranges).tolist() == [[[2, 2, 3, 5], [2, 2, 2, 2]]]
    tiles, _ = _tile_ranges(as_arr(0, 1), as_arr(0, 1), as_arr(0, 1), as_arr(0, 1))  # both empty
    assert np.asarray(tiles).tolist() == [[[0, 0]]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_q=32), "block_q must be 64 or 128"),
    (dict(block_q=64.0), "block_q must be 64 or 128"),
    (dict(block_kv=96), "block_kv must be a multiple of 64"),
    (dict(block_kv=512), "block_kv must be a multiple of 64"),
    (dict(max_concurrent_steps=1), "max_concurrent_steps must be an int >= 2"),
])
def test_block_sizes_reject_invalid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MosaicFlashBlockSizes(**kwargs)


def test_block_sizes_are_frozen_and_hashable():
    sizes = MosaicFlashBlockSizes()
    assert hash(sizes) == hash(MosaicFlashBlockSizes(64, 128, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sizes.block_q = 128


def test_rejects_what_it_cannot_run():
    inputs = make_inputs(BY_NAME["causal_gqa2"], jnp.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        flash_attention_mgpu(**upcast(inputs), interpret=True)
    with pytest.raises(ValueError, match="cannot run in jax's GPU interpret mode"):
        flash_attention_mgpu(**inputs, interpret=True, interpreter_safe=False)
    with pytest.raises(ValueError, match="shared memory"):  # 3 x 2 x 256 x 256 keys: 800 KiB
        flash_attention_mgpu(**{**inputs, "q": jnp.zeros((1, 128, 2, 256), jnp.bfloat16),
                                "k": jnp.zeros((1, 128, 1, 256), jnp.bfloat16),
                                "v": jnp.zeros((1, 128, 1, 256), jnp.bfloat16)},
                             block_sizes=MosaicFlashBlockSizes(128, 256, 3), interpret=True)
    with pytest.raises(TypeError, match="MosaicFlashBlockSizes"):
        flash_attention_mgpu(**inputs, block_sizes=(64, 64), interpret=True)
    two_kv_heads = make_inputs(BY_NAME["odd_lengths_head_dim_80"], jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention_mgpu(**{**two_kv_heads, "q": two_kv_heads["q"][:, :, :1].repeat(3, axis=2)},
                             interpret=True)


@pytest.mark.slow
@pytest.mark.skipif(_thread_map is None, reason=f"jax {jax.__version__} has no Mosaic GPU interpret mode")
def test_model_picks_it_by_name():
    """attention_impl="mosaic" (the model's prefill choice) runs this kernel and agrees with the XLA path."""
    from swiftkv_jax.model.attention import ATTENTION_IMPLS, attend

    assert "mosaic" in ATTENTION_IMPLS
    inputs = make_inputs(BY_NAME["packed_segments"], jnp.bfloat16, seed=8)
    args = [inputs[name] for name in ("q", "k", "v", "q_positions", "kv_positions", "q_segment_ids",
                                      "kv_segment_ids")]
    assert_close(attend("mosaic", *args), attend("xla", *[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                                                           for a in args]), BF16_TOL)


def test_shared_memory_counts_p_tiles_only_in_the_form_that_has_them():
    """FA3's tile at head dim 128 (two warpgroups of 128 queries, 128 keys, two slots) fits a Hopper block's shared
    memory with P in registers (the compiled form) but not with P's tiles in SMEM (the interpreter's form): the
    compiled form lowers, the other is refused before launching."""
    from swiftkv_jax.kernels.mosaic_launch import SMEM_BYTES

    blocks = MosaicFlashBlockSizes(128, 128, 2)
    assert blocks.smem_bytes(128, p_in_smem=False) <= SMEM_BYTES < blocks.smem_bytes(128, p_in_smem=True)
    inputs = {key: x if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for key, x in
              make_inputs(Case("causal_1k", b=1, t=1024, s=1024, n=4, kv_heads=1, h=128), jnp.bfloat16).items()}
    for interpreter_safe in (False, True):
        traced = lambda: jax.jit(lambda **kw: flash_attention_mgpu(  # noqa: E731
            **kw, block_sizes=blocks, interpret=False, interpreter_safe=interpreter_safe)).trace(**inputs)
        if interpreter_safe:
            with pytest.raises(ValueError, match="shared memory"):
                traced()
        else:
            assert "mosaic_gpu" in traced().lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("interpreter_safe", [False, True], ids=["fa3_form", "interpreter_form"])
@pytest.mark.parametrize("blocks", [MosaicFlashBlockSizes(), MosaicFlashBlockSizes(64, 64, 3)], ids=str)
@pytest.mark.parametrize("case", [
    Case("causal_8k_d128", b=1, t=8192, s=8192, n=32, kv_heads=8, h=128),
    Case("chunk_over_context", b=1, t=512, s=4100, n=8, kv_heads=2, h=128, kv_lengths=(4000,)),
    Case("packed", b=1, t=4096, s=4096, n=4, kv_heads=1, h=128, segments=(1000, 2048, 1048)),
    Case("odd_lengths_head_dim_64", b=2, t=1001, s=1001, n=4, kv_heads=2, h=64),
], ids=str)
def test_compiled_kernel_lowers_for_cuda(case, blocks, interpreter_safe):
    """Without a GPU: jax's Mosaic GPU lowering accepts the compiled kernel at realistic shapes (register layouts,
    SMEM tiling and swizzles, TMA copy sizes, wgmma operand shapes: what the interpreter does not check). Compiling
    the module to machine code, and running it, needs the GPU (the gpu tests)."""
    inputs = {key: x if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)
              for key, x in make_inputs(case, jnp.bfloat16).items()}
    lowered = jax.jit(lambda **kw: flash_attention_mgpu(**kw, block_sizes=blocks, interpret=False,
                                                        interpreter_safe=interpreter_safe)).trace(**inputs)
    assert "mosaic_gpu" in lowered.lower(lowering_platforms=("cuda",)).as_text()

"""Prefill flash attention on Mosaic GPU (Pallas `plgpu`, Hopper): the kernel, its reference and its block sizes.

Same contract as `flash_attention` (flash_attention.py; this package imports nothing from the model): q [B, T, N, H]
attends to k, v [B, S, K, H] (GQA: N = K * G); query t sees key s of its own segment whose position is <= its own
and whose index is < kv_lengths[b]. Positions decide, not indices, so the engines' [cached context | new chunk]
layout (the queries are the last T of the S keys), packed prompts (segment ids, positions restarting) and
shuffled orders are all exact. Scale 1/sqrt(H), applied inside. A query that sees no key gets zeros.

Structure: FlashAttention-3 as in jax's `pallas/ops/gpu/attention_mgpu.py`: one CTA per (query head, tile of
2 * block_q queries, sequence) with three warpgroups. The memory warpgroup streams K, V and the keys' positions
and segment ids through `max_concurrent_steps` SMEM slots with TMA, each slot guarded by "loaded" barriers (TMA
completion) and "consumed" barriers (both compute warpgroups are done with it). The two compute warpgroups own
block_q queries each: wgmma for Q K^T (both operands in SMEM), an online softmax in registers (fp32, base 2),
wgmma for P V; a schedule barrier makes the two alternate, so one's softmax overlaps the other's matrix products.

Block skipping: as in flash_attention, cheap XLA reductions before the kernel give, per (sequence, query block),
the range [lo, hi) of KV blocks that can hold a visible key, and inside it the run [full_lo, full_hi) of blocks
whose every key is visible to every query of the block (the same segment, every position <= the block's smallest
query position, every index < kv_lengths). Those skip the mask (causal prefill: every block but the diagonal; a
chunk over its cached context: the whole context); the other blocks of [lo, hi) are masked per element, from the
positions and segment ids, so the result is exact for any data (no monotonicity assumed). The memory warpgroup
loads the union of the two compute warpgroups' ranges; a warpgroup waits on (and releases) every slot of that
union, skipping the arithmetic outside its own range, so the barriers' phases stay in step.

Inputs the kernel cannot take are padded, not refused: T to a multiple of 2 * block_q, S to a multiple of
block_kv, H to a multiple of 64 (wgmma's K and the 128-byte swizzle); padded keys get an index past kv_lengths.
Each pad is a copy of q or k and v, so the fast path is T, S multiples of the blocks and H of 64 (Llama: 128).
Only bfloat16 and float16 inputs (wgmma's operand types); float32 raises.

Mosaic GPU on this project's JAX versions:
- Compiled: needs an sm_90 GPU. Lowering does not: `jit(...).trace(...).lower(lowering_platforms=("cuda",))` runs
  jax's Mosaic GPU lowering on a CPU (the tests do, at the engines' shapes), which checks layouts, SMEM tiling, TMA
  copy sizes and wgmma shapes; compiling to machine code and running need the GPU.
- Interpreted on the CPU: JAX >= 0.10 ships a GPU interpret mode (private: `jax._src.pallas.mosaic_gpu.interpret`,
  `InterpretGPUParams` as the kernel's `interpret`) that simulates GMEM/SMEM, the warpgroups as threads, barriers
  (strictly: a wait must see exactly its phase), TMA copies and wgmma. `interpret=True` (the default on a CPU) runs
  this kernel there; without that module it raises. What jax 0.10.2's interpreter cannot run, and what this kernel
  does instead:
  * `pl.run_state` (attention_mgpu accumulates P V in place with `pl.run_state(f)(plgpu.ACC.init(acc))`):
    "NotImplementedError: Higher-order primitive run_state"; nor a store into an accumulator ref
    (`wgmma_accumulator_store`) that could replace it.
  * A wgmma operand in registers (attention_mgpu feeds P from registers): the interpreter reads every operand as
    an SMEM allocation.
  * `plgpu.transpose_ref` on a wgmma operand (attention_mgpu's K^T, and this kernel's): jax 0.10.2's wgmma rule
    fails on it ("'TransposeTransform' object has no attribute 'indices'"); mosaic_launch.py gives the interpreter
    a rule that reads the tile and transposes it, so K is read in place in both modes.
  * `plgpu.layout_cast`: no CPU lowering ("MLIR translation rule for primitive 'layout_cast' not found for
    platform cpu"). Register layouts mean nothing to the interpreter: it is the identity there.
  So P V has two forms, a static flag `interpreter_safe`: True (interpret mode; runs compiled too): P is stored to
  an SMEM tile and P V goes into a fresh accumulator added to the running one; False (the compiled default,
  FA3's): P stays in registers and P V accumulates in place (`run_state`). Everything else (TMA, barriers, block
  ranges, masks, softmax) is one code. The `gpu`-marked tests run both forms compiled.
  The interpreter is slow: jax recompiles the simulated kernel for every CTA and warpgroup (~2 s each on 2 CPU
  cores); the tests compile it once per kernel instead (conftest's `mgpu_interpreter_compiles_once`).
- On an H200 (jax 0.11.2, benchmarks/results/gpu-2026-11-24): every `gpu` test that ran passed (the calls' limits cut
  the rest); causal bf16 at 8K x 1 393 TFLOP/s against cuDNN's causal flag 429 (0.91x), 8K x 4 515 against 539, packed
  2K documents 203 against 38 for cuDNN given the mask as a bias. The engines' default prefill on sm_90
  (serving/kernel_choice.py). With the query tiles started longest first (`_kernel`), 2026-11-25: 464 TFLOP/s at
  8K x 1 against cuDNN's 483 (0.96x), 547 at 32K x 1 (0.94x), 252-345 on packed prompts; at 2K 0.64-0.87x cuDNN.

Forward only (serving prefill). K/V from an int8 / FP8 cache reach it dequantised by XLA (model/layers.py): a
prefill chunk is compute-bound, so by arithmetic that pre-pass over the cached context costs a few percent of its
attention (a 512-token chunk over 32K: ~16 MB written per layer against ~0.3 TFLOP; not yet measured, which
benchmarks/kernels.py's `mosaic_float8_e4m3fn` rows do), where converting tiles inside this kernel would
add SMEM traffic to each compute warpgroup's loop.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from swiftkv_jax.kernels.flash_attention import (block_ranges, check_shapes, pad_axis,
                                                 flash_attention_reference)
from swiftkv_jax.kernels.mosaic_launch import SMEM_BYTES, accumulate_pv, interpret_params, launch, settings
from swiftkv_jax.kernels.split_k import MASK_VALUE
from swiftkv_jax.kernels.tuning import call_shapes

__all__ = ["MosaicFlashBlockSizes", "flash_attention_mgpu", "flash_attention_mgpu_reference"]

_LOG2_E = math.log2(math.e)
_COMPUTE_WGS = 2  # compute warpgroups per CTA; the third warpgroup issues the TMA loads
_WGMMA_M = 64  # rows of one warpgroup's wgmma
_HEAD_ALIGN = 64  # head dim: a multiple of wgmma's K for 16-bit types and of the 128-byte swizzle's 64 elements
_DTYPES = (jnp.bfloat16, jnp.float16)

flash_attention_mgpu_reference = flash_attention_reference  # the same contract; upcast 16-bit inputs to compare


def _is_int(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)


@dataclasses.dataclass(frozen=True)
class MosaicFlashBlockSizes:
    """Tile sizes of the Mosaic GPU flash kernel, validated on construction.

    block_q: queries per compute warpgroup (64 or 128: wgmma's M is 64 per warpgroup); a CTA holds 2 * block_q.
    block_kv: keys per pipeline step, a multiple of 64 in [64, 256].
    max_concurrent_steps: SMEM slots of K, V in flight (>= 2). SMEM per CTA is about
    2 * (2 * block_q + 2 * max_concurrent_steps * block_kv) * H bytes (16-bit types); a config that does not fit
    the GPU's 227 KiB raises before launching.
    """

    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 2

    def __post_init__(self):
        if not _is_int(self.block_q) or self.block_q not in (64, 128):
            raise ValueError(f"MosaicFlashBlockSizes.block_q must be 64 or 128, got {self.block_q!r}")
        if not _is_int(self.block_kv) or self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"MosaicFlashBlockSizes.block_kv must be a multiple of 64 in [64, 256], "
                             f"got {self.block_kv!r}")
        if not _is_int(self.max_concurrent_steps) or self.max_concurrent_steps < 2:
            raise ValueError(f"MosaicFlashBlockSizes.max_concurrent_steps must be an int >= 2, "
                             f"got {self.max_concurrent_steps!r}")

    def smem_bytes(self, head_dim: int, itemsize: int = 2, p_in_smem: bool = True) -> int:
        """Shared memory of one CTA: Q/O tiles, the K and V slots, and P's tiles when it goes through SMEM (the
        `interpreter_safe` form: `p_in_smem`)."""
        tiles = _COMPUTE_WGS * self.block_q * head_dim + 2 * self.max_concurrent_steps * self.block_kv * head_dim
        p_tiles = _COMPUTE_WGS * self.block_q * self.block_kv if p_in_smem else 0
        meta = 4 * (2 * _COMPUTE_WGS * self.block_q + 2 * self.max_concurrent_steps * self.block_kv)
        return itemsize * (tiles + p_tiles) + meta


def _kernel(ranges_ref, tiles_ref, q_meta_ref, kv_meta_ref, q_ref, k_ref, v_ref, out_ref, scoped, *,
            block_q: int, block_kv: int, stages: int, group: int, qk_scale: float, interpreter_safe: bool,
            interpret: bool, num_tiles: int):
    """One CTA: query head `heads`, queries [2 * block_q * tile, + 2 * block_q) of sequence `batch`, where the grid's
    q_tile i is tile num_tiles - 1 - i: the GPU starts CTAs in grid order, and under a causal mask the last
    queries see the most keys, so the longest CTAs start first and the short ones fill the tail of the last wave
    (FlashAttention's causal order; in order, the last wave was the longest tiles alone)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    # Register layouts matter to the Mosaic GPU compiler only; jax 0.10's interpreter has no rule for layout_cast
    layout_cast = (lambda x, layout: x) if interpret else plgpu.layout_cast  # noqa: E731

    (qo_smem2, k_smem, v_smem, q_meta_smem2, kv_meta_smem, p_smem2), loaded, consumed, schedule = scoped
    q_barriers, q_meta_barriers, k_barriers, v_barriers, kv_meta_barriers = loaded
    k_consumed, v_consumed = consumed
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    tile = num_tiles - 1 - lax.axis_index("q_tile")
    wg = lax.axis_index("wg")
    first, last = tiles_ref[batch, tile, 0], tiles_ref[batch, tile, 1]  # KV blocks the CTA loads
    dtype, head_dim = q_ref.dtype, q_ref.shape[3]

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def slot_of(step):
        return lax.rem(step - first, jnp.array(stages, step.dtype))

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_block = tile * _COMPUTE_WGS + wg
        q_base = q_block * block_q
        qo_smem, q_meta_smem = qo_smem2.at[wg], q_meta_smem2.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, block_q), head], qo_smem, q_barriers.at[wg])
        plgpu.copy_gmem_to_smem(q_meta_ref.at[batch, :, pl.ds(q_base, block_q)], q_meta_smem,
                                q_meta_barriers.at[wg])
        lo, full_lo, full_hi, hi = (ranges_ref[batch, q_block, i] for i in range(4))
        rows, cols = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
        plgpu.barrier_wait(q_meta_barriers.at[wg])
        q_pos = layout_cast(q_meta_smem.at[0][...], rows)
        q_seg = layout_cast(q_meta_smem.at[1][...], rows)
        plgpu.barrier_wait(q_barriers.at[wg])

        def step(kv_step, carry, *, masked: bool):
            acc, m_prev, l_prev = carry
            slot = slot_of(kv_step)
            plgpu.barrier_wait(k_barriers.at[slot])

            def compute_qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                schedule_barrier()
                return acc_ref[...]

            s = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            s = s * qk_scale  # base-2 logits
            plgpu.barrier_wait(kv_meta_barriers.at[slot])
            if masked:
                kv_pos = layout_cast(kv_meta_smem.at[slot, 0][...], cols)
                kv_seg = layout_cast(kv_meta_smem.at[slot, 1][...], cols)
                shape = (block_q, block_kv)
                mask = ((lax.broadcast_in_dim(kv_pos, shape, [1]) <= lax.broadcast_in_dim(q_pos, shape, [0]))
                        & (lax.broadcast_in_dim(kv_seg, shape, [1]) == lax.broadcast_in_dim(q_seg, shape, [0])))
                s = jnp.where(mask, s, MASK_VALUE)
            m_next = jnp.maximum(m_prev, s.max(axis=1))
            alpha = jnp.exp2(m_prev - m_next)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
            if masked:  # a row that has seen no visible key yet keeps zero weight
                p = jnp.where(mask, p, 0.0)
            l_next = l_prev * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(dtype)
            plgpu.barrier_arrive(schedule)  # softmax done
            plgpu.barrier_wait(v_barriers.at[slot])
            plgpu.barrier_wait(schedule)  # the tensor cores are ours
            acc = accumulate_pv(acc, p16, v_smem.at[slot], p_smem2.at[wg] if interpreter_safe else None)
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_next, l_next

        def skip(kv_step, carry):
            """A block the other warpgroup needs: release it in step with the barriers, compute nothing."""
            slot = slot_of(kv_step)
            plgpu.barrier_wait(k_barriers.at[slot])
            schedule_barrier()
            plgpu.barrier_arrive(k_consumed.at[slot])
            plgpu.barrier_wait(kv_meta_barriers.at[slot])
            plgpu.barrier_wait(v_barriers.at[slot])
            schedule_barrier()
            plgpu.barrier_arrive(v_consumed.at[slot])
            return carry

        carry = (layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA),
                 layout_cast(jnp.full((block_q,), MASK_VALUE, jnp.float32), rows),
                 layout_cast(jnp.zeros((block_q,), jnp.float32), rows))
        pl.when(wg == 1)(schedule_barrier)  # offsets the two warpgroups by one phase: they alternate
        carry = lax.fori_loop(first, lo, skip, carry)
        carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)
        acc, _, denom = lax.fori_loop(hi, last, skip, carry)
        pl.when(wg == 0)(schedule_barrier)

        denom = jnp.where(denom == 0.0, 1.0, denom)  # no visible key: acc is 0, so is the output
        qo_smem[...] = (acc / lax.broadcast_in_dim(denom, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(q_base, block_q), head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, jnp.array(group, head.dtype))

        def load(kv_step, slot, wait: bool):
            keys = pl.ds(kv_step * block_kv, block_kv)
            if wait:
                plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_smem.at[slot], k_barriers.at[slot])
            if wait:
                plgpu.barrier_wait(v_consumed.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_smem.at[slot], v_barriers.at[slot])
            plgpu.copy_gmem_to_smem(kv_meta_ref.at[batch, :, keys], kv_meta_smem.at[slot],
                                    kv_meta_barriers.at[slot])

        for i in range(stages):
            pl.when(first + i < last)(functools.partial(load, first + i, i, False))

        @pl.loop(0, last - first - stages)
        def _stream(r):
            load(first + stages + r, lax.rem(r, jnp.array(stages, r.dtype)), True)

        # Wait for the last steps' releases too: a thread that waits on a barrier sees every phase of it (the
        # interpreter checks this when the barriers are freed; on the GPU it costs the tail of one step)
        @pl.loop(jnp.maximum(last - first - stages, 0), last - first)
        def _drain(r):
            slot = lax.rem(r, jnp.array(stages, r.dtype))
            plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.barrier_wait(v_consumed.at[slot])


def _tile_ranges(lo, full_lo, full_hi, hi):
    """The CTA's KV blocks [first, last) (the union of its two warpgroups' ranges; [B, tiles, 2]) and each
    warpgroup's ranges inside it ([B, nq, 4]: lo, full_lo, full_hi, hi; an empty range sits at `first`)."""
    b, nq = lo.shape
    pair = lambda x: x.reshape(b, nq // _COMPUTE_WGS, _COMPUTE_WGS)  # noqa: E731
    nonempty = pair(hi > lo)
    first = jnp.min(jnp.where(nonempty, pair(lo), jnp.iinfo(jnp.int32).max), axis=2)
    last = jnp.max(jnp.where(nonempty, pair(hi), 0), axis=2)
    first = jnp.where(jnp.any(nonempty, axis=2), first, 0)
    at_first = jnp.repeat(first, _COMPUTE_WGS, axis=1)
    ranges = jnp.stack([jnp.where(hi > lo, x, at_first) for x in (lo, full_lo, full_hi, hi)], axis=2)
    return jnp.stack([first, last], axis=2).astype(jnp.int32), ranges.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "interpreter_safe"))
def _flash_attention_mgpu(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_lengths, *,
                          block_sizes: MosaicFlashBlockSizes, interpret: bool, interpreter_safe: bool):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    block_q, block_kv, stages = block_sizes.block_q, block_sizes.block_kv, block_sizes.max_concurrent_steps
    tile_q = _COMPUTE_WGS * block_q
    t_pad, s_pad, h_pad = (pl.cdiv(x, m) * m for x, m in ((t, tile_q), (s, block_kv), (h, _HEAD_ALIGN)))
    smem = block_sizes.smem_bytes(h_pad, q.dtype.itemsize, p_in_smem=interpreter_safe)
    if smem > SMEM_BYTES:
        raise ValueError(f"{block_sizes} needs {smem} bytes of shared memory at head dim {h_pad}, more than "
                         f"the {SMEM_BYTES} an H100/H200 block has: use smaller blocks or fewer steps")
    # Pads are copies: only where the shapes need them
    if h_pad != h:
        q, k, v = (pad_axis(x, 3, h_pad) for x in (q, k, v))
    if t_pad != t:
        q = pad_axis(q, 1, t_pad)
    if s_pad != s:
        k, v = (pad_axis(x, 1, s_pad) for x in (k, v))
    q_positions, q_segment_ids = (pad_axis(x.astype(jnp.int32), 1, t_pad) for x in (q_positions, q_segment_ids))
    kv_positions, kv_segment_ids = (pad_axis(x.astype(jnp.int32), 1, s_pad) for x in (kv_positions, kv_segment_ids))
    kv_len = jnp.full((b,), s, jnp.int32) if kv_lengths is None else jnp.clip(kv_lengths.astype(jnp.int32), 0, s)
    lo, full_lo, full_hi, hi = block_ranges(q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_len, t,
                                             block_q, block_kv)
    tiles, ranges = _tile_ranges(lo, full_lo, full_hi, hi)
    # Keys at index >= kv_lengths (and padding) get a position no query reaches: the kernel's mask is positions
    # and segments only
    hidden = jnp.arange(s_pad)[None, :] >= kv_len[:, None]
    kv_positions = jnp.where(hidden, jnp.iinfo(jnp.int32).max, kv_positions)
    q_meta = jnp.stack([q_positions, q_segment_ids], axis=1)  # [B, 2, T]: one TMA per block
    kv_meta = jnp.stack([kv_positions, kv_segment_ids], axis=1)  # [B, 2, S]

    kernel = functools.partial(_kernel, block_q=block_q, block_kv=block_kv, stages=stages, group=n // kv_heads,
                               qk_scale=_LOG2_E / math.sqrt(h), interpreter_safe=interpreter_safe,
                               interpret=interpret, num_tiles=t_pad // tile_q)
    dtype = q.dtype

    def entry(*refs):
        tiled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
        smem = (plgpu.SMEM((_COMPUTE_WGS, block_q, h_pad), dtype, **tiled),
                plgpu.SMEM((stages, block_kv, h_pad), dtype, **tiled),
                plgpu.SMEM((stages, block_kv, h_pad), dtype, **tiled),
                plgpu.SMEM((_COMPUTE_WGS, 2, block_q), jnp.int32),
                plgpu.SMEM((stages, 2, block_kv), jnp.int32),
                plgpu.SMEM((_COMPUTE_WGS, block_q, block_kv), dtype, **tiled) if interpreter_safe else None)
        loaded = (plgpu.Barrier(num_barriers=_COMPUTE_WGS), plgpu.Barrier(num_barriers=_COMPUTE_WGS),
                  plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                  plgpu.Barrier(num_barriers=stages))
        consumed = (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),) * 2
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, loaded, consumed,
                      plgpu.Barrier(num_arrivals=_COMPUTE_WGS), collective_axes="wg")

    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        grid=(n, t_pad // tile_q, b),
        grid_names=("heads", "q_tile", "batch"),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params("flash_attention_mgpu") if interpret else False,
    )(ranges, tiles, q_meta, kv_meta, q, k, v)
    return out[:, :t, :, :h]


def flash_attention_mgpu(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_lengths=None, *,
                         block_sizes: MosaicFlashBlockSizes | None = None, interpret: bool | None = None,
                         interpreter_safe: bool | None = None) -> jnp.ndarray:
    """Flash attention forward on Mosaic GPU, masked by positions, segment ids and optional kv_lengths.

    Arguments and result as `flash_attention`, for bfloat16 / float16 q, k, v. interpret=None: jax's GPU
    interpreter on a CPU, compiled on a GPU; another backend raises (no fallback). interpreter_safe=None: the form
    the interpreter can run (P through SMEM) when interpreting, FA3's (P in registers) when compiled; True
    compiled runs the interpreted form on the GPU (the `gpu` tests compare the two).
    """
    work = check_shapes(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_lengths)
    if q.dtype not in _DTYPES:
        raise ValueError(f"flash_attention_mgpu takes bfloat16 or float16 q, k, v (wgmma's operand types), got "
                         f"{q.dtype}: cast them, or use flash_attention")
    if not work:
        return jnp.zeros(q.shape, q.dtype)  # no query, or no key: every row sees nothing
    tune = call_shapes("mosaic_flash", q, k.shape[2], k.dtype)
    interpret, interpreter_safe, block_sizes = settings("flash_attention_mgpu", interpret, interpreter_safe,
                                                        block_sizes, MosaicFlashBlockSizes, tune)
    args = (q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_lengths)
    return launch(functools.partial(_flash_attention_mgpu, *args, block_sizes=block_sizes, interpret=interpret,
                                    interpreter_safe=interpreter_safe), interpret)

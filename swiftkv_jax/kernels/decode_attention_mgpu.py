"""Few-query (decode) attention over a dense or paged KV cache on Mosaic GPU (Pallas `plgpu`, Hopper).

Contract: `decode_attention`'s (decode_attention.py; positions decide: query t of sequence b sees key s iff
s < lengths[b] and s <= q_positions[b, t]; -1 sees nothing and gets zeros; scale 1/sqrt(H) inside;
`return_residuals` gives the fp32 residuals that `merge_partials` combines), with the dense cache in the model's own
layout, k_cache / v_cache [B, K, S, H] (the static engine's cache; `decode_attention` takes [B, S, K, H], so the
engine transposes the whole cache for it at every step), so a K or V tile of one KV head is one contiguous TMA
copy and nothing is copied per call (S a multiple of 8: TMA copies whole 8-row tiles; `init_cache` allocates
so); and `paged_attention`'s contract for the pool [K, P, page_size, H] with block tables (`paged_attention_mgpu`:
a tile arrives by one TMA copy per page). bfloat16 / float16 caches are wgmma's operands as they are (q cast to
their dtype); int8 / float8_e4m3fn caches (per-layer or per-token-head scales, kv_quant's formats) are read in
place, 1 byte an element, and each tile is converted in SMEM to q's 16-bit dtype (exact: int8 and e4m3 values are
bf16 values; e4m3 goes through fp32, Hopper converts it to fp16 only). The scales stay out of the tiles: a key's K
scale multiplies its column of the scores, its V scale its column of P (per-layer: K's on the scores' scale, V's
on the output), so the conversion is a cast and the products stay on the tensor cores. Per-token scales arrive
by TMA beside their tiles; jax's lowering moves multiples of 128 bytes a copy, so paged per-token scales need
pages of at least 32 keys (a multiple of 32; refused otherwise, with the fix).

Structure: one CTA (one warpgroup) per (sequence b, KV head k and block of 64 query rows, split j of the keys).
The rows of a KV head are r = t * G + g (as in split_k.py), padded to 64 (wgmma's M): every K/V tile is read once
for all G heads and T tokens. The warpgroup streams its split's K and V tiles (block_kv keys) by TMA through
`max_concurrent_steps` SMEM slots, issuing the load of step i + slots as soon as step i's products are done, so
the copies run ahead of the arithmetic; S = Q K^T by wgmma from SMEM (K^T as `plgpu.transpose_ref` of the tile,
as jax's attention_mgpu), an online softmax in registers (fp32, base 2), P V by wgmma (P from registers and
accumulated in place, FA3's form; `interpreter_safe`: P through SMEM into a fresh accumulator, the form jax
0.10.2's interpreter can run). Each split writes its unnormalised output (of a single row block, only its real
rows rounded up to 8: a decode step's 4 of Llama's 64, so XLA merges an eighth of the bytes), max and sum, through
an SMEM scope opened after the loop's has closed (the fp32 tile reuses the slots' bytes); `merge_partials`
combines the splits in XLA.

Cost follows the context: a CTA reads keys only up to its rows' largest limit (min(position + 1, length)); keys
below their smallest limit need no mask, so a decode step masks its last block only. A split past the context
reads nothing. The last block of a dense cache whose S is not a multiple of block_kv is read at S - block_kv
(inside the array) and its keys before the block's own start are masked. In a masked block the V rows past the
keys anyone sees are zeroed in SMEM before P V: they may hold anything (a freed page's or slot's stale values,
NaN included), and 0 * NaN would reach the output. num_splits 0 (the default) picks enough splits for about
`ctas_per_sm` (2) CTAs per SM.

Interpreted on the CPU (jax's GPU interpret mode, with mosaic_launch.py's transposed-operand rule) the kernel
code is the same except register layouts (jax 0.10.2's interpreter has no rule for `layout_cast` or `plgpu.load`)
and the P V form. What the interpreter ignores (layouts, SMEM tiling, TMA copy sizes, wgmma shapes, conversions)
jax's Mosaic GPU lowering checks, and it runs on a CPU too (`jit(...).trace(...).lower(lowering_platforms=
("cuda",))`, tested). On an H200 (2026-11-24 and -25, benchmarks/kernels.py, impls "mosaic*") the dense kernel
read at 94-104% of the measured bandwidth at 32 x 32K and 128 x 4K-32K, the fastest the static engine can run
there, and at 55-74% at 32 x 4K-8K, where a fixed cost of ~0.1 ms a call not yet located (the next run's
--profile-at rows) left XLA level or ahead; over int8 / FP8 caches it reached 30-43% (the SMEM conversion), behind
XLA over the same caches; the paged kernel trailed the Triton one (0.26 against 0.19 ms at 32 x 4K, pages of 16).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from swiftkv_jax.kernels.mosaic_launch import SMEM_BYTES, accumulate_pv, interpret_params, launch, settings
from swiftkv_jax.kernels.split_k import (MASK_VALUE, AttentionResiduals, check_pages, check_queries, check_scales,
                                         merge_partials, no_keys, normalize)
from swiftkv_jax.kernels.tuning import call_shapes

__all__ = ["MosaicDecodeBlockSizes", "decode_attention_mgpu", "paged_attention_mgpu", "resident_ctas"]

_LOG2_E = math.log2(math.e)
_ROWS = 64  # query rows per CTA: wgmma's M for one warpgroup
HEAD_ALIGN = 64  # head dim: the 128-byte swizzle's 64 elements of a 16-bit type
_DTYPES = (jnp.bfloat16, jnp.float16)
_QUANTIZED = (jnp.int8, jnp.float8_e4m3fn)  # read in place by TMA, converted to q's 16-bit dtype in SMEM
_TILE_ROWS = 8  # a TMA copy into a tiled SMEM tile covers whole 8-row tiles of its GMEM array
_SCALE_COPY_KEYS = 32  # fp32 scales in one TMA copy: jax's Mosaic GPU lowering moves multiples of 128 bytes
_DEFAULT_SMS = 132  # H100 SXM; the device's own count is used when it has one
_SMEM_ALIGNMENT = 1024  # jax's Mosaic GPU lowering rounds each SMEM buffer up to this
# jax's lowering reserves CompilerParams.reduction_scratch_bytes (default 2048) of SMEM in any kernel with a
# reduction, for one across warps. This kernel's reduce rows of the WGMMA layout, each within its warp: none reserved
_REDUCTION_SCRATCH = 0
_MBARRIER_BYTES = 8  # each barrier's SMEM, after the scratch (jax's Mosaic GPU launch)
SM_SMEM_BYTES = 228 * 1024  # Hopper's shared memory per SM, which resident CTAs share
_CTA_RESERVED_SMEM = 1024  # what the hardware reserves of it for each resident CTA


def _aligned(n: int) -> int:
    return -(-n // _SMEM_ALIGNMENT) * _SMEM_ALIGNMENT


def resident_ctas(smem_bytes: int) -> int:
    """How many CTAs of `smem_bytes` each fit one Hopper SM at once (shared memory decides here: 128 threads a
    CTA)."""
    return SM_SMEM_BYTES // (smem_bytes + _CTA_RESERVED_SMEM)


def _is_int(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)


@dataclasses.dataclass(frozen=True)
class MosaicDecodeBlockSizes:
    """Tile sizes of the Mosaic GPU decode kernel, validated on construction (hashable: a static jit argument).

    block_kv: keys per pipeline step, a multiple of 64 in [64, 256].
    max_concurrent_steps: SMEM slots of K and V tiles in flight (>= 2).
    num_splits: programs per sequence and KV head along the keys; 0 picks enough for about `ctas_per_sm` CTAs
      per SM (a shape-free setting, which the tuning table keeps).
    ctas_per_sm: what num_splits 0 aims at (>= 1): more splits hide each CTA's start and merge behind others' copies
      but add partial results for XLA to merge.
    SMEM per CTA (`smem_bytes`) is about 2 * (64 + 2 * slots * block_kv) * H bytes over a 16-bit cache (an 8-bit
    one takes 1 byte a slot element, plus the two converted 16-bit tiles and the keys' scales); the epilogue's fp32
    output tile reuses the slots' bytes. At H = 128, 64-key blocks in 2 slots (3 over an 8-bit cache) let two CTAs
    share an SM (`resident_ctas`), so one's start and epilogue overlap the other's copies; 128-key blocks, one. A
    config that does not fit a block raises before launching.
    """

    block_kv: int = 128
    max_concurrent_steps: int = 2
    num_splits: int = 0
    ctas_per_sm: int = 2

    def __post_init__(self):
        if not _is_int(self.block_kv) or self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"MosaicDecodeBlockSizes.block_kv must be a multiple of 64 in [64, 256], "
                             f"got {self.block_kv!r}")
        if not _is_int(self.max_concurrent_steps) or self.max_concurrent_steps < 2:
            raise ValueError(f"MosaicDecodeBlockSizes.max_concurrent_steps must be an int >= 2, "
                             f"got {self.max_concurrent_steps!r}")
        if not _is_int(self.num_splits) or self.num_splits < 0:
            raise ValueError(f"MosaicDecodeBlockSizes.num_splits must be an int >= 0 (0: automatic), "
                             f"got {self.num_splits!r}")
        if not _is_int(self.ctas_per_sm) or self.ctas_per_sm < 1:
            raise ValueError(f"MosaicDecodeBlockSizes.ctas_per_sm must be an int >= 1, got {self.ctas_per_sm!r}")

    def smem_bytes(self, head_dim: int, itemsize: int = 2, p_in_smem: bool = True) -> int:
        """Shared memory of one CTA over a cache of `itemsize` bytes an element, as jax's Mosaic GPU lowering
        requests it: the scratch, each buffer rounded up to 1 KiB and the larger of two scopes, then the barriers
        (Q's, the limits', one a slot for K and one for V). The loop's scope: the Q tile, the K and V slots, the
        rows' limits, P's tile (only the `interpreter_safe` form has one: `p_in_smem`), for an 8-bit cache the
        converted K and V tiles and the slots' per-token scales (counted for per-layer scales too), and the
        scratch a reduction reserves (none). The epilogue's (`_write_partials`): the fp32 output tile, maxes and
        sums."""
        slots = self.max_concurrent_steps * self.block_kv
        loop = (_aligned(2 * _ROWS * head_dim) + 2 * _aligned(itemsize * slots * head_dim) + _aligned(4 * _ROWS)
                + (_aligned(2 * _ROWS * self.block_kv) if p_in_smem else 0) + _REDUCTION_SCRATCH)
        if itemsize == 1:
            loop += 2 * _aligned(2 * self.block_kv * head_dim) + 2 * _aligned(4 * slots)
        barriers = (2 + 2 * self.max_concurrent_steps) * _MBARRIER_BYTES
        return max(loop, _aligned(4 * _ROWS * head_dim) + 2 * _aligned(4 * _ROWS)) + barriers

    def splits(self, num_keys: int, ctas: int, num_sms: int = _DEFAULT_SMS) -> int:
        """How many splits a launch of `ctas` CTAs per split uses over `num_keys` keys (each split >= one block)."""
        blocks = pl.cdiv(num_keys, self.block_kv)
        wanted = self.num_splits or pl.cdiv(self.ctas_per_sm * num_sms, ctas)
        return max(1, min(wanted, blocks))


def _cta_position(row_blocks: int):
    """(sequence, KV head, block of 64 query rows, split) of this CTA, from the grid (batch, rows, split)."""
    rows_id = lax.axis_index("rows")
    return (lax.axis_index("batch"), lax.div(rows_id, jnp.array(row_blocks, rows_id.dtype)),
            lax.rem(rows_id, jnp.array(row_blocks, rows_id.dtype)), lax.axis_index("split"))


def _kernel(ranges_ref, limits_ref, q_ref, k_ref, v_ref, *refs, block_kv: int, stages: int, row_blocks: int,
            split_len: int, num_keys: int, page_size: int | None, qk_scale: float,
            scales: str | None, interpreter_safe: bool, interpret: bool):
    """One CTA's pass over its keys: rows [64 * row_block, + 64) of KV head `kv_head` of sequence `batch`, keys
    of split `split`; returns its unnormalised output, maxes (base 2) and sums in registers (`_write_partials`
    stores them). refs: the scales (`scales` "token": k_scale, v_scale laid out as the cache minus H; "layer": one
    [2] array of the per-layer K and V scales, V's applied outside), the block tables if paged, then the scoped
    SMEM and barriers."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    num_scale_refs = {None: 0, "layer": 1, "token": 2}[scales]
    scale_refs, (*tables, scoped) = refs[:num_scale_refs], refs[num_scale_refs:]

    # Register layouts matter to the Mosaic GPU compiler only; jax 0.10's interpreter has no rule for layout_cast
    # or plgpu.load, so interpreted code reads refs plainly
    layout_cast = (lambda x, layout: x) if interpret else plgpu.layout_cast  # noqa: E731
    load = (lambda ref, layout: ref[...]) if interpret else (  # noqa: E731
        lambda ref, layout: plgpu.load(ref, (), layout=layout))
    (q_smem, k_smem, v_smem, limit_smem, p_smem, kd_smem, vd_smem, ks_smem, vs_smem), \
        (q_barrier, limit_barrier), k_barriers, v_barriers = scoped
    if scales == "layer":  # K's per-layer scale multiplies the scores (V's multiplies the output, outside)
        qk_scale = qk_scale * scale_refs[0][0]
    batch, kv_head, row_block, split = _cta_position(row_blocks)
    dtype, head_dim = q_ref.dtype, q_ref.shape[3]
    row_slice = pl.ds(row_block * _ROWS, _ROWS)

    # Keys [start, end) of this split that some row sees; blocks [0, num_full) of them every row sees
    hi, low = ranges_ref[batch, row_block, 0], ranges_ref[batch, row_block, 1]
    start = split * split_len
    end = jnp.minimum(start + split_len, hi)
    num_blocks = jnp.maximum(end - start + block_kv - 1, 0) // block_kv
    num_full = jnp.clip(lax.div(jnp.maximum(low - start, 0), jnp.array(block_kv, low.dtype)), 0, num_blocks)

    def block_start(i):  # the block's first key, and where it is read (dense: inside the cache, the last may shift)
        nominal = start + i * block_kv
        return nominal, (nominal if page_size else jnp.minimum(nominal, num_keys - block_kv))

    def copy_tiles(i, slot):
        if not page_size:
            keys = pl.ds(block_start(i)[1], block_kv)
            plgpu.copy_gmem_to_smem(k_ref.at[batch, kv_head, keys], k_smem.at[slot], k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[batch, kv_head, keys], v_smem.at[slot], v_barriers.at[slot])
            if scales == "token":  # each key's scale beside its tile, on the tile's barrier
                plgpu.copy_gmem_to_smem(scale_refs[0].at[batch, kv_head, keys], ks_smem.at[slot], k_barriers.at[slot])
                plgpu.copy_gmem_to_smem(scale_refs[1].at[batch, kv_head, keys], vs_smem.at[slot], v_barriers.at[slot])
            return
        # Paged: one copy per page (or part of a page) of the block, each arriving on the slot's barrier. Copies
        # past the split's last needed key re-read the copy that holds it (L2, not HBM): their keys are masked
        copy_rows = min(page_size, block_kv)
        last = lax.div(end - 1, jnp.array(copy_rows, end.dtype)) * copy_rows
        for c in range(block_kv // copy_rows):
            key = jnp.minimum(block_start(i)[0] + c * copy_rows, last)
            page = jnp.clip(tables[0][batch, lax.div(key, jnp.array(page_size, key.dtype))], 0, k_ref.shape[1] - 1)
            src = (kv_head, page, pl.ds(lax.rem(key, jnp.array(page_size, key.dtype)), copy_rows))
            dst = (slot, pl.ds(c * copy_rows, copy_rows))
            plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[dst], k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[dst], v_barriers.at[slot])
            if scales == "token":
                plgpu.copy_gmem_to_smem(scale_refs[0].at[src], ks_smem.at[dst], k_barriers.at[slot])
                plgpu.copy_gmem_to_smem(scale_refs[1].at[src], vs_smem.at[dst], v_barriers.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[batch, kv_head, row_slice], q_smem, q_barrier)
    plgpu.copy_gmem_to_smem(limits_ref.at[batch, row_slice], limit_smem, limit_barrier)
    for i in range(stages):
        pl.when(i < num_blocks)(functools.partial(copy_tiles, i, i))
    rows = plgpu.Layout.WGMMA.reduce(1)
    iota = (lambda shape, dim, layout=plgpu.Layout.WGMMA: lax.broadcasted_iota(jnp.int32, shape, dim)  # noqa: E731
            if interpret else plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout))
    columns = plgpu.Layout.WGMMA.reduce(0)
    plgpu.barrier_wait(limit_barrier)
    limit = layout_cast(limit_smem[...], rows)
    plgpu.barrier_wait(q_barrier)
    shape = (_ROWS, block_kv)

    def operand(tile, dequantized, read_at=None):
        """The tile wgmma reads: the slot itself (a 16-bit cache), or its values converted to q's dtype in the
        dequantised tile (exact: int8 and e4m3 values are bf16 / fp16 values; their scales multiply the scores and
        P). read_at given (a masked block): rows past the keys anyone sees are zeroed, as they may hold anything
        (a freed page's NaN) and 0 * NaN would reach the output."""
        if dequantized is None and read_at is None:
            return tile
        layout = plgpu.Layout.WGMMA if dequantized is None else plgpu.Layout.WGMMA_UPCAST_2X
        x = load(tile, layout)
        if dequantized is not None:  # e4m3 converts to bf16 through fp32 (Hopper converts it to fp16 only)
            x = (x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x).astype(dtype)
        if read_at is not None:
            x = jnp.where(iota(x.shape, 0, layout) + read_at < end, x, jnp.zeros_like(x))
        target = tile if dequantized is None else dequantized
        target[...] = x
        plgpu.commit_smem()
        return target

    def token_scales(scales_smem, slot):  # [block_kv] per-key scales, broadcast over the rows
        return lax.broadcast_in_dim(load(scales_smem.at[slot], columns), shape, [1])

    def step(i, carry, *, masked: bool):
        acc, m_prev, l_prev = carry
        slot = lax.rem(i, jnp.array(stages, i.dtype))
        nominal, read_at = block_start(i)
        plgpu.barrier_wait(k_barriers.at[slot])
        k_tile = operand(k_smem.at[slot], kd_smem)

        def compute_qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(compute_qk, plgpu.ACC(shape, jnp.float32)) * qk_scale  # base-2 logits
        if scales == "token":
            s = s * token_scales(ks_smem, slot)
        if masked:
            key = iota(shape, 1) + read_at
            mask = (key >= nominal) & (key < lax.broadcast_in_dim(limit, shape, [0]))
            s = jnp.where(mask, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        alpha = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_next, shape, [0]))
        if masked:  # a row that has seen no visible key yet keeps zero weight
            p = jnp.where(mask, p, 0.0)
        l_next = l_prev * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_barriers.at[slot])
        if scales == "token":  # P V with each key's V scale on its column of P (a masked key's may be NaN)
            p = p * token_scales(vs_smem, slot)
            if masked:
                p = jnp.where(mask, p, 0.0)
        v_tile = operand(v_smem.at[slot], vd_smem, read_at if masked else None)
        acc = accumulate_pv(acc, p.astype(dtype), v_tile, p_smem if interpreter_safe else None)
        # Both products of step i are complete: its slot takes step i + stages
        pl.when(i + stages < num_blocks)(lambda: copy_tiles(i + stages, slot))
        return acc, m_next, l_next

    carry = (layout_cast(jnp.zeros((_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
             layout_cast(jnp.full((_ROWS,), MASK_VALUE, jnp.float32), rows),
             layout_cast(jnp.zeros((_ROWS,), jnp.float32), rows))
    carry = lax.fori_loop(0, num_full, functools.partial(step, masked=False), carry)
    return lax.fori_loop(num_full, num_blocks, functools.partial(step, masked=True), carry)


def _write_partials(o_ref, m_ref, l_ref, acc, m, total, o_smem, m_smem, l_smem, *, row_blocks: int, out_rows: int):
    """A CTA's epilogue: its output, maxes and sums through SMEM to GMEM by TMA. Its SMEM is a scope of its own,
    opened after the loop's has closed, so the fp32 output tile reuses the K / V slots' bytes: a CTA needs the larger
    of the two scopes, not their sum (with 64-key blocks in two slots, two CTAs fit an SM)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    batch, kv_head, row_block, split = _cta_position(row_blocks)
    o_smem[...] = acc
    m_smem[...] = m
    l_smem[...] = total
    plgpu.commit_smem()
    out_at = (split, batch, kv_head, pl.ds(row_block * _ROWS, _ROWS))
    # the output's first out_rows rows (whole 8-row tiles): a decode's T * G real rows, not wgmma's 64
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, out_rows)],
                            o_ref.at[split, batch, kv_head, pl.ds(row_block * out_rows, out_rows)])
    plgpu.copy_smem_to_gmem(m_smem, m_ref.at[out_at])
    plgpu.copy_smem_to_gmem(l_smem, l_ref.at[out_at])
    plgpu.wait_smem_to_gmem(0)


def _row_ranges(limits, row_blocks: int, rows: int):
    """[B, row_blocks, 2] int32 per block of 64 rows: (largest limit: keys to read, smallest limit of its real
    rows: keys every row sees). limits [B, R_pad]; rows past `rows` are padding."""
    b = limits.shape[0]
    real = (jnp.arange(row_blocks * _ROWS) < rows)[None, :]
    by_block = lambda x: x.reshape(b, row_blocks, _ROWS)  # noqa: E731
    hi = jnp.max(by_block(jnp.where(real, limits, 0)), axis=2)
    low = jnp.min(by_block(jnp.where(real, limits, jnp.iinfo(jnp.int32).max)), axis=2)
    return jnp.stack([hi, jnp.minimum(low, hi)], axis=2).astype(jnp.int32)


def _num_sms() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or _DEFAULT_SMS)


_STATIC = ("block_sizes", "interpret", "interpreter_safe", "num_sms")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode_attention_mgpu(q, k_cache, v_cache, lengths, q_positions, k_scale=None, v_scale=None, *,
                           block_sizes: MosaicDecodeBlockSizes, interpret: bool, interpreter_safe: bool,
                           num_sms: int) -> AttentionResiduals:
    num_keys, block_kv = k_cache.shape[2], block_sizes.block_kv
    token_scales = k_scale is not None and k_scale.ndim > 0
    # A cache shorter than one block, or a small one of a length TMA cannot tile (at most the default block's, which
    # the defaults pad as a short cache: a tuned smaller block must not refuse it), is padded: a copy, of a cache
    # this small only.
    padded = block_kv if num_keys < block_kv else -(-num_keys // _TILE_ROWS) * _TILE_ROWS
    if padded != num_keys:
        pad = ((0, 0), (0, 0), (0, padded - num_keys), (0, 0))
        if num_keys >= block_kv:  # the last tile ends aligned; the keys past S stay past every (clipped) length
            lengths, num_keys = jnp.minimum(lengths, num_keys), padded
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
        if token_scales:
            k_scale, v_scale = (jnp.pad(x, pad[:3]) for x in (k_scale, v_scale))
    return _split_k(q, lengths, q_positions, (k_cache, v_cache), (k_scale, v_scale), (), kv_heads=k_cache.shape[1],
                    num_keys=num_keys, page_size=None, block_sizes=block_sizes, interpret=interpret,
                    interpreter_safe=interpreter_safe, num_sms=num_sms)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _paged_attention_mgpu(q, k_pages, v_pages, block_tables, lengths, q_positions, k_scale=None, v_scale=None, *,
                          block_sizes: MosaicDecodeBlockSizes, interpret: bool, interpreter_safe: bool,
                          num_sms: int) -> AttentionResiduals:
    page_size = k_pages.shape[2]
    return _split_k(q, lengths, q_positions, (k_pages, v_pages), (k_scale, v_scale),
                    (block_tables.astype(jnp.int32),), kv_heads=k_pages.shape[0],
                    num_keys=block_tables.shape[1] * page_size, page_size=page_size, block_sizes=block_sizes,
                    interpret=interpret, interpreter_safe=interpreter_safe, num_sms=num_sms)


def _compute_dtype(q_dtype, cache_dtype):
    """The dtype of wgmma's operands: a 16-bit cache's own; over a quantised cache, q's if 16-bit, else bf16."""
    if cache_dtype in _DTYPES:
        return jnp.dtype(cache_dtype)
    return jnp.dtype(q_dtype) if q_dtype in _DTYPES else jnp.dtype(jnp.bfloat16)


def _tiled(itemsize: int, row_bytes: int = 128):
    """SMEM transforms of a tile whose rows are row_bytes long (any 16- or 32-bit tile here: H and block_kv are
    multiples of 64): 8-row tiles, the widest swizzle the rows allow (an 8-bit cache's rows of H = 64: 64 bytes)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    swizzle = next(x for x in (128, 64, 32) if row_bytes % x == 0)
    return dict(transforms=(plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))


def _split_k(q, lengths, q_positions, kv, scales, tables, *, kv_heads: int, num_keys: int, page_size: int | None,
             block_sizes: MosaicDecodeBlockSizes, interpret: bool, interpreter_safe: bool,
             num_sms: int) -> AttentionResiduals:
    """The launch shared by the dense cache (kv: k, v [B, K, S', H] with S' >= block_kv; scales [B, K, S'']) and
    the paged pool (k, v [K, P, page_size, H], scales [K, P, page_size]; tables: the block tables [B, M]): query
    rows, row limits, grid, merge of the splits. scales: (None, None), both () per layer, or both per token."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, t, n, h = q.shape
    g = n // kv_heads
    storage = kv[0].dtype
    dtype = _compute_dtype(q.dtype, storage)
    quantized = storage != dtype
    mode = None if scales[0] is None else ("token" if scales[0].ndim else "layer")
    scale_inputs = (jnp.stack(scales),) if mode == "layer" else scales if mode == "token" else ()
    block_kv, stages = block_sizes.block_kv, block_sizes.max_concurrent_steps
    rows = t * g
    row_blocks = pl.cdiv(rows, _ROWS)
    padded_rows = row_blocks * _ROWS
    # Rows of the output partials a CTA writes: all 64 of a row block when there are several, else the real rows
    # rounded up to a TMA tile (a decode step's G = 4 rows: 8, an eighth of the bytes for XLA to merge). The
    # maxes and sums keep 64 a block: 8 fp32 would be a 32-byte copy, below what the lowering moves.
    out_rows = _ROWS if row_blocks > 1 else pl.cdiv(rows, _TILE_ROWS) * _TILE_ROWS
    num_splits = block_sizes.splits(num_keys, b * kv_heads * row_blocks, num_sms)
    split_len = pl.cdiv(pl.cdiv(num_keys, num_splits), block_kv) * block_kv
    num_splits = pl.cdiv(num_keys, split_len)

    # Rows of one KV head: r = t * G + g (a copy of q only); a row's limit: keys < it are visible to it
    q_rows = jnp.einsum("BTKGH->BKTGH", q.astype(dtype).reshape(b, t, kv_heads, g, h)).reshape(b, kv_heads, rows, h)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    limit = jnp.minimum(q_positions.astype(jnp.int32) + 1, lengths.astype(jnp.int32)[:, None])
    limit = jnp.repeat(jnp.clip(limit, 0, num_keys), g, axis=1)
    limit = jnp.pad(limit, ((0, 0), (0, padded_rows - rows)))
    ranges = _row_ranges(limit, row_blocks, rows)

    kernel = functools.partial(_kernel, block_kv=block_kv, stages=stages, row_blocks=row_blocks,
                               split_len=split_len, num_keys=max(num_keys, block_kv),
                               page_size=page_size, qk_scale=_LOG2_E / math.sqrt(h), scales=mode,
                               interpreter_safe=interpreter_safe, interpret=interpret)

    def entry(*refs):
        *inputs, o_ref, m_ref, l_ref = refs
        slots = plgpu.SMEM((stages, block_kv, h), storage, **_tiled(storage.itemsize, h * storage.itemsize))
        smem = (plgpu.SMEM((_ROWS, h), dtype, **_tiled(2)),
                slots,
                slots,
                plgpu.SMEM((_ROWS,), jnp.int32),
                plgpu.SMEM((_ROWS, block_kv), dtype, **_tiled(2)) if interpreter_safe else None,
                # a quantised cache: the tiles wgmma reads (converted), and each key's scales beside its tile
                *(plgpu.SMEM((block_kv, h), dtype, **_tiled(2)) if quantized else None for _ in "kv"),
                *(plgpu.SMEM((stages, block_kv), jnp.float32) if mode == "token" else None for _ in "kv"))
        copies = block_kv // min(page_size, block_kv) if page_size else 1  # TMA copies a K (V) tile arrives by
        tile_barriers = plgpu.Barrier(num_arrivals=copies * (2 if mode == "token" else 1), num_barriers=stages)
        partials = pl.run_scoped(lambda *scoped: kernel(*inputs, scoped), smem, (plgpu.Barrier(), plgpu.Barrier()),
                                 tile_barriers, tile_barriers)
        pl.run_scoped(lambda *out_smem: _write_partials(o_ref, m_ref, l_ref, *partials, *out_smem,
                                                        row_blocks=row_blocks, out_rows=out_rows),
                      plgpu.SMEM((_ROWS, h), jnp.float32, **_tiled(4)), plgpu.SMEM((_ROWS,), jnp.float32),
                      plgpu.SMEM((_ROWS,), jnp.float32))

    stats = jax.ShapeDtypeStruct((num_splits, b, kv_heads, padded_rows), jnp.float32)
    outs, maxes, sums = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((num_splits, b, kv_heads, row_blocks * out_rows, h), jnp.float32), stats,
                  stats),
        grid=(b, kv_heads * row_blocks, num_splits),
        grid_names=("batch", "rows", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=_REDUCTION_SCRATCH),
        interpret=interpret_params("decode_attention_mgpu") if interpret else False,
    )(ranges, limit, q_rows, *kv, *scale_inputs, *tables)

    # base-2 maxes back to natural units; a row that saw no key keeps the contract's MASK_VALUE
    maxes, sums = maxes[..., :row_blocks * out_rows], sums[..., :row_blocks * out_rows]
    maxes = jnp.where(sums > 0, maxes / _LOG2_E, MASK_VALUE)
    out, m, total = merge_partials(outs, maxes, sums)
    if mode == "layer":  # attention is linear in V: its per-layer scale multiplies the output
        out = out * scales[1]

    def to_heads(x):  # [B, K, R_pad, ...] -> [B, T, N, ...]
        x = x[:, :, :rows].reshape(b, kv_heads, t, g, *x.shape[3:])
        return jnp.moveaxis(x, 2, 1).reshape(b, t, n, *x.shape[4:])

    return AttentionResiduals(to_heads(out), to_heads(m), to_heads(total))


def decode_attention_mgpu(q, k_cache, v_cache, lengths, q_positions, *,
                          block_sizes: MosaicDecodeBlockSizes | None = None, interpret: bool | None = None,
                          interpreter_safe: bool | None = None, return_residuals: bool = False, k_scale=None,
                          v_scale=None):
    """Attention of a few (or many) query tokens over a dense KV cache, by the Mosaic GPU kernel.

    Args:
      q: ``[B, T, N, H]`` queries (not pre-scaled), cast to the cache's dtype (over a quantised cache: kept if
        bfloat16 / float16, else cast to bfloat16).
      k_cache, v_cache: ``[B, K, S, H]`` bfloat16, float16, int8 or float8_e4m3fn (the model's cache layout),
        N % K == 0, H a multiple of 64.
      lengths: ``[B]`` int; keys with index < lengths[b] are valid.
      q_positions: ``[B, T]`` int; query t sees keys with index <= q_positions[b, t] (none if negative).
      block_sizes: ``MosaicDecodeBlockSizes``; default ``MosaicDecodeBlockSizes()``.
      interpret: None = jax's GPU interpreter on a CPU, compiled on a GPU; another backend raises (no fallback).
      interpreter_safe: None = the form the interpreter runs (P through SMEM) when interpreting, FA3's (P in
        registers) compiled; True compiled runs the interpreted form on the GPU (the `gpu` tests compare them).
      return_residuals: ``AttentionResiduals`` (fp32, unnormalised; ``merge_partials``, ``normalize``).
      k_scale, v_scale: None (a 16-bit cache) or a quantised cache's fp32 scales, both a ``()`` per-layer scale or
        both ``[B, K, S]`` per token and KV head: key s reads ``k_cache[b, k, s].astype(f32) * k_scale[b, k, s]``.

    Returns:
      ``[B, T, N, H]`` in q's dtype (zeros for a query that sees no key), or ``AttentionResiduals``.
    """
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"q must be [B, T, N, H] and k_cache [B, K, S, H], got {q.shape} and {k_cache.shape}")
    b, _, _, h = q.shape
    if v_cache.shape != k_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != h:
        raise ValueError(f"k_cache and v_cache must both be [B={b}, K, S, H={h}] (the model's cache layout), got "
                         f"{k_cache.shape} and {v_cache.shape}")
    if q.shape[2] % k_cache.shape[1]:
        raise ValueError(f"query heads N={q.shape[2]} must be a multiple of KV heads K={k_cache.shape[1]} (k_cache "
                         f"is [B, K, S, H], the model's cache layout; decode_attention takes [B, S, K, H])")
    block_sizes, interpret, interpreter_safe = _settings("decode_attention_mgpu", "mosaic_decode", q, k_cache,
                                                         v_cache, lengths, q_positions, k_cache.shape[1],
                                                         block_sizes, interpret, interpreter_safe, k_scale, v_scale,
                                                         "[B, K, S]")
    small = max(block_sizes.block_kv, MosaicDecodeBlockSizes().block_kv)  # what _decode_attention_mgpu pads
    if k_cache.shape[2] > small and k_cache.shape[2] % _TILE_ROWS:
        raise ValueError(f"decode_attention_mgpu reads the cache by TMA in tiles of {_TILE_ROWS} keys, so its length "
                         f"S must be a multiple of {_TILE_ROWS} (or at most {small}), got S={k_cache.shape[2]}: "
                         f"allocate it so (swiftkv_jax.serving.init_cache does)")
    return _run(_decode_attention_mgpu, (q, k_cache, v_cache, lengths, q_positions), k_scale, v_scale,
                k_cache.shape[2] == 0, block_sizes, interpret, interpreter_safe, return_residuals)


def paged_attention_mgpu(q, k_pages, v_pages, block_tables, lengths, q_positions, *,
                         block_sizes: MosaicDecodeBlockSizes | None = None, interpret: bool | None = None,
                         interpreter_safe: bool | None = None, return_residuals: bool = False, k_scale=None,
                         v_scale=None):
    """Attention of a few (or many) query tokens over a paged KV cache, by the Mosaic GPU kernel.

    The contract of `paged_attention` (paged_attention.py): k_pages, v_pages ``[K, P, page_size, H]`` (one layer's
    pool, bfloat16, float16, int8 or float8_e4m3fn), block_tables ``[B, M]`` (key s of sequence b in page
    ``block_tables[b, s // page_size]`` at offset ``s % page_size``), k_scale / v_scale (a quantised pool's: both
    ``()`` or both ``[K, P, page_size]``, laid out as the pool), lengths, q_positions and the rest as
    `decode_attention_mgpu`. Each K / V tile of block_kv keys (and its scales) arrives by one TMA copy per page
    (page_size a multiple of 8 dividing block_kv below it, a multiple of block_kv above it).
    Table entries past a sequence's last needed page are not followed: the copies
    there re-read the last needed page (clamped to the pool), whose keys are masked.
    """
    check_pages(q, k_pages, v_pages, block_tables)
    block_sizes, interpret, interpreter_safe = _settings("paged_attention_mgpu", "mosaic_paged", q, k_pages,
                                                         v_pages, lengths, q_positions, k_pages.shape[0],
                                                         block_sizes, interpret, interpreter_safe, k_scale, v_scale,
                                                         "[K, P, page_size]")
    page_size, block_kv = k_pages.shape[2], block_sizes.block_kv
    if page_size % _TILE_ROWS or block_kv % page_size if page_size < block_kv else page_size % block_kv:
        raise ValueError(f"paged_attention_mgpu needs page_size a multiple of {_TILE_ROWS} that divides block_kv "
                         f"below it, and a multiple of block_kv above it (a tile is whole pages or part of one, "
                         f"copied by TMA in {_TILE_ROWS}-row tiles), got page_size {page_size} with block_kv "
                         f"{block_kv}: use pages of 16, 32, 64 or 128")
    if k_scale is not None and k_scale.ndim and min(page_size, block_sizes.block_kv) % _SCALE_COPY_KEYS:
        raise ValueError(f"paged_attention_mgpu copies per-token scales a page at a time by TMA, which moves "
                         f"multiples of 128 bytes here (jax's Mosaic GPU lowering), so per-token-head scales need "
                         f"page_size a multiple of {_SCALE_COPY_KEYS}, got {page_size}: use page_size "
                         f"{_SCALE_COPY_KEYS} or more, per-layer scales, or the Triton kernel (paged_attention)")
    return _run(_paged_attention_mgpu, (q, k_pages, v_pages, block_tables, lengths, q_positions), k_scale, v_scale,
                block_tables.shape[1] == 0, block_sizes, interpret, interpreter_safe, return_residuals)


def _run(jitted, args, k_scale, v_scale, empty: bool, block_sizes, interpret, interpreter_safe, return_residuals):
    """Both entry points' launch: args (q first) and the scales (fp32) into `jitted`, or no keys at all."""
    q = args[0]
    if empty:
        residuals = no_keys(q)
    else:
        scales = tuple(None if x is None else jnp.asarray(x, jnp.float32) for x in (k_scale, v_scale))
        residuals = launch(functools.partial(
            jitted, *args, *scales, block_sizes=block_sizes, interpret=interpret, interpreter_safe=interpreter_safe,
            num_sms=_DEFAULT_SMS if interpret else _num_sms()), interpret)
    return residuals if return_residuals else normalize(residuals, q.dtype)


def _settings(what: str, kernel: str, q, k, v, lengths, q_positions, kv_heads: int, block_sizes, interpret,
              interpreter_safe, k_scale, v_scale, scale_layout: str):
    """The checks and settings both entry points share: (block sizes, interpret, interpreter_safe). kernel: the
    tuning table's name ("mosaic_decode", "mosaic_paged"). The scales, if any, are laid out as the cache minus H
    (scale_layout names that)."""
    check_queries(q, kv_heads, lengths, q_positions, triton_head_dim=False)  # H: the rule below
    check_scales(k, v, k_scale, v_scale, k.shape[:3], scale_layout)
    if k.dtype not in _DTYPES + _QUANTIZED or v.dtype != k.dtype:
        raise ValueError(f"{what} takes a bfloat16, float16, int8 or float8_e4m3fn cache (K and V alike), got "
                         f"{k.dtype} / {v.dtype}")
    h = q.shape[3]
    if h % HEAD_ALIGN:
        raise ValueError(f"{what} needs a head dim that is a multiple of {HEAD_ALIGN}, got {h}")
    tune = call_shapes(kernel, q, kv_heads, k.dtype)
    interpret, interpreter_safe, block_sizes = settings(what, interpret, interpreter_safe, block_sizes,
                                                        MosaicDecodeBlockSizes, tune)
    smem = block_sizes.smem_bytes(h, k.dtype.itemsize, p_in_smem=interpreter_safe)
    if smem > SMEM_BYTES:
        raise ValueError(f"{block_sizes} needs {smem} bytes of shared memory at head dim {h}, more than the "
                         f"{SMEM_BYTES} an H100/H200 block has: use a smaller block_kv or fewer steps")
    return block_sizes, interpret, interpreter_safe

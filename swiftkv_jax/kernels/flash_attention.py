"""Prefill flash attention: a Pallas kernel, its plain-jnp reference and its block sizes.

Semantics are those of the model's `xla_attention` (this package imports nothing from the model): a query attends to the
keys of its own segment whose position is <= its own position. Positions, not array indices, decide, so causality is
"bottom-right aligned" when the queries are the last T of S keys (chunked prefill, SwiftKV's later layers), and packed
documents whose positions restart stay apart. On top of that, `kv_lengths [B]` hides the keys at index >= length (a
cache padded past the sequence). Scale is 1/sqrt(D), applied inside. A query with no visible key gets zeros, not NaN.

Algorithm: one program per (query head, query block, sequence); it keeps the query block resident, walks the
KV blocks with an online softmax (fp32 max, sum and accumulator, FlashAttention-2 style, in base 2) and
normalises once at the end. GQA needs no copy of K/V: the BlockSpec maps query head h to KV head h // G, and
the head axis is the fastest grid axis so the G programs reading one KV head run side by side.

Block skipping: before the kernel, a few cheap XLA reductions give, per (sequence, query block), the first
and one-past-last KV block that can hold a visible key (some valid key with position <= the block's largest
query position and a segment id inside the block's range of query segment ids). The kernel loops over that
range only. This is a conservative bound computed from the data, so it never depends on positions being
monotone; the per-element mask inside the loop keeps the result exact. With monotone positions the range is
tight: causal prefill reads about half the KV blocks, packed documents read only their own. Inside it,
`block_ranges` also gives the run of blocks whose every key every query of the block sees (the same segment,
every position <= the block's smallest query position, every index < kv_lengths): those skip the mask (causal
prefill: every block but the diagonal; a chunk over its cached context: the whole context), as the Mosaic kernel
does. Query blocks run last first (longest first under a causal mask), so that short programs fill the last wave.

Backend: a Triton-style `pl.pallas_call` (BlockSpecs, `fori_loop`, `jnp` ops; no Mosaic-GPU-only features).
- It runs in `interpret=True` mode on CPU, so CI checks the very kernel code that runs on the GPU.
- It lowers on JAX 0.10 and 0.11. In 0.10 a pallas_call without `pallas.triton.CompilerParams` is lowered
  with Mosaic GPU, so the params are always passed (`_triton_compiler_params`, guarded for naming changes).
  The Triton backend is deprecated as of JAX 0.11; Mosaic GPU (warpgroup MMA, TMA) is Hopper's native
  path and a later kernel may move there.
- On an H200 (benchmarks/results/gpu-2026-11-24 and -25, at 64 x 64 tiles under 8 warps): 98-106 TFLOP/s causal
  bf16 at 8K-32K, then 146-162 with the unmasked run and the longest-first order, against cuDNN's 429-577; Hopper's
  default is the Mosaic kernel (flash_attention_mgpu.py), this one serves other GPUs. Its block sizes are
  `benchmarks/tune_kernels.py`'s to pick (the `gpu`-marked tests run it compiled); the defaults follow what the
  compiled kernel's layouts showed (`FlashBlockSizes.for_head_dim`).

Forward only (serving prefill): `pl.program_id` is not differentiable; training uses the XLA paths.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from swiftkv_jax.kernels.call_settings import block_sizes_for, interpret_mode
# MASK_VALUE: the kernels' finite "minus infinity": masked logits never give inf - inf = NaN; exp2 of it is 0.
from swiftkv_jax.kernels.split_k import MASK_VALUE, is_power_of_two
from swiftkv_jax.kernels.tuning import call_shapes

_LOG2_E = math.log2(math.e)
_MIN_BLOCK = 16  # Triton's dot needs every matrix dimension >= 16
_MAX_BLOCK = 1024
_VALID_NUM_WARPS = (1, 2, 4, 8, 16, 32)


def _is_int(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)


@dataclasses.dataclass(frozen=True)
class FlashBlockSizes:
    """Tile sizes and launch parameters of the flash-attention kernel, validated on construction.

    block_q / block_k: queries / keys per tile, powers of two in [16, 1024] (Triton tensor shapes must be
    powers of two, its dot needs >= 16). They are shrunk to the sequence lengths when those are shorter.
    num_warps: warps per program (1..32, power of two). num_stages: software-pipelining depth (>= 1).
    Shared memory grows with block_k * head_dim * num_stages: a tuned config must fit the GPU (H200: 227 KiB
    per block), otherwise it fails at launch, after compiling.
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not is_power_of_two(value) or not _MIN_BLOCK <= value <= _MAX_BLOCK:
                raise ValueError(f"FlashBlockSizes.{name} must be a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}], "
                                 f"got {value!r}")
        if not _is_int(self.num_warps) or self.num_warps not in _VALID_NUM_WARPS:
            raise ValueError(f"FlashBlockSizes.num_warps must be one of {_VALID_NUM_WARPS}, got {self.num_warps!r}")
        if not _is_int(self.num_stages) or self.num_stages < 1:
            raise ValueError(f"FlashBlockSizes.num_stages must be an int >= 1, got {self.num_stages!r}")

    @classmethod
    def for_head_dim(cls, head_dim: int) -> FlashBlockSizes:
        """Defaults where the tuning table has no entry: 64 x 64 tiles in one warpgroup (4 warps) for heads of <= 64,
        128-row tiles in two warpgroups (8 warps) for wider ones, 2 stages (96.5 KiB of shared memory at head dim
        128, which fits every GPU since Ampere). Hopper's MMA gives each warp 16 rows: 8 warps over 64 rows computed
        the scores twice and moved P between two layouts through shared memory (benchmarks/triton_static.py reads
        that off the compiled kernel on a CPU); 4 warps over 128 rows spill registers. Not yet timed: a GPU's
        `tune_kernels.py` entry replaces them."""
        if head_dim <= 64:
            return cls(block_q=64, block_k=64, num_warps=4, num_stages=2)
        return cls(block_q=128, block_k=64, num_warps=8, num_stages=2)


def _triton_compiler_params(block_sizes: FlashBlockSizes):
    """`pallas.triton.CompilerParams` (named `TritonCompilerParams` before JAX 0.7); loud if it is gone."""
    try:
        from jax.experimental.pallas import triton as pl_triton
    except ImportError as e:  # removed in some future JAX
        raise NotImplementedError(
            "flash_attention is a Pallas Triton kernel and this JAX has no jax.experimental.pallas.triton; "
            "use attention_impl='xla' or port the kernel to Mosaic GPU") from e
    params = getattr(pl_triton, "CompilerParams", None) or getattr(pl_triton, "TritonCompilerParams", None)
    if params is None:
        raise NotImplementedError("jax.experimental.pallas.triton has no CompilerParams in this JAX version")
    return params(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages)


def flash_attention_reference(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                              kv_lengths=None) -> jnp.ndarray:
    """Plain jnp, fp32 softmax: query t sees key s of its own segment with position <= its own and index <
    kv_lengths. Same arguments and result as `flash_attention` (zeros for a query that sees nothing)."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    visible = ((kv_positions[:, None, :] <= q_positions[:, :, None])
               & (kv_segment_ids[:, None, :] == q_segment_ids[:, :, None]))  # [B, T, S]
    if kv_lengths is not None:
        visible &= (jnp.arange(k.shape[1]) < kv_lengths[:, None])[:, None, :]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * (h ** -0.5)
    mask = visible[:, None, None]
    probs = jnp.where(mask, jax.nn.softmax(jnp.where(mask, logits, MASK_VALUE), axis=-1), 0.0)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v)
    return out.reshape(b, t, n, h)


def _flash_kernel(ranges_ref, kv_len_ref, q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref, q_ref, k_ref, v_ref, o_ref, *,
                  block_k: int, qk_scale: float):
    """One (query head, query block, sequence): online softmax over KV blocks [lo, hi), the mask computed only
    outside the run [full_lo, full_hi) of blocks whose every key every query of the block sees."""
    q = q_ref[...]  # [block_q, D]
    q_pos = q_pos_ref[...]  # [block_q]
    q_seg = q_seg_ref[...]
    kv_len = kv_len_ref[()]
    block_q = q.shape[0]

    def body(j, carry, masked: bool):
        acc, m_prev, l_prev = carry
        keys = pl.ds(j * block_k, block_k)
        k = k_ref[keys, :]  # [block_k, D]
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        logits = logits * qk_scale  # base-2 logits: exp2(x * log2 e) = exp(x)
        if masked:
            kv_index = j * block_k + jnp.arange(block_k)
            mask = ((kv_pos_ref[keys][None, :] <= q_pos[:, None])
                    & (kv_seg_ref[keys][None, :] == q_seg[:, None])
                    & (kv_index < kv_len)[None, :])
            logits = jnp.where(mask, logits, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1))
        p = jnp.exp2(logits - m_next[:, None])
        if masked:  # a row whose keys so far are all masked keeps exactly zero weight
            p = jnp.where(mask, p, 0.0)
        correction = jnp.exp2(m_prev - m_next)
        v = v_ref[keys, :]
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc * correction[:, None] + pv, m_next, l_prev * correction + jnp.sum(p, axis=1)

    carry = (jnp.zeros((block_q, q.shape[1]), jnp.float32),
             jnp.full((block_q,), MASK_VALUE, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    lo, full_lo, full_hi, hi = (ranges_ref[i] for i in range(4))
    carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
    acc, _, denom = lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)
    o_ref[...] = (acc / jnp.where(denom == 0.0, 1.0, denom)[:, None]).astype(o_ref.dtype)


def _blockwise(x, block: int):
    """[B, L] -> [B, L / block, block]."""
    return x.reshape(x.shape[0], -1, block)


def _query_block_extremes(q_positions, q_segment_ids, num_real_q: int, block_q: int):
    """Per (sequence, query block): the smallest and largest position and segment id of its real queries (index <
    num_real_q), [B, nq] each; a block of padding only gets int max / int min."""
    int_max, int_min = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min
    real_q = _blockwise(jnp.arange(q_positions.shape[1])[None, :] < num_real_q, block_q)
    q_pos, q_seg = _blockwise(q_positions, block_q), _blockwise(q_segment_ids, block_q)
    return (jnp.min(jnp.where(real_q, q_pos, int_max), axis=2), jnp.max(jnp.where(real_q, q_pos, int_min), axis=2),
            jnp.min(jnp.where(real_q, q_seg, int_max), axis=2), jnp.max(jnp.where(real_q, q_seg, int_min), axis=2))


def _kv_block_bounds(q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_len, num_real_q: int,
                     block_q: int, block_k: int):
    """Per (sequence, query block): [lo, hi) of the KV blocks that may hold a visible key, [B, nq] int32 each.

    Conservative from the data (no monotonicity assumed): a KV block is read when one of its valid keys has
    position <= the block's largest query position and the blocks' segment-id ranges overlap. Inputs are
    already padded to multiples of the blocks; padded queries (index >= num_real_q) are left out.
    """
    int_max, int_min = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min
    _, q_pos_max, q_seg_min, q_seg_max = _query_block_extremes(q_positions, q_segment_ids, num_real_q, block_q)

    valid_k = _blockwise(jnp.arange(kv_positions.shape[1])[None, :] < kv_len[:, None], block_k)
    k_pos_min = jnp.min(jnp.where(valid_k, _blockwise(kv_positions, block_k), int_max), axis=2)
    k_seg = _blockwise(kv_segment_ids, block_k)
    k_seg_min = jnp.min(jnp.where(valid_k, k_seg, int_max), axis=2)
    k_seg_max = jnp.max(jnp.where(valid_k, k_seg, int_min), axis=2)

    needed = (jnp.any(valid_k, axis=2)[:, None, :]  # [B, nq, nk]
              & (k_pos_min[:, None, :] <= q_pos_max[:, :, None])
              & (k_seg_min[:, None, :] <= q_seg_max[:, :, None])
              & (k_seg_max[:, None, :] >= q_seg_min[:, :, None]))
    num_k_blocks = needed.shape[2]
    any_needed = jnp.any(needed, axis=2)
    lo = jnp.argmax(needed, axis=2)
    hi = num_k_blocks - jnp.argmax(needed[:, :, ::-1], axis=2)
    return (jnp.where(any_needed, lo, 0).astype(jnp.int32),
            jnp.where(any_needed, hi, 0).astype(jnp.int32))


def block_ranges(q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_len, num_real_q: int,
                  block_q: int, block_kv: int):
    """Per (sequence, query block of block_q): lo, full_lo, full_hi, hi (KV block indices, [B, nq] int32 each)
    with lo <= full_lo <= full_hi <= hi. [lo, hi) holds every KV block with a key some query of the block may see
    (flash_attention's bound); [full_lo, full_hi) is a run of blocks every key of which every query of the block
    sees. A block with no real query gets lo = hi = 0. Inputs are padded to the blocks."""
    lo, hi = _kv_block_bounds(q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_len, num_real_q,
                              block_q, block_kv)
    q_pos_min, _, q_seg_min, q_seg_max = _query_block_extremes(q_positions, q_segment_ids, num_real_q, block_q)
    valid_k = _blockwise(jnp.arange(kv_positions.shape[1])[None, :] < kv_len[:, None], block_kv)
    k_pos_max = jnp.max(_blockwise(kv_positions, block_kv), axis=2)
    k_seg = _blockwise(kv_segment_ids, block_kv)
    k_seg_min, k_seg_max = jnp.min(k_seg, axis=2), jnp.max(k_seg, axis=2)
    full = (jnp.all(valid_k, axis=2)[:, None, :]  # [B, nq, nk]
            & (k_pos_max[:, None, :] <= q_pos_min[:, :, None])
            & (k_seg_min == k_seg_max)[:, None, :] & (q_seg_min == q_seg_max)[:, :, None]
            & (k_seg_min[:, None, :] == q_seg_min[:, :, None]))
    num_k = full.shape[2]
    blocks = jnp.arange(num_k)
    in_range = (blocks[None, None, :] >= lo[:, :, None]) & (blocks[None, None, :] < hi[:, :, None])
    full &= in_range
    any_full = jnp.any(full, axis=2)
    full_lo = jnp.where(any_full, jnp.argmax(full, axis=2), hi)
    # the run starting at full_lo: up to the first block after it that is not full
    not_full_after = (~full) & (blocks[None, None, :] > full_lo[:, :, None])
    full_hi = jnp.where(any_full, jnp.where(jnp.any(not_full_after, axis=2), jnp.argmax(not_full_after, axis=2),
                                            num_k), hi)
    full_hi = jnp.minimum(full_hi, hi)
    return lo, full_lo.astype(jnp.int32), full_hi.astype(jnp.int32), hi


def pad_axis(x, axis: int, size: int, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _round_block(block: int, length: int) -> int:
    """The configured block, shrunk to the smallest power of two >= length (and >= 16) for short inputs."""
    return min(block, max(_MIN_BLOCK, pl.next_power_of_2(length)))


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def _flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_lengths, *,
                     block_sizes: FlashBlockSizes, interpret: bool):
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    group = n // kv_heads
    block_q, block_k = _round_block(block_sizes.block_q, t), _round_block(block_sizes.block_k, s)
    if block_q < block_sizes.block_q:  # a short input's smaller tile: no more warps than its rows give 16 each
        block_sizes = dataclasses.replace(block_sizes, num_warps=min(block_sizes.num_warps, max(4, block_q // 16)))
    t_pad, s_pad = pl.cdiv(t, block_q) * block_q, pl.cdiv(s, block_k) * block_k
    h_pad = max(_MIN_BLOCK, pl.next_power_of_2(h))  # zero columns change no dot product; sliced off after

    q = pad_axis(pad_axis(q, 3, h_pad), 1, t_pad)
    k, v = (pad_axis(pad_axis(x, 3, h_pad), 1, s_pad) for x in (k, v))
    q_positions, q_segment_ids = (pad_axis(x.astype(jnp.int32), 1, t_pad) for x in (q_positions, q_segment_ids))
    kv_positions, kv_segment_ids = (pad_axis(x.astype(jnp.int32), 1, s_pad) for x in (kv_positions, kv_segment_ids))
    kv_len = jnp.full((b,), s, jnp.int32) if kv_lengths is None else jnp.clip(kv_lengths.astype(jnp.int32), 0, s)
    ranges = jnp.stack(block_ranges(q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_len, t,
                                     block_q, block_k), axis=2)  # [B, nq, 4]: lo, full_lo, full_hi, hi

    # Grid (query head, query block, sequence); the head axis varies fastest so a KV head's G readers run together.
    # Query blocks run last first: the GPU starts programs in grid order and under a causal mask the last queries
    # see the most keys, so the longest programs start first and the short ones fill the last wave's tail.
    nq = t_pad // block_q
    per_q_block = pl.BlockSpec((None, None, 4), lambda hq, i, bi: (bi, nq - 1 - i, 0))
    q_rows = pl.BlockSpec((None, block_q), lambda hq, i, bi: (bi, nq - 1 - i))
    kv_rows = pl.BlockSpec((None, s_pad), lambda hq, i, bi: (bi, 0))
    kv_tile = pl.BlockSpec((None, s_pad, None, h_pad), lambda hq, i, bi: (bi, 0, hq // group, 0))
    q_tile = pl.BlockSpec((None, block_q, None, h_pad), lambda hq, i, bi: (bi, nq - 1 - i, hq, 0))
    kernel = functools.partial(_flash_kernel, block_k=block_k, qk_scale=_LOG2_E / math.sqrt(h))
    out = pl.pallas_call(
        kernel,
        grid=(n, nq, b),
        in_specs=[per_q_block, pl.BlockSpec((None,), lambda hq, i, bi: (bi,)),
                  q_rows, q_rows, kv_rows, kv_rows, q_tile, kv_tile, kv_tile],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_triton_compiler_params(block_sizes),
        interpret=interpret,
        name="swiftkv_flash_attention",
    )(ranges, kv_len, q_positions, q_segment_ids, kv_positions, kv_segment_ids, q, k, v)
    return out[:, :t, :, :h]


def check_shapes(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_lengths) -> bool:
    """Raises on arguments the kernels cannot take; returns whether there is anything to attend (T and S > 0)."""
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"expected q [B, T, N, H] and k, v [B, S, K, H] of one shape, got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    (b, t, n, h), (_, s, kv_heads, _) = q.shape, k.shape
    if k.shape[0] != b or k.shape[3] != h:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head dim")
    if n % kv_heads:
        raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({kv_heads})")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    expected = {"q_positions": ((b, t), q_positions), "q_segment_ids": ((b, t), q_segment_ids),
                "kv_positions": ((b, s), kv_positions), "kv_segment_ids": ((b, s), kv_segment_ids)}
    if kv_lengths is not None:
        expected["kv_lengths"] = ((b,), kv_lengths)
    for name, (shape, x) in expected.items():
        if x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array of shape {shape}, got {x.dtype}{list(x.shape)}")
    return t > 0 and s > 0


def flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_lengths=None, *,
                    block_sizes: FlashBlockSizes | None = None, interpret: bool | None = None) -> jnp.ndarray:
    """Flash attention forward, masked by positions, segment ids and optional kv_lengths.

    q [B, T, N, H]; k, v [B, S, K, H] with N = K * G; q_positions, q_segment_ids [B, T]; kv_positions,
    kv_segment_ids [B, S]; kv_lengths [B] or None (keys at index >= length are invisible). Returns
    [B, T, N, H] in q's dtype; rows with no visible key are zeros. Any T, S, H (padded to the blocks and
    masked). interpret=None: interpret mode on CPU, compiled on GPU; another backend raises (no fallback).
    """
    if not check_shapes(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_lengths):
        return jnp.zeros(q.shape, q.dtype)  # no query, or no key: every row sees nothing
    interpret = interpret_mode(interpret, "flash_attention", "Pallas Triton", cross_lowering=True)
    tune = call_shapes("flash", q, k.shape[2], k.dtype)
    block_sizes = block_sizes_for(block_sizes, FlashBlockSizes, interpret, tune,
                                  FlashBlockSizes.for_head_dim(q.shape[3]))
    return _flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_lengths,
                            block_sizes=block_sizes, interpret=interpret)

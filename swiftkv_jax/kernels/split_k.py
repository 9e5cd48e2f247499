"""The split-K launch shared by the dense (decode_attention.py) and paged (paged_attention.py) few-query kernels:
block sizes, the program body, the launch, exact merges of partial results, and the checks and settings both use.

Kernel layout: one program per (batch b, KV head k, row block i, KV split j). The query rows of one KV head are
r = t * G + g, so every K/V block is read from memory once for all G heads of the group. They are cut into blocks of
``block_q`` rows (each a contiguous range of query tokens), so T may be a whole prompt chunk (hundreds or thousands
of tokens) as well as 1 for decode: one Triton program cannot hold thousands of rows. T*G rows that fit in one
block are padded to a power of two >= 16 (the smallest Triton dot) and make one row block, the launch of the
decode case. A program streams its split of the cache in blocks of ``block_k`` keys, but only up to the largest
limit of its own rows: with causal positions a chunk's early rows read fewer keys than its late ones, and a row
block that sees no key (rows of another sequence, ``q_positions == -1``; padding) reads no K/V and runs no
iteration, so the cost follows each sequence's own context. Each split returns its unnormalised output with the
running max and sum of the softmax (the flash-attention residuals); ``merge_partials`` combines them exactly in
jnp. Where a block's keys are read from is the kernel's own (``key_index`` of ``attend_split``).

Backend decision: a Triton-style ``pl.pallas_call`` (BlockSpecs over a grid, fori_loop over key blocks, masked
``load``). That style is the one that runs in ``interpret=True`` on CPU (so CI checks the same kernel code), and
that compiles on both JAX 0.10 and 0.11. JAX 0.10 lowers a GPU ``pallas_call`` with Mosaic GPU unless Triton
``CompilerParams`` are passed, so they are always passed here. The Triton backend is deprecated from JAX 0.11 on.

Quantised caches (int8, float8_e4m3fn): K and V blocks are loaded in their storage dtype (1 byte an element) and
cast in registers to the queries' 16-bit dtype, exactly (int8 and e4m3 values are bf16 and fp16 values), so both
products run on the tensor cores as over a 16-bit cache (fp32 queries: in fp32). The fp32 scale of each token and
KV head, loaded beside the block, multiplies that key's column of the scores (K's) and of the softmax weights
before P V (V's): [rows, block_k] products where scaling the block would take [block_k, H], and no dequantised
copy of the cache is made. Softmax and accumulation stay fp32. A per-layer (``()``) scale is not loaded at all: K's
multiplies the queries and V's the unnormalised output (attention is linear in each). `DecodeBlockSizes.dequant_dtype`
may convert the values to fp16 or fp32 instead (tuning knobs). The H200 run of 2026-11-24 found the int8 pool slower
than bf16 with the default, by arithmetic the int-to-float conversions; an int8 cache now reaches every dtype by
integer arithmetic, no conversion instruction (bf16 through fp32: bf16's 8 bits cannot hold 128 + x).
FP8 needs a GPU of compute capability >= 8.9 under Triton (checked before the launch).

Nothing here imports the model: the kernels stand alone, and the model picks them by name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from swiftkv_jax.kernels.call_settings import block_sizes_for, interpret_mode

try:  # JAX 0.10 and 0.11 (deprecated there, still present); the masked load and the Triton compiler params.
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a JAX without the Triton Pallas backend
    pltriton = None

__all__ = [
    "MASK_VALUE", "AttentionResiduals", "DecodeBlockSizes", "Launch", "attend_split", "check_pages",
    "check_queries", "check_scales", "dequantize", "int8_to_float16", "int8_to_float32", "kernel_settings", "launch",
    "merge_partials", "no_keys", "normalize", "scale_inputs", "split_k_attention",
]

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
MIN_ROWS = 16  # a Triton dot needs at least 16 rows


def is_power_of_two(x: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


DEQUANT_DTYPES = (None, "float16", "float32")  # DecodeBlockSizes.dequant_dtype


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Block sizes of the decode kernel (hashable: a static jit argument).

    block_k: keys per inner-loop block; a power of two >= 16 (Triton tensor sizes are powers of two and a
      dot needs >= 16 along each dimension). Shared memory per stage is about 2 * block_k * H * itemsize.
    num_splits: how many programs split the cache along S (parallelism when B * K is small). The split
      length is rounded up to a multiple of block_k, so a short cache uses fewer splits.
    num_warps, num_stages: Triton compiler parameters (ignored in interpret mode).
    block_q: query rows (tokens x the G heads of a KV head) per program at most; a power of two >= 16. T*G rows
      that fit are one row block padded to a power of two >= 16 (decode); more are cut into ceil(T*G / block_q)
      blocks, each its own program, which reads keys only up to its own rows' positions.
    dequant_dtype: what a quantised (int8 / float8_e4m3fn) cache's values become in registers when q is 16-bit:
      None, q's dtype; "float16": one conversion a value (Hopper converts e4m3 to fp16 directly, to bf16 through
      fp32), the 16-bit q and P cast to fp16 for the two products (exact for 1-byte values; P in [0, 1] keeps more
      bits than in bf16); "float32": fp32 operands, so the products run in TF32 (Triton's default for fp32 dots:
      exact for a bf16 q and 1-byte values, P rounded to 10 mantissa bits, more than bf16's 7) and P is not
      converted. An int8 cache reaches fp16 or fp32 by integer arithmetic (`int8_to_float16`, `int8_to_float32`;
      bf16 through fp32), not by a conversion instruction. A tuning knob: which is faster is the GPU's to say.
    """

    block_k: int = 64
    num_splits: int = 16
    num_warps: int = 4
    num_stages: int = 2
    block_q: int = 64
    dequant_dtype: str | None = None

    def __post_init__(self):
        for name in ("block_k", "block_q"):
            value = getattr(self, name)
            if not is_power_of_two(value) or value < MIN_ROWS:
                raise ValueError(f"DecodeBlockSizes.{name} must be a power of two >= 16, got {value!r}")
        if not isinstance(self.num_splits, int) or isinstance(self.num_splits, bool) or self.num_splits < 1:
            raise ValueError(f"DecodeBlockSizes.num_splits must be an integer >= 1, got {self.num_splits!r}")
        if not is_power_of_two(self.num_warps) or self.num_warps > 32:
            raise ValueError(f"DecodeBlockSizes.num_warps must be a power of two in [1, 32], got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool) or self.num_stages < 1:
            raise ValueError(f"DecodeBlockSizes.num_stages must be an integer >= 1, got {self.num_stages!r}")
        if self.dequant_dtype not in DEQUANT_DTYPES:
            raise ValueError(f"DecodeBlockSizes.dequant_dtype must be one of {DEQUANT_DTYPES}, got "
                             f"{self.dequant_dtype!r}")


class AttentionResiduals(NamedTuple):
    """Unnormalised attention of one KV segment, mergeable exactly with ``merge_partials``.

    out: ``[..., H]`` fp32, ``sum_s exp(score_s - max) v_s``; max: ``[...]`` fp32, the max visible score
    (``MASK_VALUE`` where no key is visible); sum: ``[...]`` fp32, ``sum_s exp(score_s - max)`` (0 where no
    key is visible). ``normalize`` turns it into the attention output.
    """

    out: jax.Array
    max: jax.Array
    sum: jax.Array


def merge_partials(outs: jax.Array, maxes: jax.Array, sums: jax.Array) -> AttentionResiduals:
    """Merges partial attentions stacked on a leading axis (``[P, ..., H]``, ``[P, ...]``, ``[P, ...]``).

    Exact: rescales every partial to the common max. Partials with no visible key (max ``MASK_VALUE``,
    sum 0) contribute nothing. To merge two segments: ``merge_partials(*map(jnp.stack, zip(r1, r2)))``. One
    partial is itself (no work: a launch of one split merges nothing).
    """
    if outs.shape[0] == 1:
        return AttentionResiduals(outs[0], maxes[0], sums[0])
    m = jnp.max(maxes, axis=0)
    # jax's bundled decode kernel needs this barrier to avoid invalid values after jit (b/389925439).
    m = lax.optimization_barrier(m)
    w = jnp.exp(maxes - m[None])
    return AttentionResiduals(jnp.sum(outs * w[..., None], axis=0), m, jnp.sum(sums * w, axis=0))


def normalize(residuals: AttentionResiduals, dtype) -> jax.Array:
    """The attention output ``out / sum`` in ``dtype``; zeros where no key was visible."""
    out, _, total = residuals
    return (out / jnp.where(total > 0, total, 1.0)[..., None]).astype(dtype)


def is_quantized(dtype) -> bool:
    """A cache dtype that needs scales: any integer or 1-byte (FP8) dtype."""
    return not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize == 1


def check_scales(k, v, k_scale, v_scale, token_shape: tuple, layout: str):
    """Validates a cache's scales: None (only for a bf16 / fp16 / fp32 cache), ``()`` or ``token_shape`` (named
    ``layout``), the same for K and V."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale go together: pass both or neither")
    if k_scale is None:
        for name, x in (("k", k), ("v", v)):
            if is_quantized(x.dtype):
                raise ValueError(f"a quantised {x.dtype} {name} cache needs k_scale and v_scale (a () scalar or "
                                 f"{layout} {token_shape} fp32 scales)")
        return
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tuple(x.shape) not in ((), token_shape):
            raise ValueError(f"{name} must be a () scalar or {layout} {token_shape}, got {tuple(x.shape)}")
    if k_scale.shape != v_scale.shape:
        raise ValueError(f"k_scale and v_scale must have one shape, got {k_scale.shape} and {v_scale.shape}")


_INT8_IN_MANTISSA = 0x4B000080  # the bits of the fp32 2^23 + 128: an int8 added to them lands in the low byte
_INT8_IN_FP16_MANTISSA = 0x6480  # the bits of the fp16 2^10 + 128 (ulp 1 from 1024 to 2048)


def int8_to_float32(x):
    """int8 values as fp32, exactly, by integer arithmetic: the bits of 2^23 + 128 + x are those of 2^23 + 128 plus
    x (sign-extended), so a 32-bit integer add, a bitcast and an fp32 subtraction replace the int-to-float
    conversion, an instruction Hopper issues at a quarter of the rate of integer and fp32 arithmetic."""
    bits = x.astype(jnp.int32) + _INT8_IN_MANTISSA
    return lax.bitcast_convert_type(bits, jnp.float32) - float(2**23 + 128)


def int8_to_float16(x):
    """int8 values as fp16, exactly, by the same integer arithmetic at 16 bits (1152 + x lies in [1024, 1280), where
    fp16's ulp is 1): what FasterTransformer's int8 GEMMs do instead of the int-to-float conversion."""
    bits = x.astype(jnp.int16) + jnp.int16(_INT8_IN_FP16_MANTISSA)
    return lax.bitcast_convert_type(bits, jnp.float16) - jnp.float16(2**10 + 128)


def attend_split(limit_ref, q_ref, k_ref, v_ref, *refs, scale: float, block_k: int, split_len: int, key_index,
                  dequantize=None):
    """One (b, kv head, row block, split) program, for any layout of the keys. limit_ref [R]: row r of this block
    sees keys < limit[r]; the program iterates key blocks only up to its rows' largest limit (none if it is 0).

    q_ref [R, H]; refs: o_ref [R, H], m_ref [R], l_ref [R] fp32, preceded by k_scale_ref and v_scale_ref (laid out
    as k_ref minus H) for per-token-head scales. ``key_index(i, idx, in_range)`` gives the indexers of block i's
    keys (global indices ``idx [block_k]`` of this sequence, ``in_range`` those to load): into k_ref and v_ref,
    which they must turn into ``[block_k, H]``, and into the scale refs (``[block_k]``). The dense cache and the
    paged pool differ only there. dequantize: None, or K and V are a quantised cache converted to this dtype as they
    are read (`dequant_dtype`), with their per-key scales (if given) on the columns of the scores and of P; see
    the module.
    """
    *scale_refs, o_ref, m_ref, l_ref = refs
    rows, head_dim = q_ref.shape
    split_start = pl.program_id(3) * split_len
    limit = limit_ref[...]
    # One dtype for the q.k product (Triton's dot needs it; fp32 q over a bf16 cache is a serving case). A quantised
    # cache reads as `dequantize`: its 1-byte values are exact in bf16 and fp16.
    dot_dtype = dequantize if dequantize is not None else jnp.promote_types(q_ref.dtype, k_ref.dtype)
    q = q_ref[...].astype(dot_dtype)
    # Keys past every row's limit are neither loaded nor computed (limit <= S, so no load runs past S): a row
    # block of rows that see nothing runs no iteration.
    split_end = jnp.minimum(jnp.max(limit), split_start + split_len)
    num_blocks = (jnp.maximum(split_end - split_start, 0) + block_k - 1) // block_k

    def body(i, carry):
        o, m, l = carry
        idx = split_start + i * block_k + jnp.arange(block_k)
        in_range = idx < split_end
        keys, scale_keys = key_index(i, idx, in_range)

        def read(ref):  # [block_k, H]: K or V, in its storage dtype, or a quantised cache's values as dot_dtype
            x = pltriton.load(ref.at[keys], mask=in_range[:, None], other=0.0)
            if dequantize is None:
                return x
            if x.dtype == jnp.int8:  # integer arithmetic, no int-to-float conversion (bf16 cannot hold 128 + x)
                return int8_to_float16(x) if dot_dtype == jnp.float16 else int8_to_float32(x).astype(dot_dtype)
            if dot_dtype == jnp.float16:  # e4m3 converts to fp16 in one step
                return x.astype(dot_dtype)
            return x.astype(jnp.float32).astype(dot_dtype)  # to bf16 through fp32 (Triton has no e4m3 -> bf16)

        def key_scales(which):  # [1, block_k]: each key's K (0) or V (1) scale, on its column
            return pltriton.load(scale_refs[which].at[scale_keys], mask=in_range, other=0.0)[None, :]

        k = read(k_ref).astype(dot_dtype)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        if scale_refs:
            s = s * key_scales(0)
        visible = idx[None, :] < limit[:, None]
        s = jnp.where(visible, s, MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp(m - m_next)
        p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
        v = read(v_ref)
        weights = p * key_scales(1) if scale_refs else p  # V's scales on P's columns; the row sums stay P's own
        pv = lax.dot_general(weights.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
        return o * correction[:, None] + pv, m_next, l * correction + jnp.sum(p, axis=1)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def compiler_params(block_sizes: DecodeBlockSizes, interpret: bool):
    """Triton compiler params: without them JAX 0.10 lowers a GPU pallas_call with Mosaic GPU."""
    return None if interpret else pltriton.CompilerParams(num_warps=block_sizes.num_warps,
                                                          num_stages=block_sizes.num_stages)


def check_queries(q, num_kv_heads: int, lengths, q_positions, *, triton_head_dim: bool = True):
    """The checks the split-K kernels share (q already checked to be 4-D); triton_head_dim: the Triton kernels' rule
    for H (the Mosaic kernels check their own)."""
    B, T, N, H = q.shape
    if T == 0:
        raise ValueError(f"q {q.shape} has no query tokens (T = 0): there is nothing to attend")
    if N % num_kv_heads:
        raise ValueError(f"query heads N={N} must be a multiple of KV heads K={num_kv_heads}")
    if triton_head_dim and (not is_power_of_two(H) or H < 16):
        raise ValueError(f"head_dim must be a power of two >= 16 for the Pallas kernel, got {H}")
    if tuple(lengths.shape) != (B,) or tuple(q_positions.shape) != (B, T):
        raise ValueError(f"lengths must be [B={B}] and q_positions [B={B}, T={T}], got {lengths.shape} and "
                         f"{q_positions.shape}")
    if not (jnp.issubdtype(lengths.dtype, jnp.integer) and jnp.issubdtype(q_positions.dtype, jnp.integer)):
        raise ValueError(f"lengths and q_positions must be integers, got {lengths.dtype} and {q_positions.dtype}")


def check_pages(q, k_pages, v_pages, block_tables):
    """The shapes both paged kernels (Triton and Mosaic) take: q [B, T, N, H], one layer's pool of pages
    k_pages = v_pages [K, P, page_size, H] of one dtype, block_tables [B, M] integers."""
    if q.ndim != 4 or k_pages.ndim != 4:
        raise ValueError(f"q must be [B, T, N, H] and k_pages [K, P, page_size, H], got {q.shape} and "
                         f"{k_pages.shape}")
    B, _, _, H = q.shape
    if v_pages.shape != k_pages.shape or k_pages.shape[3] != H:
        raise ValueError(f"k_pages and v_pages must both be [K, P, page_size, H={H}], got {k_pages.shape} and "
                         f"{v_pages.shape}")
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"k_pages and v_pages must have one dtype, got {k_pages.dtype} and {v_pages.dtype}")
    if k_pages.shape[1] == 0 or k_pages.shape[2] == 0:
        raise ValueError(f"the pool needs at least one page (its null page 0) of at least one key, got k_pages "
                         f"{k_pages.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != B or not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(f"block_tables must be [B={B}, M] integers, got {block_tables.shape} {block_tables.dtype}")


def scale_inputs(k_scale, v_scale):
    """How a cache's (checked) scales reach the kernel: (dequantize, per-token-head scales to pass in as inputs,
    per-layer scales to apply outside). A per-layer scale costs nothing in the kernel: K's multiplies the fp32
    queries (the scores are linear in the keys), V's the unnormalised output (linear in the values)."""
    if k_scale is None:
        return False, (), None
    scales = (jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32))
    return (True, scales, None) if scales[0].ndim else (True, (), scales)


class Launch(NamedTuple):
    """The launch arithmetic of ``split_k_attention`` (pure Python, static): grid (B, K, row_blocks, num_splits)."""

    block_rows: int   # query rows per program: a power of two >= 16
    row_blocks: int   # ceil(T*G / block_rows)
    split_len: int    # keys per split: a multiple of block_k
    num_splits: int   # ceil(num_keys / split_len) <= block_sizes.num_splits


def launch(rows: int, num_keys: int, block_sizes: DecodeBlockSizes) -> Launch:
    """How ``rows`` (T*G) query rows of a KV head and ``num_keys`` keys of a sequence are cut into programs. Rows
    that fit in one block are padded to a power of two >= 16 (the decode launch); more make blocks of block_q."""
    block_rows = min(block_sizes.block_q, max(MIN_ROWS, pl.next_power_of_2(rows)))
    split_len = pl.cdiv(pl.cdiv(num_keys, block_sizes.num_splits), block_sizes.block_k) * block_sizes.block_k
    return Launch(block_rows, pl.cdiv(rows, block_rows), split_len, pl.cdiv(num_keys, split_len))


def split_k_attention(kernel, q, lengths, q_positions, kv_inputs, kv_specs, *, num_kv_heads: int, num_keys: int,
                       block_sizes: DecodeBlockSizes, interpret: bool, name: str, dequantize: bool = False,
                       static_scales=None) -> AttentionResiduals:
    """The launch shared by the dense and the paged kernels: query rows, row limits, grid, merge of the splits.

    kernel: ``(limit_ref, q_ref, *kv_refs, o_ref, m_ref, l_ref, *, scale, block_k, split_len)`` (and
    ``dequantize`` when it is set); kv_inputs: what kv_refs come from; kv_specs(split_len): their BlockSpecs over the
    grid (b, kv head k, row block i, split j). num_keys: the key capacity of one sequence (S), split in
    ``num_splits`` pieces of a multiple of block_k keys. static_scales: per-layer (k_scale, v_scale), see
    ``scale_inputs``.
    """
    sixteen_bit = q.dtype in (jnp.bfloat16, jnp.float16)
    if dequantize:  # the 16-bit q's dtype unless the block sizes name another (fp32 for an fp32 q)
        kernel = functools.partial(kernel, dequantize=jnp.dtype(
            (block_sizes.dequant_dtype or q.dtype) if sixteen_bit else jnp.float32))
    if static_scales is not None:  # K's per-layer scale on the queries (rounded back to a 16-bit q's dtype)
        scaled = q.astype(jnp.float32) * static_scales[0]
        q = scaled.astype(q.dtype) if sixteen_bit else scaled
    B, T, N, H = q.shape
    K = num_kv_heads
    G = N // K
    rows = T * G
    block_rows, row_blocks, split_len, num_splits = launch(rows, num_keys, block_sizes)
    padded_rows = row_blocks * block_rows

    # Rows of one KV head: r = t * G + g (a copy of q only), so a row block is a contiguous range of tokens.
    # Padded rows see no key; nor does a query at a negative position (limit 0).
    q_rows = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, rows, H)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    limit = jnp.minimum(q_positions.astype(jnp.int32) + 1, lengths.astype(jnp.int32)[:, None])
    limit = jnp.clip(limit, 0, num_keys)
    limit = jnp.pad(jnp.repeat(limit, G, axis=1), ((0, 0), (0, padded_rows - rows)))

    stat_spec = pl.BlockSpec((None, None, None, block_rows), lambda b, k, i, j: (j, b, k, i))
    stat_shape = jax.ShapeDtypeStruct((num_splits, B, K, padded_rows), jnp.float32)
    outs, maxes, sums = pl.pallas_call(
        functools.partial(kernel, scale=1.0 / math.sqrt(H), block_k=block_sizes.block_k, split_len=split_len),
        grid=(B, K, row_blocks, num_splits),
        in_specs=[
            pl.BlockSpec((None, block_rows), lambda b, k, i, j: (b, i)),
            pl.BlockSpec((None, None, block_rows, H), lambda b, k, i, j: (b, k, i, 0)),
            *kv_specs(split_len),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_rows, H), lambda b, k, i, j: (j, b, k, i, 0)),
            stat_spec,
            stat_spec,
        ],
        out_shape=[jax.ShapeDtypeStruct((num_splits, B, K, padded_rows, H), jnp.float32), stat_shape, stat_shape],
        compiler_params=compiler_params(block_sizes, interpret),
        interpret=interpret,
        name=name,
    )(limit, q_rows, *kv_inputs)

    out, m, total = merge_partials(outs, maxes, sums)
    if static_scales is not None:
        out = out * static_scales[1]

    def to_heads(x):  # [B, K, R_pad, ...] -> [B, T, N, ...]
        x = x[:, :, :rows].reshape(B, K, T, G, *x.shape[3:])
        return jnp.moveaxis(x, 2, 1).reshape(B, T, N, *x.shape[4:])

    return AttentionResiduals(to_heads(out), to_heads(m), to_heads(total))


def kernel_settings(block_sizes: DecodeBlockSizes | None, interpret: bool | None, what: str, cache_dtypes=(),
                    tune: dict | None = None):
    """Defaults and loud failures shared by the public kernels: (block sizes, interpret). tune: the kernel's name
    and shapes (`tuning.lookup`'s arguments): compiled without block sizes, it takes the measured ones if the table
    has them for this GPU."""
    if pltriton is None or not hasattr(pltriton, "CompilerParams"):  # pragma: no cover
        raise NotImplementedError(
            f"{what} needs the Pallas Triton backend (jax.experimental.pallas.triton), which JAX "
            f"{jax.__version__} does not have; use {what}_reference")
    interpret = interpret_mode(interpret, what, "Pallas Triton", reference=f"{what}_reference")
    if not interpret and any(jnp.dtype(dtype) == jnp.float8_e4m3fn for dtype in cache_dtypes):
        capability = getattr(jax.devices()[0], "compute_capability", None)
        if capability is not None and tuple(map(int, str(capability).split(".")[:2])) < (8, 9):
            raise NotImplementedError(f"a float8_e4m3fn cache needs compute capability >= 8.9 for Triton (this GPU "
                                      f"is {capability}); use an int8 cache or {what}_reference")
    return block_sizes_for(block_sizes, DecodeBlockSizes, interpret, tune), interpret


def no_keys(q) -> AttentionResiduals:
    """The residuals of attention over no key at all (zero cache capacity)."""
    zeros = jnp.zeros(q.shape[:3], jnp.float32)
    return AttentionResiduals(jnp.zeros(q.shape, jnp.float32), zeros + MASK_VALUE, zeros)


def dequantize(x, scale):
    """A cache's values in fp32 (the references' way): x * scale, scale None (a float cache), () or x.shape[:-1]."""
    x = x.astype(jnp.float32)
    return x if scale is None else x * (scale[..., None] if scale.ndim else scale)

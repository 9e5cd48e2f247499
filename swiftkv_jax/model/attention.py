"""Attention dispatch and the plain XLA path, the reference every kernel is checked against.

Masking is by positions and segment ids, never by array index: a query at position p attends to keys of
its own segment at positions <= p. This stays right when queries are fewer than keys (decode, chunked
prefill, SwiftKV's later layers), where an index-aligned `is_causal` mask would pick the wrong keys, and it
keeps packed documents (positions restarting per segment) from attending to each other.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from swiftkv_jax.model.kv_quant import dequantize
from swiftkv_jax.model.precision import einsum_fp32
from swiftkv_jax.sharding import map_over_heads


def attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids) -> jnp.ndarray:
    """[B, T, S] bool: same segment and key position <= query position."""
    causal = kv_positions[:, None, :] <= q_positions[:, :, None]
    same_segment = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return causal & same_segment


def xla_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids) -> jnp.ndarray:
    """Grouped-query attention by einsum, softmax in fp32.

    q [B, T, N, H], k and v [B, S, K, H] with N = K * G; positions and segment ids [B, T] / [B, S].
    Returns [B, T, N, H] in q's dtype. A query with no visible key (impossible for a token's own
    position in a full forward) gets zeros, not NaN.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    logits = einsum_fp32("BTKGH,BSKH->BKGTS", q, k) * (h ** -0.5)
    mask = attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids)[:, None, None]
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask, probs, 0.0).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(b, t, n, h)


QUERY_CHUNK = 512
# Own rows: the query blocks go in this many groups, each a loop over its blocks against the keys up to the group's
# end: 5/8 of full rows' work at 4 (causal's floor is 1/2), with one block's logits alive per loop. Unrolling every
# block against its own prefix (the floor) let XLA keep all their logits alive: 17 GiB at 8K x 32 heads (CPU).
OWN_ROW_GROUPS = 4


def xla_chunked_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                          chunk: int = QUERY_CHUNK, own_rows: bool = False) -> jnp.ndarray:
    """`xla_attention` over blocks of `chunk` queries, each rematerialised in the backward pass.

    Same result; the fp32 logits alive at once shrink from [B, N, T, S] to [B, N, chunk, S] (at T = 8K,
    32 heads: 8 GiB -> 0.5 GiB per sequence), forward and backward. For training on long sequences.

    own_rows: K/V are the queries' own rows as `swiftkv_jax.data.pack` makes them (every run of equal segment ids
    one document whose positions rise along the row), so no query sees a key further along the row: the blocks
    go in `OWN_ROW_GROUPS` groups, each attending to the keys up to its last query only (5/8 of the work at T >>
    chunk). Exact for every document token (a padding run, whose positions need not rise, may differ; it is
    never used).
    """
    t = q.shape[1]
    if t <= chunk:
        return xla_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    if own_rows and k.shape[1] != t:
        raise ValueError(f"own_rows attends a row to itself, but got {t} queries and {k.shape[1]} keys")
    pad = -t % chunk  # padded queries: segment -1 matches no key, so their rows are zeros
    pad_t = lambda a, value=0: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=value)
    blocks = lambda a: jnp.moveaxis(a.reshape((a.shape[0], -1, chunk) + a.shape[2:]), 1, 0)
    q_blocks = (blocks(pad_t(q)), blocks(pad_t(q_positions)), blocks(pad_t(q_segment_ids, -1)))
    n = q_blocks[0].shape[0]
    groups = min(OWN_ROW_GROUPS, n) if own_rows else 1
    cuts = [round(g * n / groups) for g in range(groups + 1)]  # the groups' first blocks
    outs = []
    for first, stop in zip(cuts[:-1], cuts[1:]):
        # keys [0, end): all that the group's queries may see (own rows: up to its last query; otherwise, as
        # a chunk over a longer cache, every key)
        end = min(stop * chunk, k.shape[1]) if own_rows else k.shape[1]
        body = jax.checkpoint(lambda xs, end=end: xla_attention(
            xs[0], k[:, :end], v[:, :end], xs[1], kv_positions[:, :end], xs[2], kv_segment_ids[:, :end]),
            prevent_cse=False)
        outs.append(jax.lax.map(body, tuple(x[first:stop] for x in q_blocks)))
    out = jnp.concatenate(outs)
    out = jnp.moveaxis(out, 0, 1).reshape((q.shape[0], t + pad) + q.shape[2:])
    return out[:, :t]


# Blocks of the blockwise path, tuned on CPU (2 cores, Llama heads of 64: 4-6x faster than `xla_attention` at 1-2K
# tokens); a prompt of at most FLASH_BLOCK_Q queries is one block and takes `xla_attention` unchanged.
FLASH_BLOCK_Q, FLASH_BLOCK_K = 256, 256
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: no inf - inf in the running max


def xla_flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                        block_q: int = FLASH_BLOCK_Q, block_k: int = FLASH_BLOCK_K) -> jnp.ndarray:
    """`xla_attention` blockwise with an online softmax (flash attention in plain XLA), same arguments and result.

    `xla_attention` materialises the fp32 scores [B, K, G, T, S] and passes over them several times; at 1K
    tokens that is memory-bound and 9x slower than torch's fused CPU attention. Here a `lax.map` over blocks of
    `block_q` queries runs a loop over blocks of `block_k` keys whose scores stay in cache, and skips (`lax.cond`)
    every key block whose smallest valid position is past the query block's largest, or whose segments none of
    the query block's has: causal prefill does about half the work, packed documents their own blocks only, and
    keys past a cache's length none. Each KV head's G * block_q query rows meet its
    keys as one batched product over (B, K), with K/V in the cache's [B, K, S, H] layout (the transposes at
    the call cancel out under jit). Serving only (not in DIFFERENTIABLE_IMPLS).
    """
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    if t <= block_q:
        return xla_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    g = n // kv_heads
    rows = g * block_q  # row r = g_index * block_q + t_index
    pad_q, pad_k = -t % block_q, -s % block_k
    pad = lambda a, extra, value: jnp.pad(a, [(0, 0), (0, extra)] + [(0, 0)] * (a.ndim - 2), constant_values=value)
    q_blocks = pad(q, pad_q, 0).reshape(b, -1, block_q, kv_heads, g, h)
    q_blocks = jnp.einsum("BQTKGH->QBKGTH", q_blocks).reshape(-1, b, kv_heads, rows, h)  # [nQ, B, K, R, H]
    # padded queries get segment -1 (no key: zero rows, sliced off at the end)
    to_blocks = lambda a, value: jnp.moveaxis(pad(a, pad_q, value).reshape(b, -1, block_q), 1, 0)
    q_pos, q_seg = to_blocks(q_positions, 0), to_blocks(q_segment_ids, -1)
    k, v = (jnp.swapaxes(pad(a, pad_k, 0), 1, 2) for a in (k, v))  # [B, K, S, H]
    kv_positions, kv_segment_ids = pad(kv_positions, pad_k, 0), pad(kv_segment_ids, pad_k, -2)
    num_k = (s + pad_k) // block_k
    big = jnp.iinfo(jnp.int32).max
    # per key block, its smallest valid position and its range of segments (over the batch); per query block, its
    # largest position and its range of segments. A block pair is visited only if both can meet: packed prompts
    # (segments in order along the row) then cost their own blocks, not the whole row's square.
    valid_key = (kv_segment_ids >= 0).reshape(b, num_k, block_k)
    key_blocks = lambda a, fill, f: f(jnp.where(valid_key, a.reshape(b, num_k, block_k), fill), axis=(0, 2))
    first_key = key_blocks(kv_positions, big, jnp.min)
    key_seg_lo, key_seg_hi = key_blocks(kv_segment_ids, big, jnp.min), key_blocks(kv_segment_ids, -1, jnp.max)
    last_query = jnp.max(jnp.where(q_seg >= 0, q_pos, -1), axis=(1, 2))
    q_seg_lo = jnp.min(jnp.where(q_seg >= 0, q_seg, big), axis=(1, 2))
    q_seg_hi = jnp.max(q_seg, axis=(1, 2))

    def query_block(args):
        qb, qp, qs, last, seg_lo, seg_hi = args
        qp, qs = jnp.tile(qp, (1, g)), jnp.tile(qs, (1, g))  # [B, R]

        def key_block(j, carry):
            def visit(out, row_max, row_sum):
                kb, vb = (jax.lax.dynamic_slice_in_dim(a, j * block_k, block_k, axis=2) for a in (k, v))
                kp, ks = (jax.lax.dynamic_slice_in_dim(a, j * block_k, block_k, axis=1)
                          for a in (kv_positions, kv_segment_ids))
                visible = (kp[:, None, :] <= qp[:, :, None]) & (ks[:, None, :] == qs[:, :, None])
                # 1/sqrt(H) on the fp32 scores, as `xla_attention` and the kernels: on a bf16 q it rounded every
                # query where the scale is no power of two (H 96, 128), 2.8x the mean error of transformers' sdpa
                scores = jnp.einsum("BKRH,BKSH->BKRS", qb, kb, preferred_element_type=jnp.float32) * h ** -0.5
                scores = scores + jnp.where(visible, 0.0, MASKED)[:, None]
                new_max = jnp.maximum(row_max, scores.max(axis=-1))
                probs = jnp.exp(scores - new_max[..., None])  # masked keys: 0, once a row has seen a visible one
                rescale = jnp.exp(row_max - new_max)
                out = out * rescale[..., None] + jnp.einsum("BKRS,BKSH->BKRH", probs.astype(vb.dtype), vb,
                                                            preferred_element_type=jnp.float32)
                return out, new_max, row_sum * rescale + probs.sum(axis=-1)

            meets = (first_key[j] <= last) & (key_seg_lo[j] <= seg_hi) & (seg_lo <= key_seg_hi[j])
            return jax.lax.cond(meets, visit, lambda *c: c, *carry)

        shape = (b, kv_heads, rows)
        carry = (jnp.zeros(shape + (h,), jnp.float32), jnp.full(shape, MASKED, jnp.float32),
                 jnp.zeros(shape, jnp.float32))
        out, row_max, row_sum = jax.lax.fori_loop(0, num_k, key_block, carry)
        seen = row_max > MASKED / 2  # a row that never saw a visible key: zeros
        out = jnp.where(seen[..., None], out / jnp.where(seen, row_sum, 1.0)[..., None], 0.0)
        return jnp.einsum("BKGTH->BTKGH", out.reshape(b, kv_heads, g, block_q, h)).astype(q.dtype)

    out = jax.lax.map(query_block, (q_blocks, q_pos, q_seg, last_query, q_seg_lo, q_seg_hi))  # [nQ, B, Tb, K, G, H]
    return jnp.moveaxis(out, 0, 1).reshape(b, t + pad_q, n, h)[:, :t]


_NO_HEADS = (None,) * 4  # positions and segment ids: every head shard sees them whole


def _pallas_flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    from swiftkv_jax.kernels.flash_attention import flash_attention  # Pallas imports only when chosen

    return map_over_heads(flash_attention, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                          heads=(2, 2, 2) + _NO_HEADS, out_heads=2)


def _mosaic_flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """The Mosaic GPU (Hopper) flash kernel: bf16/fp16 only (it raises otherwise); jax's GPU interpreter on a CPU."""
    from swiftkv_jax.kernels.flash_attention_mgpu import flash_attention_mgpu  # Pallas imports only when chosen

    return map_over_heads(flash_attention_mgpu, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                          heads=(2, 2, 2) + _NO_HEADS, out_heads=2)


def cudnn_max_head_dim(device=None) -> int:
    """The widest head dim jax's cuDNN attention runs on `device`: 256 on sm_90 and later (Blackwell too), 128 before,
    and on a device whose compute capability is absent or not a number (ROCm names its architecture, "gfx90a")."""
    device = device or jax.devices()[0]
    major = str(getattr(device, "compute_capability", None) or "0").split(".")[0]
    return 256 if major.isdigit() and int(major) >= 9 else 128


def cudnn_takes_head_dim(head_dim: int, device=None) -> bool:
    """Whether jax's cuDNN attention runs `head_dim` on `device` (its check, forward and backward: a multiple of 8, at
    most `cudnn_max_head_dim`)."""
    return head_dim % 8 == 0 and head_dim <= cudnn_max_head_dim(device)


def check_cudnn(dtype) -> None:
    """Raises unless cuDNN attention can run here on activations of `dtype` (an NVIDIA GPU, 16 bits). The engines
    call it when they are made: a prompt short enough for the few-query path never reaches cuDNN."""
    backend = jax.default_backend()
    if backend != "gpu":
        raise ValueError(f"attention_impl='cudnn' needs an NVIDIA GPU with cuDNN, but JAX's backend is "
                         f"{backend!r}: use attention_impl='xla' (or 'pallas')")
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"attention_impl='cudnn' takes bfloat16 or float16 activations, got {jnp.dtype(dtype)}: "
                         f"set the model's dtype to bfloat16, or use attention_impl='xla'")


def _on_head_shards(fused, q, k, v, *ids):
    try:
        return map_over_heads(fused, q, k, v, *ids, heads=(2, 2, 2) + (None,) * len(ids), out_heads=2)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise ValueError(f"attention_impl='cudnn' does not support this case ({e}); use attention_impl='xla' "
                         f"or 'pallas'") from e


def cudnn_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`), NVIDIA GPUs only.

    Our position/segment mask goes in as a boolean mask, which jax hands to cuDNN as an additive bias
    [B, 1, T, S]: exact for any positions (chunked prefill over a cache, packed documents) at the price of
    reading that bias (the H200 measured 150 TFLOP/s against 430 with cuDNN's own causal mask, at 8K).
    `cudnn_row_attention` is the fast form for a row attending to itself. cuDNN takes fp16/bf16 only.
    Unsupported setups raise, there is no fallback to XLA.
    """
    check_cudnn(q.dtype)
    fused = lambda q, k, v, *ids: jax.nn.dot_product_attention(
        q, k, v, mask=attention_mask(*ids)[:, None], implementation="cudnn")
    return _on_head_shards(fused, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)


def segment_runs(segment_ids, max_runs: int):
    """cuDNN's packed layout of rows [B, T]: every run of equal segment ids is one sequence.

    Returns (offsets [B, max_runs + 1], lengths [B, max_runs], runs [B]): where each run starts, then -1;
    each run's length, then -1 (jax's `q_offsets` / `q_seqlen`); how many runs each row has. A row with more
    than `max_runs` runs is not described whole (the caller must not use it).
    """
    b, t = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    first = jax.vmap(lambda row: jnp.nonzero(row, size=max_runs + 1, fill_value=-1)[0])(starts).astype(jnp.int32)
    ends = jnp.where(first[:, 1:] >= 0, first[:, 1:], t)  # a run ends where the next starts, or at the row's end
    lengths = jnp.where(first[:, :-1] >= 0, ends - first[:, :-1], -1)
    offsets = first.at[:, max_runs].set(-1)
    return offsets, lengths, starts.sum(axis=1, dtype=jnp.int32)


def cudnn_row_attention(q, k, v, segment_ids, max_runs: int):
    """Each row [B, T] attending to itself with cuDNN's own causal mask, its documents kept apart by cuDNN's
    packed layout: no [T, S] bias is built or read. Training's (and a whole prompt's) attention.

    Exact where `attention_mask` would be, for rows as `swiftkv_jax.data.pack` makes them: every run of equal
    segment ids is one document whose positions rise along the row (padding, a run of its own, attends
    causally within itself instead of to all of itself; its outputs are never used). `max_runs` bounds the
    runs of a row (static: cuDNN's grid has B * max_runs sequences); 1: one document per row, which is plain
    causal attention. A row with more runs than `max_runs` comes out NaN, loudly, never silently wrong.
    """
    check_cudnn(q.dtype)
    t, h = q.shape[1], q.shape[3]
    if k.shape[1] != t:
        raise ValueError(f"cudnn_row_attention attends a row to itself, but got {t} queries and {k.shape[1]} keys")

    def fused(q, k, v, segment_ids):
        offsets, lengths, runs = segment_runs(segment_ids, max_runs)
        if max_runs == 1:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        else:
            from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

            # jax turns the offsets into element strides with the query's heads (N * H per token) for K/V too,
            # so K/V go in with the query's N heads (the backward sums each group's gradient back)
            groups = q.shape[2] // k.shape[2]
            k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
            out = dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                                        kv_offsets=offsets, scale=h ** -0.5, mask_type=MaskType.PADDING_CAUSAL,
                                        qkv_layout="BTNH")
        return jnp.where((runs <= max_runs)[:, None, None, None], out, jnp.nan).astype(q.dtype)

    return _on_head_shards(fused, q, k, v, segment_ids)


# A name not in this table raises, there is no fallback. "xla_flash", "pallas" and "mosaic" serve prefill only (no
# backward pass). "cudnn" trains too: jax's cuDNN attention has a fused backward (gpu-tested against XLA's gradient).
_IMPLS = {"xla": xla_attention, "xla_chunked": xla_chunked_attention, "xla_flash": xla_flash_attention,
          "pallas": _pallas_flash_attention, "mosaic": _mosaic_flash_attention, "cudnn": cudnn_attention}
DIFFERENTIABLE_IMPLS = ("xla", "xla_chunked", "cudnn")
ATTENTION_IMPLS = tuple(_IMPLS)


def attend(impl: str, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
           row_runs: Optional[int] = None) -> jnp.ndarray:
    """Run the named attention implementation; an unknown name raises, there is no fallback.

    row_runs: set when K/V are the queries' own rows as `swiftkv_jax.data.pack` makes them (no cache:
    kv_positions/kv_segment_ids are the queries') and each row holds at most this many runs of equal segment ids
    (`ModelConfig.max_segments_per_row`, `swiftkv_jax.data.packing.max_runs`); "cudnn" then attends with cuDNN's
    own causal mask over its packed layout (`cudnn_row_attention`), "xla_chunked" skips the keys past each query
    block (`own_rows`).
    """
    try:
        fn = _IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown attention_impl {impl!r}: available are {', '.join(_IMPLS)}") from None
    if impl == "cudnn" and row_runs is not None:
        return cudnn_row_attention(q, k, v, q_segment_ids, row_runs)
    if impl == "xla_chunked" and row_runs is not None:
        return xla_chunked_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, own_rows=True)
    return fn(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)


# Few-query attention over a KV cache (decode, and SwiftKV's later layers in prefill): q [B, T, N, H] against
# the cache [B, K, S, H] whose first kv_lengths[b] entries are valid, entry i holding position i.
def cache_positions(kv_lengths, length: int):
    """(positions, segment_ids) [B, S] of a cache: entry i is position i; entries >= length get segment -1,
    which no query (segment 0) matches."""
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (kv_lengths.shape[0], length))
    return positions, jnp.where(positions < kv_lengths[:, None], 0, -1)


def _xla_cache_attention(q, k, v, q_positions, kv_lengths, k_scale=None, v_scale=None):
    """The T*G query rows of each KV head against its cache [S, H], as batched products over (B, K) in the
    cache's own layout; scores [B, K, S, R] keep S before the rows, the order in which XLA:CPU's product is
    fastest (2.5x the [B, K, R, S] order at decode shapes). Softmax in fp32."""
    if k_scale is not None:  # a quantised cache, read back in fp32 (kv_quant)
        k, v = dequantize(k, k_scale), dequantize(v, v_scale)
    b, t, n, h = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    g = n // kv_heads
    rows = jnp.einsum("BTKGH->BKTGH", q.reshape(b, t, kv_heads, g, h)).reshape(b, kv_heads, t * g, h)
    scores = jax.lax.dot_general(k, rows, (((3,), (3,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)
    scores = scores * (h ** -0.5)
    kv_positions, kv_segments = cache_positions(kv_lengths, length)
    row_positions = jnp.repeat(q_positions, g, axis=1)  # row r = t * G + g
    mask = ((kv_positions[:, :, None] <= row_positions[:, None, :]) & (kv_segments[:, :, None] == 0))[:, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    # P in the wider of q's and the cache's dtypes: an fp32 model over a bf16 cache keeps P in fp32, as the paged
    # path does (rounding it to the cache's bf16 made the two engines' tokens differ)
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=2), 0.0).astype(jnp.promote_types(q.dtype, v.dtype))
    out = jax.lax.dot_general(probs, v, (((2,), (2,)), ((0, 1), (0, 1))))  # [B, K, R, H]
    return jnp.einsum("BKTGH->BTKGH", out.reshape(b, kv_heads, t, g, h)).reshape(b, t, n, h)


def _pallas_cache_attention(q, k, v, q_positions, kv_lengths, k_scale=None, v_scale=None):
    from swiftkv_jax.kernels.decode_attention import decode_attention  # Pallas imports only when chosen

    # the kernel takes [B, S, K, H] (and per-token-head scales [B, S, K]); a quantised cache stays quantised
    def per_shard(q, k, v, q_positions, kv_lengths, *scales):
        scales = dict(zip(("k_scale", "v_scale"), (jnp.swapaxes(s, 1, 2) if s.ndim else s for s in scales)))
        return decode_attention(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), kv_lengths, q_positions, **scales)

    scales = tuple(s for s in (k_scale, v_scale) if s is not None)
    return map_over_heads(per_shard, q, k, v, q_positions, kv_lengths, *scales,
                          heads=(2, 1, 1, None, None) + tuple(1 if s.ndim else None for s in scales), out_heads=2)


def _mosaic_cache_attention(q, k, v, q_positions, kv_lengths, k_scale=None, v_scale=None):
    from swiftkv_jax.kernels.decode_attention_mgpu import decode_attention_mgpu  # Pallas imports only when chosen

    # the kernel reads the model's cache [B, K, S, H] (and per-token-head scales [B, K, S]) in place, no transpose;
    # a quantised cache stays quantised (converted tile by tile in shared memory)
    def per_shard(q, k, v, q_positions, kv_lengths, *scales):
        scales = dict(zip(("k_scale", "v_scale"), scales))
        return decode_attention_mgpu(q, k, v, kv_lengths, q_positions, **scales).astype(q.dtype)

    scales = tuple(s for s in (k_scale, v_scale) if s is not None)
    return map_over_heads(per_shard, q, k, v, q_positions, kv_lengths, *scales,
                          heads=(2, 1, 1, None, None) + tuple(1 if s.ndim else None for s in scales), out_heads=2)


DECODE_IMPLS = {"xla": _xla_cache_attention, "pallas": _pallas_cache_attention, "mosaic": _mosaic_cache_attention}
DECODE_ATTENTION_IMPLS = tuple(DECODE_IMPLS)
FEW_QUERIES = 16  # at most this many query tokens over a cache take the few-query path


def attend_cache(impl: str, q, k, v, q_positions, kv_lengths, k_scale=None, v_scale=None) -> jnp.ndarray:
    """Few-query attention over a cache by the named implementation (a quantised cache with its scales, see
    `kv_quant`); an unknown name raises."""
    try:
        fn = DECODE_IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown decode_attention_impl {impl!r}: available are {', '.join(DECODE_IMPLS)}") from None
    return fn(q, k, v, q_positions, kv_lengths, k_scale, v_scale)

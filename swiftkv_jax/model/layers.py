"""Decoder building blocks (Flax Linen). Dimension letters: B batch, T time, D model, N query heads,
K kv heads, H head dim, F MLP hidden, V vocab.

Every parameter carries logical axis names (see `swiftkv_jax.sharding`); parameter dtype and compute
dtype come from the config and are independent.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from swiftkv_jax import sharding
from swiftkv_jax.dtypes import as_dtype
from swiftkv_jax.model.attention import FEW_QUERIES, attend, attend_cache, cache_positions
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.kv_quant import dequantize_pair, write_pair
from swiftkv_jax.model.rope import apply_rope


def logical_param(module: nn.Module, name: str, init, shape, axes):
    return module.param(
        name, nn.with_logical_partitioning(init, axes), shape, as_dtype(module.config.param_dtype)
    )


class Einsum(nn.Module):
    """`einsum(equation, x, kernel)` plus an optional bias, computed in the config's dtype."""

    config: ModelConfig
    equation: str
    kernel_shape: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    bias_axes: Optional[tuple[str, ...]] = None  # None: no bias; else the output's trailing axes

    @nn.compact
    def __call__(self, x):
        dtype = as_dtype(self.config.dtype)
        init = nn.initializers.normal(self.config.initializer_range)
        kernel = logical_param(self, "kernel", init, self.kernel_shape, self.kernel_axes)
        equation, x, kernel = _flat_contraction(self.equation, x, kernel)
        y = jnp.einsum(equation, x.astype(dtype), kernel.astype(dtype))
        if self.bias_axes is not None:
            bias_shape = y.shape[y.ndim - len(self.bias_axes):]
            y = y + logical_param(self, "bias", nn.initializers.zeros, bias_shape, self.bias_axes).astype(dtype)
        return sharding.constrain(y, self.output_axes())

    def output_axes(self) -> tuple:
        """Logical axes of the output: batch and length, then the kernel's axes that survive."""
        kernel_letters, out_letters = self.equation.split(",")[1].split("->")
        axis_of = {"B": "batch", "T": "length"}
        axis_of.update({c: ("act_embed" if a == "embed" else a) for c, a in zip(kernel_letters, self.kernel_axes)})
        return tuple(axis_of[c] for c in out_letters)


def _flat_contraction(equation: str, x, kernel):
    """`equation` over x and kernel with several contracted axes (o_proj's BTNH,NHD->BTD) as one flat axis
    (BTZ,ZD->BTD) when they lead the kernel and end x in the same order: XLA otherwise lays out the attention output
    head-dim-major and transposes the [N, H, D] kernel to match, a copy of the weight at every step (seen in the CPU
    engine's steps); over one flat axis it copies the small activation instead."""
    x_letters, rest = equation.split(",")
    kernel_letters, out_letters = rest.split("->")
    n = sum(c not in out_letters for c in kernel_letters)
    if n < 2 or kernel_letters[:n] != x_letters[-n:]:
        return equation, x, kernel
    flat = x.reshape(x.shape[:-n] + (-1,)), kernel.reshape((-1,) + kernel.shape[n:])
    return f"{x_letters[:-n]}Z,Z{kernel_letters[n:]}->{out_letters}", *flat


def q_projection(cfg: ModelConfig, **kwargs) -> Einsum:
    n, h, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    bias = ("q_heads", "head_dim") if cfg.qkv_bias else None
    return Einsum(cfg, "BTD,DNH->BTNH", (d, n, h), ("embed", "q_heads", "head_dim"), bias, **kwargs)


def kv_projection(cfg: ModelConfig, **kwargs) -> Einsum:
    k, h, d = cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    bias = ("kv_heads", "head_dim") if cfg.qkv_bias else None
    return Einsum(cfg, "BTD,DKH->BTKH", (d, k, h), ("embed", "kv_heads", "head_dim"), bias, **kwargs)


class RMSNorm(nn.Module):
    """Statistics in fp32, the normalised input cast back before the scale, as transformers does."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        scale = logical_param(self, "scale", nn.initializers.ones, (self.config.hidden_size,), ("norm",))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.config.rms_norm_eps)
        dtype = as_dtype(self.config.dtype)
        return normed.astype(dtype) * scale.astype(dtype)


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        d, f = cfg.hidden_size, cfg.intermediate_size
        bias_f, bias_d = (("mlp",), ("embed",)) if cfg.mlp_bias else (None, None)
        gate = Einsum(cfg, "BTD,DF->BTF", (d, f), ("embed", "mlp"), bias_f, name="gate_proj")(x)
        up = Einsum(cfg, "BTD,DF->BTF", (d, f), ("embed", "mlp"), bias_f, name="up_proj")(x)
        return Einsum(cfg, "BTF,FD->BTD", (f, d), ("mlp", "embed"), bias_d, name="down_proj")(
            jax.nn.silu(gate) * up
        )


@struct.dataclass
class CacheWrite:
    """Serving over a dense cache (one row [K, S, H] per sequence): where this call's tokens go, and how much of
    it is valid afterwards. A paged pool has its own kind (`swiftkv_jax.model.paged.PagedBatch`) with the same two
    methods; the layers only call `write` and `view`, so one layer code serves both."""

    write_at: Optional[jax.Array]  # [B] cache index of the first new token; None: read the cache only
    kv_lengths: jax.Array          # [B] valid entries after the write

    def write(self, pair, k, v):
        """The layer's cache with new k, v [B, T, K, H] written at `write_at`. A pair is (k, v), or for a quantised
        cache (k, v, k_scale, v_scale) with 0-d static scales or [B, K, S] per-token-head ones (`kv_quant`)."""
        put_scale = lambda scale, new: jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice(c, n, (0, i)))(
            scale, jnp.swapaxes(new, 1, 2), self.write_at)  # [B, T, K] at write_at of [B, K, S]
        return write_pair(pair, k, v, lambda cache, q: write_cache(cache, q, self.write_at), put_scale)

    def view(self, pair, k=None, v=None):
        """What attention reads: the whole cache, of which the first kv_lengths are valid (k, v: unused here,
        the new tokens are in the cache already). A quantised cache's view ends with its (k_scale, v_scale): few
        queries hand them to `attend_cache` (the Pallas kernel dequantises in registers), many dequantise first."""
        return cache_view(*pair[:2], self.kv_lengths) + tuple(pair[2:])


def write_cache(cache, new, write_at):
    """cache [B, K, S, H] with new [B, T, K, H] written at per-sequence offsets write_at [B] (in place under jit
    when the cache is donated or loop-carried)."""
    put = lambda c, n, i: jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (0, i, 0))
    return jax.vmap(put)(cache, jnp.swapaxes(new, 1, 2), write_at)


def cache_view(k, v, kv_lengths):
    """(k, v, positions, segment_ids, lengths) of a cache k, v [B, K, S, H]: entry i is position i; entries >=
    length match no query. The cache keeps KV heads before positions, so that few-query attention reads it as
    the batched product it is, with no transpose of the whole cache per layer and step."""
    return (k, v, *cache_positions(kv_lengths, k.shape[2]), kv_lengths)


class Attention(nn.Module):
    """Self-attention of one layer.

    Teacher wiring (`shared_kv is None`): q/k/v from this layer's own input. SwiftKV wiring: the query
    from `q_proj_swiftkv` of this layer's input, K/V given as a view (k, v, positions, segment_ids,
    lengths): the group owner's, already rotated (lengths None), or a cache; or a paged pool's view, which
    attends by itself. Few queries over a cache take
    `decode_attention_impl`; everything else `attention_impl`. Serving: with `cache` (this layer's (k, v)) its own K/V
    are written into it by `cache_write` (a `CacheWrite`, or a paged pool's `PagedBatch`) and attention reads
    `cache_write.view` of it.
    """

    config: ModelConfig
    has_swiftkv_query: bool = False  # layers >= l of a SwiftKV model

    def setup(self):
        cfg = self.config
        self.q_proj = q_projection(cfg)
        self.k_proj = kv_projection(cfg)
        self.v_proj = kv_projection(cfg)
        n, h, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        o_bias = ("embed",) if cfg.o_bias else None
        self.o_proj = Einsum(cfg, "BTNH,NHD->BTD", (n, h, d), ("q_heads", "head_dim", "embed"), o_bias)
        if self.has_swiftkv_query:
            self.q_proj_swiftkv = q_projection(cfg)

    def __call__(self, x, rope, positions, segment_ids, shared_kv=None, cache=None,
                 cache_write: Optional[CacheWrite] = None):
        """(output [B, T, D], the updated cache or None)."""
        cos, sin = rope
        if self.is_initializing() and self.has_swiftkv_query:
            self.q_proj_swiftkv(x)  # create both wirings' parameters whatever the mode
        new_cache = None
        if shared_kv is None or self.is_initializing():
            q = self.q_proj(x)
            k = apply_rope(self.k_proj(x), cos, sin)
            v = self.v_proj(x)
            view = (k, v, positions, segment_ids, None)
            if cache is not None:
                new_cache = cache_write.write(cache, k, v)
                view = cache_write.view(new_cache, k, v)
        if shared_kv is not None:
            q = self.q_proj_swiftkv(x)
            view = shared_kv
        q = apply_rope(q, cos, sin)
        if not isinstance(view, tuple):  # a paged pool's view attends by itself (swiftkv_jax.model.paged)
            return self.o_proj(view.attend(self.config, q, positions)), new_cache
        k, v, kv_positions, kv_segment_ids, kv_lengths, *scales = view
        self.sow("intermediates", "keys", k)  # what this layer reads: its own K, or its group owner's
        if kv_lengths is not None and q.shape[1] <= FEW_QUERIES:
            out = attend_cache(self.config.decode_attention_impl, q, k, v, positions, kv_lengths, *scales)
        else:
            if scales:
                k, v = dequantize_pair((k, v, *scales))
            if kv_lengths is not None:  # a cache [B, K, S, H]: many queries amortise one transpose; the cache
                # may be wider than the activations (an fp32 cache under a bf16 model holds bf16 values, so the
                # cast is exact) and cuDNN takes one dtype for q, k and v
                k, v = (jnp.swapaxes(x, 1, 2).astype(q.dtype) for x in (k, v))
            out = attend(self.config.attention_impl, q, k, v, positions, kv_positions, segment_ids, kv_segment_ids,
                         row_runs=self.config.max_segments_per_row if kv_lengths is None else None)
        return self.o_proj(out), new_cache


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer; a scan body: (carry, *broadcast inputs, cache) -> (carry, updated cache).

    The carry is the residual h, or (h, input of the previous layer): the tuple form lets a caller read
    the hidden state entering the last layer of a stack without stacking every layer's. `cache` is this
    layer's slice of a serving KV cache (None when training).
    """

    config: ModelConfig
    has_swiftkv_query: bool = False

    @nn.compact
    def __call__(self, carry, rope, positions, segment_ids, shared_kv, cache_write, cache):
        cfg = self.config
        h_in = sharding.constrain(carry[0] if isinstance(carry, tuple) else carry, ("batch", "length", "act_embed"))
        x = RMSNorm(cfg, name="input_layernorm")(h_in)
        attn, cache = Attention(cfg, self.has_swiftkv_query, name="self_attn")(
            x, rope, positions, segment_ids, shared_kv, cache, cache_write)
        h = h_in + attn
        x = RMSNorm(cfg, name="post_attention_layernorm")(h)
        h = h + MLP(cfg, name="mlp")(x)
        self.sow("intermediates", "residual", h)  # the layer's output; kept only when asked for
        return ((h, h_in) if isinstance(carry, tuple) else h), cache


def _dots_and_cudnn_attention(prim, *args, **params) -> bool:
    """Save the matmuls' outputs (no batch dims: the projections and the MLP) and cuDNN attention's forward
    outputs (its output and softmax statistics, jax's `dot_product_attention_fwd` primitives): the backward pass
    then recomputes only elementwise work, not the attention forward (a lowered step held one more cuDNN forward
    call a trained layer without them). Its cost: a layer's attention output and statistics, ~2 bytes a hidden
    unit a token, as MaxText's policies that save the attention context."""
    return (jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)
            or prim.name.startswith("dot_product_attention_fwd"))


_REMAT_POLICIES = {
    "full": None,  # save nothing inside the layer
    "dots": _dots_and_cudnn_attention,
}


def scanned_layers(cfg: ModelConfig, length: int, has_swiftkv_query: bool, **kwargs) -> nn.Module:
    """`length` DecoderLayers stacked on a leading 'layers' axis and run by one `lax.scan`."""
    body = DecoderLayer
    if cfg.remat != "none":
        body = nn.remat(DecoderLayer, prevent_cse=False, policy=_REMAT_POLICIES[cfg.remat])
    return nn.scan(
        body,
        variable_axes={"params": 0, "intermediates": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,) * 5 + (0,),  # rope, positions, segment_ids, shared_kv, cache_write | cache
        length=length,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg, has_swiftkv_query, **kwargs)

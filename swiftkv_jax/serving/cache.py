"""The static-shaped KV cache: `l + (L - l) / g` layers for SwiftKV serving, `L` for the teacher wiring."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.kv_quant import as_format, init_scales
from swiftkv_jax.serving.tensor_parallel import build_sharded


@struct.dataclass
class KVCache:
    """One (k, v) pair of [B, K, S, H] arrays per cached layer (KV heads before positions, see `cache_view`), separate
    buffers so that a decode step updates each in place (see `swiftkv_jax.model.cached`). lower: a tuple of l pairs,
    layers < l (all L for a plain model). upper: layers >= l, a tuple of G = (L - l) / g pairs (one per AcrossKV group)
    in SwiftKV wiring, of L - l pairs in teacher wiring, or None. lengths [B]: valid entries per sequence; entry i holds
    position i."""

    lower: tuple
    upper: Optional[tuple]
    lengths: jax.Array

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((self.lower, self.upper)))

    def take(self, rows) -> "KVCache":
        """The cache of sequences `rows` [R] (repeats allowed): one prefilled context serves several
        continuations. A pair's K/V are [B, K, S, H]; its scales, if quantised, [B, K, S] or 0-d (static)."""
        def take_pair(pair):
            kv = tuple(jnp.take(a, rows, axis=0) for a in pair[:2])
            return kv + tuple(jnp.take(s, rows, axis=0) if s.ndim else s for s in pair[2:])

        take = lambda pairs: None if pairs is None else tuple(take_pair(p) for p in pairs)
        return KVCache(take(self.lower), take(self.upper), self.lengths[rows])


def cache_layers(config: ModelConfig, swiftkv: bool) -> int:
    """Layers of K/V held: l + (L - l) / g in SwiftKV wiring, L otherwise."""
    return config.num_kv_cache_layers if swiftkv else config.num_hidden_layers


# Logical axes of a cache's arrays, by rank: K/V [B, K, S, H], per-token-head scales [B, K, S], lengths [B], a static
# scale []. Tensor parallelism splits the KV heads (`swiftkv_jax.sharding`).
CACHE_AXES = {4: ("batch", "kv_heads", "length", "head_dim"), 3: ("batch", "kv_heads", "length"), 1: ("batch",),
              0: ()}


# The Mosaic GPU decode kernel reads the cache by TMA in 8-key tiles, which must tile the whole length
LENGTH_ALIGN = 8


def allocated_length(max_len: int) -> int:
    """The cache length `init_cache` allocates for `max_len` tokens: the next multiple of `LENGTH_ALIGN`."""
    return -(-max_len // LENGTH_ALIGN) * LENGTH_ALIGN


def init_cache(config: ModelConfig, batch_size: int, max_len: int, swiftkv: bool, dtype="auto",
               kv_scales: Optional[str] = None, mesh: Optional[Mesh] = None) -> KVCache:
    """An empty cache (zeros, lengths 0) for `batch_size` sequences of up to `max_len` tokens, allocated to the next
    multiple of `LENGTH_ALIGN` (entries past a sequence's length are never read as keys). `dtype`: `auto` (the
    model's compute dtype, `config.dtype`), a float dtype, or float8_e4m3fn / int8 with `kv_scales`
    (`swiftkv_jax.model.kv_quant`; a `KVCacheFormat` also works). On a tensor-parallel `mesh`, born split by KV
    heads."""
    if swiftkv and not config.is_swiftkv:
        raise ValueError("swiftkv=True needs a SwiftKV model: this one has no SwiftKV layers (see to_swiftkv)")
    fmt = as_format(dtype, kv_scales, config.dtype)
    row = (batch_size, config.num_key_value_heads, allocated_length(max_len), config.head_dim)
    pairs = lambda n: tuple((jnp.zeros(row, fmt.element_dtype), jnp.zeros(row, fmt.element_dtype))
                            + init_scales(fmt, row[:-1]) for _ in range(n))
    upper = config.num_kv_groups and (config.num_kv_groups if swiftkv else
                                      config.num_hidden_layers - config.num_lower_layers)
    build = lambda: KVCache(pairs(config.num_lower_layers), pairs(upper) if upper else None,
                            jnp.zeros((batch_size,), jnp.int32))
    return build_sharded(build, lambda shape: CACHE_AXES[len(shape)], mesh)

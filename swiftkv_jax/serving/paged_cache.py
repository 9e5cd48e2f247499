"""The paged KV cache's device side: a pool of fixed-size pages per cached layer, and its size from a budget (the
host side, page ids and their allocator, is `serving.pages`).

Layers held are those of the static cache (`cache_layers`): l + (L - l) / g in SwiftKV wiring, where the layers of
an AcrossKV group share one set of pages, L in teacher wiring. Every cached layer has its own pool arrays (so a
step updates each in place), and all pools share one numbering: a sequence owns page ids, the same id in every
layer. Page 0 is reserved for the padding tokens' writes (`swiftkv_jax.model.paged.NULL_PAGE`).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.kv_quant import as_format, init_scales, kv_bytes_per_token
from swiftkv_jax.serving.cache import cache_layers
from swiftkv_jax.serving.tensor_parallel import build_sharded


@struct.dataclass
class PagePool:
    """lower: l pairs of (k, v) pools [K, P, page_size, H] (layers < l; all L of a plain model); upper: G pairs
    (one per AcrossKV group) in SwiftKV wiring, L - l in teacher wiring, or None."""

    lower: tuple
    upper: Optional[tuple]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((self.lower, self.upper)))


def page_bytes(config: ModelConfig, swiftkv: bool, page_size: int, dtype, kv_scales: Optional[str] = None) -> int:
    """Bytes of one page id across every cached layer, K and V (a quantised cache's dynamic scales included)."""
    fmt = as_format(dtype, kv_scales, config.dtype)  # "auto": the model's compute dtype
    return page_size * kv_bytes_per_token(config, cache_layers(config, swiftkv), fmt)


def free_memory(devices: list) -> int:
    """The fewest bytes free now on any of `devices` (their memory_stats); a clear error where they are not reported."""
    stats = [d.memory_stats() or {} for d in devices]
    if any("bytes_limit" not in s for s in stats):
        raise ValueError(f"kv_cache_fraction needs the device's memory figures, which {devices[0].platform} "
                         f"does not report: pass kv_cache_bytes or num_pages instead")
    return min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)


def tokens_held(num_pages: int, page_size: int) -> int:
    """Tokens a pool of `num_pages` pages (as `pages_for_budget` counts them) holds for sequences: page 0 is the
    null page."""
    return (num_pages - 1) * page_size


def pages_for_budget(config: ModelConfig, swiftkv: bool, page_size: int, dtype, *, num_pages: Optional[int] = None,
                     kv_cache_bytes: Optional[int] = None, kv_cache_fraction: Optional[float] = None,
                     kv_scales: Optional[str] = None, devices: Optional[list] = None) -> int:
    """The pool's page count (the null page included) from exactly one of: a page count, a byte budget (over all
    the pool's devices), or a fraction of the memory that is free now on each of `devices` (default: the first)."""
    given = [name for name, value in (("num_pages", num_pages), ("kv_cache_bytes", kv_cache_bytes),
                                      ("kv_cache_fraction", kv_cache_fraction)) if value is not None]
    if len(given) != 1:
        raise ValueError(f"size the paged KV cache with exactly one of num_pages, kv_cache_bytes, kv_cache_fraction "
                         f"(got {', '.join(given) or 'none'})")
    per_page = page_bytes(config, swiftkv, page_size, dtype, kv_scales)
    if kv_cache_fraction is not None:
        if not 0 < kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must lie in (0, 1], got {kv_cache_fraction}")
        devices = devices or jax.devices()[:1]
        kv_cache_bytes = int(kv_cache_fraction * free_memory(devices) * len(devices))  # pages are split evenly
    if kv_cache_bytes is not None:
        num_pages = kv_cache_bytes // per_page
    if num_pages < 2:
        raise ValueError(f"the paged KV cache needs at least 2 pages (one is reserved), got {num_pages} "
                         f"({per_page} bytes a page of {page_size} tokens): raise the budget or lower page_size")
    return int(num_pages)


# Logical axes of a pool's arrays, by rank: K/V [K, P, page_size, H], per-token-head scales [K, P, page_size], a
# static scale []. Tensor parallelism splits the KV heads.
POOL_AXES = {4: ("kv_heads", None, None, "head_dim"), 3: ("kv_heads", None, None), 0: ()}


def init_pool(config: ModelConfig, num_pages: int, page_size: int, swiftkv: bool, dtype="auto",
              kv_scales: Optional[str] = None, mesh: Optional[Mesh] = None) -> PagePool:
    """Zeroed pools of `dtype` (`auto`: the model's compute dtype, `config.dtype`); a quantised one (`model.kv_quant`)
    adds its scales to each pair. On a tensor-parallel `mesh`, born split by KV heads."""
    if swiftkv and not config.is_swiftkv:
        raise ValueError("swiftkv=True needs a SwiftKV model: this one has no SwiftKV layers (see to_swiftkv)")
    fmt = as_format(dtype, kv_scales, config.dtype)
    shape = (config.num_key_value_heads, num_pages, page_size, config.head_dim)
    pairs = lambda n: tuple((jnp.zeros(shape, fmt.element_dtype), jnp.zeros(shape, fmt.element_dtype))
                            + init_scales(fmt, shape[:-1]) for _ in range(n))
    upper = config.num_kv_groups and (config.num_kv_groups if swiftkv else
                                      config.num_hidden_layers - config.num_lower_layers)
    build = lambda: PagePool(pairs(config.num_lower_layers), pairs(upper) if upper else None)
    return build_sharded(build, lambda shape: POOL_AXES[len(shape)], mesh)

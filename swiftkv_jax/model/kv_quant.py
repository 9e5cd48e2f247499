"""KV cache formats: the element dtype of a cache, and for FP8 / int8 the scales that go with it.

A quantised cache stores q = round(x / scale) clipped to the format's range, and reads x ≈ q * scale, with the
softmax and accumulation in fp32 (`dequantize` returns fp32). Two scale granularities:

- `per-layer`: one static scale for a layer's K and one for its V (vLLM's `--kv-cache-dtype fp8` default; its
  uncalibrated value is 1.0). It costs no bytes, but an outlier token or head sets the step for all of them.
- `per-token-head`: a dynamic scale per written token and KV head, amax over the head dimension / the format's
  largest value, kept in fp32 beside the cache. It costs 4 bytes per token and head (3% of an FP8 head of 128).

Bytes (`kv_bytes_per_token`) count the scales, so the paged pool sizes itself and the bytes table from one rule.

The default cache dtype is `auto`: the model's compute dtype (`ModelConfig.dtype`), as vLLM's `--kv-cache-dtype auto`
and transformers' caches (an fp32 model's cache is fp32, a bf16 model's bf16). `cache_dtype_name` resolves it, given
the model's dtype, and is the one place that does.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import jax.numpy as jnp

from swiftkv_jax.dtypes import DTYPES, dtype_name
if TYPE_CHECKING:  # config imports attention, which reads caches through this module
    from swiftkv_jax.model.config import ModelConfig

# The largest magnitude each quantised format holds: e4m3fn has no infinity, and a value past 448 casts to NaN,
# so writes clip; int8 keeps -128 unused, so the range is symmetric.
QUANTIZED_MAX = {"float8_e4m3fn": 448.0, "int8": 127.0}
AUTO = "auto"  # the model's compute dtype
CACHE_DTYPES = (AUTO,) + tuple(DTYPES) + tuple(QUANTIZED_MAX)
SCALE_GRANULARITIES = ("per-layer", "per-token-head")
SCALE_DTYPE = jnp.float32
# For both formats: a static scale of 1.0 leaves int8 unusable (K/V below 0.5 round to 0), and a good static scale
# needs calibration data (benchmarks/kv_cache.py quality measures both).
DEFAULT_SCALES = "per-token-head"
_TINY = 1e-12  # an all-zero token-head gets this scale rather than 0 (whose inverse is inf)


def is_auto(dtype) -> bool:
    """Whether a cache dtype setting is `auto` (the model's compute dtype, resolved by `cache_dtype_name`)."""
    return isinstance(dtype, str) and dtype.lower() == AUTO


def cache_dtype_name(dtype, model_dtype=None) -> str:
    """The canonical name of a cache dtype (`CACHE_DTYPES`); aliases fp8 / e4m3 / float8 name float8_e4m3fn; `auto`
    names `model_dtype`, the model's compute dtype (`ModelConfig.dtype`), which it then needs."""
    if is_auto(dtype):
        if model_dtype is None:
            raise ValueError("KV cache dtype 'auto' is the model's compute dtype: resolve it with the model's, "
                             "as_format(cache_dtype, model_dtype=config.dtype)")
        return dtype_name(model_dtype)
    if isinstance(dtype, str):
        name = dtype.lower()
        name = {"fp8": "float8_e4m3fn", "float8": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
                "fp8_e4m3": "float8_e4m3fn"}.get(name, name)
        if name in QUANTIZED_MAX:
            return name
    elif jnp.dtype(dtype).name in QUANTIZED_MAX:
        return jnp.dtype(dtype).name
    try:
        return dtype_name(dtype)
    except ValueError:
        raise ValueError(f"unknown KV cache dtype {dtype!r}: choose one of {', '.join(CACHE_DTYPES)} "
                         f"(fp8 is float8_e4m3fn)") from None


@dataclasses.dataclass(frozen=True)
class KVCacheFormat:
    """A cache's element dtype and, when quantised, its scale granularity (default `per-token-head`, see
    `DEFAULT_SCALES`). `per_layer_scale` is the static scale of every layer under `per-layer` (1.0: vLLM's
    uncalibrated FP8)."""

    dtype: str = "bfloat16"
    scales: Optional[str] = None
    per_layer_scale: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "dtype", cache_dtype_name(self.dtype))
        if not self.quantized:
            if self.scales is not None:
                raise ValueError(f"kv scales {self.scales!r} do not apply to a {self.dtype} cache: scales go with "
                                 f"a quantised cache dtype ({', '.join(QUANTIZED_MAX)}); leave them unset")
            return
        scales = DEFAULT_SCALES if self.scales is None else self.scales
        if scales not in SCALE_GRANULARITIES:
            raise ValueError(f"unknown kv scales {self.scales!r}: choose one of {', '.join(SCALE_GRANULARITIES)}")
        if not self.per_layer_scale > 0:
            raise ValueError(f"per_layer_scale must be positive, got {self.per_layer_scale}")
        object.__setattr__(self, "scales", scales)

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_MAX

    @property
    def element_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype) if self.quantized else jnp.dtype(DTYPES[self.dtype])

    @property
    def dynamic(self) -> bool:
        """Whether scales are stored per token and head beside the cache."""
        return self.scales == "per-token-head"

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) for one KV head, its scale included."""
        return head_dim * self.element_dtype.itemsize + (jnp.dtype(SCALE_DTYPE).itemsize if self.dynamic else 0)


def as_format(cache_dtype, kv_scales: Optional[str] = None, model_dtype=None) -> KVCacheFormat:
    """A `KVCacheFormat` from the user's cache dtype (a name, a dtype or a format) and scale setting; `auto` becomes
    `model_dtype`, the model's compute dtype (`ModelConfig.dtype`), which it then needs."""
    if isinstance(cache_dtype, KVCacheFormat):
        if kv_scales is not None and kv_scales != cache_dtype.scales:
            raise ValueError(f"kv scales {kv_scales!r} given beside a KVCacheFormat with {cache_dtype.scales!r}")
        return cache_dtype
    if is_auto(cache_dtype) and kv_scales is not None:  # before resolving: the message names 'auto', not a dtype
        raise ValueError(f"kv scales {kv_scales!r} do not apply to cache dtype 'auto' (the model's float dtype): "
                         f"scales go with a quantised cache dtype ({', '.join(QUANTIZED_MAX)}); leave them unset")
    fmt = KVCacheFormat(cache_dtype_name(cache_dtype, model_dtype), kv_scales)
    if fmt.dtype == "int8" and fmt.scales == "per-layer":  # named by a user: the uncalibrated static scale of 1.0
        raise ValueError("an int8 cache with per-layer scales needs a calibrated scale, and named settings give it "
                         "1.0, which rounds every K/V value below 0.5 to 0 (half of a small model's cache): use "
                         "per-token-head scales (the default), float8_e4m3fn, or "
                         "KVCacheFormat('int8', 'per-layer', per_layer_scale=S) with a scale calibrated for the model")
    return fmt


def check_format(cache_dtype, kv_scales: Optional[str] = None) -> None:
    """Raises as `as_format` would for any model, before one is known (a bad name or scale setting names the
    choices): `auto` is checked as a float cache, which it is for every model."""
    as_format(cache_dtype, kv_scales, model_dtype="float32")


def kv_bytes_per_token(config: ModelConfig, layers: int, fmt: KVCacheFormat) -> int:
    """Bytes one token's K and V take over `layers` cached layers (scales included)."""
    return 2 * layers * config.num_key_value_heads * fmt.bytes_per_token_head(config.head_dim)


def init_scales(fmt: KVCacheFormat, shape) -> tuple:
    """The scales that sit beside one layer's K and V in a cache whose K (or V) is `shape` [..., S?, H] without
    its last axis given: () for an unquantised cache; two 0-d arrays (the static per-layer scale); or two fp32
    arrays of `shape` (per token and head, filled as tokens are written)."""
    if not fmt.quantized:
        return ()
    if fmt.dynamic:
        return jnp.ones(shape, SCALE_DTYPE), jnp.ones(shape, SCALE_DTYPE)
    return jnp.asarray(fmt.per_layer_scale, SCALE_DTYPE), jnp.asarray(fmt.per_layer_scale, SCALE_DTYPE)


def quantize(x, dtype, scale=None):
    """x [..., H] into a cache of `dtype`: (q [..., H], scale). A float dtype: a cast, scale None. A quantised one
    (`QUANTIZED_MAX`): with `scale` a 0-d static scale, q = round(x / scale) clipped to the range and that scale
    back; with scale None, a dynamic scale per [...] (amax over H / the format's largest value), fp32."""
    dtype = jnp.dtype(dtype)
    if dtype.name not in QUANTIZED_MAX:
        return x.astype(dtype), None
    top = QUANTIZED_MAX[dtype.name]
    x = x.astype(jnp.float32)
    if scale is None:
        scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1) / top, _TINY).astype(SCALE_DTYPE)
    scaled = jnp.clip(x / (scale[..., None] if scale.ndim else scale), -top, top)
    if dtype == jnp.int8:
        scaled = jnp.round(scaled)
    return scaled.astype(dtype), scale


def dequantize(q, scale, dtype=jnp.float32):
    """The values a cache holds, in `dtype` (fp32 by default): q * scale (scale None: a float cache, a cast)."""
    if scale is None:
        return q.astype(dtype)
    x = q.astype(jnp.float32) * (scale[..., None] if scale.ndim else scale)
    return x.astype(dtype)


def as_stored(new, cache_dtype, scale=None, dtype=jnp.float32):
    """What a read gives back of `new` [..., H] once a cache of `cache_dtype` holds it (scale: the cache's, 0-d
    static or per-token-head dynamic, as `write_pair` takes it), in `dtype`: rounded to a float cache's dtype, or
    quantised and dequantised."""
    dynamic = scale is not None and scale.ndim > 0
    return dequantize(*quantize(new, cache_dtype, None if dynamic else scale), dtype=dtype)


def write_pair(pair, k, v, put, put_scale):
    """A layer's cache `pair` with new k, v [..., H] written into it: (k, v) for a float cache, (k, v, k_scale,
    v_scale) for a quantised one (0-d static scales, or per-token-head ones). `put(cache, q)` and
    `put_scale(scale, s)` place the quantised values and their dynamic scales; the cache kind decides where."""
    caches, scales = pair[:2], pair[2:] or (None, None)
    written, new_scales = [], []
    for cache, scale, new in zip(caches, scales, (k, v)):
        dynamic = scale is not None and scale.ndim > 0
        q, new_scale = quantize(new, cache.dtype, None if dynamic else scale)
        written.append(put(cache, q))
        new_scales.append(put_scale(scale, new_scale) if dynamic else scale)
    return tuple(written) + (tuple(new_scales) if pair[2:] else ())


def dequantize_pair(pair, index=lambda a: a):
    """The (k, v) a layer's cache holds, each `index`ed (a gather of pages, or nothing), fp32 when quantised."""
    if not pair[2:]:
        return tuple(index(a) for a in pair)
    return tuple(dequantize(index(c), index(s) if s.ndim else s) for c, s in zip(pair[:2], pair[2:]))

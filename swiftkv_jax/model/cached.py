"""The decoder's serving stages over a KV cache, layer by layer (`swiftkv_jax.serving` drives them).

Training scans stacked layers, so that compile time stays flat in depth. Serving does not, for two costs measured
in the compiled decode step (benchmarks/peers.py): inside a `lax.scan`, XLA reads each layer's weights by a
dynamic slice that it materialises (a copy of every weight, every step, on CPU), and a cache that travels as the
scan's per-layer input and output is copied whole every step. Here the layers are a Python loop over per-layer
parameter dicts (`unstack_layers`, done once per jitted program) and per-layer cache arrays: each layer reads
its weights in place and writes its new K/V with an in-place `dynamic_update_slice`.

The layer code is the training model's (`DecoderLayer`, `Embedder`, `RMSNorm`, `Transformer.head`).
Cache layout (`swiftkv_jax.serving.KVCache`, or a paged pool with `PagedBatch` as the `cache_write`): one (k, v)
pair per layer below l; above it one pair per
AcrossKV group in SwiftKV wiring (written by `swiftkv_cache_kv`, read by the group's layers), one per layer in
teacher wiring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from swiftkv_jax import sharding
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.layers import CacheWrite, DecoderLayer, RMSNorm, kv_projection
from swiftkv_jax.model.rope import apply_rope, rope_angles
from swiftkv_jax.model.transformer import Embedder, Transformer


def _split(tree, n: int, consume: bool) -> tuple:
    """n trees of the slices [i] of every leaf; with `consume`, each leaf is deleted once it is sliced."""
    def leaf(a):
        parts = tuple(a[i] for i in range(n))
        if consume:
            a.delete()
        return parts

    split = jax.tree.map(leaf, tree)
    return tuple(jax.tree.map(lambda parts: parts[i], split, is_leaf=lambda x: isinstance(x, tuple)) for i in range(n))


def unstack_layers(params: dict, config: ModelConfig, consume: bool = False) -> dict:
    """The parameters in serving layout (idempotent): `layers` a tuple of l per-layer dicts, `swiftkv_groups/layers`
    a tuple over groups of tuples of g; the owners' k/v_proj_swiftkv tuples of G (a product over the stacked
    [G, D, K, H] kernel would transpose it to [D, G, K, H], a copy of those weights at every step).
    Inside jit this costs one copy of the layer weights per program, not one per step. Outside jit, `consume`
    deletes each stacked array once it is sliced (the caller's params are unusable afterwards): the layer weights
    then exist once, at a peak of one stacked array more, instead of twice."""
    if isinstance(params["layers"], tuple):
        return params
    out = dict(params, layers=_split(params["layers"], config.num_lower_layers, consume))
    if "swiftkv_groups" in params:
        groups = params["swiftkv_groups"]
        by_group = _split(groups["layers"], config.num_kv_groups, consume)
        owners = {name: _split(groups[name], config.num_kv_groups, consume)
                  for name in ("k_proj_swiftkv", "v_proj_swiftkv")}
        out["swiftkv_groups"] = dict(groups, **owners, layers=tuple(_split(g, config.key_value_group_size, consume)
                                                                    for g in by_group))
    return out


def _run_layer(config: ModelConfig, has_swiftkv_query: bool, layer_params, h, *args):
    return DecoderLayer(config, has_swiftkv_query).apply({"params": layer_params}, h, *args)


def _query_segments(cache_write, positions):
    """Segment ids [B, T] of new tokens over a dense cache: 0, or -1 for the right padding past each sequence's
    length (a prompt padded to its bucket). The cache marks its entries past the length -1 too (`cache_positions`),
    so the padding sees the padding only (or nothing, where a kernel masks by kv_lengths), never the prompt's keys:
    attention skips those blocks instead of doing a real token's work (a 16385-token prompt, padded to 32768, cost
    3.2x a 16384-token one). A paged batch masks by its own segments (`PagedView.attend` ignores these)."""
    if isinstance(cache_write, CacheWrite):
        return jnp.where(positions < cache_write.kv_lengths[:, None], 0, -1)
    return jnp.zeros_like(positions)


def cached_lower(params, config: ModelConfig, tokens, positions, cache_write: CacheWrite, cache: tuple):
    """Embedding and layers < l for new tokens [B, T] at positions [B, T], each layer's K/V written into its
    (k, v) of `cache`: (residual h_l [B, T, D], updated cache)."""
    h = Embedder(config).apply({"params": params["embed_tokens"]}, tokens)
    rope = rope_angles(config.rope, config.head_dim, positions)
    segments = _query_segments(cache_write, positions)
    updated = []
    for layer_params, layer_cache in zip(params["layers"], cache):
        h, layer_cache = _run_layer(config, False, layer_params, h, rope, positions, segments, None, cache_write,
                                    layer_cache)
        updated.append(layer_cache)
    return h, tuple(updated)


def swiftkv_cache_kv(params, config: ModelConfig, h, positions, cache_write: CacheWrite, cache: tuple):
    """The K/V of every AcrossKV group for tokens with residual h_l [B, T, D], written into the group caches
    (SWIFTKV.md §2): each owner's projections of norm_swiftkv(h_l), its kernels read in place. Returns the updated
    cache."""
    if not config.num_kv_groups:  # l == L: no later layer
        return cache
    x = RMSNorm(config).apply({"params": params["norm_swiftkv"]}, h)
    owners = params["swiftkv_groups"]
    rope = rope_angles(config.rope, config.head_dim, positions)
    project = lambda p: kv_projection(config).apply({"params": p}, x)
    return tuple(cache_write.write(pair, apply_rope(project(k), *rope), project(v))
                 for pair, k, v in zip(cache, owners["k_proj_swiftkv"], owners["v_proj_swiftkv"]))


def cached_upper(params, config: ModelConfig, h, positions, cache_write: CacheWrite, cache: tuple, swiftkv: bool):
    """Layers >= l for tokens h [B, T, D]: (final residual, updated cache).

    SwiftKV wiring: `cache` holds one (k, v) per group, filled by `swiftkv_cache_kv` and only read here (the
    layers' queries come from q_proj_swiftkv). Teacher wiring: one (k, v) per layer, each written by its layer.
    """
    if not config.num_kv_groups:
        return h, cache
    rope = rope_angles(config.rope, config.head_dim, positions)
    segments = _query_segments(cache_write, positions)
    updated = []
    for group, group_layers in enumerate(params["swiftkv_groups"]["layers"]):
        shared_kv = cache_write.view(cache[group]) if swiftkv else None
        for j, layer_params in enumerate(group_layers):
            layer_cache = None if swiftkv else cache[group * config.key_value_group_size + j]
            h, layer_cache = _run_layer(config, True, layer_params, h, rope, positions, segments, shared_kv,
                                        cache_write, layer_cache)
            updated.append(layer_cache)
    return h, (cache if swiftkv else tuple(updated))


def head(params, config: ModelConfig, h):
    """Final norm and output projection: fp32 logits [B, T, V], whole on every device under tensor parallelism
    (sampling and scoring then run replicated, as in vLLM)."""
    logits = Transformer(config).apply({"params": params}, h, method="head")
    return sharding.constrain(logits, ("batch", "length", None))

"""Serving: a static KV cache, SwiftKV prefill, on-device decode loop, `generate`; and `Engine`, continuous batching
over a paged KV cache; both tensor-parallel on a `serving_mesh`."""

from swiftkv_jax.serving.cache import KVCache, cache_layers, init_cache
from swiftkv_jax.serving.continuous import Engine, EngineConfig, RequestOutput
from swiftkv_jax.serving.engine import decode_step, prefill
from swiftkv_jax.serving.generate import Generation, generate, generate_tokens
from swiftkv_jax.serving.sampling import SamplingParams, sample
from swiftkv_jax.serving.tensor_parallel import load_sharded, serving_mesh, shard_model

__all__ = ["Engine", "EngineConfig", "Generation", "KVCache", "SamplingParams", "cache_layers", "decode_step",
           "generate", "generate_tokens", "init_cache", "load_sharded", "prefill", "RequestOutput", "sample",
           "serving_mesh", "shard_model"]

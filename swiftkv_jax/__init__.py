"""swiftkv-jax: SwiftKV (SingleInputKV + AcrossKV) for Llama-family models in JAX/Flax.

    import swiftkv_jax as sk
    model = sk.load(path, dtype=None)              # HF or Orbax directory, detected
    student = sk.to_swiftkv(model, num_key_value_layers=16, key_value_group_size=1)
    logits = sk.logits(student, tokens)            # [B, T] -> [B, T, V], SwiftKV wiring
    sk.save(student, out_dir, format="hf")         # or "orbax"
    out = sk.generate(student, [[1, 2, 3]], max_new_tokens=32)  # SwiftKV prefill + on-device decode
    engine = sk.Engine(student, num_pages=1024)     # continuous batching over a paged KV cache
    mesh = sk.serving_mesh(8)                        # tensor-parallel serving: mesh= in generate and Engine
"""

from swiftkv_jax.checkpoints import CheckpointError, detect_format, load, save
from swiftkv_jax.model import (Model, ModelConfig, RopeConfig, Transformer, abstract_params, cast, check_params,
                               forward, init, intermediates, logical_axes, logits, param_shardings, to_swiftkv)
from swiftkv_jax.serving import Engine, EngineConfig, generate, load_sharded, serving_mesh
from swiftkv_jax.sharding import LOGICAL_AXIS_RULES, make_mesh

__all__ = [
    "CheckpointError", "Engine", "EngineConfig", "LOGICAL_AXIS_RULES", "Model", "ModelConfig", "RopeConfig",
    "Transformer", "abstract_params", "cast", "check_params", "detect_format", "forward", "generate", "init",
    "intermediates", "load", "load_sharded", "logical_axes", "logits", "make_mesh", "param_shardings", "save",
    "serving_mesh", "to_swiftkv",
]

"""The Llama-family model with SwiftKV layers: config, Linen modules, functional API, transform."""

from swiftkv_jax.model.config import ModelConfig, RopeConfig
from swiftkv_jax.model.model import (Model, abstract_params, cast, check_params, forward, init, intermediates,
                                     logical_axes, logits, param_shardings)
from swiftkv_jax.model.swiftkv import to_swiftkv
from swiftkv_jax.model.transformer import Transformer

__all__ = [
    "ModelConfig", "RopeConfig",
    "Model", "abstract_params", "cast", "check_params", "forward", "init", "intermediates", "logical_axes", "logits",
    "param_shardings",
    "to_swiftkv",
    "Transformer",
]

"""The SwiftKV transform: a plain model -> a student initialised per ../shared/SWIFTKV.md §3."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from swiftkv_jax.model.config import ModelConfig, check_swiftkv_layout
from swiftkv_jax.model.model import Model

NORM_INITS = ("copy", "ones")


def to_swiftkv(model: Model, num_key_value_layers: int, key_value_group_size: int = 1,
               norm_init: str = "copy") -> Model:
    """Student of `model` with SingleInputKV from layer l and AcrossKV groups of g.

    q_proj_swiftkv = the layer's q_proj; each owner's k/v_proj_swiftkv = the mean of its group's k/v_proj
    (a copy for g = 1); norm_swiftkv = layer l's input_layernorm ("copy") or ones (the paper-era init).
    The original weights are kept: they define the teacher. Shardings follow the input's.
    """
    cfg = model.config
    if cfg.is_swiftkv:
        raise ValueError(
            f"the model is already a SwiftKV model (num_key_value_layers={cfg.num_key_value_layers}, "
            f"key_value_group_size={cfg.key_value_group_size}); to_swiftkv applies once, to a plain model"
        )
    check_swiftkv_layout(cfg.num_hidden_layers, num_key_value_layers, key_value_group_size)
    if norm_init not in NORM_INITS:
        raise ValueError(f"norm_init must be one of {NORM_INITS}, got {norm_init!r}")
    student = cfg.replace(num_key_value_layers=num_key_value_layers, key_value_group_size=key_value_group_size)
    params = jax.jit(_student_params, static_argnums=(1, 2))(model.params, student, norm_init)
    return Model(student, params)


def _student_params(params: dict, cfg: ModelConfig, norm_init: str) -> dict:
    l, g, groups = cfg.num_key_value_layers, cfg.key_value_group_size, cfg.num_kv_groups
    layers = params["layers"]
    out = {k: v for k, v in params.items() if k != "layers"}
    out["layers"] = jax.tree.map(lambda a: a[:l], layers)
    if norm_init == "copy" and l < cfg.num_hidden_layers:
        out["norm_swiftkv"] = {"scale": layers["input_layernorm"]["scale"][l]}
    else:  # "ones", or l == L where no later layer reads it
        out["norm_swiftkv"] = {"scale": jnp.ones_like(layers["input_layernorm"]["scale"][0])}
    if groups:
        later = jax.tree.map(lambda a: a[l:].reshape((groups, g) + a.shape[1:]), layers)
        attn = later["self_attn"]
        attn["q_proj_swiftkv"] = dict(attn["q_proj"])
        group_mean = lambda a: jnp.mean(a.astype(jnp.float32), axis=1).astype(a.dtype)
        out["swiftkv_groups"] = {
            "k_proj_swiftkv": jax.tree.map(group_mean, attn["k_proj"]),
            "v_proj_swiftkv": jax.tree.map(group_mean, attn["v_proj"]),
            "layers": later,
        }
    return out

"""The SwiftKV transform: a plain model -> a student initialised per ../shared/SWIFTKV.md §3."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import traverse_util

from swiftkv_jax.checks import flag, integer
from swiftkv_jax.model.config import ModelConfig, check_swiftkv_layout
from swiftkv_jax.model.model import Model

NORM_INITS = ("copy", "ones")


def to_swiftkv(model: Model, num_key_value_layers: int, key_value_group_size: int = 1,
               norm_init: str = "copy", *, donate: bool = False) -> Model:
    """Student of `model` with SingleInputKV from layer l and AcrossKV groups of g.

    q_proj_swiftkv = the layer's q_proj; each owner's k/v_proj_swiftkv = the mean of its group's k/v_proj
    (a copy for g = 1); norm_swiftkv = layer l's input_layernorm ("copy") or ones (the paper-era init).
    The original weights are kept: they define the teacher. Shardings and dtypes follow the input's.

    The student holds every weight of `model` again (its layers split at l), so while both are alive memory holds
    the weights twice. `donate=True` consumes `model` instead: its stacked layer weights are transformed one at a
    time and each deleted once its parts exist, so the peak is the student plus one stacked weight (8B in bf16:
    ~17 GB rather than ~33 GB); `model` is unusable afterwards. The embeddings, final norm and lm_head are the
    student's own either way (no copy).
    """
    if not isinstance(model, Model):
        raise TypeError(f"to_swiftkv takes a Model (as sk.load and sk.init return), got {type(model).__name__}")
    # bools are ints to Python (a[True] adds an axis: a student that fails only when saved), numpy ints are fine,
    # and donate="false" would be true: checked by name
    num_key_value_layers = integer("num_key_value_layers", num_key_value_layers)
    key_value_group_size = integer("key_value_group_size", key_value_group_size)
    donate = flag("donate", donate)
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
    if not donate:
        params = jax.jit(_student_params, static_argnums=(1, 2))(model.params, student, norm_init)
        return Model(student, params)
    flat = {k: v for k, v in traverse_util.flatten_dict(model.params).items() if k[0] != "layers"}
    for path, leaf in traverse_util.flatten_dict(model.params["layers"]).items():
        flat.update(_split_leaf(leaf, path, student, norm_init))
        if isinstance(leaf, jax.Array):
            leaf.delete()  # its parts are the student's now: one stacked weight in flight, not the teacher's layers
    return Model(student, traverse_util.unflatten_dict(flat))


def _student_params(params: dict, cfg: ModelConfig, norm_init: str) -> dict:
    flat = {k: v for k, v in traverse_util.flatten_dict(params).items() if k[0] != "layers"}
    for path, leaf in traverse_util.flatten_dict(params["layers"]).items():
        flat.update(_parts(leaf, path, cfg, norm_init))
    return traverse_util.unflatten_dict(flat)


def _parts(a, path: tuple, cfg: ModelConfig, norm_init: str) -> dict:
    """The student's parameters made from the teacher's stacked layer weight `a` at `path` under "layers", by
    their paths in the student's tree, each in `a`'s dtype."""
    l, g, groups = cfg.num_key_value_layers, cfg.key_value_group_size, cfg.num_kv_groups
    out = {("layers", *path): a[:l]}
    if path == ("input_layernorm", "scale"):
        if norm_init == "copy" and l < cfg.num_hidden_layers:
            out[("norm_swiftkv", "scale")] = a[l]
        else:  # "ones", or l == L where no later layer reads it
            out[("norm_swiftkv", "scale")] = jnp.ones_like(a[0])
    if groups:
        later = a[l:].reshape((groups, g) + a.shape[1:])
        out[("swiftkv_groups", "layers", *path)] = later
        module = path[:2]
        if module == ("self_attn", "q_proj"):
            out[("swiftkv_groups", "layers", "self_attn", "q_proj_swiftkv", *path[2:])] = later
        elif module in (("self_attn", "k_proj"), ("self_attn", "v_proj")):
            mean = jnp.mean(later.astype(jnp.float32), axis=1).astype(a.dtype)
            out[("swiftkv_groups", f"{path[1]}_swiftkv", *path[2:])] = mean
    return out


_split_leaf = jax.jit(_parts, static_argnums=(1, 2, 3))

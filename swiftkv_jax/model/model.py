"""`Model` = config + plain parameter pytree, and the functional entry points over it."""

from __future__ import annotations

import functools
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from swiftkv_jax import sharding
from swiftkv_jax.dtypes import as_dtype, dtype_name
from swiftkv_jax.model.config import ModelConfig, serves_swiftkv
from swiftkv_jax.model.transformer import Transformer


@struct.dataclass
class Model:
    """A config (static) and its parameters (a pytree of plain nested dicts of arrays)."""

    config: ModelConfig = struct.field(pytree_node=False)
    params: dict


def _boxed_init(config: ModelConfig, rng):
    # The parameters do not depend on the attention backend; XLA's traces for any dtype and device (cuDNN refuses
    # the fp32 of an export, the kernels want their own shapes).
    return Transformer(config.replace(attention_impl="xla")).init(rng, jnp.zeros((1, 1), jnp.int32))["params"]


@functools.lru_cache(maxsize=64)
def _abstract_boxed(config: ModelConfig):
    return jax.eval_shape(functools.partial(_boxed_init, config), jax.random.key(0))


def abstract_params(config: ModelConfig):
    """ShapeDtypeStructs of the parameter tree, without allocating it (works for 70B)."""
    return nn.meta.unbox(_abstract_boxed(config))


def logical_axes(config: ModelConfig):
    """Logical PartitionSpec of every parameter (names as in `sharding.LOGICAL_AXIS_RULES`)."""
    return nn.get_partition_spec(_abstract_boxed(config))


def param_shardings(config: ModelConfig, mesh: Mesh, rules=sharding.LOGICAL_AXIS_RULES):
    """NamedSharding of every parameter on `mesh` under `rules`."""
    return sharding.logical_to_shardings(logical_axes(config), abstract_params(config), mesh, rules)


def init(config: ModelConfig, rng=0, mesh: Optional[Mesh] = None, rules=sharding.LOGICAL_AXIS_RULES) -> Model:
    """Random parameters (normal(initializer_range), norms at one); born sharded when a mesh is given. `rng`: an int
    seed or a PRNG key."""
    if not isinstance(config, ModelConfig):  # a dict failed on `config.replace`, naming neither
        raise TypeError(f"config must be a ModelConfig (ModelConfig(**fields) for a dict of its fields), got "
                        f"{type(config).__name__}")
    rng = _prng_key(rng)
    out_shardings = None if mesh is None else param_shardings(config, mesh, rules)
    params = jax.jit(lambda r: nn.meta.unbox(_boxed_init(config, r)), out_shardings=out_shardings)(rng)
    return Model(config, params)


def _prng_key(rng):
    """init's rng as a key: from an int seed, or a jax.random.key, or a legacy jax.random.PRNGKey (uint32[2])."""
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, (bool, np.bool_)):
        return jax.random.key(int(rng))
    array = isinstance(rng, (jax.Array, np.ndarray))
    if array and (rng.shape == () and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
                  or rng.shape == (2,) and rng.dtype == np.uint32):
        return rng
    got = f"an array {rng.dtype}{list(rng.shape)}" if array else f"{rng!r:.80}"
    # None failed inside flax and text inside jit, naming neither
    raise TypeError(f"rng must be an int seed or one PRNG key (jax.random.key(seed)), got {got}")


def cast(model: Model, dtype, compute_dtype=None) -> Model:
    """The model with parameters stored in `dtype` (compute dtype too, unless given)."""
    name = dtype_name(dtype)
    cfg = model.config.replace(param_dtype=name, dtype=dtype_name(compute_dtype or name))
    return Model(cfg, jax.tree.map(lambda a: a.astype(as_dtype(name)), model.params))


def check_params(config: ModelConfig, params) -> None:
    """Raise ValueError naming the first missing, unexpected or mis-shaped parameter; `params` stacked, or in the
    engines' serving layout (`unstack_layers`: tuples of per-layer dicts)."""
    expected = abstract_params(config)
    if isinstance(params, dict) and isinstance(params.get("layers"), tuple):
        from swiftkv_jax.model.cached import unstack_layers  # it imports this module

        expected = jax.eval_shape(lambda p: unstack_layers(p, config), expected)
    flat_expected = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
    flat_given = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, spec in flat_expected.items():
        if path not in flat_given:
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} {tuple(spec.shape)} is missing")
        shape = tuple(np.shape(flat_given[path]))
        if shape != tuple(spec.shape):
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} has shape {shape}, the config needs {tuple(spec.shape)}"
            )
    unexpected = sorted(jax.tree_util.keystr(path) for path in flat_given.keys() - flat_expected.keys())
    if unexpected:
        raise ValueError(f"unexpected parameter(s) {', '.join(unexpected)} for this config")


def forward(params, tokens, positions=None, segment_ids=None, *, config: ModelConfig, swiftkv: bool = False):
    """Pure teacher-forced forward; fp32 logits [B, T, V]. Traceable: jit, grad and shard it freely."""
    check_params(config, params)  # shapes only; another config's weights failed inside lax.scan, naming neither
    return Transformer(config).apply({"params": params}, tokens, positions, segment_ids, swiftkv=swiftkv)


_jitted_forward = jax.jit(forward, static_argnames=("config", "swiftkv"))


@functools.partial(jax.jit, static_argnames=("config", "swiftkv"))
def _forward_with_intermediates(params, tokens, positions, segment_ids, *, config: ModelConfig, swiftkv: bool):
    logits, state = Transformer(config).apply(
        {"params": params}, tokens, positions, segment_ids, swiftkv=swiftkv, mutable=["intermediates"]
    )
    sown = state["intermediates"]
    stacks = [sown["layers"]]
    if "swiftkv_groups" in sown:  # [G, g, ...] -> [G * g, ...]: layer order
        stacks.append(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), sown["swiftkv_groups"]["layers"]))
    residual = jnp.concatenate([sown["embeddings"][0][None]] + [stack["residual"][0] for stack in stacks])
    keys = jnp.concatenate([stack["self_attn"]["keys"][0] for stack in stacks])
    return logits, {"residual": residual, "keys": keys}


def _as_int_array(name: str, value, shape=None):
    value = value if isinstance(value, jax.Array) else np.asarray(value)
    if value.ndim != 2 or not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array [B, T], got {value.dtype}{list(value.shape)}")
    if shape is not None and value.shape != shape:
        raise ValueError(f"{name} has shape {list(value.shape)}, tokens have {list(shape)}")
    return value


def _checked_inputs(model: Model, tokens, swiftkv, positions, segment_ids):
    cfg = model.config
    check_params(cfg, model.params)  # another config's weights failed inside flax or lax.scan, naming neither
    swiftkv = serves_swiftkv(cfg, swiftkv)
    tokens = _as_int_array("tokens", tokens)
    if tokens.size == 0:
        raise ValueError(f"tokens {list(tokens.shape)} hold no token: logits need at least one")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}), got values in [{low}, {high}]")
    if positions is not None:
        positions = _as_int_array("positions", positions, tokens.shape)
    if segment_ids is not None:
        segment_ids = _as_int_array("segment_ids", segment_ids, tokens.shape)
    return tokens, bool(swiftkv), positions, segment_ids


def logits(model: Model, tokens, swiftkv: Optional[bool] = None, positions=None, segment_ids=None) -> jax.Array:
    """Teacher-forced logits at every position: tokens int [B, T] -> float32 [B, T, V].

    swiftkv=None runs the SwiftKV wiring when the model has SwiftKV layers, the teacher wiring otherwise.
    positions [B, T] (default 0..T-1) and segment_ids [B, T] (default 0) as in `Transformer`.
    """
    tokens, swiftkv, positions, segment_ids = _checked_inputs(model, tokens, swiftkv, positions, segment_ids)
    return _jitted_forward(model.params, tokens, positions, segment_ids, config=model.config, swiftkv=swiftkv)


def intermediates(model: Model, tokens, swiftkv: Optional[bool] = None, positions=None, segment_ids=None):
    """(logits, {"residual": [L + 1, B, T, D], "keys": [L, B, T, K, H]}) of one forward.

    residual[0] is the embedding output and residual[i] the output of layer i - 1 (before the final
    norm); keys[i] are the rotated keys layer i attends with (a SwiftKV layer's are its group owner's).
    """
    tokens, swiftkv, positions, segment_ids = _checked_inputs(model, tokens, swiftkv, positions, segment_ids)
    return _forward_with_intermediates(model.params, tokens, positions, segment_ids, config=model.config,
                                       swiftkv=swiftkv)

"""The student of a run: its config, and its parameters split into trainable (fp32 master) and frozen
(held once, e.g. bf16), each sharded on the mesh — for real from the teacher checkpoint, or abstractly
(shapes and shardings only) for `--dry-run`."""

from __future__ import annotations

from pathlib import Path

import jax
from jax.sharding import Mesh

from swiftkv_jax import checkpoints, sharding
from swiftkv_jax.checkpoints.hf import INDEX_FILE, SINGLE_FILE, CheckpointError, read_config
from swiftkv_jax.checkpoints.hf_config import config_from_hf
from swiftkv_jax.configuration import ConfigError
from swiftkv_jax.distill import trainable as trainable_lib
from swiftkv_jax.distill.config import ModelSection
from swiftkv_jax.dtypes import as_dtype
from swiftkv_jax.model.attention import (ATTENTION_IMPLS, DIFFERENTIABLE_IMPLS, cudnn_max_head_dim,
                                         cudnn_takes_head_dim)
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.checkpoints.orbax import is_orbax_checkpoint
from swiftkv_jax.model.model import abstract_params, init, param_shardings
from swiftkv_jax.model.swiftkv import to_swiftkv


AUTO = "auto"  # MaxText's `attention: autoselected`: the fastest this machine trains with (`training_attention`)
TRAINING_ATTENTION = (AUTO, *DIFFERENTIABLE_IMPLS)


def cudnn_packed_layout() -> bool:
    """cuDNN's packed layout (several documents a row, causal within each) needs Hopper (sm_90) or later."""
    return float(getattr(jax.devices()[0], "compute_capability", None) or 0) >= 9


def _computes_in_16_bits(section: ModelSection) -> bool:
    return as_dtype(section.compute_dtype) in (as_dtype("bfloat16"), as_dtype("float16"))


def training_attention(section: ModelSection, head_dim: int) -> str:
    """model.attention_impl, with `auto` resolved: cuDNN's fused attention on an NVIDIA sm_90+ GPU computing in
    16 bits at a head dim it takes (the 8B distillation step on an H200: 0.56 s against 1.31 s with xla_chunked,
    2026-11-25), else xla_chunked (before Hopper cuDNN would attend packed rows through a [T, S] bias; a head dim
    that is not a multiple of 8, OpenLLaMA 3B's 100, it refuses at the first step)."""
    if section.attention_impl != AUTO:
        return section.attention_impl
    gpu = jax.default_backend() == "gpu"
    cudnn = gpu and _computes_in_16_bits(section) and cudnn_packed_layout() and cudnn_takes_head_dim(head_dim)
    return "cudnn" if cudnn else "xla_chunked"


def check_attention(section: ModelSection) -> None:
    """A trainable attention_impl that this machine runs, refused before any data is read."""
    impl = section.attention_impl
    if impl == AUTO:
        return
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(f"model.attention_impl={impl!r} is unknown: training runs one of "
                          f"{', '.join(TRAINING_ATTENTION)}")
    if impl not in DIFFERENTIABLE_IMPLS:
        raise ConfigError(f"model.attention_impl={impl!r} has no backward pass; training needs one of "
                          f"{', '.join(TRAINING_ATTENTION)} (xla_chunked bounds memory on long sequences)")
    if impl == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(f"model.attention_impl='cudnn' needs an NVIDIA GPU, but JAX's backend is "
                          f"{jax.default_backend()!r}: use xla_chunked (or xla)")
    if impl == "cudnn" and not _computes_in_16_bits(section):
        raise ConfigError(f"model.attention_impl='cudnn' computes in bfloat16 or float16, but model.compute_dtype is "
                          f"{section.compute_dtype!r}: set model.compute_dtype=bfloat16, or use xla_chunked")


def _student_of(teacher: ModelConfig, section: ModelSection) -> ModelConfig:
    l, g = section.num_key_value_layers, section.key_value_group_size
    if teacher.is_swiftkv and (teacher.num_key_value_layers, teacher.key_value_group_size) != (l, g):
        raise ConfigError(
            f"{section.teacher} is already a SwiftKV model with l={teacher.num_key_value_layers}, "
            f"g={teacher.key_value_group_size}, but the config asks for l={l}, g={g}: set "
            f"model.num_key_value_layers/key_value_group_size to match, or start from the plain model"
        )
    if l >= teacher.num_hidden_layers:
        raise ConfigError(
            f"model.num_key_value_layers={l} leaves no layer to distil in a {teacher.num_hidden_layers}-layer "
            f"model: choose l < {teacher.num_hidden_layers} (the paper uses l = L/2)"
        )
    try:
        return teacher.replace(num_key_value_layers=l, key_value_group_size=g, remat=section.remat)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


def _teacher_config(section: ModelSection) -> ModelConfig:
    check_attention(section)  # before ModelConfig refuses an unknown one without naming the key
    try:
        hf_config = read_config(section.teacher)
    except (FileNotFoundError, CheckpointError) as e:
        raise ConfigError(f"model.teacher: {e}") from None
    try:
        config = config_from_hf(hf_config, param_dtype=section.frozen_dtype, dtype=section.compute_dtype)
    except (ValueError, TypeError) as e:  # an unsupported model_type, a missing or malformed field
        raise ConfigError(f"model.teacher: {Path(section.teacher) / 'config.json'}: {e}") from None
    impl = training_attention(section, config.head_dim)
    if impl == "cudnn" and not cudnn_takes_head_dim(config.head_dim):  # now, not at the first step
        raise ConfigError(f"model.attention_impl='cudnn' cannot run the teacher's head_dim {config.head_dim} on this "
                          f"GPU (cuDNN takes multiples of 8 up to {cudnn_max_head_dim()} here): use xla_chunked "
                          f"(or auto)")
    return config.replace(attention_impl=impl)


def student_config(section: ModelSection) -> ModelConfig:
    """The student's config from the teacher's config.json alone (no weights read)."""
    return _student_of(_teacher_config(section), section)


def pretrain_config(section: ModelSection) -> ModelConfig:
    """stage pretrain: the plain model trained as a whole (its config.json)."""
    config = _teacher_config(section)
    if config.is_swiftkv:
        raise ConfigError(f"stage pretrain trains a plain model, but {section.teacher} is a SwiftKV model: pretrain "
                          f"its base model, then distil (stage distill)")
    return config.replace(remat=section.remat)


def has_weights(path) -> bool:
    """A checkpoint with weights, rather than a config.json that only describes the model."""
    path = Path(path)
    return is_orbax_checkpoint(path) or (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()


def require_weights(section: ModelSection) -> None:
    """Distilling needs the teacher's weights (pretraining starts from a config.json alone)."""
    if not has_weights(section.teacher):
        raise ConfigError(f"model.teacher: {section.teacher} holds a config.json but no weights: distillation needs "
                          f"the teacher's weights (only stage: pretrain starts from a config.json alone, with random "
                          f"weights)")


def abstract_pretrain(section: ModelSection, mesh: Mesh, rules=sharding.LOGICAL_AXIS_RULES):
    """(config, trainable = every parameter, frozen = {}) as ShapeDtypeStructs with shardings."""
    config = pretrain_config(section)
    dtype = as_dtype(section.trainable_dtype)
    trainable = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh),
                             abstract_params(config), param_shardings(config, mesh, rules))
    return config, trainable, {}


def load_pretrain(section: ModelSection, mesh: Mesh, seed: int, rules=sharding.LOGICAL_AXIS_RULES):
    """(config, trainable = every parameter, frozen = {}): the checkpoint's weights, or random weights (seeded,
    born sharded) when model.teacher holds only a config.json. Master weights in trainable_dtype."""
    config = pretrain_config(section)
    master = as_dtype(section.trainable_dtype)
    if has_weights(section.teacher):
        try:
            params = checkpoints.load(section.teacher, master, mesh=mesh, rules=rules,
                                      compute_dtype=section.compute_dtype).params
        except (FileNotFoundError, checkpoints.CheckpointError) as e:
            raise ConfigError(f"model.teacher: {e}") from None
    else:
        params = init(config.replace(param_dtype=section.trainable_dtype), seed, mesh=mesh, rules=rules).params
    return config, params, {}


def split_shardings(config: ModelConfig, mesh: Mesh, rules=sharding.LOGICAL_AXIS_RULES):
    """(trainable, frozen) trees of NamedShardings."""
    return trainable_lib.split(param_shardings(config, mesh, rules))


def abstract_student(section: ModelSection, mesh: Mesh, rules=sharding.LOGICAL_AXIS_RULES):
    """(config, trainable, frozen) as ShapeDtypeStructs carrying their shardings: nothing allocated."""
    config = student_config(section)
    shapes = trainable_lib.split(abstract_params(config))
    dtypes = (as_dtype(section.trainable_dtype), as_dtype(section.frozen_dtype))
    trees = [
        jax.tree.map(lambda s, sh, dt=dt: jax.ShapeDtypeStruct(s.shape, dt, sharding=sh), shape, shard)
        for shape, shard, dt in zip(shapes, split_shardings(config, mesh, rules), dtypes)
    ]
    return config, trees[0], trees[1]


def load_student(section: ModelSection, mesh: Mesh, rules=sharding.LOGICAL_AXIS_RULES):
    """(config, trainable, frozen) from the teacher checkpoint, born sharded on `mesh`.

    A plain teacher goes through `to_swiftkv`; a SwiftKV checkpoint with the same l and g continues
    as it is (its original weights are the teacher).
    """
    config = student_config(section)  # validates before any weight is read
    require_weights(section)
    try:
        model = checkpoints.load(section.teacher, section.frozen_dtype, mesh=mesh, rules=rules,
                                 compute_dtype=section.compute_dtype, attention_impl=config.attention_impl)
    except (FileNotFoundError, checkpoints.CheckpointError) as e:
        raise ConfigError(f"model.teacher: {e}") from None
    if not model.config.is_swiftkv:  # consumed: the teacher's layers and the student's are never both held
        model = to_swiftkv(model, section.num_key_value_layers, section.key_value_group_size, section.norm_init,
                           donate=True)
    trainable, frozen = trainable_lib.split(model.params)
    master = as_dtype(section.trainable_dtype)
    trainable = jax.jit(lambda t: jax.tree.map(lambda a: a.astype(master), t))(trainable)
    return config, trainable, frozen

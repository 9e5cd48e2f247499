"""Tensor-parallel serving: attention heads, MLP columns and the vocabulary split over a mesh's `tensor` axis.

The weights are placed by the one logical-axis table (`swiftkv_jax.sharding.LOGICAL_AXIS_RULES`: q_heads, kv_heads,
mlp and vocab on `tensor`), the KV cache (dense or paged) is split by KV heads, and the logits are gathered so that
sampling runs replicated. XLA's SPMD partitioner inserts the collectives (an all-reduce after each attention and MLP
block, the embedding's and the logits' exchanges); the Pallas and cuDNN kernels, which it cannot split, run per
shard inside `shard_map` (`sharding.map_over_heads`), each device on its own heads.

KV heads that do not divide by the tensor size are replicated the way vLLM does it: with K heads on T devices (T a
multiple of K) each head is repeated T / K times (`replicate_kv_heads`, an exact transform: query head n reads a copy
of its own KV head), so every device holds one KV head, and the KV cache costs T / K times its unsplit size in all.
A vocabulary that does not divide (vLLM pads it instead) leaves the embedding and output head whole on every device.
Query heads and MLP columns must divide: a size that cannot work is an error naming the sizes that do.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from swiftkv_jax import sharding
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.model import Model, logical_axes, param_shardings

log = logging.getLogger(__name__)

TENSOR = "tensor"


def serving_mesh(tensor_parallel: int, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A mesh of the first `tensor_parallel` devices, all on the `tensor` axis (data = fsdp = 1)."""
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel must be a positive integer, got {tensor_parallel!r}")
    if tensor_parallel > len(devices):
        raise ValueError(f"--tensor-parallel {tensor_parallel} needs {tensor_parallel} devices, but JAX sees "
                         f"{len(devices)} ({devices[0].platform}): lower --tensor-parallel to at most {len(devices)}")
    return sharding.make_mesh(data=1, fsdp=1, tensor=tensor_parallel, devices=devices[:tensor_parallel])


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """How a model splits over `tensor` devices: each KV head is held by `kv_replicas` of them; the embedding and
    output head are split by vocabulary when it divides (`vocab_split`), else whole on every device."""

    tensor: int
    kv_replicas: int
    vocab_split: bool

    def describe(self, config: ModelConfig) -> str:
        k = config.num_key_value_heads
        text = (f"tensor parallel over {self.tensor} devices: {config.num_attention_heads // self.tensor} query "
                f"heads and {k * self.kv_replicas // self.tensor} KV head(s) per device")
        if self.kv_replicas > 1:
            text += (f"; the model's {k} KV heads do not divide by {self.tensor}, so each is replicated on "
                     f"{self.kv_replicas} devices (as vLLM does)")
        if not self.vocab_split:
            text += (f"; the vocabulary ({config.vocab_size}) does not divide by {self.tensor}, so the embedding and "
                     f"output head are whole on every device")
        return text

    def served(self, config: ModelConfig) -> ModelConfig:
        """`config` as served: each KV head repeated `kv_replicas` times (what a KV cache page holds)."""
        return with_kv_replicas(config, self.kv_replicas)

    @property
    def rules(self):
        """The logical-axis rules of the served weights: the one table, with the vocabulary unsplit if it must be."""
        return (_override(sharding.LOGICAL_AXIS_RULES, vocab=None) if not self.vocab_split
                else sharding.LOGICAL_AXIS_RULES)

    @property
    def placement_rules(self):
        """The rules to read a checkpoint's weights by: as `rules`, with the KV projections whole on every device
        when they are about to be replicated (they are small: 1/(2G) of the attention weights)."""
        return _override(self.rules, kv_heads=None) if self.kv_replicas > 1 else self.rules


def _override(rules, **changes):
    return tuple((name, changes.get(name, axes)) for name, axes in rules)


def _problem(config: ModelConfig, tensor: int) -> Optional[str]:
    """Why `config` cannot split over `tensor` devices, or None."""
    n, k = config.num_attention_heads, config.num_key_value_heads
    for name, size in (("num_attention_heads", n), ("intermediate_size", config.intermediate_size)):
        if size % tensor:
            return f"tensor-parallel size {tensor} does not divide the model's {name} ({size})"
    if (n // k) % (tensor // math.gcd(k, tensor)):
        return (f"the model's {k} KV heads split neither into {tensor} parts nor into whole copies on {tensor} "
                f"devices ({n} query heads)")
    return None


def plan(config: ModelConfig, tensor: int) -> TensorParallelPlan:
    """Check that `config` splits over `tensor` devices: a ValueError names the dimension and the sizes that work."""
    if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1:
        raise ValueError(f"the tensor-parallel size must be a positive integer, got {tensor!r}")
    problem = _problem(config, tensor)
    if problem:
        working = [t for t in range(1, config.num_attention_heads + 1) if _problem(config, t) is None]
        raise ValueError(f"{problem}; sizes that work for this model: {', '.join(map(str, working))}")
    return TensorParallelPlan(tensor, tensor // math.gcd(config.num_key_value_heads, tensor),
                              config.vocab_size % tensor == 0)


def _check_mesh(mesh: Mesh) -> int:
    other = {a: s for a, s in mesh.shape.items() if a != TENSOR and s != 1}
    if TENSOR not in mesh.shape or other:
        raise ValueError(f"a serving mesh splits the model over its '{TENSOR}' axis only, got axes {dict(mesh.shape)}: "
                         f"build it with swiftkv_jax.serving.serving_mesh(N)")
    return mesh.shape[TENSOR]


def with_kv_replicas(config: ModelConfig, replicas: int) -> ModelConfig:
    """`config` with every KV head repeated `replicas` times (K heads -> K * replicas)."""
    return config.replace(num_key_value_heads=config.num_key_value_heads * replicas)


def replicate_kv_heads(model: Model, replicas: int, mesh: Optional[Mesh] = None,
                       rules=sharding.LOGICAL_AXIS_RULES) -> Model:
    """The same model with every KV head repeated `replicas` times, adjacent copies (K heads -> K * replicas): query
    head n of group size G reads head n // G, and copy n // (G / replicas) of it. Every parameter whose logical axes
    name kv_heads is repeated along that axis; on `mesh`, the result is placed by `rules`."""
    if replicas == 1:
        return model
    cfg = with_kv_replicas(model.config, replicas)
    axes = logical_axes(model.config)

    def repeat(params):
        return jax.tree.map(lambda a, spec: jnp.repeat(a, replicas, axis=tuple(spec).index("kv_heads"))
                            if "kv_heads" in tuple(spec) else a, params, axes)

    out_shardings = None if mesh is None else param_shardings(cfg, mesh, rules)
    return Model(cfg, jax.jit(repeat, out_shardings=out_shardings)(model.params))


def finish_placement(model: Model, mesh: Mesh, tp_plan: TensorParallelPlan) -> Model:
    """A model placed by `tp_plan.placement_rules` made ready to serve: KV heads replicated if the plan says so."""
    if tp_plan.kv_replicas > 1 or not tp_plan.vocab_split:
        log.warning("%s", tp_plan.describe(model.config))
    return replicate_kv_heads(model, tp_plan.kv_replicas, mesh, tp_plan.rules)


def shard_model(model: Model, mesh: Mesh) -> Model:
    """`model` placed for serving on `mesh` (see the module docstring); arrays already placed so stay where they are."""
    tp_plan = plan(model.config, _check_mesh(mesh))
    placed = jax.device_put(model.params, param_shardings(model.config, mesh, tp_plan.placement_rules))
    return finish_placement(Model(model.config, placed), mesh, tp_plan)


def is_placed(model: Model, mesh: Mesh) -> bool:
    """Whether every parameter already lies on `mesh` as `shard_model` places it (so serving can skip that)."""
    tp_plan = plan(model.config, _check_mesh(mesh))
    if tp_plan.kv_replicas > 1:
        return False
    expected = jax.tree.leaves(param_shardings(model.config, mesh, tp_plan.rules))
    return all(getattr(a, "sharding", None) is not None and a.sharding.is_equivalent_to(s, a.ndim)
               for a, s in zip(jax.tree.leaves(model.params), expected))


def for_serving(model: Model, mesh: Optional[Mesh]) -> Model:
    """The model as an engine on `mesh` serves it (unchanged without a mesh, or when already placed)."""
    if mesh is None or is_placed(model, mesh):
        return model
    return shard_model(model, mesh)


def load_sharded(path, dtype=None, *, mesh: Mesh, **options) -> Model:
    """A checkpoint (HF or Orbax, as `sk.load`) read straight onto `mesh`: each device reads only its own part of
    every weight, so peak host memory is about one device's shard of one stacked weight (plus one tensor as stored,
    for HF). The plan is checked from config.json before any weight is read."""
    from swiftkv_jax.checkpoints import load
    from swiftkv_jax.checkpoints.hf import read_config
    from swiftkv_jax.checkpoints.hf_config import config_from_hf

    tp_plan = plan(config_from_hf(read_config(path)), _check_mesh(mesh))
    return finish_placement(load(path, dtype, mesh=mesh, rules=tp_plan.placement_rules, **options), mesh, tp_plan)


def activation_sharding(config: ModelConfig, mesh: Optional[Mesh]):
    """The context a jitted serving function traces in (`sharding.activation_sharding` under the served model's
    rules; a no-op without a mesh). The function takes config and mesh as static arguments."""
    rules = sharding.LOGICAL_AXIS_RULES if mesh is None else plan(config, _check_mesh(mesh)).rules
    return sharding.activation_sharding(mesh, rules)


def replicated(mesh: Optional[Mesh], tree):
    """Host arrays put on every device of `mesh` (the engine's per-step inputs); a plain transfer without one."""
    if mesh is None:
        return jax.device_put(tree)
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def build_sharded(build, logical, mesh: Optional[Mesh]):
    """`build()` (a tree of arrays), born split on `mesh` by each leaf's logical axes, `logical(leaf shape) -> axes`:
    no whole copy on one device first. Without a mesh, `build()` as is."""
    if mesh is None:
        return build()
    shapes = jax.eval_shape(build)
    specs = jax.tree.map(lambda s: PartitionSpec(*logical(s.shape)), shapes)
    return jax.jit(build, out_shardings=sharding.logical_to_shardings(specs, shapes, mesh))()


def sizing(config: ModelConfig, tensor: int, *, batch: int, max_len: int, swiftkv: bool, cache_format) -> dict:
    """Bytes per device of the weights and of a dense KV cache for `batch` sequences of `max_len` tokens, when
    `config` is served over `tensor` devices: arithmetic on shapes and the logical-axis rules, nothing allocated
    and no device needed (a 70B model on 8 GPUs can be sized on a laptop)."""
    from swiftkv_jax.model.kv_quant import as_format, kv_bytes_per_token
    from swiftkv_jax.model.model import abstract_params
    from swiftkv_jax.serving.cache import allocated_length, cache_layers

    tp_plan = plan(config, tensor)
    served = tp_plan.served(config)
    mesh_sizes = {"data": 1, "fsdp": 1, TENSOR: tensor}
    specs = nn.logical_to_mesh(logical_axes(served), tp_plan.rules)

    def per_device(leaf, spec):
        return leaf.size * leaf.dtype.itemsize // math.prod(sharding.axes_size(mesh_sizes, axes) for axes in spec)

    weights = sum(jax.tree.leaves(jax.tree.map(per_device, abstract_params(served), specs,
                                               is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))))
    layers = cache_layers(served, swiftkv)
    per_token = kv_bytes_per_token(served, layers, as_format(cache_format, model_dtype=served.dtype)) // tensor
    return dict(tensor_parallel=tensor, kv_replicas=tp_plan.kv_replicas,
                kv_heads_per_device=served.num_key_value_heads // tensor, weight_bytes_per_device=int(weights),
                kv_cache_bytes_per_device=int(per_token * batch * allocated_length(max_len)),
                kv_bytes_per_token_per_device=per_token,
                cache_layers=layers, batch=batch, max_len=max_len)


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"= ([a-z]+[0-9a-z]*)\[([0-9,]*)\]\S* (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo_text: str) -> list[dict]:
    """The collectives of a compiled program's HLO text (`jax.jit(f).lower(...).compile().as_text()`), in order:
    {op, shape, bytes} with the result's shape and bytes on one device (an all-gather's gathered result, an
    all-reduce's summed one)."""
    found = []
    for dtype, dims, op in _COLLECTIVE.findall(hlo_text):
        shape = tuple(int(d) for d in dims.split(",") if d)
        bits = re.match(r"[a-z]+(\d*)", dtype).group(1)  # f32, bf16, s32, f8e4m3fn; pred: a byte
        itemsize = int(bits) // 8 if bits else 1
        found.append(dict(op=op, shape=shape, dtype=dtype, bytes=math.prod(shape) * itemsize))
    return found


__all__ = ["COLLECTIVES", "TensorParallelPlan", "activation_sharding", "collectives", "for_serving", "is_placed",
           "load_sharded", "plan", "finish_placement", "replicate_kv_heads", "sizing", "replicated", "serving_mesh",
           "shard_model", "build_sharded"]

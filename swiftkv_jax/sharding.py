"""Sharding: the device mesh and the one table that maps logical axis names to mesh axes.

Every parameter declares logical axes in `swiftkv_jax.model.layers`; this table is the only place that
decides how they are laid out. Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with
sharded weights), `tensor` (heads / MLP / vocab split).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Optional, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_AXIS_RULES: tuple[tuple[str, object], ...] = (
    ("batch", ("data", "fsdp")),
    ("layers", None),
    ("layer_groups", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    # activations only
    ("length", None),
    ("act_embed", None),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A (data, fsdp, tensor) mesh; one size may be -1, meaning the rest of the devices."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive, with at most one -1; got data={data} fsdp={fsdp} "
                         f"tensor={tensor}")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not split into a mesh with fixed axes of product {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} needs {math.prod(sizes)} devices, "
            f"{len(devices)} are available"
        )
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=axis_types, devices=devices)


def logical_to_shardings(logical_specs, shapes, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """NamedShardings for a tree of logical PartitionSpecs; raises if a mesh axis does not divide its dim."""
    mesh_specs = nn.logical_to_mesh(logical_specs, rules)

    def check(path, spec, shape):
        for dim, axes in zip(shape.shape, spec):
            if axes is None:
                continue
            size = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
            if dim % size:
                raise ValueError(
                    f"cannot shard {jax.tree_util.keystr(path)} {tuple(shape.shape)}: dimension {dim} is not "
                    f"divisible by mesh axes {axes} of size {size}; change the mesh or the logical axis rules"
                )
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(
        check, mesh_specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )



# Activation layout. Without it GSPMD may resolve "batch and weights both sharded over fsdp" by gathering
# the batch instead of the weights: every device then computes every sequence.
_ACTIVATIONS: contextvars.ContextVar = contextvars.ContextVar("activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Optional[Mesh], rules=LOGICAL_AXIS_RULES):
    """While tracing inside this context, `constrain` pins activations to `mesh` by `rules` (None: no mesh, a
    no-op context, so that single-device callers need no branch). A jitted function that enters it must take
    the mesh as a static argument: jit's trace cache does not see this context."""
    token = _ACTIVATIONS.set(None if mesh is None else (mesh, rules))
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


def constrain(x, logical_axes: tuple):
    """`x` sharded by its logical axes (e.g. ("batch", "length", "act_embed")); a no-op outside
    `activation_sharding`, so single-device code pays nothing."""
    context = _ACTIVATIONS.get()
    if context is None:
        return x
    mesh, rules = context
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, nn.logical_to_mesh_axes(logical_axes, rules)))


def axes_size(mesh_shape, axes) -> int:
    """How many ways one entry of a PartitionSpec splits its dimension: None, an axis name or a tuple of names, over
    `mesh_shape` ({axis: size}, as `Mesh.shape`)."""
    if axes is None:
        return 1
    return math.prod(mesh_shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def map_over_heads(fn, *args, heads: tuple, out_heads: int):
    """`fn(*args)`, run per shard of the attention heads (inside `shard_map`) when tracing under
    `activation_sharding` with heads split over the mesh; plain `fn(*args)` otherwise.

    For kernels that XLA's partitioner cannot split (Pallas calls, cuDNN's fused attention): each device runs
    the kernel on its own query and KV heads. heads[i]: the head axis of args[i], None for an argument every
    shard sees whole (lengths, positions, a static scale); out_heads: that of the result, which has args[0]'s
    rank (the queries').
    """
    context = _ACTIVATIONS.get()
    if context is None:
        return fn(*args)
    mesh, rules = context
    axis = nn.logical_to_mesh_axes(("kv_heads",), rules)[0]
    if axes_size(mesh.shape, axis) == 1:
        return fn(*args)
    spec = lambda ndim, head: PartitionSpec(*(axis if d == head else None for d in range(ndim)))
    in_specs = tuple(spec(jax.numpy.ndim(a), h) for a, h in zip(args, heads))
    out_specs = spec(jax.numpy.ndim(args[0]), out_heads)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

"""Parameter tree <-> Hugging Face tensor names, as data.

Each of our (stacked) parameters expands into one HF tensor per layer (or per AcrossKV owner). The name
follows from the tree path through the tables below; the layout change is the same rule both ways:
a kernel stores its input dims first and output dims last, an HF Linear weight is [out, in], so
import is `w.T.reshape(ours)` and export `ours.reshape(in, out).T`. Everything else only reshapes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional

from flax.traverse_util import flatten_dict

from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.model import abstract_params

TOP_LEVEL = {"embed_tokens": "model.embed_tokens", "norm": "model.norm",
             "norm_swiftkv": "model.norm_swiftkv", "lm_head": "lm_head"}
LEAF = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}
KERNEL_INPUT_DIMS = {"o_proj": 2}  # o_proj reads [N, H]; every other kernel one input dim
# Tensors some checkpoints carry that the model recomputes; skipped on import.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One HF tensor: where it lives in our tree and how its layout maps."""

    hf_name: str
    path: tuple[str, ...]  # keys into our parameter tree
    index: tuple[int, ...]  # into the leading stacked axes of that parameter
    shape: tuple[int, ...]  # our per-layer shape
    input_dims: int  # kernels: how many leading dims are inputs; 0: not a Linear weight

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.input_dims:
            n_in = math.prod(self.shape[: self.input_dims])
            return (math.prod(self.shape) // n_in, n_in)
        return self.shape if self.path[0] == "embed_tokens" else (math.prod(self.shape),)

    def to_ours(self, hf_tensor):
        """HF tensor (numpy) -> our per-layer layout."""
        if self.input_dims:
            return hf_tensor.T.reshape(self.shape)
        return hf_tensor.reshape(self.shape)

    def hf_part(self, index: tuple) -> Optional[tuple]:
        """The slices of the HF tensor that hold our per-layer `index` (one slice per dim of `shape`), or None when
        that part is not one block of it. Splits along heads, MLP columns or the vocabulary are one block: every dim
        flattened after the split one is whole."""
        if self.path[0] == "embed_tokens":
            return tuple(index)
        if not self.input_dims:
            part = _flat_range(self.shape, index)
            return None if part is None else (part,)
        n = self.input_dims
        inputs, outputs = _flat_range(self.shape[:n], index[:n]), _flat_range(self.shape[n:], index[n:])
        return None if inputs is None or outputs is None else (outputs, inputs)

    def part_to_ours(self, hf_part, index: tuple):
        """The HF tensor's `hf_part(index)` (numpy) -> our per-layer array at `index`."""
        shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, self.shape))
        return (hf_part.T if self.input_dims else hf_part).reshape(shape)

    def to_hf(self, ours):
        """Our per-layer array (numpy) -> the HF tensor."""
        if self.input_dims:
            return ours.reshape(math.prod(self.shape[: self.input_dims]), -1).T
        return ours.reshape(self.hf_shape)


def _flat_range(dims: tuple, index: tuple) -> Optional[slice]:
    """The range of a row-major flattening of `dims` that slices `index` select, if it is one contiguous range:
    at most one dim partial, with only size-1 dims before it."""
    ranges = [s.indices(n) for s, n in zip(index, dims)]
    partial = [i for i, (r, n) in enumerate(zip(ranges, dims)) if r != (0, n, 1)]
    if not partial:
        return slice(0, math.prod(dims))
    j = partial[0]
    start, stop, step = ranges[j]
    if len(partial) > 1 or step != 1 or math.prod(dims[:j]) != 1:
        return None
    inner = math.prod(dims[j + 1:])
    return slice(start * inner, stop * inner)


def _module_name(keys: tuple[str, ...]) -> str:
    return ".".join(keys[:-1] + (LEAF[keys[-1]],))


def tensor_entries(cfg: ModelConfig) -> Iterator[TensorEntry]:
    """Every HF tensor of `cfg`, in our tree order (stacked layers grouped by parameter)."""
    l, g = cfg.num_lower_layers, cfg.key_value_group_size
    for keys, spec in flatten_dict(abstract_params(cfg)).items():
        input_dims = KERNEL_INPUT_DIMS.get(keys[-2], 1) if keys[-1] == "kernel" else 0
        if keys[0] in TOP_LEVEL:
            yield TensorEntry(f"{TOP_LEVEL[keys[0]]}.{LEAF[keys[-1]]}", keys, (), tuple(spec.shape), input_dims)
        elif keys[0] == "layers":  # [l, ...]: layers 0..l-1
            for i in range(spec.shape[0]):
                yield TensorEntry(f"model.layers.{i}.{_module_name(keys[1:])}", keys, (i,),
                                  tuple(spec.shape[1:]), input_dims)
        elif keys[:2] == ("swiftkv_groups", "layers"):  # [G, g, ...]: layer l + group * g + member
            for group in range(spec.shape[0]):
                for member in range(spec.shape[1]):
                    i = l + group * g + member
                    yield TensorEntry(f"model.layers.{i}.{_module_name(keys[2:])}", keys, (group, member),
                                      tuple(spec.shape[2:]), input_dims)
        elif keys[0] == "swiftkv_groups":  # [G, ...]: the owners' k/v_proj_swiftkv, layer l + group * g
            for group in range(spec.shape[0]):
                yield TensorEntry(f"model.layers.{l + group * g}.self_attn.{_module_name(keys[1:])}", keys,
                                  (group,), tuple(spec.shape[1:]), input_dims)
        else:
            raise AssertionError(f"no HF name rule for parameter {keys}")

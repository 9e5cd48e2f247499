"""Hugging Face checkpoints: `config.json` + safetensors (one file, or shards with an index).

Import streams: each stacked parameter is assembled on the host from its per-layer tensors (read one at a
time from the memory-mapped files, cast to the target dtype), placed on device(s) with its sharding, and
its host buffer dropped before the next. Export slices one tensor at a time off the device and writes
shard by shard.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import re
from pathlib import Path
from typing import Optional

import jax
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from huggingface_hub import split_state_dict_into_shards_factory
from huggingface_hub.serialization._base import SIZE_UNITS, parse_size_to_int
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from swiftkv_jax import sharding
from swiftkv_jax.checkpoints.atomic import atomic_directory, current_umask
from swiftkv_jax.checkpoints.hf_config import config_from_hf, config_to_hf, stored_dtype
from swiftkv_jax.checkpoints.hf_layout import IGNORED_SUFFIXES, TensorEntry, tensor_entries
from swiftkv_jax.dtypes import as_dtype, dtype_name
from swiftkv_jax.model.model import Model, abstract_params, check_params, param_shardings

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
REDOWNLOAD = "re-download or re-export the checkpoint"
MISMATCH = "config.json does not match the weights: fix config.json, or re-download or re-export the checkpoint"
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}  # safetensors' names of the float types


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or this library's formats."""


def read_config(path) -> dict:
    config_path = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{path}: no config.json; expected a Hugging Face model directory or a swiftkv-jax Orbax checkpoint"
        )
    return _read_json(config_path, "fix it, or re-download or re-export the checkpoint")


def declared_dtype(path, hf_config: dict) -> Optional[str]:
    """config.json's dtype, the one dtype=None loads the weights in; one they cannot load in is refused naming the
    dtype= argument, which overrides it."""
    try:
        return stored_dtype(hf_config)
    except ValueError as e:
        fix = 'pass dtype= (e.g. dtype="bfloat16") to load them in one of those'
        raise CheckpointError(f"{path}: {e}; {fix}") from None


def _read_json(path: Path, fix: str) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); {fix}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not a text file ({e.reason}); {fix}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}; {fix}")
    return value


def parse_size(size) -> int:
    """Bytes of a max_shard_size as huggingface_hub reads it: an int, or a number with a unit ("5GB", "500MB")."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    try:
        value = parse_size_to_int(str(size))
    except ValueError:
        value = 0
    if not value > 0:
        units = ", ".join(sorted(SIZE_UNITS, key=SIZE_UNITS.get))
        raise ValueError(f"{size!r} is not a size: give a number and a unit ({units}), e.g. 5GB "
                         f"or 500MB")
    return int(value)


class _SafetensorsFiles(contextlib.ExitStack):
    """Name -> tensor over the checkpoint's safetensors files, opened lazily (memory-mapped)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        if (path / INDEX_FILE).is_file():
            index = _read_json(path / INDEX_FILE, REDOWNLOAD)
            if not isinstance(index.get("weight_map"), dict):
                raise CheckpointError(f"{path / INDEX_FILE}: no \"weight_map\" object; {REDOWNLOAD}")
            self.file_of = index["weight_map"]
        elif (path / SINGLE_FILE).is_file():
            self.file_of = None
        else:
            other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pth"))
            # An Orbax checkpoint without params/ has the same config.json: the weights are missing either way.
            hint = (f" (found {other[:3]}: re-save with transformers' save_pretrained, which writes safetensors)"
                    if other else f" (Hugging Face weights) and no params/ (swiftkv-jax Orbax weights): an incomplete "
                                  f"download, or an incomplete Orbax checkpoint whose params/ is missing; "
                                  f"{REDOWNLOAD}")
            raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
        self._handles = {}

    def __enter__(self):
        super().__enter__()
        files = sorted(set(self.file_of.values())) if self.file_of else [SINGLE_FILE]
        for name in files:
            if not (self.path / name).is_file():
                raise FileNotFoundError(f"{self.path}: {INDEX_FILE} lists {name}, which is missing")
            try:
                self._handles[name] = self.enter_context(safe_open(self.path / name, framework="numpy"))
            except SafetensorError as e:
                raise CheckpointError(f"{self.path / name}: not a readable safetensors file ({e}): truncated or "
                                      f"corrupt; {REDOWNLOAD}") from None
        if self.file_of is None:
            self.file_of = {k: SINGLE_FILE for k in self._handles[SINGLE_FILE].keys()}
        else:  # the index against the files (their headers, read already): a wrong entry, named, before any read
            held = {name: set(handle.keys()) for name, handle in self._handles.items()}
            wrong = sorted((t, f) for t, f in self.file_of.items() if t not in held[f])
            if wrong:
                raise CheckpointError(f"{self.path}: {INDEX_FILE} maps {len(wrong)} tensor(s) to a file that does "
                                      f"not hold them, e.g. {wrong[0][0]} to {wrong[0][1]}; {REDOWNLOAD}")
        return self

    def names(self) -> set[str]:
        return set(self.file_of)

    def dtype(self, name: str) -> str:
        return dtype_name(self._handles[self.file_of[name]].get_slice(name).get_dtype())

    def get(self, entry: TensorEntry) -> np.ndarray:
        return self._checked(entry).get_tensor(entry.hf_name)

    def get_part(self, entry: TensorEntry, index: tuple) -> np.ndarray:
        """Our per-layer `index` of an entry, reading only that part of the file when it is one block of it."""
        part = entry.hf_part(index)
        if part is None:
            return entry.to_ours(self.get(entry))[index]
        return entry.part_to_ours(self._checked(entry).get_slice(entry.hf_name)[part], index)

    def _checked(self, entry: TensorEntry):
        if entry.hf_name not in self.file_of:
            raise CheckpointError(f"{self.path}: tensor {entry.hf_name} {list(entry.hf_shape)} is missing; "
                                  f"{MISMATCH}")
        handle = self._handles[self.file_of[entry.hf_name]]
        tensor = handle.get_slice(entry.hf_name)
        shape = tuple(tensor.get_shape())
        if shape != entry.hf_shape:
            raise CheckpointError(
                f"{self.path}: tensor {entry.hf_name} has shape {list(shape)}, config.json implies "
                f"{list(entry.hf_shape)}; {MISMATCH}"
            )
        if tensor.get_dtype() not in FLOAT_DTYPES:  # an int tensor would be cast to float silently: not weights
            raise CheckpointError(f"{self.path}: tensor {entry.hf_name} is stored as {tensor.get_dtype()}, not a "
                                  f"float type: the checkpoint is damaged or not a model's weights; {REDOWNLOAD}")
        return handle


def load_hf(path, dtype=None, *, mesh: Optional[Mesh] = None, rules=sharding.LOGICAL_AXIS_RULES,
            compute_dtype=None, attention_impl: str = "xla_flash") -> Model:
    """Load a HF `llama`, `llama_swiftkv`, `qwen2` or `qwen2_swiftkv` checkpoint.

    dtype: parameter dtype (None: config.json's `dtype`/`torch_dtype`, else the embedding's stored dtype, as
    transformers' dtype="auto"); compute_dtype defaults to it. With a mesh the parameters
    are born sharded under `rules`. Peak host memory (anonymous, beyond the page cache of the
    memory-mapped files): one stacked parameter in flight (all layers' copies of one weight, e.g. the MLP
    up-projections: 1/9 of an 8B Llama) plus one tensor as stored, on top of the parameters themselves
    when the device is the host. Measured on CPU (benchmarks/checkpoint_io.py, 187M params): peak
    1.29x the loaded parameters' bytes. With a mesh, each device's part of a parameter is read from the files as
    that device asks for it (only the rows or columns it holds, when they form one block of the stored tensor, as
    splits by heads, MLP columns or vocabulary do): peak host memory is one device's shard of one stacked parameter
    (70B at tensor parallel 8: 4.7 GB for the MLP up-projections of all 80 layers) plus one tensor's part.
    """
    path = Path(path)
    hf_config = read_config(path)
    with _SafetensorsFiles(path) as files:
        # As transformers' dtype="auto" (and vLLM's): config.json's dtype, else the first weight's. Reading the
        # embedding alone turned a bf16 checkpoint with an fp32 embedding into fp32 everywhere (twice the memory).
        if dtype is None:
            dtype = declared_dtype(path, hf_config)
        if dtype is None:
            embed = "model.embed_tokens.weight"
            if embed not in files.names():
                raise CheckpointError(f"{path}: tensor {embed} is missing")
            dtype = files.dtype(embed)
        param_dtype = dtype_name(dtype)
        cfg = config_from_hf(hf_config, param_dtype=param_dtype, dtype=dtype_name(compute_dtype or param_dtype),
                             attention_impl=attention_impl)
        entries = list(tensor_entries(cfg))
        expected = {e.hf_name for e in entries}
        unexpected = sorted(
            n for n in files.names() - expected
            if not n.endswith(IGNORED_SUFFIXES) and not (cfg.tie_word_embeddings and n == "lm_head.weight")
        )
        if unexpected:
            raise CheckpointError(
                f"{path}: tensors {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''} do not belong to a "
                f"{hf_config['model_type']} model with this config.json (wrong model_type or "
                f"num_key_value_layers / key_value_group_size?)"
            )
        shapes = flatten_dict(abstract_params(cfg))
        shardings = flatten_dict(param_shardings(cfg, mesh, rules)) if mesh is not None else {}
        np_dtype = as_dtype(param_dtype)
        leaves = {}
        for keys, group in itertools.groupby(entries, key=lambda e: e.path):
            group, shape = list(group), shapes[keys].shape
            if keys in shardings:  # each device's part, read from the files as its device asks for it
                read = functools.partial(_read_shard, files, group, shape, np_dtype)
                leaves[keys] = jax.make_array_from_callback(shape, shardings[keys], read)
                continue
            host = np.empty(shape, np_dtype)
            for entry in group:
                host[entry.index] = entry.to_ours(files.get(entry)).astype(np_dtype)
            leaves[keys] = jax.device_put(host)
            del host
    return Model(cfg, unflatten_dict(leaves))


def _read_shard(files: _SafetensorsFiles, group: list, shape: tuple, np_dtype, index: tuple) -> np.ndarray:
    """One device's part `index` of a stacked parameter of `shape`, built from the HF tensors of `group` (one per
    layer): only the slices of each tensor that fall in it are read, so host memory holds one shard at a time."""
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
    stacked = len(shape) - len(group[0].shape)
    out = np.empty([len(range(s.start, s.stop, s.step)) for s in index], np_dtype)
    for entry in group:
        if all(i in range(s.start, s.stop, s.step) for i, s in zip(entry.index, index)):
            at = tuple(range(s.start, s.stop, s.step).index(i) for i, s in zip(entry.index, index))
            out[at] = files.get_part(entry, index[stacked:]).astype(np_dtype)
    return out


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def save_hf(model: Model, path, *, dtype=None, max_shard_size="5GB", overwrite: bool = False,
            extra_files=None) -> Path:
    """Write `model` as a HF checkpoint (safetensors, sharded with an index above `max_shard_size`).

    Plain models load in transformers' LlamaForCausalLM / Qwen2ForCausalLM; SwiftKV models are written
    as `llama_swiftkv` / `qwen2_swiftkv` with the published field and tensor names. The directory appears
    only when complete, with `extra_files` (name -> bytes) in it. Arrays spread over several processes (hosts)
    are gathered tensor by tensor, every process calling this; process 0 writes the files.
    """
    cfg = model.config
    check_params(cfg, model.params)
    np_dtype = as_dtype(dtype or cfg.param_dtype)
    entries = {e.hf_name: e for e in sorted(tensor_entries(cfg), key=lambda e: _natural_key(e.hf_name))}
    split = split_state_dict_into_shards_factory(
        entries,
        get_storage_size=lambda e: int(np.prod(e.hf_shape)) * np_dtype.itemsize,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=parse_size(max_shard_size),
    )
    params = flatten_dict(model.params)
    lead = jax.process_index() == 0
    with atomic_directory(path, overwrite, extra_files, replaces="config.json") as tmp:  # a checkpoint
        for filename, names in split.filename_to_tensors.items():
            tensors = {}
            for name in names:
                entry = entries[name]
                leaf = params[entry.path]
                ours = _on_host(leaf[entry.index] if entry.index else leaf)  # a collective: every process
                if lead:  # the others have nothing to write
                    tensors[name] = np.ascontiguousarray(entry.to_hf(ours.astype(np_dtype)))
            if lead:
                save_file(tensors, tmp / filename, metadata={"format": "pt"})
                os.chmod(tmp / filename, 0o666 & ~current_umask())  # safetensors 0.8 writes 0600: as the others
            del tensors
        if lead and split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if lead:
            (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype_name(np_dtype)), indent=2) + "\n")
    return Path(path)


def _on_host(x) -> np.ndarray:
    """The whole of `x` in this process's memory: gathered from the other processes where it is spread over them
    (a collective: every process calls it for the same tensors in the same order)."""
    if not getattr(x, "is_fully_addressable", True):
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))

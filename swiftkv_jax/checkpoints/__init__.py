"""Checkpoint formats: Hugging Face safetensors (plain and SwiftKV) and Orbax; `load`/`save` detect and dispatch."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from jax.sharding import Mesh

from swiftkv_jax import sharding
from swiftkv_jax.checkpoints.hf import INDEX_FILE, SINGLE_FILE, CheckpointError, load_hf, save_hf
from swiftkv_jax.checkpoints.orbax import is_orbax_checkpoint, load_orbax, save_orbax
from swiftkv_jax.model.model import Model, cast

FORMATS = ("orbax", "hf")


def detect_format(path) -> str:
    """'hf' or 'orbax' for a checkpoint directory; FileNotFoundError naming what is missing otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if is_orbax_checkpoint(path):
        return "orbax"
    if (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file():
        return "hf"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json; not a Hugging Face or swiftkv-jax Orbax checkpoint"
                                + _checkpoints_inside(path))
    return "hf"  # config.json without weights: load_hf names the missing files


def _checkpoints_inside(path: Path) -> str:
    """A hint for a folder that holds checkpoints (a train.py run's student_hf / student_orbax) or is a training
    state (a run's checkpoints/STEP, which resumes training and holds no model to load)."""
    if (path / "state").is_dir() and (path / "meta").is_dir():
        return ("; it is a train.py training state (it resumes the run): load the model the run exported, in its "
                "student_hf or student_orbax folder (model_hf, model_orbax for a pretraining run)")
    inside = sorted(str(child) for child in path.iterdir() if child.is_dir() and (child / "config.json").is_file())
    return f"; the checkpoints in it: {', '.join(inside[:4])}" if inside else ""


def load(path, dtype=None, *, mesh: Optional[Mesh] = None, rules=sharding.LOGICAL_AXIS_RULES,
         compute_dtype=None, attention_impl: str = "xla_flash") -> Model:
    """Load a HF or Orbax checkpoint directory (detected).

    dtype: parameter dtype ("float32" | "bfloat16" | a jnp dtype | None = config.json's dtype); compute_dtype
    defaults to it. With a mesh, parameters are placed sharded by `rules`.
    """
    loader = {"hf": load_hf, "orbax": load_orbax}[detect_format(path)]
    return loader(path, dtype, mesh=mesh, rules=rules, compute_dtype=compute_dtype, attention_impl=attention_impl)


def save(model: Model, path, format: str = "orbax", *, dtype=None, overwrite: bool = False,
         max_shard_size="5GB", extra_files: Optional[Mapping[str, bytes]] = None) -> Path:
    """Save as "orbax" or "hf", parameters cast to `dtype` if given (max_shard_size: HF only).

    Refuses a non-empty path unless overwrite=True, which replaces only a checkpoint (a directory holding a
    config.json), never the working directory; never leaves a half-written directory;
    `extra_files` (name -> bytes, e.g. tokenizer files) are committed with the weights.
    """
    if not isinstance(model, Model):
        raise TypeError(f"save takes a Model (as sk.load and sk.init return), got {type(model).__name__}")
    if format == "hf":
        return save_hf(model, path, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite,
                       extra_files=extra_files)
    if format == "orbax":
        return save_orbax(model if dtype is None else cast(model, dtype), path, overwrite=overwrite,
                          extra_files=extra_files)
    raise ValueError(f"unknown checkpoint format {format!r}: use one of {', '.join(FORMATS)}")


__all__ = ["CheckpointError", "FORMATS", "detect_format", "load", "load_hf", "load_orbax", "save", "save_hf",
           "save_orbax"]

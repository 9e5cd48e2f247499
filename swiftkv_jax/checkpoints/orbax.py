"""Orbax checkpoints: `params/` (an Orbax StandardCheckpointer tree) with the HF-style `config.json` beside it.

Restore builds an abstract target (shapes, dtype, shardings) from the config, so a checkpoint saved on one
device count restores onto any mesh, in any parameter dtype.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Optional

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, SingleDeviceSharding

from swiftkv_jax import sharding
from swiftkv_jax.checkpoints.atomic import atomic_directory
from swiftkv_jax.checkpoints.hf import REDOWNLOAD, CheckpointError, declared_dtype, read_config
from swiftkv_jax.checkpoints.hf_config import config_from_hf, config_to_hf
from swiftkv_jax.dtypes import dtype_name
from swiftkv_jax.model.model import Model, abstract_params, check_params, param_shardings

PARAMS_DIR = "params"


def is_orbax_checkpoint(path) -> bool:
    return (Path(path) / PARAMS_DIR).is_dir()


def save_orbax(model: Model, path, *, overwrite: bool = False, extra_files=None) -> Path:
    """Save parameters (any sharding) and config, plus `extra_files` (name -> bytes); the directory
    appears only when complete."""
    check_params(model.config, model.params)
    with atomic_directory(path, overwrite, extra_files, replaces="config.json") as tmp:  # a checkpoint
        if jax.process_index() == 0:
            (tmp / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp / PARAMS_DIR, model.params)
            checkpointer.wait_until_finished()
    return Path(path)


def _stored_shapes(checkpointer: ocp.StandardCheckpointer, directory: Path) -> dict:
    metadata = checkpointer.metadata(directory)
    tree = getattr(metadata, "item_metadata", metadata)
    return getattr(tree, "tree", tree)


def load_orbax(path, dtype=None, *, mesh: Optional[Mesh] = None, rules=sharding.LOGICAL_AXIS_RULES,
               compute_dtype=None, attention_impl: str = "xla_flash") -> Model:
    """Restore onto `mesh` (sharded by `rules`) or the default device, casting to `dtype` if given."""
    path = Path(path)
    hf_config = read_config(path)
    param_dtype = dtype_name(dtype or declared_dtype(path, hf_config) or "float32")
    cfg = config_from_hf(hf_config, param_dtype=param_dtype, dtype=dtype_name(compute_dtype or param_dtype),
                         attention_impl=attention_impl)
    abstract = abstract_params(cfg)
    if mesh is None:
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract)
    else:
        shardings = param_shardings(cfg, mesh, rules)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    directory = (path / PARAMS_DIR).absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        with unreadable_orbax(directory):
            stored = _stored_shapes(checkpointer, directory)
            if not stored:  # Orbax only warns when it cannot read the metadata
                raise ValueError("no parameter metadata can be read")
        try:
            check_params(cfg, stored)
        except ValueError as e:
            raise CheckpointError(f"{path}: the Orbax parameters do not match config.json: {e}") from None
        with unreadable_orbax(directory):
            params = checkpointer.restore(directory, target)
    return Model(cfg, params)


@contextlib.contextmanager
def unreadable_orbax(directory, fix: str = f"it is incomplete or corrupt: {REDOWNLOAD}"):
    """Orbax's and TensorStore's errors on a damaged checkpoint (many, from its threads) as one CheckpointError
    naming the directory, the root cause's first sentence (its advice is Orbax's API, not ours) and `fix`. The
    noise Orbax's abandoned reads print after the first failure (`is_abandoned_read_noise`,
    `is_abandoned_task_log`) is dropped from before the read on: some of it comes from Orbax's threads while the
    error is still on its way here (seen under load, 2026-11-25)."""
    _drop_abandoned_read_noise()
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        first = next((line for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
        raise CheckpointError(f"{directory}: cannot read this Orbax checkpoint ({first.split('. ')[0]}); "
                              f"{fix}") from e


ORBAX_SOURCES = str(Path(ocp.__file__).parent.parent) + os.sep  # orbax/ (orbax.checkpoint is one of its packages)


def is_abandoned_read_noise(unraisable) -> bool:
    """What Orbax's other reads print once one read of a restore has failed (`sys.unraisablehook`'s argument).
    Orbax closes the event loop that ran them: TensorStore's callbacks into it fail ("Event loop is closed",
    reported with no object, raised in `call_soon_threadsafe` called from native code: no Python frame above it;
    asyncio's or uvloop's, whose Cython frames are named `uvloop.loop.Loop.call_soon_threadsafe`: uvicorn makes
    uvloop the process's loop policy, so Orbax's loops are uvloop's in a process that served),
    and each reader coroutine still pending, closed when it is collected, turns the GeneratorExit into an Exception
    (Orbax's `except BaseException` around a read): dozens of tracebacks after the one error that matters, at any
    time up to the interpreter's exit."""
    exc, obj = unraisable.exc_value, unraisable.object
    if inspect.iscoroutine(obj):
        return isinstance(exc.__cause__, GeneratorExit) and obj.cr_code.co_filename.startswith(ORBAX_SOURCES)
    tb = exc.__traceback__
    return (obj is None and isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and tb is not None
            and tb.tb_frame.f_code.co_name.rsplit(".", 1)[-1] == "call_soon_threadsafe")


# an absl status, as TensorStore's errors begin (`OUT_OF_RANGE: Error reading "..." in OCDBT database ...`)
TENSORSTORE_STATUS = re.compile(r"(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|"
                                r"PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|"
                                r"UNIMPLEMENTED|INTERNAL|UNAVAILABLE|DATA_LOSS|UNAUTHENTICATED): ")


def is_abandoned_task_log(record: logging.LogRecord) -> bool:
    """asyncio's report (logger "asyncio", dozens of lines each) of a task or future of Orbax's reads collected
    with its exception unread ("Task exception was never retrieved", "_GatheringFuture ...") or still pending,
    once a read of the restore has failed: its coroutine is defined in Orbax's sources, or its exception was
    raised there; or a plain Future that TensorStore failed from its native code (an exception never raised in
    Python: no traceback, an absl status first), awaited by one of those reads (seen 2026-11-27)."""
    message = record.getMessage()
    first = message.split("\n", 1)[0]
    if not (first.endswith(" exception was never retrieved") or first == "Task was destroyed but it is pending!"):
        return False
    if f"defined at {ORBAX_SOURCES}" in message:
        return True
    exc = record.exc_info[1] if record.exc_info else None
    if (first == "Future exception was never retrieved" and exc is not None and exc.__traceback__ is None
            and TENSORSTORE_STATUS.match(str(exc))):
        return True
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(ORBAX_SOURCES)


def _keep_task_log(record: logging.LogRecord) -> bool:  # one function, so that adding it again adds nothing
    return not is_abandoned_task_log(record)


def _drop_abandoned_read_noise():
    """Chains a filter of `is_abandoned_read_noise` in front of the unraisable hook (once a process) and puts one of
    `is_abandoned_task_log` on asyncio's logger (every time: adding it again adds nothing, and a logging setup that
    replaced the logger's filters since gets it back): everything else still reaches the hook that was there and
    the logger's handlers."""
    logging.getLogger("asyncio").addFilter(_keep_task_log)
    previous = sys.unraisablehook
    if getattr(previous, "drops_abandoned_orbax_reads", False):
        return

    def hook(unraisable):
        if not is_abandoned_read_noise(unraisable):
            previous(unraisable)

    hook.drops_abandoned_orbax_reads = True
    sys.unraisablehook = hook

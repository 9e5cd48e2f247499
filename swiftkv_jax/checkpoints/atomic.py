"""Write a checkpoint directory, or a small file, all at once: a failed or interrupted save leaves the target
untouched."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Iterator, Mapping, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from swiftkv_jax.checks import flag


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _shared_suffix() -> str:
    """A random suffix every process agrees on (process 0's), so a collective save writes one directory."""
    suffix = np.frombuffer(uuid.uuid4().bytes[:4], np.uint32)
    if jax.process_count() > 1:
        suffix = multihost_utils.broadcast_one_to_all(suffix)
    return f"{int(np.asarray(suffix)[0]):08x}"


def write_text_atomic(path, text: str) -> None:
    """Write a file whole or not at all: a kill or a full disk mid-write leaves the earlier file (if any) intact, and
    no temporary file. Not a lock: callers writing one path from several threads hold their own."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _remove_leftovers(path: Path) -> None:
    """What saves to `path` cut short by a kill left beside it (SIGKILL leaves no time to clean): their partial
    directories, and a replaced directory whose removal was cut short. That one is kept while `path` is missing (a
    kill between the two renames of a commit left the only complete copy there)."""
    name = glob.escape(path.name)
    leftovers = list(path.parent.glob(f".{name}.partial-*"))
    if path.is_dir():
        leftovers += path.parent.glob(f".{name}.old-*")
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path, overwrite: bool = False, extra_files: Optional[Mapping[str, bytes]] = None,
                     replaces: Optional[str] = None) -> Iterator[Path]:
    """Yield a fresh sibling directory; on success it replaces `path` by rename, on error it is removed.

    A non-empty `path` is only replaced with overwrite=True, and then only after the new one is complete; with
    `replaces` (a file name, e.g. a checkpoint's config.json) only a directory holding that file is (overwrite=True
    deleted a folder of the user's files), and never the working directory or one holding it.
    `extra_files` (name -> bytes, e.g. tokenizer files read before `path` is replaced) are written into
    the new directory before it is committed. What an earlier save to `path` left when killed is removed first
    (`_remove_leftovers`). With several JAX processes every one gets the same directory
    (for collective writers such as Orbax); process 0 alone writes the extra files and commits.
    """
    overwrite = flag("overwrite", overwrite)  # bool("false") is True: it replaced the checkpoint it was to keep
    for name, content in (extra_files or {}).items():  # checked before the weights are written, not after
        if not isinstance(name, str) or not isinstance(content, (bytes, bytearray)):
            raise TypeError(f"extra_files maps file names to bytes, got {name!r}: {type(content).__name__} "
                            f"(encode text, e.g. text.encode())")
        if name in ("", ".", "..") or os.path.basename(name) != name or "\\" in name:  # "../x" wrote outside it
            raise ValueError(f"extra_files name {name!r} is not a plain file name: the files are written into the "
                             f"checkpoint directory itself, so name one without a directory part")
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is a file; choose a directory path")
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{path} exists and is not empty: pass overwrite=True (--overwrite) or a new path")
        if replaces and not (path / replaces).is_file():
            held = ", ".join(sorted(p.name for p in path.iterdir())[:4])
            raise FileExistsError(f"{path} holds files ({held}, ...) but no {replaces}: it is not one to replace, "
                                  f"and overwrite=True would delete them: choose an empty or new path")
        if path == Path.cwd() or path in Path.cwd().parents:
            raise FileExistsError(f"{path} is the working directory or holds it: replacing it would delete it from "
                                  f"under this process: choose another path")
    lead = jax.process_index() == 0
    tmp = path.with_name(f".{path.name}.partial-{_shared_suffix()}")
    if lead:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(path)
        tmp.mkdir(mode=0o777 & ~current_umask())
    _sync(f"atomic_directory:create:{tmp.name}")
    try:
        yield tmp
        if lead:
            for name, content in (extra_files or {}).items():
                if (tmp / name).exists():  # e.g. config.json: the checkpoint's own file, silently replaced
                    raise FileExistsError(f"extra_files names {name}, which the save itself wrote: drop it from "
                                          f"extra_files (the checkpoint at {path} is left as it was)")
                (tmp / name).write_bytes(content)
        _sync(f"atomic_directory:written:{tmp.name}")
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if lead:
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    _sync(f"atomic_directory:committed:{tmp.name}")

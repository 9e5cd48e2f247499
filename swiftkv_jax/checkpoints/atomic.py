"""Write a checkpoint directory all at once: a failed or interrupted save leaves the target untouched."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator, Mapping, Optional


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_directory(path, overwrite: bool = False, extra_files: Optional[Mapping[str, bytes]] = None
                     ) -> Iterator[Path]:
    """Yield a fresh sibling directory; on success it replaces `path` by rename, on error it is removed.

    A non-empty `path` is only replaced with overwrite=True, and then only after the new one is complete.
    `extra_files` (name -> bytes, e.g. tokenizer files read before `path` is replaced) are written into
    the new directory before it is committed.
    """
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is a file; choose a directory path")
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty: pass overwrite=True (--overwrite) or a new path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        yield tmp
        for name, content in (extra_files or {}).items():
            (tmp / name).write_bytes(content)
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; a checkpoint is as readable as any directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(path)

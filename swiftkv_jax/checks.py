"""Argument checks shared by the Python API's entry points (sk.generate, sk.Engine, sk.save, ModelConfig).

A wrong type is refused naming the argument, not read as something else (bool("false") is True, int(1.7) is 1,
a NaN temperature samples token 0) nor left to fail deep inside JAX. numpy scalars are numbers like any other.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np


class ArgumentError(ValueError):
    """A bad argument: the message says which and what it takes; `param` is its name."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def flag(name: str, value, error=ArgumentError) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise error(f"{name} must be True or False, got {value!r}", name)
    return bool(value)


def integer(name: str, value, minimum: Optional[int] = None, error=ArgumentError, optional: bool = False) -> int:
    """`value` as an int; `optional`: the argument may also be None (the caller handles it), as the message says."""
    or_none = " or None" if optional else ""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{name} must be an integer{or_none}, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise error(f"{name} must be " + ("a positive integer" if minimum == 1 else f">= {minimum}") + or_none
                    + f", got {value}", name)
    return int(value)


def real(name: str, value, error=ArgumentError, positive: bool = False) -> float:
    """`value` as a float; `positive`: it must also be > 0 (an epsilon or a scale, which 0 turns into NaN)."""
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating))
            or not math.isfinite(value) or positive and not value > 0):
        raise error(f"{name} must be a {'positive ' if positive else ''}finite number, got {value!r}", name)
    return float(value)


def token_ids(name: str, values, error=ArgumentError) -> list[int]:
    """A sequence of token ids as ints; floats, bools and text are refused (int() would truncate or parse them)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise error(f"{name} must be a sequence of token ids (integers), got {values!r:.80}", name)
    if hasattr(values, "dtype") and hasattr(values, "shape"):  # a numpy or jax array: its dtype says it at once
        if len(values.shape) != 1 or not np.issubdtype(values.dtype, np.integer):
            raise error(f"{name} must be token ids (a 1-D integer array), got {values.dtype}{list(values.shape)}",
                        name)
        return np.asarray(values).tolist()
    ids = list(values)
    bad = [t for t in ids if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))]
    if bad:
        raise error(f"{name} must be token ids (integers), got {bad[0]!r} in it", name)
    return [int(t) for t in ids]


def not_a_directory(path) -> Optional[str]:
    """Why the directory `path` cannot be made: "is a file" or "lies under FILE, which is a file"; None if it can."""
    path = Path(path).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing.is_dir():
        return None
    return "is a file" if existing == path else f"lies under {existing}, which is a file"

"""How every Pallas kernel of this package resolves a call's interpret mode and block sizes, in one place."""

from __future__ import annotations

import jax

from swiftkv_jax.kernels.tuning import tuned


def interpret_mode(interpret: bool | None, what: str, kind: str, reference: str | None = None,
                   cross_lowering: bool = False) -> bool:
    """interpret None: jax's interpreter on a CPU, compiled on a GPU; another backend raises (no fallback).
    interpret False off a GPU raises too, unless `cross_lowering` (the kernel is traced on a CPU and lowered for
    CUDA, as the flash kernels' lowering tests do). kind: the kernel's backend, for the message."""
    backend = jax.default_backend()
    if interpret is None:
        if backend not in ("cpu", "gpu"):
            raise NotImplementedError(f"{what} is a {kind} kernel; JAX's backend {backend!r} is not supported "
                                      f"(pass interpret=True to emulate it)")
        interpret = backend == "cpu"
    if not interpret and backend != "gpu" and not cross_lowering:
        raise NotImplementedError(f"the compiled {what} kernel needs a GPU (JAX's backend is {backend!r}); pass "
                                  "interpret=True to emulate it" + (f" or use {reference}" if reference else ""))
    return bool(interpret)


def block_sizes_for(block_sizes, cls, interpret: bool, tune: dict | None, default=None):
    """The call's block sizes: those given (checked to be a `cls`); else, compiled, the ones measured best on this GPU
    for `tune` (`tuning.tuned`'s kernel and shapes) where the table has them; else `default` (`cls()` if None)."""
    if block_sizes is not None:
        if not isinstance(block_sizes, cls):
            raise TypeError(f"block_sizes must be a {cls.__name__}, got {type(block_sizes).__name__}")
        return block_sizes
    if not interpret and tune:
        found = tuned(cls=cls, **tune)
        if found is not None:
            return found
    return cls() if default is None else default

"""Dtype names: the one place where user-facing strings become jnp dtypes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# Canonical name -> dtype. Aliases map onto these names.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_ALIASES = {
    "fp32": "float32", "f32": "float32", "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16",
}


def dtype_name(dtype) -> str:
    """Canonical name ("float32" | "bfloat16" | "float16") of a string, numpy or jnp dtype.

    Raises ValueError naming the accepted spellings for anything else.
    """
    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
        name = _ALIASES.get(name, name)
        if name in DTYPES:
            return name
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
        if name in DTYPES:
            return name
    accepted = sorted(DTYPES) + sorted(_ALIASES)
    raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(accepted)} (or the jnp dtype itself)")


def as_dtype(dtype) -> jnp.dtype:
    """The jnp dtype for a name or dtype; see `dtype_name`."""
    return jnp.dtype(DTYPES[dtype_name(dtype)])

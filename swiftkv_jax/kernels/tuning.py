"""Measured block sizes per GPU, as data (`tuned_blocks.json`, as tokamax keeps its autotuning results per GPU).

An entry names a kernel (the Triton kernels "flash", "decode", "paged"; the Mosaic GPU kernels "mosaic_flash",
"mosaic_decode", "mosaic_paged"), a device (a substring of `jax.Device.device_kind`, e.g. "H100"), the shapes it
was measured for (`head_dim`, a `group` of query heads per KV head, a range of query tokens `[min_tokens,
max_tokens]`, and optionally the `cache_dtype` of K and V, e.g. "int8": a 1-byte cache moves half the bytes a key
and may want other blocks), the block sizes that won, and how it was measured (`benchmarks/tune_kernels.py` writes
the entries: command, commit, time of the winner and of the default). A compiled kernel called without block sizes
takes the entry that matches it most narrowly (its own cache dtype, then another dtype of the same width, then an
entry for any dtype; its head dim and group before any; then the narrowest token range), else its own defaults,
which are unmeasured guesses. The same-width rule is why an FP8 pool with no entry of its own takes int8's blocks:
what the blocks trade is the bytes a block of keys moves (on an H200 the untuned FP8 pool ran as slowly as the
untuned int8 one, 0.42 against 0.41 ms at 32 x 8K, and int8's tuned blocks took it to 0.32). A GPU with no entry
for a kernel takes the entries measured on a GPU of its compute capability (an entry's `compute_capability`): on an
H100, the H200's, whose SMs and shared memory are the same (its memory is faster), until the H100 is tuned.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

TABLE = Path(__file__).with_name("tuned_blocks.json")
KERNELS = ("flash", "decode", "paged", "mosaic_flash", "mosaic_decode", "mosaic_paged")


@functools.lru_cache(maxsize=None)
def _entries(path: str) -> tuple:
    data = json.loads(Path(path).read_text())
    entries = data.get("entries", [])
    for e in entries:
        if e.get("kernel") not in KERNELS or not isinstance(e.get("block_sizes"), dict) or not e.get("device"):
            raise ValueError(f"{path}: an entry needs kernel (one of {', '.join(KERNELS)}), device and block_sizes, "
                             f"got {e}")
    return tuple(entries)


def lookup(kernel: str, device_kind: str, *, head_dim: int, group: int, tokens: int, cache_dtype=None,
           compute_capability: Optional[str] = None, table: Optional[Path] = None) -> Optional[dict]:
    """The block sizes (a dict of the kernel's block-size fields) measured best for this kernel on this device at
    these shapes, or None. An entry for this cache dtype wins over one for any dtype, one for this head dim and
    group over one for any (in that order); then the narrowest token range. An entry for another cache dtype of the
    same width (FP8's for int8, bf16's for fp16) ranks after this dtype's own and before one for any dtype.
    compute_capability (e.g. "9.0"): where no entry for this kernel names this device, those measured on another GPU
    of the same architecture (an H200's on an H100: the same SMs and shared memory, other memory) are used, ranked
    as above."""
    dtype = None if cache_dtype is None else str(cache_dtype)
    entries = [e for e in _entries(str(table or TABLE)) if e["device"].lower() in device_kind.lower()]
    if compute_capability is not None and not any(e["kernel"] == kernel for e in entries):
        entries = [e for e in _entries(str(table or TABLE))
                   if str(e.get("compute_capability")) == str(compute_capability)]

    def dtype_rank(e) -> Optional[int]:  # 0: this dtype's own entry, 1: one of the same width, 2: any dtype
        if "cache_dtype" not in e:
            return 2
        if e["cache_dtype"] == dtype:
            return 0
        return 1 if dtype is not None and _itemsize(e["cache_dtype"]) == _itemsize(dtype) else None

    matches = [e for e in entries
               if e["kernel"] == kernel and e.get("head_dim", head_dim) == head_dim and e.get("group", group) == group
               and dtype_rank(e) is not None
               and e.get("min_tokens", 0) <= tokens <= e.get("max_tokens", float("inf"))]
    if not matches:
        return None
    best = min(matches, key=lambda e: (dtype_rank(e), "head_dim" not in e, "group" not in e,
                                       e.get("max_tokens", float("inf")) - e.get("min_tokens", 0)))
    return dict(best["block_sizes"])


def _itemsize(dtype: str) -> int:
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def call_shapes(kernel: str, q, num_kv_heads: int, cache_dtype, tokens: Optional[int] = None) -> dict:
    """`lookup`'s kernel and shape arguments for a call with queries ``[..., T, N, H]`` over ``num_kv_heads`` KV
    heads of ``cache_dtype`` (tokens: T unless given)."""
    *_, t, n, h = q.shape
    return dict(kernel=kernel, head_dim=h, group=n // num_kv_heads, tokens=t if tokens is None else tokens,
                cache_dtype=cache_dtype)


def tuned(kernel: str, cls, *, head_dim: int, group: int, tokens: int, cache_dtype=None):
    """`cls(**entry)` for the current device when the table has one, else None (the caller's defaults)."""
    import jax

    device = jax.devices()[0]
    found = lookup(kernel, device.device_kind, head_dim=head_dim, group=group, tokens=tokens, cache_dtype=cache_dtype,
                   compute_capability=getattr(device, "compute_capability", None))
    return None if found is None else cls(**found)

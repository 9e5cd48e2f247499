"""Which parameters distillation trains (../shared/SWIFTKV.md §4), and the split/merge of the tree.

Trainable: norm_swiftkv, every q_proj_swiftkv, the group owners' k/v_proj_swiftkv (kernels and biases).
Everything else (embeddings, lm_head, all other norms, o_proj, MLPs, all layers < l) is frozen: it lives
in a separate tree that is never differentiated and has no optimizer state.
"""

from __future__ import annotations

from flax import traverse_util

TRAINABLE_MODULES = frozenset({"norm_swiftkv", "q_proj_swiftkv", "k_proj_swiftkv", "v_proj_swiftkv"})


def is_trainable(path: tuple[str, ...]) -> bool:
    return any(name in TRAINABLE_MODULES for name in path)


def split(params: dict) -> tuple[dict, dict]:
    """(trainable, frozen) nested dicts; `merge` puts them back together. No array is copied."""
    flat = traverse_util.flatten_dict(params)
    trainable = {p: a for p, a in flat.items() if is_trainable(p)}
    frozen = {p: a for p, a in flat.items() if not is_trainable(p)}
    return traverse_util.unflatten_dict(trainable), traverse_util.unflatten_dict(frozen)


def merge(trainable: dict, frozen: dict) -> dict:
    flat = traverse_util.flatten_dict(frozen)
    flat.update(traverse_util.flatten_dict(trainable))
    return traverse_util.unflatten_dict(flat)

"""The packed training set of a run, and the batches each process reads from it.

Batches are a pure function of (seed, position): global batch p is rows [s*B, (s+1)*B) of epoch e's
permutation of the packed rows (e, s = divmod(p, steps_per_epoch)). So a run resumes at a saved position
exactly, and every process can read only its own rows of a global batch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import datasets
import numpy as np
import pyarrow.compute as pc
from transformers import PreTrainedTokenizerBase

from swiftkv_jax.checks import not_a_directory
from swiftkv_jax.data.chat import tokenize
from swiftkv_jax.data.config import DataConfig
from swiftkv_jax.data.errors import DataError
from swiftkv_jax.data.packing import check_settings, drop_long, pack
from swiftkv_jax.data.sources import load_mixture

COLUMNS = ("tokens", "positions", "segment_ids", "loss_mask")


def build_dataset(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
    """Sources -> weighted mixture -> documents shuffled by cfg.seed -> tokens -> (documents over seq_len cut in
    pieces, or dropped) -> packed rows (numpy format)."""
    check_settings(cfg.seq_len, cfg.loss_mask, cfg.long_documents)  # before any loading
    why = cfg.cache_dir and not_a_directory(cfg.cache_dir)
    if why:
        raise DataError(f"data.cache_dir={cfg.cache_dir!r} {why}, not a directory: choose a directory path for the "
                        f"tokenised and packed data")
    mixture = load_mixture(cfg.sources, cfg.seed, cfg.cache_dir, cfg.num_proc)
    docs = tokenize(mixture.shuffle(seed=cfg.seed), tokenizer, assistant_mask=cfg.loss_mask == "assistant",
                    num_proc=cfg.num_proc)
    if cfg.long_documents == "drop":
        docs = drop_long(docs, cfg.seq_len, cfg.num_proc)
    packed = pack(docs, cfg.seq_len, cfg.loss_mask, pad_id(tokenizer), cfg.num_proc)
    check_trained_tokens(packed, cfg)
    return packed.with_format("numpy")


def check_trained_tokens(packed: datasets.Dataset, cfg: DataConfig) -> None:
    """At least one position with loss: without, every step would "train" on a loss and gradient of exactly 0."""
    for chunk in packed.with_format("arrow")["loss_mask"].chunks:  # usually the first has some
        if pc.max(chunk.flatten()).as_py():
            return
    sources = ", ".join(repr(src.path) for src in cfg.sources)
    fix = ("it has no assistant turns (chat examples with user turns only?): use data.loss_mask: all, or add "
           "sources with assistant turns" if cfg.loss_mask == "assistant" else "add data")
    raise DataError(f"data.loss_mask: {cfg.loss_mask} leaves no token to train on in the data of {sources}; {fix}")


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Padding token: the tokenizer's pad, else its eos, else 0 (masked out either way)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


class Batches:
    """Endless iterator of this process's rows of every global batch: dicts of numpy [len(rows), seq_len].

    rows: indices within each global batch this process materialises (None = all); over all processes they
    must cover range(global_batch_size). start: global batches already consumed (the checkpointed
    `position`). An epoch is len(dataset) // global_batch_size batches; the remainder is dropped.
    """

    def __init__(self, dataset: datasets.Dataset, global_batch_size: int, seed: int,
                 rows: Optional[Sequence[int]] = None, start: int = 0):
        if global_batch_size < 1:
            raise DataError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if len(dataset) < global_batch_size:
            raise DataError(f"the packed dataset has {len(dataset)} rows, fewer than one global batch of "
                            f"{global_batch_size}: add data (or raise source weights), lower seq_len, or lower "
                            f"the global batch size")
        self.rows = np.arange(global_batch_size) if rows is None else np.asarray(rows, np.int64).reshape(-1)
        if self.rows.size and not (0 <= self.rows.min() and self.rows.max() < global_batch_size):
            raise DataError(f"rows must lie in [0, {global_batch_size}), got {self.rows.tolist()}")
        if start < 0:
            raise DataError(f"start (batches already consumed) must be >= 0, got {start}")
        self.dataset = dataset
        self._table = dataset.with_format("arrow")
        self.seq_len = dataset.features["tokens"].length
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.steps_per_epoch = len(dataset) // global_batch_size
        self.position = start
        self._epoch, self._order = -1, None

    @property
    def epoch(self) -> int:
        return self.position // self.steps_per_epoch

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of the packed rows that epoch `epoch` reads."""
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def indices(self, position: int) -> np.ndarray:
        """Dataset rows of this process's share of global batch `position`."""
        epoch, step = divmod(position, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self.order(epoch)
        return self._order[step * self.global_batch_size + self.rows]

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        table = self._table[self.indices(self.position)]
        self.position += 1
        # from Arrow directly: the numpy format would widen every integer column to int64
        return {k: table[k].combine_chunks().flatten().to_numpy().reshape(len(self.rows), self.seq_len)
                for k in COLUMNS}

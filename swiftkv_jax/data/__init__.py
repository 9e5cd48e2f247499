"""Data pipeline for distillation: sources -> mixture -> chat-templated tokens -> packed rows -> batches.

    from swiftkv_jax.data import DataConfig, DataSource, Batches, build_dataset, load_tokenizer
    tokenizer = load_tokenizer(teacher_dir)
    ds = build_dataset(DataConfig(sources=(DataSource("chats.jsonl"),), seq_len=2048), tokenizer)
    for batch in Batches(ds, global_batch_size=64, seed=0, start=position):
        batch["tokens"], batch["positions"], batch["segment_ids"], batch["loss_mask"]  # numpy [64, 2048]
"""

from swiftkv_jax.data import toy
from swiftkv_jax.data.chat import load_tokenizer
from swiftkv_jax.data.config import DataConfig, DataSource
from swiftkv_jax.data.errors import DataError
from swiftkv_jax.data.loader import Batches, build_dataset

__all__ = ["Batches", "DataConfig", "DataError", "DataSource", "build_dataset", "load_tokenizer", "toy"]

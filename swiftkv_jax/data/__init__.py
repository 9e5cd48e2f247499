"""Data pipeline for distillation: sources -> mixture -> chat-templated tokens -> packed rows -> batches.

    from swiftkv_jax.data import DataConfig, DataSource, Batches, build_dataset, load_tokenizer
    tokenizer = load_tokenizer(teacher_dir)
    ds = build_dataset(DataConfig(sources=(DataSource("chats.jsonl"),), seq_len=2048), tokenizer)
    for batch in Batches(ds, global_batch_size=64, seed=0, start=position):
        batch["tokens"], batch["positions"], batch["segment_ids"], batch["loss_mask"]  # numpy [64, 2048]

The names load on first use (PEP 562): a config (`swiftkv_jax.data.config`) imports without `datasets` and
`transformers`, so `train.py --help` and a config check start in about a second.
"""

import importlib

_WHERE = {"toy": None, "load_tokenizer": "chat", "DataConfig": "config", "DataSource": "config",
          "DataError": "errors", "Batches": "loader", "build_dataset": "loader"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _WHERE[name]
    value = importlib.import_module(f"{__name__}.{module or name}")
    return value if module is None else getattr(value, name)


def __dir__():
    return __all__

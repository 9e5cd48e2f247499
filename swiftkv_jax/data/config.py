"""Data settings of a training run (the `data:` section of a recipe)."""

from __future__ import annotations

import dataclasses
from typing import Optional

FORMATS = ("auto", "chat", "prompt_response", "text")
LOSS_MASKS = ("all", "assistant")
LONG_DOCUMENTS = ("split", "drop")


@dataclasses.dataclass(frozen=True)
class DataSource:
    """One source of a mixture: a hub dataset name or local json/jsonl/parquet/text file(s) (globs allowed).

    `weight` is how many times each example is used per epoch: 0.25 takes a seeded quarter, 2 repeats twice.
    """

    path: str
    format: str = "auto"               # auto: chat if `messages` exists, prompt_response, else text
    split: str = "train"
    name: Optional[str] = None         # hub dataset config name
    weight: float = 1.0
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    text_field: str = "text"
    max_examples: Optional[int] = None  # first N examples only (before weighting)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    sources: tuple[DataSource, ...] = ()
    seq_len: int = 8192                # packed sequence length
    long_documents: str = "split"      # a document over seq_len tokens: split (seq_len pieces) or drop (published)
    loss_mask: str = "all"             # all: every position (paper era); assistant: assistant tokens only
    seed: int = 0                      # shuffling of documents and of packed sequences
    num_proc: Optional[int] = None     # tokenisation workers (datasets.map); another value tokenises again
    cache_dir: Optional[str] = None    # datasets cache (tokenised + packed); default: HF_DATASETS_CACHE

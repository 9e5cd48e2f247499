"""Pack tokenized documents into rows of exactly `seq_len` tokens (greedy, in document order).

A document longer than `seq_len` is cut into `seq_len` pieces, each its own document (or, with
`data.long_documents: drop`, left out before packing: `drop_long`). Pieces fill rows in
order; a row is closed and padded (segment 0) when the next piece does not fit. Positions restart at 0 per
piece and segment ids number the pieces of a row 1, 2, ..., so attention stays within a document.

The plan (which row every piece lands in) is computed once over all document lengths; rows are then built
by `Dataset.map` over chunks of documents that each begin a row, so the result is the same for any
`num_proc` and is cached next to the tokenized data.
"""

from __future__ import annotations

import os
from typing import Optional

import datasets
import numpy as np
from datasets.fingerprint import Hasher

from swiftkv_jax.data.config import LONG_DOCUMENTS, LOSS_MASKS
from swiftkv_jax.data.errors import DataError

ROWS_PER_CHUNK = 256  # rows built per map call: bounds worker memory at 256 * seq_len tokens


def features(seq_len: int) -> datasets.Features:
    def column(dtype):
        return datasets.Sequence(datasets.Value(dtype), length=seq_len)

    return datasets.Features({"tokens": column("int32"), "positions": column("int32"),
                              "segment_ids": column("int32"), "loss_mask": column("int8")})


def pack(ds: datasets.Dataset, seq_len: int, loss_mask: str = "all", pad_id: int = 0,
         num_proc: Optional[int] = None) -> datasets.Dataset:
    """Documents {input_ids, assistant, length} -> rows {tokens, positions, segment_ids, loss_mask} [seq_len].

    loss_mask "all": 1 at every non-padding position; "assistant": 1 at t where token t+1 is an assistant
    token of the same document (the logits at t predict t+1).
    """
    check_settings(seq_len, loss_mask)
    lengths = ds.with_format("arrow")["length"].to_numpy().astype(np.int64)  # (numpy format: row by row)
    starts = _chunk_starts(lengths, seq_len)
    chunks = datasets.Dataset.from_dict({"start": starts, "stop": np.r_[starts[1:], len(lengths)]})
    fingerprint = Hasher.hash(("pack-v1", ds._fingerprint, seq_len, loss_mask, int(pad_id), ROWS_PER_CHUNK))
    cache_file = (os.path.join(os.path.dirname(ds.cache_files[0]["filename"]), f"packed-{fingerprint}.arrow")
                  if ds.cache_files and datasets.is_caching_enabled() else None)
    return chunks.map(_pack_chunks, batched=True, batch_size=1, remove_columns=chunks.column_names,
                      features=features(seq_len), num_proc=num_proc, new_fingerprint=fingerprint,
                      cache_file_name=cache_file, desc="packing",
                      fn_kwargs={"docs": ds, "seq_len": seq_len, "loss_mask": loss_mask, "pad_id": int(pad_id)})


def check_settings(seq_len: int, loss_mask: str, long_documents: str = "split") -> None:
    if loss_mask not in LOSS_MASKS:
        raise DataError(f"unknown loss_mask {loss_mask!r}; use one of {', '.join(LOSS_MASKS)}")
    if long_documents not in LONG_DOCUMENTS:
        raise DataError(f"unknown long_documents {long_documents!r}; use one of {', '.join(LONG_DOCUMENTS)}")
    if not (isinstance(seq_len, int) and seq_len >= 2):
        raise DataError(f"seq_len must be an integer >= 2, got {seq_len!r}")


def drop_long(ds: datasets.Dataset, seq_len: int, num_proc: Optional[int] = None) -> datasets.Dataset:
    """Documents {input_ids, assistant, length} of at most seq_len tokens; longer ones are dropped whole, as the
    published recipe's SFT data does (ArcticTraining `filter_dataset_length`), rather than packed in pieces."""
    kept = ds.filter(lambda lengths: [n <= seq_len for n in lengths], input_columns="length", batched=True,
                     num_proc=num_proc, desc=f"dropping documents over {seq_len} tokens")
    if len(kept) == 0:
        raise DataError(f"every document is longer than seq_len={seq_len} tokens, so long_documents: drop keeps "
                        f"none: raise seq_len or use long_documents: split")
    return kept


def pieces(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents cut into pieces of at most seq_len: (document of each piece, offset in it, length)."""
    count = -(-lengths // seq_len)
    doc = np.repeat(np.arange(len(lengths)), count)
    offset = (np.arange(len(doc)) - np.repeat(np.cumsum(count) - count, count)) * seq_len
    return doc, offset, np.minimum(seq_len, lengths[doc] - offset)


def assign_rows(piece_lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Greedy sequential packing: the row of every piece (a new row when the next piece does not fit)."""
    rows = np.empty(len(piece_lengths), np.int64)
    row, fill = -1, seq_len
    for i, n in enumerate(piece_lengths.tolist()):
        if fill + n > seq_len:
            row, fill = row + 1, 0
        rows[i] = row
        fill += n
    return rows


def _chunk_starts(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """First documents of chunks of about ROWS_PER_CHUNK rows; each begins a row in the global plan, so
    packing a chunk on its own gives exactly the global plan's rows."""
    doc, offset, size = pieces(lengths, seq_len)
    if len(doc) == 0:
        raise DataError("no tokens to pack: every document is empty")
    rows = assign_rows(size, seq_len)
    begins_row = np.r_[True, rows[1:] != rows[:-1]] & (offset == 0)  # a piece that starts both row and doc
    first = np.flatnonzero(begins_row)
    chunk = rows[first] // ROWS_PER_CHUNK
    first = first[np.r_[True, chunk[1:] != chunk[:-1]]]
    starts = doc[first]
    starts[0] = 0  # documents without tokens before the first piece go with the first chunk
    return starts


def _pack_chunks(batch, docs: datasets.Dataset, seq_len: int, loss_mask: str, pad_id: int):
    out = [_pack(docs.with_format("arrow")[start:stop], seq_len, loss_mask, pad_id)
           for start, stop in zip(batch["start"], batch["stop"])]
    return {k: np.concatenate([o[k] for o in out]) for k in out[0]}


def _pack(table, seq_len: int, loss_mask: str, pad_id: int) -> dict[str, np.ndarray]:
    ids, assistant = (table[name].combine_chunks() for name in ("input_ids", "assistant"))
    flat_ids, flat_assistant = ids.flatten().to_numpy(), assistant.flatten().to_numpy()
    doc_start = np.asarray(ids.offsets) - ids.offsets[0].as_py()
    doc, offset, size = pieces(np.diff(doc_start), seq_len)
    rows = assign_rows(size, seq_len)
    row_first = np.r_[0, np.flatnonzero(rows[1:] != rows[:-1]) + 1]  # first piece of every row
    first_token = np.cumsum(size) - size                   # of every piece, counted over the chunk
    column = first_token - first_token[row_first][rows]    # ... and within its row
    segment = np.arange(len(size)) - row_first[rows] + 1

    piece = np.repeat(np.arange(len(size)), size)          # per token, in document order
    pos = np.arange(len(piece)) - first_token[piece]
    src = doc_start[doc[piece]] + offset[piece] + pos       # index into the flat token array
    where = (rows[piece], column[piece] + pos)
    # the prediction made at t is of token t+1: mask t by t+1's assistant flag, within the same piece
    next_assistant = np.r_[flat_assistant[1:], 0][src] * (pos + 1 < size[piece])
    n_rows = rows[-1] + 1
    out = {"tokens": np.full((n_rows, seq_len), pad_id, np.int32),
           "positions": np.zeros((n_rows, seq_len), np.int32),
           "segment_ids": np.zeros((n_rows, seq_len), np.int32),
           "loss_mask": np.zeros((n_rows, seq_len), np.int8)}
    out["tokens"][where] = flat_ids[src]
    out["positions"][where] = pos
    out["segment_ids"][where] = segment[piece]
    out["loss_mask"][where] = 1 if loss_mask == "all" else next_assistant
    return out


def max_runs(rows) -> int:
    """The most runs of equal segment ids in any row: of `segment_ids` [..., T] (numpy), or of a packed dataset
    (read in blocks of rows). A run is a document piece or a row's padding; the model's `max_segments_per_row`
    for these rows (cuDNN's packed attention, `swiftkv_jax.model.attention.cudnn_row_attention`)."""
    if isinstance(rows, datasets.Dataset):
        blocks = (b["segment_ids"] for b in rows.select_columns(["segment_ids"]).with_format("numpy").iter(1024))
        return max((max_runs(block) for block in blocks), default=1)
    ids = np.asarray(rows).reshape(-1, np.shape(rows)[-1])
    return int((ids[:, 1:] != ids[:, :-1]).sum(axis=1).max(initial=0)) + 1


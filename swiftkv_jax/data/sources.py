"""Load the sources of a mixture with `datasets`, normalise them to one schema and weight them.

Every source becomes rows of {messages: [{role, content}], text}: chat and prompt/response examples fill
`messages` (text None), plain-text examples fill `text` (messages empty), so sources of any format can be
concatenated into one mixture.
"""

from __future__ import annotations

import dataclasses
import glob
import lzma
import math
import os
import re
import zlib
from typing import Optional, Sequence

import datasets
import numpy as np

from swiftkv_jax.data.config import FORMATS, DataSource
from swiftkv_jax.data.errors import DataError

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
FIELD_KEYS = {"chat": ("messages_field",), "prompt_response": ("prompt_field", "response_field"),
              "text": ("text_field",)}  # the source keys that name each format's fields
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")  # the json/text builders read these transparently

FEATURES = datasets.Features({
    "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
    "text": datasets.Value("string"),
})


def load_mixture(sources: Sequence[DataSource], seed: int = 0, cache_dir: Optional[str] = None,
                 num_proc: Optional[int] = None) -> datasets.Dataset:
    """All sources, normalised and weighted, concatenated in the order given (shuffle afterwards)."""
    if not sources:
        raise DataError("no data sources: add at least one entry to data.sources")
    for src in sources:  # settings first, before any (slow) loading
        check_source(src)
    parts = [weighted(load_source(src, cache_dir, num_proc), src, np.random.default_rng([seed, i]))
             for i, src in enumerate(sources)]
    return datasets.concatenate_datasets(parts)


def load_source(src: DataSource, cache_dir: Optional[str] = None,
                num_proc: Optional[int] = None) -> datasets.Dataset:
    """One source as normalised rows (before weighting), the first `max_examples` only."""
    check_source(src)
    ds, src = _load_raw(src, cache_dir)
    if len(ds) == 0:
        raise DataError(f"source {src.path!r} has no examples: check the file(s) / split {src.split!r}")
    if src.max_examples is not None:
        ds = ds.select(range(min(src.max_examples, len(ds))))
    fmt = detect_format(ds, src)
    keys = _message_keys(_message_struct(ds.features[src.messages_field])) if fmt == "chat" else None
    ds = ds.map(_normalise, batched=True, with_indices=True, fn_kwargs={"fmt": fmt, "src": src, "keys": keys},
                remove_columns=ds.column_names,
                features=FEATURES, num_proc=num_proc, desc=f"reading {src.path}")
    ds = ds.filter(lambda b: [bool(m) or bool(t) for m, t in zip(b["messages"], b["text"])], batched=True,
                   num_proc=num_proc)
    if len(ds) == 0:
        raise DataError(f"source {src.path!r}: every example is empty (no messages / empty text)")
    return ds


def weighted(ds: datasets.Dataset, src: DataSource, rng: np.random.Generator) -> datasets.Dataset:
    """Each example floor(w) times, plus a seeded round(frac(w) * n) of them once more."""
    w, n = src.weight, len(ds)
    extra = rng.permutation(n)[:round((w - math.floor(w)) * n)]
    indices = np.concatenate([np.tile(np.arange(n), math.floor(w)), np.sort(extra)])
    if len(indices) == 0:
        raise DataError(f"source {src.path!r}: weight {w} of {n} examples keeps none of them; raise the weight")
    if len(indices) == n:
        return ds
    return ds.select(indices)


def check_source(src: DataSource) -> None:
    """The settings of a source that can be checked without reading it."""
    if src.format not in FORMATS:
        raise DataError(f"source {src.path!r}: unknown format {src.format!r}; use one of {', '.join(FORMATS)}")
    w = src.weight
    if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0):
        raise DataError(f"source {src.path!r}: weight must be a finite number > 0 (times each example is used "
                        f"per epoch, e.g. 0.5 or 2), got {w!r}")
    if src.max_examples is not None and src.max_examples < 1:
        raise DataError(f"source {src.path!r}: max_examples must be >= 1 or null, got {src.max_examples}")


def detect_format(ds: datasets.Dataset, src: DataSource) -> str:
    """The source's format (resolving `auto`), after checking that its fields are there."""
    columns = list(ds.column_names)
    needs = {"chat": [src.messages_field], "prompt_response": [src.prompt_field, src.response_field],
             "text": [src.text_field]}
    fmt = src.format
    if fmt == "auto":
        fmt = next((f for f, fields in needs.items() if all(c in columns for c in fields)), None)
        if fmt is None:
            raise DataError(
                f"source {src.path!r}: cannot tell the format, no field {src.messages_field!r} (chat), "
                f"{src.prompt_field!r} + {src.response_field!r} (prompt_response) or {src.text_field!r} (text); "
                f"fields present: {columns}. Set the source's format and messages_field / prompt_field / "
                f"response_field / text_field")
    missing = [c for c in needs[fmt] if c not in columns]
    if missing:
        keys = " / ".join(FIELD_KEYS[fmt])
        raise DataError(f"source {src.path!r}: format {fmt!r} needs field(s) {missing}; fields present: "
                        f"{columns}. Name the right field in the source with {keys} (e.g. {{path: ..., format: "
                        f"{fmt}, {FIELD_KEYS[fmt][0]}: {columns[0] if columns else 'NAME'}}})")
    if fmt == "chat":
        _check_messages(ds.features[src.messages_field], src)
    return fmt


# ShareGPT-style conversations ({from, value}, e.g. OpenHermes-2.5) are read as chat messages too.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
# The roles chat templates are written for (OpenAI's and transformers' chat format); another one ('bot') would be
# rendered as a turn of its own, or dropped by the template, and never trained as the assistant's.
ROLES = ("system", "user", "assistant", "tool")


_JSON = getattr(datasets, "Json", None)  # datasets >= 5: messages whose dicts differ in keys load as Json


def _message_keys(inner) -> Optional[tuple[str, str]]:
    """(role key, content key) of a message struct: {role, content} or ShareGPT's {from, value}; () for messages
    stored as Json (their dicts differ in keys: a `weight` or `name` on some turns only), read message by message, or
    that are all empty (null items: no message to read)."""
    if _JSON is not None and isinstance(inner, _JSON) or getattr(inner, "dtype", None) == "null":
        return ()
    for role, content in (("role", "content"), ("from", "value")):
        if isinstance(inner, dict) and role in inner and getattr(inner.get(content), "dtype", None) in (
                "string", "large_string"):
            return role, content
    return None


def _message_struct(feature):
    return feature[0] if isinstance(feature, list) else getattr(feature, "feature", None)


def _check_messages(feature, src: DataSource) -> None:
    if _message_keys(_message_struct(feature)) is None:
        raise DataError(f"source {src.path!r}: field {src.messages_field!r} must be a list of "
                        f"{{role, content}} (or ShareGPT {{from, value}}) messages with string content, got {feature}")


def _conversation(batch, j: int, example: int, keys: tuple, src: DataSource) -> list[dict]:
    conv = batch[src.messages_field][j]
    if not isinstance(conv, list):  # e.g. a plain-text row among the chat rows
        fields = [k for k, v in batch.items() if v[j] is not None]
        raise DataError(f"source {src.path!r}: example {example} has no list of messages in {src.messages_field!r} "
                        f"(got {conv!r:.60}; its fields: {fields}): drop it, or give examples of another format a "
                        f"source of their own")
    return [_turn(m, keys, src, example) for m in conv]


def _turn(m: dict, keys: tuple, src: DataSource, example: int) -> dict:
    """One message as {role, content}. A turn that holds only tool calls is refused, not trained as an empty reply
    (the pipeline keeps text: role and content)."""
    where = f"source {src.path!r}: example {example}"
    role, content = keys or (("role", "content") if isinstance(m, dict) and "role" in m else ("from", "value"))
    text = m.get(content) if isinstance(m, dict) else None
    if not isinstance(m, dict) or role not in m or not isinstance(text, (str, type(None))):
        raise DataError(f"{where}: a message without a string {{role, content}} (or ShareGPT {{from, value}}): "
                        f"{str(m)[:200]}")
    if text is None and m.get("tool_calls"):
        raise DataError(f"{where}: a message of role {m[role]!r} holds tool_calls and no content "
                        f"({str(m)[:120]}); this pipeline trains on the messages' text: drop or filter the examples "
                        f"with tool calls, or render them into the content")
    name = SHAREGPT_ROLES.get(m[role], m[role]) if isinstance(m[role], str) else None
    if name not in ROLES:
        raise DataError(f"{where}: unknown role {m[role]!r}; chat templates know the roles {', '.join(ROLES)} "
                        f"(ShareGPT's human and gpt are read as user and assistant): rename it in the data")
    return {"role": name, "content": text or ""}


def _normalise(batch, indices, fmt: str, src: DataSource, keys=("role", "content")):
    n = len(indices)
    if fmt == "chat":
        messages = [_conversation(batch, j, i, keys, src) for j, i in enumerate(indices)]
    elif fmt == "prompt_response":
        pairs = list(zip(batch[src.prompt_field], batch[src.response_field]))
        for p, r in pairs:  # a null would be an empty turn trained on (or a template's error about the wrong thing)
            if not (isinstance(p, str) and isinstance(r, str)):
                raise DataError(f"source {src.path!r}: an example whose {src.prompt_field!r} or "
                                f"{src.response_field!r} is not a string ({p!r:.60} / {r!r:.60}): drop it from "
                                f"the data")
        messages = [[{"role": "user", "content": p}, {"role": "assistant", "content": r}] for p, r in pairs]
    else:
        return {"messages": [[] for _ in range(n)], "text": batch[src.text_field]}
    return {"messages": messages, "text": [None] * n}


def read_raw(path: str, split: str = "train", name: Optional[str] = None, cache_dir: Optional[str] = None,
             text_by_file: bool = False) -> datasets.Dataset:
    """The rows of local json/jsonl/parquet/txt file(s), a glob, a folder or a hub dataset, as stored.

    `.txt` files give a `text` column, one row per line, or with `text_by_file` one per file (a folder's
    `.txt` files are then read and its other files ignored).
    """
    return _load_raw(DataSource(path=path, split=split, name=name), cache_dir, text_by_file)[0]


def _load_raw(src: DataSource, cache_dir: Optional[str],
              text_by_file: bool = False) -> tuple[datasets.Dataset, DataSource]:
    path = os.path.expanduser(src.path)
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"source {src.path!r}: no files match this pattern")
        return _load_files(files, src, cache_dir, text_by_file)
    if os.path.isfile(path):
        return _load_files([path], src, cache_dir, text_by_file)
    if os.path.isdir(path) and text_by_file:
        texts = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if os.path.isfile(f) and _extension(f) == ".txt")
        if texts:
            return _load_files(texts, src, cache_dir, text_by_file)
    if os.path.isdir(path):  # a downloaded hub dataset or a folder of data files: datasets finds the splits
        try:
            return datasets.load_dataset(path, src.name, split=src.split, cache_dir=cache_dir), src
        except (FileNotFoundError, ValueError) as e:
            raise DataError(f"source {src.path!r}: no usable data files in this directory ({e}); put "
                            f"{'/'.join(sorted(BUILDERS))} files there or name them directly") from e
    if _looks_local(path):
        raise DataError(f"source {src.path!r}: no such file or directory (relative to {os.getcwd()})")
    return _load_hub(src, cache_dir), src


def _load_files(files: list[str], src: DataSource, cache_dir: Optional[str], text_by_file: bool = False):
    extensions = sorted({_extension(f) for f in files})
    unknown = [e for e in extensions if e not in BUILDERS]
    if unknown or len({BUILDERS[e] for e in extensions}) > 1:
        raise DataError(f"source {src.path!r}: unknown or mixed file extension(s) {extensions}; use one kind "
                        f"of {', '.join(sorted(BUILDERS))} (optionally compressed) per source")
    builder = BUILDERS[extensions[0]]
    _check_file_split(src)
    if builder == "text":  # the text builder names its one column "text", one example per line
        src = dataclasses.replace(src, text_field="text")
    files = [f for f in files if os.path.getsize(f) > 0]  # the builders fail obscurely on empty files
    if not files:
        raise DataError(f"source {src.path!r} has no examples: its file(s) are empty")
    try:
        by_file = {"sample_by": "document"} if builder == "text" and text_by_file else {}
        return datasets.load_dataset(builder, data_files=files, split=src.split, cache_dir=cache_dir, **by_file), src
    except datasets.exceptions.DatasetGenerationError as e:
        damaged = _damaged(src, e.__cause__, files)  # past the first chunk (the first 10 MB read fine)
        if damaged:
            raise damaged from e
        raise DataError(f"source {src.path!r}: cannot read the file(s) as {builder} ({e.__cause__ or e}); "
                        f"check that they are valid {', '.join(x for x, b in BUILDERS.items() if b == builder)}"
                        ) from e
    except ValueError as e:  # a slice that datasets cannot read, e.g. train[:200%]
        raise DataError(f"source {src.path!r}: split {src.split!r}: {e}") from e
    except (EOFError, OSError, lzma.LZMAError, zlib.error) as e:
        damaged = _damaged(src, e, files)
        if not damaged:
            raise
        raise damaged from e


def _damaged(src: DataSource, e: BaseException, files: list[str]) -> Optional[DataError]:
    """The error for what the codecs raise on a compressed file cut short (EOFError: an interrupted download or copy)
    or damaged (BadGzipFile, bz2's OSError, LZMAError); None for anything else, an OSError of the system included
    (no permission: it has an errno)."""
    if not (any(f.lower().endswith(COMPRESSIONS) for f in files) and (
            isinstance(e, (EOFError, lzma.LZMAError, zlib.error)) or isinstance(e, OSError) and e.errno is None)):
        return None
    what = "truncated" if isinstance(e, EOFError) else "damaged"
    return DataError(f"source {src.path!r}: cannot read the file(s) (a compressed file is {what}: {e}); re-download "
                     f"or re-compress it")


def _check_file_split(src: DataSource) -> None:
    """Local files are one split, `train`, as `datasets.load_dataset("json", data_files=...)` reads them: its
    slices (train[:10%]) work, another name (test) is refused as datasets refuses it, never silently ignored."""
    names = {re.sub(r"\[.*?\]", "", part).strip() for part in src.split.split("+")}
    if names != {"train"}:
        raise DataError(f"source {src.path!r}: split {src.split!r}, but local files are one split, 'train' (as "
                        f"datasets.load_dataset reads data_files); drop split, take part of the file with a slice "
                        f"(split: 'train[:10%]') or max_examples, or put the {src.split} examples in their own "
                        f"file and name that in path")


def _load_hub(src: DataSource, cache_dir: Optional[str]) -> datasets.Dataset:
    try:
        return datasets.load_dataset(src.path, src.name, split=src.split, cache_dir=cache_dir)
    except ConnectionError as e:  # offline mode or no network
        raise DataError(
            f"source {src.path!r}: hub dataset unreachable ({e}); this machine is offline "
            f"(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE or no network). Download it where there is network "
            f"(`hf download {src.path} --repo-type dataset --local-dir DIR`) and set path to DIR, or use local "
            f"json/jsonl/parquet/txt files. If you meant a local file: it does not exist") from e
    except FileNotFoundError as e:
        raise DataError(f"source {src.path!r}: neither a local file nor a hub dataset ({e}); check the path "
                        f"or the dataset name") from e


def _extension(path: str) -> str:
    root, ext = os.path.splitext(path.lower())
    return os.path.splitext(root)[1] if ext in COMPRESSIONS else ext


def _looks_local(path: str) -> bool:
    """A path rather than a hub name `owner/name`: absolute, ./ ../ ~, deeper than one /, or a file suffix."""
    return (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1
            or _extension(path) in (*BUILDERS, ".csv", ".tsv", ".arrow"))

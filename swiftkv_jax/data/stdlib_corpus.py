"""A real corpus with nothing downloaded: the running interpreter's standard library, one `.py` file per row.

    python -m swiftkv_jax.data.stdlib_corpus /tmp/stdlib_corpus    # parquet splits + a BPE tokenizer
    datasets.load_dataset("parquet", data_files={"train": "/tmp/stdlib_corpus/train.parquet"})
    DataSource("/tmp/stdlib_corpus/train.parquet", format="text")    # in a recipe's data sources

A file's split is a hash of its path relative to the stdlib, so it lands in the same split on every machine
and run. `test/`, `idlelib/` and other less "library-like" packages are kept: they are ordinary Python
(about half of the bytes) and excluding them would be an arbitrary choice. Installed packages
(`site-packages`, `dist-packages`) are not the standard library and are left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerFast

from swiftkv_jax.checkpoints.atomic import atomic_directory
from swiftkv_jax.data.bpe import train_chat_tokenizer
from swiftkv_jax.data.chat import load_tokenizer

SPLITS = ("train", "validation")
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
TOKENIZER_META = "training.json"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root=None) -> list[Path]:
    """The `.py` files under `root` (default: this interpreter's stdlib), sorted by relative POSIX path."""
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]  # pruned: never walked into
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _unit(relative_path: str, part: int) -> float:
    """A uniform number in [0, 1) from a slice of the path's SHA-256 (Python's `hash` is salted per process)."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[8 * part:8 * part + 8], "big") / 2.0 ** 64


def _check_fraction(validation_fraction: float) -> None:
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")


def split_of(relative_path: str, validation_fraction: float) -> str:
    """'validation' or 'train'; raising the fraction only moves files from train to validation."""
    _check_fraction(validation_fraction)
    return "validation" if _unit(relative_path, 0) < validation_fraction else "train"


def build_corpus(out_dir, validation_fraction: float = 0.05, max_files: Optional[int] = None,
                 min_chars: int = 64, root=None, overwrite: bool = False) -> dict:
    """Write OUT_DIR/{train,validation}.parquet (columns text, path) and OUT_DIR/meta.json; returns the meta.

    Files that are not UTF-8 or shorter than `min_chars` (mostly empty `__init__.py`) are skipped and counted (over the
    whole stdlib, also with `max_files`). `max_files` keeps a deterministic, spread-out subset (ranked by another slice
    of the path hash, independent of the split). An existing identical corpus (same meta.json) is reused as is; a
    different one is only replaced with overwrite=True, and then all at once.
    """
    root = Path(root) if root is not None else stdlib_root()
    _check_fraction(validation_fraction)
    if max_files is not None and max_files < 1:
        raise ValueError(f"max_files must be positive, got {max_files}")
    docs, skipped = [], {"not_utf8": 0, "too_short": 0}
    for file in stdlib_files(root):
        try:
            text = file.read_bytes().decode("utf-8")  # bytes as they are: no newline translation
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        if len(text) < min_chars:
            skipped["too_short"] += 1
            continue
        docs.append((file.relative_to(root).as_posix(), text))
    if max_files is not None:
        docs = sorted(sorted(docs, key=lambda doc: _unit(doc[0], 1))[:max_files])  # back in path order

    rows = {split: {"text": [], "path": []} for split in SPLITS}
    content = hashlib.sha256()
    for path, text in docs:
        split = split_of(path, validation_fraction)
        rows[split]["text"].append(text)
        rows[split]["path"].append(path)
        data = text.encode("utf-8")
        content.update(f"{split}\0{path}\0{len(data)}\0".encode("utf-8") + data)
    meta = {
        "python": {"version": sys.version, "implementation": platform.python_implementation()},
        "stdlib": str(root),
        "validation_fraction": validation_fraction,
        "min_chars": min_chars,
        "max_files": max_files,
        "splits": {split: {"files": len(r["path"]), "bytes": sum(len(t.encode("utf-8")) for t in r["text"])}
                   for split, r in rows.items()},
        "skipped": skipped,
        "content_hash": "sha256:" + content.hexdigest(),
    }

    out = Path(out_dir)
    existing = _read_json(out / "meta.json")
    if existing == meta:
        return existing
    if existing is not None and not overwrite:
        raise FileExistsError(f"{out} holds a different stdlib corpus ({_differ(meta, existing)} differ): pass "
                              f"overwrite=True (--overwrite) to replace it, or choose another directory")
    with atomic_directory(out, overwrite=overwrite) as tmp:
        for split, columns in rows.items():
            pq.write_table(pa.table(columns, schema=pa.schema({"text": pa.string(), "path": pa.string()})),
                           tmp / f"{split}.parquet")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def train_corpus_tokenizer(corpus_dir, vocab_size: int = 4096, out_dir=None,
                           overwrite: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE (bpe.train_chat_tokenizer) trained on the corpus' train split only, saved with
    `save_pretrained` in `out_dir` (default CORPUS_DIR/tokenizer) with what it was trained on in
    training.json. The whole stdlib trains in seconds, so there is no sampling. An existing tokenizer
    trained the same way is loaded instead; a different one is only replaced with overwrite=True.
    """
    corpus_dir = Path(corpus_dir)
    out = Path(out_dir) if out_dir is not None else corpus_dir / "tokenizer"
    corpus = _read_json(corpus_dir / "meta.json")
    if corpus is None:
        raise FileNotFoundError(f"no corpus in {corpus_dir} (no meta.json): run build_corpus first")
    training = {"corpus_content_hash": corpus["content_hash"], "split": "train", **corpus["splits"]["train"],
                "vocab_size": vocab_size}
    existing = _read_json(out / TOKENIZER_META)
    if existing == training:
        return load_tokenizer(str(out))
    if existing is not None and not overwrite:
        raise FileExistsError(f"{out} holds a tokenizer trained differently ({_differ(training, existing)} "
                              f"differ): pass overwrite=True (--overwrite) to replace it, or choose another directory")
    texts = pq.read_table(corpus_dir / "train.parquet", columns=["text"]).column("text").to_pylist()
    tokenizer = train_chat_tokenizer(texts, vocab_size)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        tokenizer.save_pretrained(tmp)
        (tmp / TOKENIZER_META).write_text(json.dumps(training, indent=2) + "\n")
    return tokenizer


def _read_json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.exists() else None


def _differ(new: dict, old: dict) -> str:
    return ", ".join(sorted(k for k in new.keys() | old.keys() if new.get(k) != old.get(k)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swiftkv_jax.data.stdlib_corpus",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--validation-fraction", type=float, default=0.05)
    parser.add_argument("--max-files", type=int, default=None, help="a deterministic subset, for quick runs")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--overwrite", action="store_true", help="replace a different corpus or tokenizer")
    args = parser.parse_args(argv)
    try:
        start = time.perf_counter()
        meta = build_corpus(args.out_dir, args.validation_fraction, args.max_files, overwrite=args.overwrite)
        built = time.perf_counter()
        tokenizer = train_corpus_tokenizer(args.out_dir, args.vocab_size, overwrite=args.overwrite)
        trained = time.perf_counter()
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    train, val = meta["splits"]["train"], meta["splits"]["validation"]
    validation = pq.read_table(Path(args.out_dir, "validation.parquet"), columns=["text"])["text"].to_pylist()
    tokens = sum(map(len, tokenizer(validation, add_special_tokens=False)["input_ids"])) if validation else 0
    compression = f", {tokens / val['bytes']:.3f} validation tokens/byte" if val["bytes"] else ""
    print(f"{meta['python']['implementation']} {meta['python']['version'].split()[0]} stdlib -> {args.out_dir}: "
          f"train {train['files']} files {train['bytes'] / 1e6:.1f} MB, validation {val['files']} files "
          f"{val['bytes'] / 1e6:.1f} MB ({built - start:.1f} s); tokenizer vocab {len(tokenizer)} "
          f"({trained - built:.1f} s){compression}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

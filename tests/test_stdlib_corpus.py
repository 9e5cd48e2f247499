"""The stdlib corpus: a split by a stable hash of the path, parquet splits that `datasets` loads, meta.json,
atomic reuse/refusal, and a byte-level BPE trained on the train split that round-trips code exactly.

References not written here: `datasets`' parquet loader, transformers' AutoTokenizer, the files' own bytes.
"""

import platform
import sys

import datasets
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from swiftkv_jax.data import load_tokenizer
from swiftkv_jax.data import stdlib_corpus as sc

datasets.disable_progress_bars()

FRACTION, MAX_FILES, VOCAB = 0.2, 60, 600
TRICKY = "def f(x):\n\treturn x  \r\n# café → 世界 🙂\n  a = b , c . d ;\n\n\n   \t \n\x0c\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "stdlib"
    return out, sc.build_corpus(out, FRACTION, max_files=MAX_FILES)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return sc.train_corpus_tokenizer(corpus[0], vocab_size=VOCAB)


def rows(out, split):
    return pq.read_table(out / f"{split}.parquet").to_pydict()


def mtimes(directory):
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


def test_split_is_a_stable_hash_of_the_path():
    root = sc.stdlib_root()
    paths = [p.relative_to(root).as_posix() for p in sc.stdlib_files()]
    assert len(paths) > 500 and paths == sorted(paths) and "os.py" in paths
    assert not any(part in ("site-packages", "dist-packages") for p in paths for part in p.split("/"))
    # pinned (sha256 of the path): the same on every machine, run and PYTHONHASHSEED
    pinned = {"os.py": "train", "json/__init__.py": "train", "asyncio/tasks.py": "validation",
              "idlelib/editor.py": "validation", "collections/__init__.py": "validation", "ast.py": "train"}
    assert {p: sc.split_of(p, 0.5) for p in pinned} == pinned
    validation = {p for p in paths if sc.split_of(p, FRACTION) == "validation"}
    assert abs(len(validation) / len(paths) - FRACTION) < 0.04
    # a larger fraction only moves files into validation
    assert validation <= {p for p in paths if sc.split_of(p, FRACTION + 0.1) == "validation"}
    assert not any(sc.split_of(p, 0.0) == "validation" for p in paths)
    with pytest.raises(ValueError, match="validation_fraction"):
        sc.split_of("os.py", 1.0)


def test_meta_and_splits(corpus, tmp_path):
    out, meta = corpus
    assert meta["python"] == {"version": sys.version, "implementation": platform.python_implementation()}
    assert meta["stdlib"] == str(sc.stdlib_root()) and meta["validation_fraction"] == FRACTION
    assert meta["content_hash"].startswith("sha256:") and meta["skipped"]["too_short"] > 0
    files = {s: ds for s, ds in datasets.load_dataset(
        "parquet", data_files={s: str(out / f"{s}.parquet") for s in sc.SPLITS}, cache_dir=str(tmp_path)).items()}
    assert set(files) == set(sc.SPLITS)
    for split, ds in files.items():
        assert ds.column_names == ["text", "path"]
        assert meta["splits"][split] == {"files": ds.num_rows,
                                          "bytes": sum(len(t.encode()) for t in ds["text"])}
        assert all(sc.split_of(p, FRACTION) == split for p in ds["path"]) and ds["path"] == sorted(ds["path"])
        for path, text in list(zip(ds["path"], ds["text"]))[:5]:
            assert text == (sc.stdlib_root() / path).read_bytes().decode("utf-8")  # byte for byte
    assert not set(files["train"]["path"]) & set(files["validation"]["path"])
    assert sum(ds.num_rows for ds in files.values()) == MAX_FILES and files["validation"].num_rows > 0
    # the subset is spread over the stdlib (not the first files alphabetically) and the same every time
    assert len({p.split("/")[0] for ds in files.values() for p in ds["path"] if "/" in p}) > 3
    assert sc.build_corpus(tmp_path / "again", FRACTION, max_files=MAX_FILES) == meta


def test_identical_corpus_is_reused_a_different_one_refused(corpus):
    out, meta = corpus
    before = mtimes(out)
    assert sc.build_corpus(out, FRACTION, max_files=MAX_FILES) == meta
    with pytest.raises(FileExistsError, match=r"different stdlib corpus \(.*validation_fraction.*overwrite=True"):
        sc.build_corpus(out, FRACTION + 0.1, max_files=MAX_FILES)
    assert mtimes(out) == before


def test_overwrite_is_all_at_once(tmp_path, monkeypatch):
    out = tmp_path / "corpus"
    old = sc.build_corpus(out, FRACTION, max_files=10)
    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # a crash while writing the new corpus leaves the old one
        m.setattr(sc.pq, "write_table", crash)
        with pytest.raises(KeyboardInterrupt):
            sc.build_corpus(out, 0.5, max_files=10, overwrite=True)
    assert sc._read_json(out / "meta.json") == old and sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]
    new = sc.build_corpus(out, 0.5, max_files=10, overwrite=True)
    assert new["validation_fraction"] == 0.5 and sc._read_json(out / "meta.json") == new


def test_non_utf8_short_and_installed_files_are_skipped(tmp_path):
    root = tmp_path / "lib"
    files = {"a.py": b"import os\n" * 10, "d.py": b"x = 1\r\n\tif x:  \r\n" * 5,
             "pkg/__init__.py": b"", "pkg/b.py": b"# caf\xe9, latin-1\nx = 1\n" * 5,
             "site-packages/c.py": b"import c\n" * 10, "pkg/dist-packages/e.py": b"import e\n" * 10,
             "notes.txt": b"not python\n" * 10}
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
    assert [p.relative_to(root).as_posix() for p in sc.stdlib_files(root)] == [
        "a.py", "d.py", "pkg/__init__.py", "pkg/b.py"]
    meta = sc.build_corpus(tmp_path / "out", validation_fraction=0.0, root=root)
    assert meta["skipped"] == {"not_utf8": 1, "too_short": 1} and meta["stdlib"] == str(root)
    train = rows(tmp_path / "out", "train")
    assert train["path"] == ["a.py", "d.py"] and train["text"][1] == files["d.py"].decode()  # CRLF kept
    assert rows(tmp_path / "out", "validation") == {"text": [], "path": []}


def test_tokenizer_trained_on_train_only(corpus, tokenizer, tmp_path, monkeypatch):
    out, meta = corpus
    seen, real = [], sc.train_chat_tokenizer

    def recording(texts, vocab_size):
        seen.extend(texts)
        return real(seen, vocab_size)

    monkeypatch.setattr(sc, "train_chat_tokenizer", recording)
    sc.train_corpus_tokenizer(out, vocab_size=VOCAB, out_dir=tmp_path / "tok")
    assert seen == rows(out, "train")["text"]
    training = sc._read_json(out / "tokenizer" / sc.TOKENIZER_META)
    assert training == {"corpus_content_hash": meta["content_hash"], "split": "train",
                        **meta["splits"]["train"], "vocab_size": VOCAB}


def test_tokenizer_saved_reloaded_and_exact(corpus, tokenizer):
    out, _ = corpus
    directory = out / "tokenizer"
    assert len(tokenizer) == VOCAB
    validation = rows(out, "validation")["text"]
    for loaded in (tokenizer, AutoTokenizer.from_pretrained(directory), load_tokenizer(str(directory))):
        assert len(loaded) == VOCAB and loaded.bos_token == "<|begin_of_text|>" and loaded.chat_template
        for text in [TRICKY] + validation[:3]:  # held-out files: merges never seen whole
            ids = loaded(text, add_special_tokens=False)["input_ids"]
            assert loaded.decode(ids) == text
            assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    # the same training again is loaded, not redone; a different one is refused
    before = mtimes(directory)
    assert sc.train_corpus_tokenizer(out, vocab_size=VOCAB).get_vocab() == tokenizer.get_vocab()
    with pytest.raises(FileExistsError, match=r"trained differently \(vocab_size differ\).*overwrite=True"):
        sc.train_corpus_tokenizer(out, vocab_size=VOCAB + 100)
    assert mtimes(directory) == before


def test_cli(tmp_path, capsys):
    args = ["--max-files", "20", "--vocab-size", "400", "--validation-fraction"]
    assert sc.main([str(tmp_path / "c"), *args, "0.3"]) == 0
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and "tokenizer vocab 400" in line and "validation tokens/byte" in line
    assert sc.main([str(tmp_path / "empty"), *args, "0"]) == 0  # no validation files: no compression figure
    assert "tokens/byte" not in capsys.readouterr().out
    assert sc.main([str(tmp_path / "c"), *args, "0.4"]) == 2
    assert "different stdlib corpus" in capsys.readouterr().err

"""`python -m swiftkv_jax.tiny_assets DIR`: what it refuses, and that a refusal writes nothing."""

import pytest

from swiftkv_jax.tiny_assets import main, make_tiny_assets


def test_a_file_in_the_way_is_refused(capsys, tmp_path):
    (tmp_path / "afile").write_text("kept")
    assert main([str(tmp_path / "afile")]) == 2
    assert f"error: {tmp_path / 'afile'} is a file, not a directory" in capsys.readouterr().err
    assert main([str(tmp_path / "afile" / "tiny")]) == 2
    assert f"lies under {tmp_path / 'afile'}, which is a file" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "kept" and [p.name for p in tmp_path.iterdir()] == ["afile"]


@pytest.mark.parametrize("held", [["chat.jsonl"], ["teacher"], ["teacher", "chat.jsonl"]])
def test_existing_assets_are_replaced_only_with_overwrite(capsys, tmp_path, held):
    if "teacher" in held:
        (tmp_path / "teacher").mkdir()
        (tmp_path / "teacher" / "config.json").write_text("{}")
    if "chat.jsonl" in held:
        (tmp_path / "chat.jsonl").write_text("mine\n")
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path} already holds {' and '.join(held)}: pass overwrite=True (--overwrite) to replace "
        f"{'it' if len(held) == 1 else 'them'}, or choose another directory\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(held)  # nothing written, no staging folder left
    assert "teacher" not in held or (tmp_path / "teacher" / "config.json").read_text() == "{}"
    assert "chat.jsonl" not in held or (tmp_path / "chat.jsonl").read_text() == "mine\n"
    make_tiny_assets(tmp_path, num_examples=12, overwrite=True)
    assert len((tmp_path / "chat.jsonl").read_text().splitlines()) == 12
    assert (tmp_path / "teacher" / "tokenizer.json").is_file()

"""The tuned block-size table: its lookup rules, the package's table, and benchmarks/tune_kernels.py writing one
(smoke: tiny shapes, kernels interpreted) that the lookup reads back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swiftkv_jax.kernels import DecodeBlockSizes, FlashBlockSizes
from swiftkv_jax.kernels.tuning import TABLE, _entries, lookup

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, entries) -> Path:
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"entries": entries}))
    return path


def test_the_narrowest_matching_entry_wins(tmp_path):
    wide = dict(kernel="flash", device="H100", head_dim=128, group=4, min_tokens=1,
                block_sizes=dict(block_q=64, block_k=64, num_warps=4, num_stages=2))
    narrow = dict(wide, min_tokens=4096, max_tokens=16384, block_sizes=dict(block_q=128, block_k=64, num_warps=8,
                                                                             num_stages=3))
    table = write(tmp_path, [wide, narrow])
    at = lambda **kw: lookup("flash", "NVIDIA H100 80GB HBM3", table=table, **{**dict(head_dim=128, group=4), **kw})
    assert FlashBlockSizes(**at(tokens=8192)).block_q == 128
    assert at(tokens=2048) == wide["block_sizes"] and at(tokens=65536) == wide["block_sizes"]
    assert at(tokens=8192, head_dim=64) is None and at(tokens=8192, group=8) is None
    assert lookup("flash", "NVIDIA H200", head_dim=128, group=4, tokens=8192, table=table) is None
    assert lookup("paged", "NVIDIA H100", head_dim=128, group=4, tokens=1, table=table) is None


def test_a_malformed_entry_is_a_clear_error(tmp_path):
    table = write(tmp_path, [dict(kernel="flashy", device="H100", block_sizes={})])
    with pytest.raises(ValueError, match="kernel .one of flash, decode, paged"):
        lookup("flash", "H100", head_dim=128, group=4, tokens=1, table=table)


def test_the_packages_table_is_valid():
    for entry in _entries(str(TABLE)):
        cls = FlashBlockSizes if entry["kernel"] == "flash" else DecodeBlockSizes
        cls(**entry["block_sizes"])  # validates


def test_the_tuning_script_writes_a_table_the_kernels_read(tmp_path):
    table = tmp_path / "tuned.json"
    proc = subprocess.run([sys.executable, "benchmarks/tune_kernels.py", "--smoke", "--write", "--table", str(table),
                           "--out", str(tmp_path / "rows.json")], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = json.loads(table.read_text())["entries"]
    assert sorted(e["kernel"] for e in entries) == ["decode", "flash", "paged"]
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert all("time_s" in r for r in rows) and sum(r["default"] for r in rows) == 3
    flash = next(e for e in entries if e["kernel"] == "flash")
    found = lookup("flash", flash["device"], head_dim=32, group=4, tokens=64, table=table)
    assert found == flash["block_sizes"] and FlashBlockSizes(**found)
    # a GPU run's --out brought back: its winners into another table, nothing measured
    again = tmp_path / "again.json"
    proc = subprocess.run([sys.executable, "benchmarks/tune_kernels.py", "--from-results", str(tmp_path / "rows.json"),
                           "--table", str(again)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(again.read_text())["entries"] == entries

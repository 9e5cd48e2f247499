"""The tuned block-size table: its lookup rules, the package's table, and benchmarks/tune_kernels.py writing one
(smoke: tiny shapes, kernels interpreted) that the lookup reads back."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from swiftkv_jax.kernels import DecodeBlockSizes, FlashBlockSizes, MosaicDecodeBlockSizes, MosaicFlashBlockSizes
from swiftkv_jax.kernels.tuning import TABLE, _entries, call_shapes, lookup

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, entries) -> Path:
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"entries": entries}))
    return path


def test_a_call_is_looked_up_by_its_head_dim_group_and_tokens():
    """Llama-3.1-8B heads: 32 query heads over 8 KV heads of 128; [B, T, N, H] and the ragged kernel's [T, N, H]."""
    q = jax.ShapeDtypeStruct((2, 512, 32, 128), jnp.bfloat16)
    assert call_shapes("flash", q, 8, jnp.bfloat16) == dict(kernel="flash", head_dim=128, group=4, tokens=512,
                                                            cache_dtype=jnp.bfloat16)
    ragged = jax.ShapeDtypeStruct((700, 32, 128), jnp.bfloat16)
    assert call_shapes("paged", ragged, 8, jnp.int8, tokens=1)["tokens"] == 1


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


def test_an_entry_for_the_head_dim_and_group_wins_over_one_for_any_whatever_the_order(tmp_path):
    sizes = lambda k: dict(block_q=64, block_k=k, num_warps=4, num_stages=2)  # noqa: E731
    any_shape = dict(kernel="flash", device="H100", min_tokens=1, block_sizes=sizes(16))
    exact = dict(any_shape, head_dim=128, group=4, block_sizes=sizes(128))
    for i, entries in enumerate(([any_shape, exact], [exact, any_shape])):
        (tmp_path / str(i)).mkdir()
        table = write(tmp_path / str(i), entries)  # a path a table (tuning caches each path's entries)
        assert lookup("flash", "NVIDIA H100", head_dim=128, group=4, tokens=8192, table=table) == sizes(128)
        assert lookup("flash", "NVIDIA H100", head_dim=64, group=4, tokens=8192, table=table) == sizes(16)


def test_an_entry_for_the_cache_dtype_wins_over_one_for_any(tmp_path):
    sizes = lambda k: dict(block_kv=k, max_concurrent_steps=2, ctas_per_sm=2)  # noqa: E731
    any_dtype = dict(kernel="mosaic_decode", device="H200", head_dim=128, group=4, min_tokens=1, max_tokens=16,
                     block_sizes=sizes(128))
    int8 = dict(any_dtype, cache_dtype="int8", min_tokens=0, max_tokens=1 << 20, block_sizes=sizes(64))
    table = write(tmp_path, [any_dtype, int8])
    at = lambda dtype: lookup("mosaic_decode", "NVIDIA H200", head_dim=128, group=4, tokens=1,  # noqa: E731
                              cache_dtype=dtype, table=table)
    assert at(jnp.dtype(jnp.int8)) == sizes(64)  # although its token range is the wider
    assert at(jnp.dtype(jnp.bfloat16)) == sizes(128) and at(None) == sizes(128)
    assert lookup("mosaic_paged", "NVIDIA H200", head_dim=128, group=4, tokens=1, cache_dtype="int8",
                  table=table) is None


def test_a_cache_dtype_without_an_entry_takes_one_of_the_same_width_before_one_for_any(tmp_path):
    """FP8 pools borrow int8's measured blocks (the bytes a block moves are what the blocks trade), fp16 bf16's; a
    width with no entry falls to an entry for any dtype, else to the kernel's defaults."""
    sizes = lambda k: dict(block_k=k, num_splits=8, num_warps=4, num_stages=2, block_q=64)  # noqa: E731
    base = dict(kernel="paged", device="H200", head_dim=128, group=4, min_tokens=1, max_tokens=16)
    int8, bf16 = dict(base, cache_dtype="int8", block_sizes=sizes(128)), dict(base, cache_dtype="bfloat16",
                                                                             block_sizes=sizes(64))
    any_dtype = dict(base, block_sizes=sizes(32))
    for i, entries in enumerate(([int8, bf16, any_dtype], [any_dtype, bf16, int8], [int8, bf16])):
        (tmp_path / str(i)).mkdir()
        table = write(tmp_path / str(i), entries)
        at = lambda dtype: lookup("paged", "NVIDIA H200", head_dim=128, group=4, tokens=1,  # noqa: E731
                                  cache_dtype=dtype, table=table)
        assert at(jnp.dtype(jnp.float8_e4m3fn)) == sizes(128) and at(jnp.dtype(jnp.int8)) == sizes(128)
        assert at(jnp.dtype(jnp.float16)) == sizes(64) and at("bfloat16") == sizes(64)
        assert at(jnp.dtype(jnp.float32)) == (None if i == 2 else sizes(32))
    fp8 = dict(int8, cache_dtype="float8_e4m3fn", block_sizes=sizes(256))
    table = write(tmp_path, [int8, fp8])
    assert lookup("paged", "NVIDIA H200", head_dim=128, group=4, tokens=1, cache_dtype="float8_e4m3fn",
                  table=table) == sizes(256)  # its own entry, once measured, before int8's


def test_a_gpu_without_entries_for_a_kernel_takes_those_of_its_architecture(tmp_path):
    """An H100 with no entry of its own takes the H200's (compute capability 9.0); once it has one for the kernel,
    only its own count; another architecture, or an entry that names none, is never borrowed."""
    sizes = lambda k: dict(block_kv=k, max_concurrent_steps=2, ctas_per_sm=1)  # noqa: E731
    h200 = dict(kernel="mosaic_decode", device="H200", compute_capability="9.0", head_dim=128, group=4,
                cache_dtype="bfloat16", min_tokens=1, max_tokens=16, block_sizes=sizes(64))
    unnamed = dict(h200, device="B200", kernel="mosaic_paged", block_sizes=sizes(256))
    del unnamed["compute_capability"]
    at = lambda device, capability, table, kernel="mosaic_decode": lookup(  # noqa: E731
        kernel, device, head_dim=128, group=4, tokens=1, cache_dtype="bfloat16", compute_capability=capability,
        table=table)
    (tmp_path / "a").mkdir()
    table = write(tmp_path / "a", [h200, unnamed])
    assert at("NVIDIA H100 80GB HBM3", "9.0", table) == sizes(64)
    assert at("NVIDIA H100 80GB HBM3", None, table) is None and at("NVIDIA B200", "10.0", table) is None
    assert at("NVIDIA H100 80GB HBM3", "9.0", table, kernel="mosaic_paged") is None
    h100 = dict(h200, device="H100", cache_dtype="int8", block_sizes=sizes(128))
    table = write(tmp_path, [h200, h100])
    assert at("NVIDIA H100 80GB HBM3", "9.0", table) is None  # its own int8 entry: not a bf16 one from the H200
    assert at("NVIDIA H200", "9.0", table) == sizes(64)


def test_a_compiled_mosaic_kernel_without_block_sizes_takes_the_tuned_ones(tmp_path, monkeypatch):
    """`settings`, which every Mosaic kernel's entry point calls: the table's entry for this device (here the CPU)
    when compiled and given no block sizes; the defaults interpreted; given sizes as given."""
    import swiftkv_jax.kernels.tuning as tuning
    from swiftkv_jax.kernels.mosaic_launch import settings

    device = jax.devices()[0].device_kind
    tuned = dict(block_kv=64, max_concurrent_steps=3, num_splits=0, ctas_per_sm=4)
    monkeypatch.setattr(tuning, "TABLE", write(tmp_path, [dict(kernel="mosaic_decode", device=device, head_dim=128,
                                                               group=4, cache_dtype="int8", block_sizes=tuned)]))
    tune = dict(kernel="mosaic_decode", head_dim=128, group=4, tokens=1, cache_dtype=jnp.dtype(jnp.int8))
    compiled = lambda sizes=None, **kw: settings("k", False, False, sizes, MosaicDecodeBlockSizes,  # noqa: E731
                                                 dict(tune, **kw))[2]
    assert compiled() == MosaicDecodeBlockSizes(**tuned)
    assert compiled(cache_dtype=jnp.dtype(jnp.bfloat16)) == MosaicDecodeBlockSizes()
    assert compiled(MosaicDecodeBlockSizes(block_kv=256)) == MosaicDecodeBlockSizes(block_kv=256)
    assert settings("k", True, None, None, MosaicDecodeBlockSizes, tune)[2] == MosaicDecodeBlockSizes()


def test_a_malformed_entry_is_a_clear_error(tmp_path):
    table = write(tmp_path, [dict(kernel="flashy", device="H100", block_sizes={})])
    with pytest.raises(ValueError, match="kernel .one of flash, decode, paged, mosaic_flash"):
        lookup("flash", "H100", head_dim=128, group=4, tokens=1, table=table)


SIZES = {"flash": FlashBlockSizes, "decode": DecodeBlockSizes, "paged": DecodeBlockSizes,
         "mosaic_flash": MosaicFlashBlockSizes, "mosaic_decode": MosaicDecodeBlockSizes,
         "mosaic_paged": MosaicDecodeBlockSizes}


def test_the_packages_table_is_valid():
    for entry in _entries(str(TABLE)):
        SIZES[entry["kernel"]](**entry["block_sizes"])  # validates


def benchmark_module(name: str):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def tune(tmp_path, *args, timeout=600):
    proc = subprocess.run([sys.executable, "benchmarks/tune_kernels.py", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_the_tuning_script_writes_a_table_the_kernels_read(tmp_path):
    """Its smoke (tiny shapes, interpreted) over every kernel but the Mosaic prefill (a minute interpreted: the slow
    test below), the quantised points included; then a GPU run's --out brought back into another table."""
    table, rows = tmp_path / "tuned.json", tmp_path / "rows.json"
    kernels = "flash,decode,paged,mosaic_decode,mosaic_paged"
    tune(tmp_path, "--smoke", "--write", "--table", table, "--out", rows, "--only", kernels)
    entries = json.loads(table.read_text())["entries"]
    assert sorted((e["kernel"], e["cache_dtype"]) for e in entries) == [
        ("decode", "bfloat16"), ("flash", "bfloat16"), ("mosaic_decode", "int8"), ("mosaic_paged", "bfloat16"),
        ("paged", "bfloat16"), ("paged", "int8")]
    result = json.loads(rows.read_text())
    assert all("time_s" in r for r in result["rows"]) and sum(r["default"] for r in result["rows"]) == 6
    assert [p["status"] for p in result["points"]] == ["tuned"] * 6
    mosaic = next(r for r in result["rows"] if r["kernel"] == "mosaic_decode")
    assert [s["context"] for s in mosaic["shapes"]] == [128, 64]  # every shape of the point timed
    for e in entries:
        found = lookup(e["kernel"], e["device"], head_dim=64, group=4, tokens=1 if "flash" not in e["kernel"] else 64,
                       cache_dtype=jnp.dtype(e["cache_dtype"]), table=table)
        assert found == e["block_sizes"] and SIZES[e["kernel"]](**found)
    again = tmp_path / "again.json"
    tune(tmp_path, "--from-results", rows, "--table", again, timeout=120)
    assert json.loads(again.read_text())["entries"] == entries


def test_a_second_run_replaces_only_its_own_points(tmp_path):
    """Two bounded GPU calls tune different points: writing the second keeps the first's entries, and a point tuned
    again replaces its own entry."""
    tune_kernels = benchmark_module("tune_kernels")
    table = tmp_path / "tuned.json"
    entry = lambda kernel, dtype, block_k: dict(  # noqa: E731
        kernel=kernel, device="H200", head_dim=128, group=4, cache_dtype=dtype, min_tokens=1, max_tokens=16,
        block_sizes=dict(block_k=block_k), measured={})
    tune_kernels.write_table(table, [entry("decode", "bfloat16", 32)], "first")
    tune_kernels.write_table(table, [entry("paged", "int8", 64)], "second")
    tune_kernels.write_table(table, [entry("decode", "bfloat16", 128)], "third")
    entries = json.loads(table.read_text())["entries"]
    assert sorted((e["kernel"], e["cache_dtype"], e["block_sizes"]["block_k"], e["measured"]["commit"])
                  for e in entries) == [("decode", "bfloat16", 128, "third"), ("paged", "int8", 64, "second")]


def test_a_deadline_keeps_what_was_measured(tmp_path):
    rows = tmp_path / "rows.json"
    tune(tmp_path, "--smoke", "--out", rows, "--only", "decode,paged", "--deadline", 0)
    result = json.loads(rows.read_text())
    assert result["entries"] == [] and result["rows"] == []
    assert [p["status"] for p in result["points"]] == ["not started (deadline)"] * 3


def test_a_point_cut_by_the_deadline_keeps_the_best_that_ran():
    """The defaults run first; a deadline after them leaves an entry of the defaults, marked as cut."""
    tune_kernels = benchmark_module("tune_kernels")
    kernels = tune_kernels.Kernels(smoke=True, interpret=True)
    point = tune_kernels.SMOKE_POINTS[1]  # the Triton decode kernel, bf16
    clock = iter([0.0, 10.0])  # the first candidate (the defaults) starts before the deadline, the next after
    rows = []
    outcome = tune_kernels.tune_point(kernels, point, tune_kernels.SMOKE_CANDIDATES["decode"], 1, 5.0, rows,
                                      clock=lambda: next(clock))
    assert outcome["status"] == "tuned over 1 of 3 (the deadline)" and outcome["block_sizes"] == DecodeBlockSizes()
    assert [r["default"] for r in rows] == [True] and outcome["default_time_s"] == outcome["time_s"]
    assert tune_kernels.tune_point(kernels, point, [], 1, 5.0, [], clock=lambda: 10.0)["status"] == (
        "stopped at the deadline")


def test_a_run_killed_inside_a_candidate_keeps_the_points_checked_best(tmp_path, monkeypatch):
    """A compile can outlast the deadline's margin, and the pack kills the run inside that candidate (2026-11-26: the
    Triton prefill point, 17 candidates timed, all lost). Each new best is checked when timed and written to --out,
    so the file holds it, marked as cut, and --from-results can take it."""
    tune_kernels = benchmark_module("tune_kernels")
    timed, calls = tune_kernels.timed, []

    def dies_on_the_second_candidate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what the kill leaves: nothing after this line of the run
        return timed(*args, **kwargs)

    monkeypatch.setattr(tune_kernels, "timed", dies_on_the_second_candidate)
    out = tmp_path / "rows.json"
    with pytest.raises(KeyboardInterrupt):
        tune_kernels.main(["--smoke", "--out", str(out), "--only", "decode"])
    result = json.loads(out.read_text())
    (entry,) = result["entries"]
    assert entry["kernel"] == "decode" and DecodeBlockSizes(**entry["block_sizes"]) == DecodeBlockSizes()
    assert entry["measured"]["candidates_run"] == 1 and entry["measured"]["candidates"] == 3
    assert result["points"][-1]["status"] == "tuned over 1 of 3 so far (the run was cut)"
    table = tmp_path / "table.json"
    tune_kernels.main(["--from-results", str(out), "--table", str(table)])
    assert [e["kernel"] for e in json.loads(table.read_text())["entries"]] == ["decode"]


def test_only_naming_no_point_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/tune_kernels.py", "--smoke", "--only", "mosaic_decode:fp4"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "names no point" in proc.stderr and "mosaic_decode:int8" in proc.stderr


@pytest.mark.slow
def test_the_tuning_script_tunes_the_mosaic_prefill(tmp_path):
    table = tmp_path / "tuned.json"
    tune(tmp_path, "--smoke", "--write", "--table", table, "--out", tmp_path / "rows.json", "--only", "mosaic_flash")
    (entry,) = json.loads(table.read_text())["entries"]
    assert entry["kernel"] == "mosaic_flash" and MosaicFlashBlockSizes(**entry["block_sizes"])


def test_one_byte_caches_also_try_fp16_and_fp32_conversion():
    """The Triton split-K kernels over an int8 / FP8 cache try each shape with its values converted straight to fp16,
    to fp32 and to q's dtype (`DecodeBlockSizes.dequant_dtype`); a 16-bit cache and the Mosaic kernels do not have
    that knob."""
    tk = benchmark_module("tune_kernels")
    by = {(p.kernel, p.cache_dtype): p for p in tk.POINTS}
    int8, bf16 = tk.candidates_for(by["paged", "int8"]), tk.candidates_for(by["paged", "bfloat16"])
    assert len(int8) == 3 * len(bf16) and all("dequant_dtype" not in c for c in bf16)
    assert int8[:3] == [dict(bf16[0], dequant_dtype="float16"), dict(bf16[0], dequant_dtype="float32"), bf16[0]]
    for c in int8:
        DecodeBlockSizes(**c)  # every candidate is valid block sizes
    assert all("dequant_dtype" not in c for c in tk.candidates_for(by["mosaic_decode", "int8"]))
    with pytest.raises(ValueError, match="dequant_dtype must be one of"):
        DecodeBlockSizes(dequant_dtype="bfloat16")

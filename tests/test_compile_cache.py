"""JAX's persistent compilation cache for serving (`swiftkv_jax.serving.compile_cache`, `--compilation-cache`).

Where the cache lives and "off"; a directory that cannot be written is a clear error; and a real restart:
`python infer.py serve` run twice on a tiny model with one cache directory compiles every start-up program the
first time and none the second (its /metrics say so), and answers the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import jax
import pytest
from prometheus_client.parser import text_string_to_metric_families

from swiftkv_jax.infer_cli import main
from swiftkv_jax.serving.compile_cache import (ENV, CompilationCacheError, active_cache_dir, cache_dir,
                                               default_cache_dir, enable_compilation_cache)
from swiftkv_jax.tiny_assets import make_tiny_assets

from conftest import xla_flags
from server_process import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]
OPTIONS = ("jax_compilation_cache_dir", "jax_enable_compilation_cache", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture
def jax_cache_settings():
    """Whatever a test sets, this process's cache settings are as before afterwards (the cache never opened)."""
    from jax.experimental.compilation_cache import compilation_cache

    before = {name: getattr(jax.config, name) for name in OPTIONS}
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def test_where_the_cache_lives(monkeypatch, tmp_path, jax_cache_settings):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    assert cache_dir() == default_cache_dir() == str(tmp_path / "home" / ".cache" / "swiftkv-jax" / "xla")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not absolute: ignored, as the XDG spec says
    assert cache_dir() == str(tmp_path / "home" / ".cache" / "swiftkv-jax" / "xla")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == str(tmp_path / "xdg" / "swiftkv-jax" / "xla")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))  # JAX_COMPILATION_CACHE_DIR
    assert cache_dir() == str(tmp_path / "jax")
    monkeypatch.setenv(ENV, str(tmp_path / "env"))
    assert cache_dir() == str(tmp_path / "env")
    assert cache_dir("~/flag") == str(tmp_path / "home" / "flag")  # the argument (the flag) first, expanded
    monkeypatch.chdir(tmp_path)
    assert cache_dir("relative") == str(tmp_path / "relative")
    for off in ("off", "OFF", "", " "):
        assert cache_dir(off) is None
        monkeypatch.setenv(ENV, off)
        assert cache_dir() is None


def test_enable_writes_every_program_and_off_turns_it_off(tmp_path, jax_cache_settings):
    directory = enable_compilation_cache(str(tmp_path / "a" / "xla"))
    assert directory == active_cache_dir() == str(tmp_path / "a" / "xla")
    assert os.stat(directory).st_mode & 0o777 == 0o700  # the cache holds executables: private
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    assert enable_compilation_cache("off") is None and active_cache_dir() is None
    assert not jax.config.jax_enable_compilation_cache


def test_a_directory_that_cannot_be_written_is_a_clear_error(tmp_path, capsys, jax_cache_settings):
    (tmp_path / "file").write_text("")
    bad = str(tmp_path / "file" / "xla")  # under a file: fails for root too
    with pytest.raises(CompilationCacheError, match=f"{bad} cannot be written.*--compilation-cache.*{ENV}"):
        enable_compilation_cache(bad)
    # the command line says so before it reads the model
    assert main(["serve", "--model", str(tmp_path / "no-model"), "--compilation-cache", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: compilation cache directory {bad} cannot be written") and "off" in err


def test_the_suite_cache_is_back_after_main_turned_it_off(tmp_path, monkeypatch, jax_cache_settings):
    """infer.py's `main` in this process applies SWIFTKV_JAX_COMPILATION_CACHE=off to the whole process: conftest
    turns the suite's own cache back on after such a test (`restore_xla_cache`), or every later test of the process
    would compile without it."""
    import conftest

    monkeypatch.setenv(ENV, "off")
    before = {name: getattr(jax.config, name) for name in conftest._XLA_CACHE}
    assert main(["generate", "--model", str(tmp_path / "no-model"), "--prompt", "x"]) == 2
    assert not jax.config.jax_enable_compilation_cache
    conftest.restore_xla_cache()
    assert {name: getattr(jax.config, name) for name in conftest._XLA_CACHE} == before


def _serve_once(model: Path, cache: Path, log_path: Path) -> tuple[dict, str]:
    """`infer.py serve` until it answers: returns (its start-up metrics, a greedy completion); then SIGTERM."""
    port = free_port()
    env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    env.pop(ENV, None)  # the flag decides
    argv = [sys.executable, str(REPO / "infer.py"), "serve", "--model", str(model), "--port", str(port),
            "--compilation-cache", str(cache), "--cache-dtype", "float32", "--page-size", "8", "--num-pages", "32",
            "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--single-buckets", "2", "--prompt-buckets",
            "16", "--max-model-len", "64", "--shutdown-grace", "1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, log_path, timeout=120)
        metrics = {(s.name, s.labels.get("source")): s.value
                   for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
                   for s in family.samples if s.name.startswith(("swiftkv_startup", "swiftkv_compilation_cache"))}
        body = dict(prompt="What is 4 + 5?", max_tokens=6, temperature=0)
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()[-3000:]
        return metrics, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_restart_compiles_nothing(tmp_path):
    model = make_tiny_assets(tmp_path, num_examples=60) / "teacher"
    cache = tmp_path / "xla"
    first, first_text = _serve_once(model, cache, tmp_path / "first.log")
    second, second_text = _serve_once(model, cache, tmp_path / "second.log")
    logs = "".join((tmp_path / f"{run}.log").read_text()[-2000:] for run in ("first", "second"))
    programs = first[("swiftkv_startup_programs", "compiled")]
    assert programs > 0 and first[("swiftkv_startup_programs", "cache")] == 0, logs
    assert second[("swiftkv_startup_programs", "compiled")] == 0, logs
    assert second[("swiftkv_startup_programs", "cache")] == programs, logs
    assert [m[("swiftkv_compilation_cache_enabled", None)] for m in (first, second)] == [1, 1]
    assert len(list(cache.glob("*-cache"))) >= programs  # every program written (the model's load too)
    assert second_text == first_text
    assert f"start-up: 0 XLA programs compiled, {programs:.0f} loaded from the compilation cache ({cache})" in logs
    second_log = (tmp_path / "second.log").read_text()
    assert "pages wide: loaded from the compilation cache in" in second_log and "pages wide: compiled" not in second_log
    seconds = [m[(name, None)] for m in (first, second)
               for name in ("swiftkv_startup_seconds", "swiftkv_startup_compile_seconds")]
    print("start-up (all, in XLA): first %.1f s, %.1f s; restart %.1f s, %.1f s" % tuple(seconds))

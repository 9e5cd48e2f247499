"""JAX's persistent compilation cache for the serving engine: a restart loads its compiled programs from disk.

    directory = enable_compilation_cache()      # $SWIFTKV_JAX_COMPILATION_CACHE, else ~/.cache/swiftkv-jax/xla
    enable_compilation_cache("off")             # no persistent cache in this process
    with count_compiles() as counts:
        engine.warmup()
    counts.programs, counts.compiled, counts.loaded, counts.written, counts.seconds

Where the cache lives, first match wins: the `path` argument (`infer.py serve --compilation-cache DIR|off`), the
environment variable SWIFTKV_JAX_COMPILATION_CACHE, JAX's own JAX_COMPILATION_CACHE_DIR when set, then
$XDG_CACHE_HOME/swiftkv-jax/xla (~/.cache/swiftkv-jax/xla). "off" or an empty string disables the cache. Every
program is written, however quick to compile or small (JAX's defaults skip those under 1 s). Entries are keyed by
the lowered program, the compile options and XLA flags, the devices and the jaxlib and backend versions, so a stale
entry is never used; the directory is not bounded (JAX_COMPILATION_CACHE_MAX_SIZE bounds it; deleting it is safe).

The cache holds executables that are run without checks: the directory is created private (0700) and must not be
writable by anyone untrusted. The options used exist in JAX 0.10 and 0.11; the counts come from JAX's monitoring
events ('/jax/core/compile/backend_compile_duration' for every program compiled or loaded,
'/jax/compilation_cache/cache_hits' for each loaded, '/jax/compilation_cache/cache_misses' for each written).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from typing import Iterator, Optional

ENV = "SWIFTKV_JAX_COMPILATION_CACHE"
OFF = ("off", "")
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"   # jax._src.dispatch.BACKEND_COMPILE_EVENT
CACHE_HITS = "/jax/compilation_cache/cache_hits"
CACHE_WRITES = "/jax/compilation_cache/cache_misses"               # recorded when an entry is written


class CompilationCacheError(ValueError):
    """The cache directory cannot be created or written."""


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/swiftkv-jax/xla, or ~/.cache/swiftkv-jax/xla (XDG: a relative XDG_CACHE_HOME is ignored)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "swiftkv-jax", "xla")


def cache_dir(path: Optional[str] = None) -> Optional[str]:
    """The directory `enable_compilation_cache(path)` would use (absolute), or None when it is "off"."""
    import jax

    if path is None:
        path = os.environ.get(ENV)
    if path is None:
        path = jax.config.jax_compilation_cache_dir or default_cache_dir()
    if path.strip().lower() in OFF:
        return None
    return os.path.abspath(os.path.expanduser(path))


def enable_compilation_cache(path: Optional[str] = None) -> Optional[str]:
    """Turn JAX's persistent compilation cache on at `cache_dir(path)` for this process, caching every program, or
    off for "off". Returns the directory (None: off). Call it before the programs to cache are compiled; a call
    after the cache was first used moves it. A directory that cannot be created or written raises
    CompilationCacheError, naming it and how to choose another."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    directory = cache_dir(path)
    if directory is not None:
        _check_writable(directory)
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor, and none chosen by JAX
    jax.config.update("jax_enable_compilation_cache", directory is not None)
    compilation_cache.reset_cache()  # JAX opens its cache once per process: re-read the settings above
    return directory


def active_cache_dir() -> Optional[str]:
    """The directory JAX's persistent compilation cache uses now, or None when it is off."""
    import jax

    return jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None


def _check_writable(directory: str) -> None:
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise CompilationCacheError(
            f"compilation cache directory {directory} cannot be written ({type(e).__name__}: {e.strerror or e}): "
            f"choose another with --compilation-cache DIR or {ENV}=DIR, or turn the cache off with "
            f"--compilation-cache off or {ENV}=off") from None


@dataclasses.dataclass
class CompileCounts:
    """XLA programs built while `count_compiles()` was open: `programs` = `compiled` + `loaded` (from the cache);
    `written`: entries written to the cache; `seconds`: time in XLA compiling or loading them."""

    programs: int = 0
    loaded: int = 0
    written: int = 0
    seconds: float = 0.0

    @property
    def compiled(self) -> int:
        return self.programs - self.loaded

    def as_dict(self) -> dict:
        return dict(dataclasses.asdict(self), compiled=self.compiled)


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileCounts]:
    """Count the XLA programs compiled, loaded from the persistent cache and written to it inside the block (every
    thread of the process: JAX's listeners are global)."""
    from jax import monitoring

    counts = CompileCounts()

    def on_event(event: str, **_) -> None:
        if event == CACHE_HITS:
            counts.loaded += 1
        elif event == CACHE_WRITES:
            counts.written += 1

    def on_duration(event: str, seconds: float, **_) -> None:
        if event == BACKEND_COMPILE:
            counts.programs += 1
            counts.seconds += seconds

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield counts
    finally:
        monitoring.unregister_event_listener(on_event)
        monitoring.unregister_event_duration_listener(on_duration)

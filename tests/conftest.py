"""Test setup: 8 fake CPU devices for sharding tests, fp32, no hub access, one XLA compilation cache for the run,
XLA's older CPU emitters (quicker to compile)."""

import os
import subprocess
import sys

# XLA's CPU fusion emitters (its default) take 30-40% longer to compile the suite's tiny programs than its
# older elemental emitters, for the same fp32 operations (2026-11-28, jaxlib 0.10.2: one engine test 20.7 s -> 15.0 s,
# the paged kernel's interpret tests with sharded distillation steps 64 s -> 41 s): the suite, and the processes it
# starts (`xla_flags`), compile with the older ones. An XLA that does not know a flag in XLA_FLAGS exits at once, so
# a process asks this XLA first; a later XLA without them compiles with its default. XLA_FLAGS set by hand replaces
# the suite's flags (`XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest` tests the default emitters).
CPU_COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=false"


def _known_to_this_xla(flags: str) -> bool:
    """Whether a CPU process of this JAX compiles with `flags` (a few seconds; not waited for past a minute)."""
    try:
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1)"], capture_output=True,
                               env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


if "SWIFTKV_TEST_CPU_XLA_FLAGS" not in os.environ:  # decided once: xdist workers and subprocesses inherit it
    os.environ["SWIFTKV_TEST_CPU_XLA_FLAGS"] = ("" if "XLA_FLAGS" in os.environ or not _known_to_this_xla(
        CPU_COMPILE_FLAGS) else CPU_COMPILE_FLAGS)


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process the suite starts: `devices` fake CPU devices, compiled as the suite compiles."""
    return f"--xla_force_host_platform_device_count={devices} {os.environ['SWIFTKV_TEST_CPU_XLA_FLAGS']}".strip()


os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# infer.py (in this process and in the suite's subprocesses) writes no compilation cache into the home directory:
# tests/test_compile_cache.py gives it its own
os.environ.setdefault("SWIFTKV_JAX_COMPILATION_CACHE", "off")
# ... but the suite itself shares one persistent XLA cache, fresh for the run: most of a test is compiling, and
# modules compile the same tiny models' programs again (each drops its programs when done), as do the benchmarks and
# scripts the suite runs in subprocesses (they inherit this environment). Entries are keyed by the program, the
# options and the versions, so a hit is the program that would have been compiled. The controller of an xdist run
# imports this file first, so its workers share its folder. No size bound: JAX's eviction scans the whole folder on
# every write; without it there is no lock either, and an entry read while another process writes it fails JAX's
# decompression, which JAX warns of and compiles instead. SWIFTKV_TEST_XLA_CACHE=off: no cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and os.environ.get("SWIFTKV_TEST_XLA_CACHE", "on") != "off":
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="swiftkv-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")   # every program, not those over 1 s
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402  (after XLA_FLAGS)

jax.config.update("jax_default_matmul_precision", "highest")
if jax.default_backend() == "cpu":
    # Tiny shapes: compiling, not running, is most of the suite's time, and XLA's optimisations are most of
    # compiling (~30% of the suite). The arithmetic is the same fp32, fused and ordered differently; benchmarks,
    # the demo and the GPU run optimised.
    # JAX_DISABLE_MOST_OPTIMIZATIONS=0 tests optimised. Set in the environment too, for the suite's subprocesses.
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    jax.config.update("jax_disable_most_optimizations",
                      os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in ("1", "true", "yes", "on", "y", "t"))

import gc  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """A `gpu` test needs a GPU: on any other backend it skips, saying so, whatever selected it (`-m slow` picks the
    slow tests that are also `gpu`, e.g. the Mosaic kernels' compiled classes inheriting slow checks)."""
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU (this JAX's backend is {jax.default_backend()!r})")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# the persistent cache settings this process started with (the suite's cache above, or none)
_XLA_CACHE = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
              "jax_persistent_cache_min_entry_size_bytes")
_XLA_CACHE_SETTINGS = {name: getattr(jax.config, name) for name in _XLA_CACHE}


@pytest.fixture(autouse=True)
def _keep_the_suite_xla_cache():
    """A test that runs infer.py's `main` in this process applies SWIFTKV_JAX_COMPILATION_CACHE=off to the whole
    process (`compile_cache.enable_compilation_cache`): the suite's cache is turned back on after it, or every later
    test of this process (an xdist worker) would compile without it."""
    yield
    restore_xla_cache()


def restore_xla_cache() -> None:
    """The persistent cache settings this process started with, where a test changed them."""
    if any(getattr(jax.config, name) != value for name, value in _XLA_CACHE_SETTINGS.items()):
        from jax.experimental.compilation_cache import compilation_cache

        for name, value in _XLA_CACHE_SETTINGS.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()  # JAX opens its cache once per process: re-read the settings


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each module's compiled programs and arrays when it is done: one process runs the whole suite, and the
    executables of ~500 tests otherwise accumulate (a full run once crashed inside XLA's compiler late in the
    suite, while every module passes on its own)."""
    yield
    jax.clear_caches()
    gc.collect()


try:  # jax's Mosaic GPU interpret mode (private, JAX >= 0.10): the Mosaic kernels' interpreted tests need it
    from jax._src.pallas.mosaic.interpret import thread_map as GPU_INTERPRET
    from jax._src.pallas.mosaic_gpu.interpret import params as _gpu_interpret_params  # noqa: F401
except ImportError:  # this JAX has none: those tests skip
    GPU_INTERPRET = None


@pytest.fixture(scope="module")
def mgpu_interpreter_compiles_once():
    """jax's GPU interpreter (thread_map._run_jaxpr) lowers and compiles the simulated kernel body afresh for every
    CTA and warpgroup, though the body (a jaxpr whose thread and CTA ids are arguments) is one object per kernel:
    ~2 s each. For a module that uses this fixture, each body is compiled once and reused (the same executable,
    the same result)."""
    original = getattr(GPU_INTERPRET, "_run_jaxpr", None)
    if original is None:
        yield
        return
    compiled, lock = {}, threading.Lock()

    def run(jaxpr, consts, *args):
        with lock:
            if id(jaxpr) not in compiled:  # the jaxpr is kept alive with its executable, so its id is not reused
                body = lambda jaxpr, consts, *a: jax.core.eval_jaxpr(jaxpr, consts, *a)  # noqa: E731
                compiled[id(jaxpr)] = (jaxpr, jax.jit(body, static_argnums=0).trace(jaxpr, consts, *args)
                                       .lower().compile())
            executable = compiled[id(jaxpr)][1]
        executable(consts, *args)

    GPU_INTERPRET._run_jaxpr = run
    yield
    GPU_INTERPRET._run_jaxpr = original

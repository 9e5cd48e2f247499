"""Test setup: 8 fake CPU devices for sharding tests, fp32, no hub access and no compilation cache."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# infer.py (in this process and in the suite's subprocesses) writes no compilation cache into the home directory:
# tests/test_compile_cache.py gives it its own
os.environ.setdefault("SWIFTKV_JAX_COMPILATION_CACHE", "off")

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

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each module's compiled programs and arrays when it is done: one process runs the whole suite, and the
    executables of ~500 tests otherwise accumulate (a full run once crashed inside XLA's compiler late in the
    suite, while every module passes on its own)."""
    yield
    jax.clear_caches()
    gc.collect()

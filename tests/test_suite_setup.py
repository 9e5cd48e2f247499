"""The suite's own setup (tests/conftest.py): the CPU compile flags reach this process and the ones it starts only
where this XLA knows them, since an XLA exits at once on a flag it does not know."""

import os
import subprocess
import sys

import conftest


def test_an_unknown_flag_is_not_taken_and_a_known_one_is():
    assert not conftest._known_to_this_xla("--xla_cpu_no_such_flag_anywhere=true")
    assert conftest._known_to_this_xla("--xla_force_host_platform_device_count=2")


def test_processes_the_suite_starts_compile_as_this_one():
    flags = os.environ["SWIFTKV_TEST_CPU_XLA_FLAGS"]
    assert flags in ("", conftest.CPU_COMPILE_FLAGS)
    assert conftest.xla_flags(3).split() == ["--xla_force_host_platform_device_count=3", *flags.split()]
    child = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"], capture_output=True,
                           text=True, env={**os.environ, "XLA_FLAGS": conftest.xla_flags(3)}, timeout=300)
    assert child.returncode == 0 and child.stdout.split()[-1] == "3", child.stderr[-2000:]

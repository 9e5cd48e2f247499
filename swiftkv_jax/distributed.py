"""Multi-host start-up: `jax.distributed.initialize` from the config or the usual environment."""

from __future__ import annotations

import contextlib
import itertools
import os

import jax

from swiftkv_jax.configuration import ConfigError

# Launchers whose variables jax.distributed.initialize() reads by itself.
_CLUSTER_SIZE_VARS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def initialize(coordinator_address=None, num_processes=None, process_id=None, cpu_collectives: str = "gloo") -> bool:
    """Join the job's processes when there is more than one; True if it did.

    Explicit arguments win; then JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; then a
    launcher JAX detects itself (SLURM, Open MPI). A single process initialises nothing.
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes if num_processes is not None else _int_env("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _int_env("JAX_PROCESS_ID")
    launched = any((_int_env(name) or 1) > 1 for name in _CLUSTER_SIZE_VARS)
    if not (coordinator_address or (num_processes or 1) > 1 or launched):
        return False
    if cpu_collectives != "none":  # CPU devices need a collectives backend to talk across processes
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    return True


# How long a process that is through a `stop_together` block waits for the others to be (their input may take longer
# to read: a cold tokenising cache); a process that died meanwhile is reported by JAX's heartbeats well before.
WAIT_FOR_OTHERS_S = 24 * 3600
_BLOCKS = itertools.count()  # each block its own keys: the store refuses a key set twice (train() called again)


@contextlib.contextmanager
def stop_together(name: str, timeout_s: float = WAIT_FOR_OTHERS_S):
    """A block every process runs before its first collective: when it raises in one process (its own data path
    missing, say), the others raise a ConfigError quoting that error at the block's end, instead of waiting for
    that process at their next collective (on CPUs a Gloo timeout naming nothing, on GPUs until JAX's shutdown
    barrier gives up). Through the coordination service's key-value store, so that it waits as long as the
    slowest process needs, with no device in it. Nothing with one process."""
    if jax.process_count() == 1:
        yield
        return
    client = jax._src.distributed.global_state.client  # as Orbax's multihost helpers reach it
    prefix = f"swiftkv/{name}/{next(_BLOCKS)}"  # every process runs the same blocks in the same order
    try:
        yield
    except Exception as e:
        client.key_value_set(f"{prefix}/{jax.process_index()}", f"{type(e).__name__}: {e}")
        raise
    client.key_value_set(f"{prefix}/{jax.process_index()}", "ok")
    for process in range(jax.process_count()):
        status = client.blocking_key_value_get(f"{prefix}/{process}", int(timeout_s * 1000))
        if status != "ok":
            raise ConfigError(f"process {process} of {jax.process_count()} stopped ({status}), so this one stops "
                              f"too")


def _int_env(name: str):
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None

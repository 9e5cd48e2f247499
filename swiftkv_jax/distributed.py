"""Multi-host start-up: `jax.distributed.initialize` from the config or the usual environment."""

from __future__ import annotations

import os

import jax

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


def _int_env(name: str):
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None

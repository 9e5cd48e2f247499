"""What the Mosaic GPU kernels share: their launch settings, and jax's GPU interpret mode with the rule it lacks.

`settings` resolves a kernel's interpret / interpreter_safe / block-size arguments the same way for every Mosaic
kernel; `launch` runs a compiled call, or an interpreted one (resetting the interpreter if it raises).

JAX >= 0.10 ships a GPU interpret mode (private: `jax._src.pallas.mosaic_gpu.interpret`) that simulates GMEM/SMEM,
warpgroups, barriers, TMA and wgmma on the CPU; an `InterpretGPUParams` passed as a kernel's `interpret` runs it.
Its wgmma (jax 0.10.2) reads an operand only through indexers: an operand given as `plgpu.transpose_ref(...)`,
the form Hopper's wgmma takes a K^T tile in (jax's attention_mgpu does so), fails with "'TransposeTransform' object
has no attribute 'indices'". `interpret_params` installs, once, a wgmma rule that reads such an operand through its
indexers and then transposes it, so a kernel runs the same code interpreted and compiled. The rule is ours, over
the interpreter's own shared-memory calls; where those are missing (another JAX), the original rule stays.
"""

from __future__ import annotations

import functools
import threading

import jax
import numpy as np

from swiftkv_jax.kernels.call_settings import block_sizes_for, interpret_mode

__all__ = ["SMEM_BYTES", "accumulate_pv", "interpret_params", "launch", "reset_interpreter", "settings"]

SMEM_BYTES = 227 * 1024  # H100 / H200 shared memory per block (opt-in maximum)

_install_lock = threading.Lock()


def interpret_params(what: str):
    """An `InterpretGPUParams` (the transposed-operand rule installed); loud if this JAX has no GPU interpret mode.
    what: the kernel's name, for the error."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:
        raise NotImplementedError(
            f"{what}(interpret=True) needs jax's Mosaic GPU interpret mode (jax._src.pallas.mosaic_gpu.interpret, "
            f"JAX >= 0.10), which jax {jax.__version__} does not have; run it compiled on an sm_90 GPU, or use "
            f"the Triton kernel or the XLA path") from e
    _install_transposed_wgmma()
    return InterpretGPUParams()


def settings(what: str, interpret, interpreter_safe, block_sizes, block_sizes_type, tune: dict | None = None):
    """(interpret, interpreter_safe, block_sizes) of a Mosaic kernel's call. interpret None: jax's GPU interpreter
    on a CPU, compiled on a GPU, another backend raises (no fallback); interpreter_safe None: the form the
    interpreter runs (P V through SMEM) when interpreting, FA3's (P in registers) compiled. block_sizes None:
    compiled, the ones measured best on this GPU for `tune` (`tuning.tuned`'s kernel and shapes) if the table has
    them, else the type's defaults."""
    interpret = interpret_mode(interpret, what, "Mosaic GPU (Hopper)", cross_lowering=True)
    if interpreter_safe is None:
        interpreter_safe = bool(interpret)
    elif interpret and not interpreter_safe:
        raise ValueError("interpreter_safe=False (P V from registers, pl.run_state) cannot run in jax's GPU "
                         "interpret mode: it has no rule for run_state")
    return interpret, bool(interpreter_safe), block_sizes_for(block_sizes, block_sizes_type, interpret, tune)


def accumulate_pv(acc, p, v_tile, p_smem=None):
    """acc + P V on the tensor cores (inside a kernel). p_smem None: FA3's form, P (16-bit, WGMMA layout) from
    registers accumulated in place (`run_state`); else the form jax's interpreter runs: P stored to the SMEM tile
    p_smem, P V into a fresh accumulator added to acc."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental import pallas as pl

    if p_smem is None:
        def compute_in_place(acc_ref):
            plgpu.wgmma(acc_ref, p, v_tile)

        return pl.run_state(compute_in_place)(plgpu.ACC.init(acc))
    p_smem[...] = p
    plgpu.commit_smem()

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_tile)
        return acc_ref[...]

    return acc + pl.run_scoped(compute, plgpu.ACC(acc.shape, acc.dtype))


def launch(call, interpret: bool):
    """call() compiled, or interpreted and waited for: an exception inside the interpreter resets it first."""
    if not interpret:
        return call()
    try:
        return jax.block_until_ready(call())
    except Exception:
        reset_interpreter()
        raise


def reset_interpreter():
    """After an exception inside the GPU interpreter its global state must be reset before it runs again."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    reset_gpu_interpret_mode_state()


def _split_transpose(transforms):
    """(the operand's transforms without a trailing transpose, its permutation or None). A transpose followed by
    more indexing is not handled (this package's kernels transpose a sliced tile last)."""
    from jax._src.state.types import TransposeTransform

    if transforms and isinstance(transforms[-1], TransposeTransform):
        head = tuple(transforms[:-1])
        if any(isinstance(t, TransposeTransform) for t in head):
            raise NotImplementedError("wgmma operand: only a transpose applied last is interpreted")
        return head, tuple(transforms[-1].permutation)
    return tuple(transforms), None


def _install_transposed_wgmma():
    with _install_lock:
        try:
            from jax._src.pallas.mosaic.interpret import utils as interpret_utils
            from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as callbacks
            memory, key_type = callbacks._get_shared_memory, callbacks.HostAllocationKey
            drop_noops = callbacks._remove_noop_transforms
        except (ImportError, AttributeError):  # pragma: no cover - another JAX: keep its own rule
            return
        if getattr(callbacks.wgmma, "_swiftkv_transposes", False):
            return
        original = callbacks.wgmma

        @functools.wraps(original)
        def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
                  acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
                  source_info=None):
            a_head, a_perm = _split_transpose(drop_noops(a_transforms))
            b_head, b_perm = _split_transpose(drop_noops(b_transforms))
            if a_perm is None and b_perm is None:
                return original(token=token, device_id=device_id, grid_point_coords=grid_point_coords,
                                thread_id=thread_id, acc_allocation_key_as_array=acc_allocation_key_as_array,
                                acc_transforms=acc_transforms, acc_dtype=acc_dtype,
                                a_allocation_key_as_array=a_allocation_key_as_array, a_transforms=a_transforms,
                                b_allocation_key_as_array=b_allocation_key_as_array, b_transforms=b_transforms,
                                source_info=source_info)
            device, thread = int(device_id), int(thread_id)
            shared = memory()
            global_thread = shared.get_global_thread_id(device, thread)
            info = interpret_utils.GPULoggingInfo(device_id=device,
                                                  grid_point_coords=tuple(int(x) for x in grid_point_coords),
                                                  thread_id=thread, source_info=source_info)

            def read(key, transforms, perm=None):
                transforms = jax.tree.map(int, transforms)
                where = interpret_utils.to_range(transforms)
                value, _, _ = shared.get_buffer_content(key_type.from_array(key), where, global_thread,
                                                        logging_info=info)
                return (value if perm is None else np.transpose(value, perm)), where

            a, _ = read(a_allocation_key_as_array, a_head, a_perm)
            b, _ = read(b_allocation_key_as_array, b_head, b_perm)
            acc, acc_range = read(acc_allocation_key_as_array, drop_noops(acc_transforms))
            shared.store_buffer_content(key_type.from_array(acc_allocation_key_as_array), acc_range,
                                        acc + np.matmul(a, b, dtype=acc_dtype), global_thread, logging_info=info)
            return token

        wgmma._swiftkv_transposes = True
        callbacks.wgmma = wgmma

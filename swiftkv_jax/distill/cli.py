"""`python train.py`: parse the recipe and overrides, then train or size the run."""

from __future__ import annotations

import argparse
import sys

from swiftkv_jax import configuration
from swiftkv_jax.distill.config import TrainConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python train.py",
        description="Distil a Llama/Qwen2 checkpoint into a SwiftKV model (../shared/SWIFTKV.md §4).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (set in the YAML recipe or as section.key=value):\n" + configuration.describe(TrainConfig),
    )
    p.add_argument("--config", help="YAML recipe, e.g. configs/tiny.yaml")
    p.add_argument("--dry-run", action="store_true",
                   help="compile the step from shapes alone and print per-device memory, then exit")
    p.add_argument("--devices", type=int, metavar="N",
                   help="with --dry-run: size the run for N devices (fake CPU devices, e.g. 32 for the 70B recipe's "
                        "4 nodes of 8 GPUs) rather than for this machine's own")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="override recipe values")
    return p


def use_cpu_devices(count: int) -> None:
    """JAX on `count` fake CPU devices: a dry run then sizes the recipe for the device count it is for (a recipe's
    mesh takes every device, so on one CPU its batch and weights would be sized for a single device)."""
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # JAX's devices are already started (in-process callers)
        pass
    if len(jax.devices()) != count or jax.default_backend() != "cpu":
        raise RuntimeError(f"--devices {count}: JAX already runs on {len(jax.devices())} {jax.default_backend()} "
                           f"device(s); pass --devices before anything starts JAX (python train.py does)")


def main(argv=None) -> int:
    p = parser()
    args = p.parse_intermixed_args(argv)
    if args.devices is not None:
        if not args.dry_run:
            p.error("--devices sizes a --dry-run: a run trains on the devices it has")
        if args.devices < 1:
            p.error(f"--devices must be at least 1, got {args.devices}")
        try:
            use_cpu_devices(args.devices)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    from swiftkv_jax.checkpoints import CheckpointError
    from swiftkv_jax.data import DataError
    from swiftkv_jax.distill import trainer

    try:
        config = configuration.load(TrainConfig, args.config, args.overrides)
        if args.dry_run:
            trainer.dry_run(config)
            return 0
        return trainer.train(config)
    except (configuration.ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except trainer.TrainingStopped as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

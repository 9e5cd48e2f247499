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
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="override recipe values")
    return p


def main(argv=None) -> int:
    args = parser().parse_intermixed_args(argv)
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

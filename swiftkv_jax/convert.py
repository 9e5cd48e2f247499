"""Convert checkpoints between Hugging Face safetensors and Orbax.

    python -m swiftkv_jax.convert SRC DST --to hf|orbax [--dtype bf16|fp32|fp16] [--max-shard-size 5GB]

SRC is detected (HF directory, plain or SwiftKV, or a swiftkv-jax Orbax directory). Tokenizer and
generation files beside SRC are copied to DST so the result serves and evaluates as is.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
from safetensors import SafetensorError

from swiftkv_jax.checks import not_a_directory
from swiftkv_jax.checkpoints import FORMATS, detect_format, load, save
from swiftkv_jax.checkpoints.hf import parse_size, read_config
from swiftkv_jax.checkpoints.hf_config import stored_dtype
from swiftkv_jax.checkpoints.sidecar import read_sidecar_files
from swiftkv_jax.dtypes import dtype_name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swiftkv_jax.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="checkpoint directory to read (HF or Orbax, detected)")
    parser.add_argument("dst", help="directory to write; must not exist or be empty (see --overwrite)")
    parser.add_argument("--to", required=True, choices=FORMATS, help="output format")
    parser.add_argument("--dtype", default=None,
                        help="parameter dtype to write: bf16 | fp32 | fp16 (default: the checkpoint's, as "
                             "config.json declares it)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="HF only: split safetensors above this size (a number and a unit: KB, MB, GB, TB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a DST that holds a checkpoint (a config.json) once the new one is complete; a "
                             "folder of other files is never replaced")
    args = parser.parse_args(argv)
    try:
        parse_size(args.max_shard_size)
    except ValueError as e:
        parser.error(f"--max-shard-size: {e}")
    try:  # the arguments, before the minutes of reading SRC
        _check_arguments(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    # SIGTERM (a scheduler, `timeout`) ends the conversion as an exception would: the partial DST is removed
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        source_format = detect_format(args.src)
        if args.dtype is None:  # config.json's dtype is the one written: a bad one is named as the file's
            hf_config = read_config(args.src)
            try:
                stored_dtype(hf_config)
            except ValueError as e:
                raise ValueError(f"{Path(args.src) / 'config.json'}: {e}; or give --dtype") from None
        model = load(args.src, dtype=args.dtype)
        sidecars = read_sidecar_files(args.src)
        save(model, args.dst, format=args.to, overwrite=args.overwrite, max_shard_size=args.max_shard_size,
             extra_files=sidecars)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, SafetensorError) as e:  # writing DST: a full disk, a path under a file, no permission
        print(f"error: cannot write {args.dst} ({e}); nothing was written there: free space, or choose another DST",
              file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    cfg = model.config
    count = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(model.params))
    swiftkv = (f", SwiftKV l={cfg.num_key_value_layers} g={cfg.key_value_group_size}" if cfg.is_swiftkv else "")
    print(f"{args.src} ({source_format}) -> {args.dst} ({args.to}): {cfg.family}{swiftkv}, "
          f"{count / 1e6:.1f}M parameters in {cfg.param_dtype}, {time.perf_counter() - start:.1f}s"
          + (f"; copied {', '.join(sidecars)}" if sidecars else ""))
    return 0


def _check_arguments(args) -> None:
    if args.dtype is not None:
        try:
            dtype_name(args.dtype)
        except ValueError as e:
            raise ValueError(f"--dtype {args.dtype}: {e}") from None
    why = not_a_directory(args.dst)
    if why:
        raise ValueError(f"DST {args.dst} {why}, not a directory: choose a directory path")


if __name__ == "__main__":
    sys.exit(main())

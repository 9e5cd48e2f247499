"""Distil a Hugging Face Llama/Qwen2 into a SwiftKV model.

    python train.py --config configs/NAME.yaml [section.key=value ...] [--dry-run [--devices N]]

Every key, its type and default: python train.py --help. The logic lives in swiftkv_jax.distill.
"""

import sys

from swiftkv_jax.distill.cli import main

if __name__ == "__main__":
    sys.exit(main())

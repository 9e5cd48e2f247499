"""Serve, evaluate and benchmark a (SwiftKV) checkpoint.

    python infer.py generate --model DIR --prompt TEXT | --prompts-file F [--max-new-tokens N ...]
    python infer.py eval --model DIR --tasks arc_easy=FILE gsm8k=FILE ... [--compare DIR2] [--output F]
    python infer.py bench --model DIR | --preset llama-3.1-8b --random-weights [--prompt-len 2048 ...]
    python infer.py analyze --model DIR --data TEXT_FILES [--max-tokens 8192 --out DIR]
    python infer.py serve --model DIR [--port 8000 --max-num-seqs 32 --teacher-mode ...]   # OpenAI-compatible HTTP

Every option: python infer.py COMMAND --help. The logic lives in swiftkv_jax.serving and swiftkv_jax.evaluation.
"""

import sys

from swiftkv_jax.infer_cli import main

if __name__ == "__main__":
    sys.exit(main())

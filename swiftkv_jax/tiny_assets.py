"""Assets for configs/tiny.yaml, made here with nothing downloaded: synthetic chat data, a byte-level
BPE tokenizer trained on it, and a random 4-layer Llama teacher saved as a Hugging Face checkpoint.

    python -m swiftkv_jax.tiny_assets artifacts/tiny

The teacher is random (initializer_range 0.1, so its next-token distributions are far from uniform): the
recipe exercises the whole distillation machinery in seconds, not the quality of a trained model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import swiftkv_jax as sk
from swiftkv_jax.checkpoints.atomic import write_text_atomic
from swiftkv_jax.checkpoints.sidecar import read_sidecar_files
from swiftkv_jax.checks import not_a_directory
from swiftkv_jax.data import toy

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, initializer_range=0.1)


def make_tiny_assets(directory, num_examples: int = 600, seed: int = 0, overwrite: bool = False) -> Path:
    """Write DIR/chat.jsonl, DIR/teacher (HF Llama + tokenizer files); returns DIR. Existing assets are only replaced
    with overwrite=True; a refusal writes nothing."""
    directory = Path(directory).expanduser()
    _check_target(directory, overwrite)
    examples = toy.synthetic_chat_examples(num_examples, seed)
    tokenizer = toy.train_chat_tokenizer(
        [m["content"] for example in examples for m in example["messages"]], vocab_size=512)
    config = sk.ModelConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id,
                            **TINY_LLAMA)
    with tempfile.TemporaryDirectory() as staging:  # outside DIR: a failed save leaves nothing there
        tokenizer.save_pretrained(staging)
        sk.save(sk.init(config, seed), directory / "teacher", "hf", overwrite=overwrite,
                extra_files=read_sidecar_files(staging))
    write_text_atomic(directory / "chat.jsonl", "".join(json.dumps(example) + "\n" for example in examples))
    return directory


def _check_target(directory: Path, overwrite: bool) -> None:
    why = not_a_directory(directory)
    if why:
        raise NotADirectoryError(f"{directory} {why}, not a directory: choose a directory path")
    held = [name for name in ("teacher", "chat.jsonl") if (directory / name).is_file()
            or (directory / name).is_dir() and any((directory / name).iterdir())]  # an empty teacher/ is no teacher
    if held and not overwrite:
        raise FileExistsError(f"{directory} already holds {' and '.join(held)}: pass overwrite=True (--overwrite) to "
                              f"replace {'it' if len(held) == 1 else 'them'}, or choose another directory")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swiftkv_jax.tiny_assets", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", default="artifacts/tiny")
    parser.add_argument("--overwrite", action="store_true", help="replace existing assets (teacher, chat.jsonl)")
    args = parser.parse_args(argv)
    try:
        path = make_tiny_assets(args.directory, overwrite=args.overwrite)
    except (FileExistsError, NotADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path / 'chat.jsonl'} and the teacher in {path / 'teacher'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

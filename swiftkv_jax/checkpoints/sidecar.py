"""Files that travel with the weights: tokenizer, chat template and generation settings."""

from __future__ import annotations

from pathlib import Path

SIDECAR_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)


def read_sidecar_files(src) -> dict[str, bytes]:
    """The tokenizer/generation files present in src, read now (the destination may replace src)."""
    return {name: (Path(src) / name).read_bytes() for name in SIDECAR_FILES if (Path(src) / name).is_file()}

"""One way every benchmark records a run: the command, the commit and the machine beside its numbers."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path


def _cli_help():
    """swiftkv_jax/cli_help.py, loaded by its path: importing the package would import jax, and a script's --help
    and its argument checks (gpu/args_only.py) run without it."""
    path = Path(__file__).resolve().parents[1] / "swiftkv_jax" / "cli_help.py"
    spec = importlib.util.spec_from_file_location("_swiftkv_jax_cli_help", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# every benchmark's --help: each option says its default (infer.py's formatter)
_CLI_HELP = _cli_help()
DefaultsFormatter = _CLI_HELP.DefaultsFormatter
RawDescriptionDefaultsFormatter = _CLI_HELP.RawDescriptionDefaultsFormatter


@functools.lru_cache(maxsize=None)
def commit() -> str:
    """The checkout's commit (asked once: a benchmark may rewrite its file after every row)."""
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def write_results(path, script: str, argv, payload: dict, quiet: bool = False) -> Path:
    """Write payload + provenance as JSON to path (parents created); returns the path. quiet: say nothing (a
    benchmark that rewrites its file after every row)."""
    args = list(sys.argv[1:] if argv is None else argv)
    record = {"command": " ".join(["python", script, *args]), "commit": commit(), "host": platform.node(),
              "cpu_count": os.cpu_count(), **payload}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    if not quiet:
        print(f"wrote {path}")
    return path

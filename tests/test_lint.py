"""`ruff check` on the repository is clean: pyflakes finds undefined names and unused imports that no test reaches,
and lines stay within the 120 columns the code is written at (pyproject.toml's [tool.ruff])."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# the `lint` extra (pip install -e ".[test,clients,lint,structured]", as CI does); outside CI (the GPU pack's
# `pytest -m gpu` collects this module) a checkout without it skips
ruff = __import__("ruff") if os.environ.get("CI") else pytest.importorskip("ruff")

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO,
                         capture_output=True, text=True)
    assert run.returncode == 0, f"ruff check found problems:\n{run.stdout}{run.stderr}"

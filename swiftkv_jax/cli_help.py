"""The one --help formatter of infer.py's commands and the benchmark scripts: every option says its default.

Standard library only: the benchmark scripts load this file by its path (benchmarks/results_file.py), as importing
the package would import jax, and their --help and argument checks (benchmarks/gpu/args_only.py) run without it.
"""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default where the text does not say it already (None and off switches
    have none to say)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default is None or action.default is False or action.default == argparse.SUPPRESS
                or "default" in text or "%(default)" in text
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class RawDescriptionDefaultsFormatter(argparse.RawDescriptionHelpFormatter, DefaultsFormatter):
    """DefaultsFormatter, with the description and epilog printed as written (a docstring's lines and examples)."""

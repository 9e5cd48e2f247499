"""A script's argument parsing alone: `python args_only.py SCRIPT ARGS...` exits 0 when SCRIPT's argparse takes
ARGS, and 2 with argparse's message when it does not, without running SCRIPT's work.

The GPU pack's smoke run checks the exact command lines of the steps a CPU cannot run this way (appending --help
would not: argparse prints the help and exits 0 before it looks at an unknown option).
"""

import argparse
import os
import runpy
import sys

_parse_known_args = argparse.ArgumentParser.parse_known_args


def _parse_and_stop(self, args=None, namespace=None):
    """parse_args's own checks (parse_args calls this), then stop: nothing after the parsing runs."""
    _, extras = _parse_known_args(self, args, namespace)
    if extras:
        self.error(f"unrecognized arguments: {' '.join(extras)}")
    sys.exit(0)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python args_only.py SCRIPT [ARGS...]")
    argparse.ArgumentParser.parse_known_args = _parse_and_stop
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python SCRIPT` has it: its siblings import
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(f"{sys.argv[0]} ended without parsing its arguments")

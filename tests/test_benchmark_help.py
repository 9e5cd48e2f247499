"""Every benchmark script's --help: each option has help and states its default (infer.py's formatter)."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(str(p.relative_to(BENCHMARKS)) for p in [*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("gpu/*.py")]
                 if "add_argument(" in p.read_text() and "ArgumentParser(" in p.read_text())


class _Parsed(Exception):
    pass


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_script_with_a_parser_is_checked():
    assert {"serving.py", "distill_step.py", "recipe_sweep.py", "gpu/pack.py", "kernels.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_names_every_default(script, monkeypatch, capsys):
    """distill_step.py's and train_pipeline.py's --preset, recipe_sweep.py's --budget, serving.py's --vocab,
    --max-num-seqs, --page-size..., pack.py's --wheelhouse and collect's sources and --into had no help or said
    nothing of their defaults. A default the code fills in later (None here) is the help's to say: read by eye."""
    def caught(self, args=None, namespace=None):
        raise _Parsed(self)

    path = BENCHMARKS / script
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
    monkeypatch.setattr(sys, "argv", [str(path)])
    monkeypatch.syspath_prepend(str(path.parent))
    with pytest.raises(_Parsed) as parsed:
        runpy.run_path(str(path), run_name="__main__")
    for parser in _parsers(parsed.value.args[0]):
        if any(a.option_strings and not isinstance(a, argparse._HelpAction) for a in parser._actions):
            assert "DefaultsFormatter" in {c.__name__ for c in parser.formatter_class.__mro__}, parser.prog
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if (isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
                    or action.help == argparse.SUPPRESS):
                continue
            name = action.option_strings or action.dest
            assert action.help, (parser.prog, name)
            if action.option_strings and action.default is not None and action.default is not False:
                said = "default" in action.help or f"(default: {action.default})" in text
                assert said, (parser.prog, name, action.default)

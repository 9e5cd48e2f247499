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


def _cli_help_module():
    """swiftkv_jax/cli_help.py by its path, as benchmarks/results_file.py loads it (no jax import)."""
    import importlib.util

    path = BENCHMARKS.parent / "swiftkv_jax" / "cli_help.py"
    spec = importlib.util.spec_from_file_location("_test_cli_help", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_formatter_adds_the_default_as_argparses_own_where_the_help_leaves_it_unsaid():
    """DefaultsFormatter ends an option's help as argparse.ArgumentDefaultsHelpFormatter does, except where there is
    nothing to say (None, an off switch, a positional) or the help already says its default; the raw variant keeps the
    description as argparse.RawDescriptionHelpFormatter does. The scripts' test above only asks that each default be
    said somewhere: saying it twice, '(default: False)' on every switch, or a reflowed docstring passed it."""
    cli_help = _cli_help_module()
    parser = argparse.ArgumentParser(prog="x")
    said = [parser.add_argument("--rows", type=int, default=5, help="rows a step"),
            parser.add_argument("--count", type=int, default=0, help="how many"),
            parser.add_argument("--name", default="m", help="the name")]
    unsaid = [parser.add_argument("--preset", default="tiny", help="the preset (default: tiny, the smallest)"),
              parser.add_argument("--out", default=None, help="where (default: beside the input)"),
              parser.add_argument("--seed", default=None, help="a seed"),
              parser.add_argument("--fast", action="store_true", help="go fast"),
              parser.add_argument("--level", default=3, help="the level, %(default)s if unsaid"),
              parser.add_argument("path", nargs="?", default="here", help="the input")]
    ours = cli_help.DefaultsFormatter("x")._get_help_string
    theirs = argparse.ArgumentDefaultsHelpFormatter("x")._get_help_string
    for action in said:
        assert ours(action) == theirs(action) == f"{action.help} (default: %(default)s)", action.dest
    for action in unsaid:
        assert ours(action) == action.help, action.dest
    parser.formatter_class = cli_help.DefaultsFormatter
    text = " ".join(parser.format_help().split())
    assert "rows a step (default: 5)" in text and "how many (default: 0)" in text
    assert text.count("default: tiny") == 1 and "(default: False)" not in text and "None" not in text

    description = "Two lines as written:\n\n  python x.py --rows 5\n  python x.py --rows 6"
    helps = []
    for formatter in (cli_help.RawDescriptionDefaultsFormatter, argparse.RawDescriptionHelpFormatter):
        raw = argparse.ArgumentParser(prog="x", description=description, formatter_class=formatter)
        helps.append(raw.format_help())
    assert helps[0] == helps[1] and "  python x.py --rows 5\n  python x.py --rows 6\n" in helps[0]

"""Every option of every `pipeline` command has a help line, and one that takes a value names its default."""
from __future__ import annotations

import argparse

import pytest

from pipeline.bench.serve_bench import build_parser as bench_parser
from pipeline.cli import build_parser


def commands() -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser by name; `bench`'s is its own (main() hands it its arguments)."""
    parser = build_parser()
    (subparsers,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    found = dict(subparsers.choices)
    found["bench"] = bench_parser()
    return found


def test_every_command_is_walked() -> None:
    assert {"start", "stop", "status", "generate", "chat", "worker", "router", "bench"} <= set(commands())


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_option_has_help_with_its_default(name: str) -> None:
    parser = commands()[name]
    formatter = parser.formatter_class(prog=parser.prog)
    missing, no_default = [], []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        label = "/".join(action.option_strings) or action.dest
        if not action.help or action.help == argparse.SUPPRESS:
            missing.append(label)
            continue
        takes_value = action.option_strings and action.nargs != 0 and not action.required
        if takes_value and "default" not in formatter._get_help_string(action):
            no_default.append(label)
    assert not missing, f"`pipeline {name}` options without help: {missing}"
    assert not no_default, f"`pipeline {name}` options whose help names no default: {no_default}"


def test_help_prints(capsys: pytest.CaptureFixture[str]) -> None:
    for name, parser in commands().items():
        parser.print_help()
        assert parser.prog.endswith(name)
    assert "(default: 16)" in capsys.readouterr().out  # generate --max-tokens

"""Every `pipeline` and `make` command in the fenced blocks of README.md and docs/*.md names a real
command and real options, checked with the CLI's own parsers (nothing runs). A line written as a
synopsis (`[...]`, `A|B`, `...`) has its option names checked; any other line must parse whole.
`python tools/...` lines are not checked here."""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from pipeline.bench.serve_bench import build_parser as bench_parser
from pipeline.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCKS = ("", "sh", "bash", "console", "shell", "text")
PROGRAMS = ("pipeline", ".venv/bin/pipeline", "make")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
SYNOPSIS = re.compile(r"[\[\]|]|\.\.\.")


def fenced_commands(page: Path) -> list[tuple[int, str]]:
    """(line number, command) of each `pipeline` or `make` line in the page's shell blocks; a line
    ending in a backslash, or an indented line after a command, continues it."""
    commands: list[tuple[int, str]] = []
    language = None
    in_command = False  # the line before belongs to the last command
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            language = line.strip()[3:].strip() if language is None else None
            in_command = False
            continue
        if language not in SHELL_BLOCKS:
            continue
        text = line.removeprefix("$ ")
        words = text.split()
        continued = commands[-1][1].endswith("\\") if commands else False
        if in_command and (continued or (line[:1] == " " and words and words[0][:1] in "[-")):
            commands[-1] = (commands[-1][0], commands[-1][1].rstrip("\\") + " " + text.strip())
        elif words and (words[0] in PROGRAMS or ENV_ASSIGNMENT.match(words[0]) and any(w in PROGRAMS for w in words)):
            commands.append((number, text.strip()))
            in_command = True
        else:
            in_command = False
    return commands


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {**subparsers.choices, "bench": bench_parser()}


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


def check(command: str) -> None:
    """Fails with the reason when `command` names no real command or option."""
    words = shlex.split(command, comments=True)
    while words and ENV_ASSIGNMENT.match(words[0]):
        words.pop(0)
    program, args = words[0], words[1:]
    if program == "make":
        unknown = [target for target in args if not target.startswith("-") and target not in make_targets()]
        assert not unknown, f"no make target {unknown}"
        return
    parsers = subcommand_parsers()
    assert args and args[0] in parsers, f"no pipeline command {args[:1]}"
    parser = parsers[args[0]]
    known = {option for action in parser._actions for option in action.option_strings}
    named = [word.split("=", 1)[0] for word in args[1:] if word.startswith("--")]
    unknown = [option for option in named if option.strip("[]|.") not in known]
    assert not unknown, f"`pipeline {args[0]}` has no option {unknown}"
    if SYNOPSIS.search(" ".join(args)):
        return
    try:
        parser.parse_args(args[1:])
    except SystemExit:
        pytest.fail(f"`{command}` does not parse (see the message above)")


COMMANDS = [(f"{page.relative_to(REPO)}:{number}", command)
            for page in PAGES for number, command in fenced_commands(page)]


def test_the_pages_show_commands() -> None:
    readme = [where for where, _ in COMMANDS if where.startswith("README.md")]
    assert len(readme) >= 4 and len(COMMANDS) >= 12, COMMANDS


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_command_names_real_options(where: str, command: str) -> None:
    check(command)


@pytest.mark.parametrize("bad", ["pipeline chatter", "pipeline chat --modle x", "pipeline generate --max-tokens x hi",
                                 "make nothing-such"])
def test_a_wrong_command_is_caught(bad: str) -> None:
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check(bad)

"""The docs' code blocks as written: every Python block compiles, and every ``gradequiv``
command line in a shell block parses with the command line's own parser (an option that no
longer exists, or one a command requires and the line leaves out, is exit 2 for a reader
who copies it). The README's blocks are run in full (``tests/test_readme.py``); these are
read, not run: most need a user's module, a library or minutes."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from gradequiv.harness import InvalidArgument
from gradequiv.harness.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
README = ROOT / "README.md"
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)
#: a synopsis, not a command: placeholders in capitals, optional parts in brackets
SYNOPSIS = re.compile(r"\[|\||\b(SPEC|DIR|PATH|N|K=V|LIST|ID|NAME)\b")


def _blocks(lang: tuple[str, ...]) -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for match in FENCE.finditer(path.read_text(encoding="utf-8")):
            if match["lang"] in lang:
                found.append((f"{path.name}:{match['body'].splitlines()[0][:40]}",
                              match["body"]))
    return found


def _inline() -> list[str]:
    """Commands quoted in the prose, in backticks."""
    return [span for path in DOCS + [README]
            for span in re.findall(r"`(gradequiv [^`]+)`", path.read_text(encoding="utf-8"))]


def _commands() -> list[tuple[str, list[str]]]:
    lines = []
    shown = [line for _, body in _blocks(("", "sh", "bash", "console"))
             for line in body.splitlines()]
    for line in [*shown, *_inline()]:
        line = re.split(r"\s{2,}(?!#)", line.strip().removeprefix("$ "))[0]  # a column
        if "gradequiv " not in line or SYNOPSIS.search(line):
            continue
        words = shlex.split(line, comments=True)
        while words and words[0] != "gradequiv":  # cd ... &&, VAR=value, python -m
            words = words[1:]
        if len(words) > 2:  # "gradequiv check" alone names the command
            lines.append((line, words[1:]))
    return lines


@pytest.mark.parametrize("where, body", _blocks(("python",)), ids=lambda v: str(v)[:50])
def test_every_python_block_compiles(where: str, body: str) -> None:
    compile(body, where, "exec")


def test_the_docs_have_commands_to_read() -> None:
    assert len(_commands()) >= 30


@pytest.mark.parametrize("line, argv", _commands(), ids=lambda v: str(v)[:60])
def test_every_command_line_parses(line: str, argv: list[str]) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv)
    except (SystemExit, InvalidArgument) as exc:
        pytest.fail(f"{line!r} does not parse: {exc} {err.getvalue()}")

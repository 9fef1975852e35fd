"""The docs' code blocks as written: every Python block compiles, and every ``gradequiv``
command line in a shell block parses with the command line's own parser (an option that no
longer exists, or one a command requires and the line leaves out, is exit 2 for a reader
who copies it). Every block of the reference says how it is checked (``doc_blocks``), and
in the slow run each is run, saved, compared with the file it excerpts, or skipped for the
reason it gives; the README's blocks run in the default suite (``tests/test_readme.py``)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
from doc_blocks import read_page, run_page, runs_here

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


REFERENCE = ROOT / "docs" / "reference.md"


def test_every_block_of_the_reference_says_how_it_is_checked() -> None:
    page = read_page(REFERENCE)
    assert page.unmarked == [], f"reference.md: unmarked blocks at lines {page.unmarked}"
    assert len(page.blocks) >= 20


def test_an_excerpt_that_is_not_in_its_file_is_caught(tmp_path: Path) -> None:
    page = read_page(REFERENCE)
    excerpt = next(b for b in page.blocks if "excerpt" in b.attrs)
    page.blocks = [replace(excerpt, text=excerpt.text.replace("# the bug", "# a bug"))]
    with pytest.raises(AssertionError, match="not word for word"):
        run_page(page, tmp_path)


@pytest.mark.slow
def test_every_block_of_the_reference_runs_as_written(tmp_path: Path) -> None:
    """Minutes (the hand-written checkpoint's whole failing run, the libraries' models):
    in CI's slow run."""
    page = read_page(REFERENCE)
    here = [block for block in page.blocks if runs_here(block)]
    assert len([block for block in here if "needs" not in block.attrs]) >= 7
    assert run_page(page, tmp_path) == len(here)

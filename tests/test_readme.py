"""The README's examples run as written: each block marked ``<!-- readme-test ... -->`` is
saved (``file=NAME``) or run, in order, in one folder, as a newcomer would run them
(``doc_blocks``: the markers' attributes). A run's ``append="..."`` keeps it to seconds
(``--case``, ``--examples``)."""

from __future__ import annotations

import re
from pathlib import Path

from doc_blocks import read_page, run_page

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_the_setup_is_the_two_commands_ci_runs() -> None:
    """.ci/run runs the README's set-up: the install and the check of torch's own
    checkpoint, then the README's test command."""
    text = README.read_text(encoding="utf-8")
    setup = text.split("## Quick start", 1)[1].split("```\n", 2)[1].strip().splitlines()
    install, tests = setup
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 -m venv .venv" in install and "python3 -m venv .venv" in ci
    assert ".venv/bin/pip install -c ci/constraints.txt -e '.[test]'" in install
    assert ".venv/bin/pip install --quiet -c ci/constraints.txt -e '.[test]'" in ci
    assert install.endswith("PATH=.venv/bin:$PATH ci/gate.sh --impl torch")
    assert "PATH=.venv/bin:$PATH ci/gate.sh --impl torch\n" in ci
    assert tests == ".venv/bin/python -m pytest -n 2"
    assert f"\n{tests}\n" in ci


def test_the_quick_start_is_the_first_screen() -> None:
    """What a newcomer needs (install, own function, own model, Python, pytest, exit codes)
    comes before the reference, and the page stays a landing page."""
    text = README.read_text(encoding="utf-8")
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[:3] == ["## Quick start", "## Check your own checkpoint function",
                            "## Your own wrapper or toggle"]
    assert headings[-1] == "## Reference"
    assert len(text.splitlines()) < 300


def test_the_readme_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    reference = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    anchors = {re.sub(r"[^\w\- ]", "", h[3:].lower()).replace(" ", "-")
               for h in reference.splitlines() if h.startswith("## ")}
    for target in re.findall(r"\]\(([^)]+)\)", text):
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), target
        if anchor:
            assert anchor in anchors, target


def test_every_block_says_how_it_is_checked() -> None:
    page = read_page(README)
    assert page.unmarked == [], f"README.md: unmarked blocks at lines {page.unmarked}"


def test_every_marked_block_runs_as_written(tmp_path: Path) -> None:
    assert run_page(read_page(README), tmp_path) >= 7

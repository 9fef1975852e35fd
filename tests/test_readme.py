"""The README's examples run as written: each block marked ``<!-- readme-test ... -->`` is
saved (``file=NAME``) or run, in order, in one folder, as a newcomer would run them
(``doc_blocks``: the markers' attributes). A run's ``append="..."`` keeps it to seconds
(``--case``, ``--examples``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from doc_blocks import read_page, run_page, runs_here

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_ci_runs_the_readme_setup_first_word_for_word() -> None:
    """.ci/run starts with the README's two commands as its text writes them (the install
    and the check of torch's own checkpoint, then the tests), before any extra is
    installed: a test that needs one fails there."""
    text = README.read_text(encoding="utf-8")
    install, tests = _setup_commands(text)
    assert install.startswith("python3 -m venv .venv && ")
    assert ".venv/bin/pip install -c ci/constraints.txt -e '.[test]'" in install
    assert install.endswith("PATH=.venv/bin:$PATH ci/gate.sh --impl torch")
    assert tests == ".venv/bin/python -m pytest -n 2"
    ci = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.strip() and not line.startswith("#")]
    first_install = next(i for i, line in enumerate(ci) if "pip install" in line)
    assert ci.index("bash ci/readme-setup.sh") < first_install
    script = (ROOT / "ci" / "readme-setup.sh").read_text(encoding="utf-8")
    assert "python3 ci/readme_commands.py" in script and 'bash -c "$command"' in script


def test_the_setup_commands_are_read_from_the_quick_start_block() -> None:
    page = "# x\n\n## Quick start\n\ntext\n\n```\none && two\n\nthree\n```\n\n```\nfour\n```\n"
    assert _setup_commands(page) == ["one && two", "three"]


def _setup_commands(text: str) -> list[str]:
    spec = importlib.util.spec_from_file_location("readme_commands",
                                                  ROOT / "ci" / "readme_commands.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    commands: list[str] = module.setup_commands(text)
    return commands


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


@pytest.mark.slow
def test_every_marked_block_runs_as_written(tmp_path: Path) -> None:
    """Every block that can run here runs (one that needs a library that is not installed,
    such as transformers, is left out and not counted), and most need nothing extra."""
    page = read_page(README)
    here = [block for block in page.blocks if runs_here(block)]
    assert len([block for block in here if "needs" not in block.attrs]) >= 6
    assert run_page(page, tmp_path) == len(here)

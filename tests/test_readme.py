"""The README's examples run as written: each block marked ``<!-- readme-test ... -->`` is
saved (``file=NAME``) or run, in order, in one folder, as a newcomer would run them. A run's
``append="..."`` keeps it to seconds (``--case``, ``--examples``); ``exit=N`` is the code it
must end with; ``needs=MODULE`` runs it only where that library is installed; an unmarked
block right after a run is its output, whose first line must be in what the run printed."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARK = re.compile(r"^<!-- readme-test(?P<attrs>.*?)-->$")


@dataclass
class Block:
    lang: str
    text: str
    attrs: dict[str, str]
    output: str | None = None  # the unmarked block that follows, if any


def readme_blocks() -> tuple[list[Block], list[str]]:
    """The marked blocks, and every fenced block's first line (marked or not)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    fenced: list[str] = []
    attrs: dict[str, str] | None = None
    i = 0
    while i < len(lines):
        mark = MARK.match(lines[i].strip())
        if mark:
            attrs = dict(part.split("=", 1) for part in shlex.split(mark["attrs"].lstrip(":")))
        elif lines[i].startswith("```"):
            lang, end = lines[i][3:].strip(), lines.index("```", i + 1)
            text = "\n".join(lines[i + 1:end]) + "\n"
            fenced.append(text.splitlines()[0] if text.strip() else "")
            if attrs is not None:
                blocks.append(Block(lang, text, attrs))
            elif blocks and blocks[-1].output is None and "file" not in blocks[-1].attrs:
                blocks[-1].output = text
            attrs, i = None, end
        i += 1
    return blocks, fenced


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


def test_every_marked_block_runs_as_written(tmp_path: Path) -> None:
    blocks, _ = readme_blocks()
    assert len(blocks) >= 10
    shutil.copytree(ROOT / "docs" / "examples", tmp_path / "docs" / "examples",
                    ignore=shutil.ignore_patterns("out", "__pycache__"))
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTHONPATH", None)
    for block in blocks:
        if "needs" in block.attrs and importlib.util.find_spec(block.attrs["needs"]) is None:
            continue  # a library's route: run where the library is (CI installs it)
        if "file" in block.attrs:
            (tmp_path / block.attrs["file"]).write_text(block.text, encoding="utf-8")
            continue
        if block.lang == "python":
            command = [sys.executable, "-c", block.text]
        else:
            line = block.text.strip()
            assert "\n" not in line, line
            command = ["bash", "-c", f"{line} {block.attrs.get('append', '')}"]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                              check=False, timeout=300)
        shown = done.stdout + done.stderr
        assert done.returncode == int(block.attrs.get("exit", "0")), (block.text, shown[-3000:])
        if block.output is not None:
            assert block.output.splitlines()[0] in shown, (block.text, shown[-3000:])

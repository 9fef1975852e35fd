"""Code blocks of a Markdown page, run as a reader would run them.

A block is marked by the comment line right above it, ``<!-- doc-test: ... -->`` (the
README's say ``readme-test``), whose attributes say what to do with it:

- ``file=NAME``: save it as NAME in the folder the blocks run in (later blocks use it);
- nothing, or ``append="..."`` (cheap options, ``--case``, ``--examples``), ``exit=N``
  (the code it must end with, default 0), ``cwd=DIR`` (in the folder), ``needs=MODULE``
  (run only where that library is installed), ``with=PAGE`` (the files that page's
  blocks save, saved first): run it, a Python block with the interpreter, a shell block
  line by line;
- ``console``: lines starting with ``$ `` are the command, the rest (``...`` aside) is
  what it prints: each such line must be in its output;
- ``excerpt=PATH``: an excerpt of a file of the repository: each of its parts (split at
  two blank lines, where the excerpt leaves something out) must be in that file, word
  for word;
- ``skip="why"``: not run, for the reason given (a synopsis, minutes of compiling).

An unmarked block right after a run is its output: its first line must be in what the
run printed. Any other unmarked block is an error: every block says how it is checked.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"^<!-- (?:readme|doc)-test(?P<attrs>.*?)-->$")


@dataclass
class Block:
    lang: str
    text: str
    attrs: dict[str, str]
    line: int  # where its fence opens, 1-based
    output: str | None = None  # the unmarked block that follows, if any


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    unmarked: list[int] = field(default_factory=list)  # lines of fences saying nothing


def read_page(path: Path) -> Page:
    """The page's marked blocks, each with its output block, and the unmarked others."""
    page = Page(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    attrs: dict[str, str] | None = None
    i = 0
    while i < len(lines):
        mark = MARK.match(lines[i].strip())
        if mark:
            attrs = dict(part.split("=", 1) if "=" in part else (part, "")
                         for part in shlex.split(mark["attrs"].lstrip(":")))
        elif lines[i].startswith("```"):
            lang, end = lines[i][3:].strip(), lines.index("```", i + 1)
            text = "\n".join(lines[i + 1:end]) + "\n"
            if attrs is not None:
                page.blocks.append(Block(lang, text, attrs, i + 1))
            elif page.blocks and page.blocks[-1].output is None and _runs(page.blocks[-1]) \
                    and "console" not in page.blocks[-1].attrs:
                page.blocks[-1].output = text
            else:
                page.unmarked.append(i + 1)
            attrs, i = None, end
        i += 1
    return page


def _runs(block: Block) -> bool:
    return not {"file", "excerpt", "skip"} & block.attrs.keys()


def runs_here(block: Block) -> bool:
    """Whether ``block`` is run (not saved, quoted or skipped) where this process runs: its
    ``needs`` library, if any, is installed."""
    needs = block.attrs.get("needs")
    return _runs(block) and (needs is None or importlib.util.find_spec(needs) is not None)


def run_page(page: Page, folder: Path) -> int:
    """Run the page's blocks in order in ``folder`` (docs/examples copied in); how many
    ran. Fails the calling test at the first block that does not do what it says."""
    shutil.copytree(ROOT / "docs" / "examples", folder / "docs" / "examples",
                    ignore=shutil.ignore_patterns("out", "__pycache__"), dirs_exist_ok=True)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["TRANSFORMERS_VERBOSITY"] = "error"
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTHONPATH", None)
    ran = 0
    for block in page.blocks:
        where = f"{page.path.name}:{block.line}"
        if "skip" in block.attrs:
            assert block.attrs["skip"].strip(), f"{where}: skip says why"
            continue
        if "excerpt" in block.attrs:
            source = (ROOT / block.attrs["excerpt"]).read_text(encoding="utf-8")
            for part in block.text.split("\n\n\n"):  # definitions, what lies between left out
                assert part.strip("\n") in source, \
                    f"{where}: not word for word in {block.attrs['excerpt']}:\n{part}"
            continue
        if "needs" in block.attrs and importlib.util.find_spec(block.attrs["needs"]) is None:
            continue  # a library's route: run where the library is (CI installs it)
        if "file" in block.attrs:
            (folder / block.attrs["file"]).write_text(block.text, encoding="utf-8")
            continue
        if "with" in block.attrs:  # the files another page's blocks save, as they are there
            for other in read_page(ROOT / block.attrs["with"]).blocks:
                if "file" in other.attrs:
                    (folder / other.attrs["file"]).write_text(other.text, encoding="utf-8")
        cwd = folder / block.attrs.get("cwd", ".")
        if block.lang == "python":
            shown = _run(where, [sys.executable, "-c", block.text], cwd, env, block.attrs)
            expected = block.output
        elif "console" in block.attrs:
            commands = [line[2:] for line in block.text.splitlines() if line.startswith("$ ")]
            assert len(commands) == 1, f"{where}: one $ command"
            shown = _shell(where, commands[0], cwd, env, block.attrs)
            for line in block.text.splitlines():
                if not line.startswith("$ ") and line.strip() not in ("", "..."):
                    assert line in shown, f"{where}: {line!r} not printed:\n{shown[-3000:]}"
            expected = None
        else:
            commands = [line for line in block.text.splitlines() if line.strip()]
            shown = "".join(_shell(where, line, cwd, env, block.attrs) for line in commands)
            expected = block.output
        if expected is not None:
            first = expected.splitlines()[0]
            assert first in shown, f"{where}: {first!r} not printed:\n{shown[-3000:]}"
        ran += 1
    return ran


def _shell(where: str, line: str, cwd: Path, env: dict[str, str],
           attrs: dict[str, str]) -> str:
    line = line.split("  #", 1)[0].rstrip()  # a comment beside the command
    return _run(where, ["bash", "-c", f"{line} {attrs.get('append', '')}"], cwd, env, attrs)


def _run(where: str, command: list[str], cwd: Path, env: dict[str, str],
         attrs: dict[str, str]) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          check=False, timeout=600)
    shown = done.stdout + done.stderr
    assert done.returncode == int(attrs.get("exit", "0")), \
        f"{where}: exit {done.returncode}: {command[-1][:300]}\n{shown[-3000:]}"
    return shown

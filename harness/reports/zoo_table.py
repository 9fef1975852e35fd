"""The table ``gradequiv zoo`` writes, and reads back for ``--check``: a row per
architecture, a column per way its library's checkpointing is checked, under a header
that says what it is, the command that makes it and the conditions it was made in."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from gradequiv.harness.errors import InvalidArgument, exception_line

__all__ = ["CANNOT_BUILD", "CHECKED", "COLUMNS", "CONFIGS", "CRASHED", "DEFAULT_OUT", "ERROR",
           "FAIL", "NOT_APPLICABLE", "PASS", "SEED", "TIMED_OUT", "markdown", "one_line",
           "outcome", "plural", "duration", "read_verdicts", "verdicts"]

DEFAULT_OUT = Path("docs/zoo-transformers.md")
SEED = 0

#: column -> (the ``--impl-kwarg`` items of ``--impl hf``, the precision regime)
CONFIGS: dict[str, tuple[tuple[str, ...], str]] = {
    "non-reentrant fp32": ((), "fp32"),
    "non-reentrant bf16 autocast": ((), "bf16-autocast"),
    "reentrant fp32": (("use_reentrant=true",), "fp32"),
    "reentrant bf16 autocast": (("use_reentrant=true",), "bf16-autocast"),
}
COLUMNS = ("architecture", *CONFIGS, "cause of any failure", "seconds")

#: a check's verdict
PASS, FAIL, ERROR, NOT_APPLICABLE, CANNOT_BUILD = "PASS", "FAIL", "ERROR", "N/A", "cannot build"
#: a row's status: its four checks ran; or they could not, and why
CHECKED, TIMED_OUT, CRASHED = "checked", "timed out", "crashed"


def one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def verdicts(row: dict[str, Any]) -> tuple[str, ...]:
    """A row's four verdicts, in :data:`CONFIGS`' order."""
    if row["status"] == CANNOT_BUILD:
        return (CANNOT_BUILD,) * len(CONFIGS)
    return tuple(row["checks"][column]["verdict"] for column in CONFIGS)


def outcome(row: dict[str, Any]) -> str:
    """pass, fail or cannot build: a row fails on any FAIL or ERROR."""
    if row["status"] == CANNOT_BUILD:
        return "cannot build"
    return "fail" if {FAIL, ERROR} & set(verdicts(row)) else "pass"


def markdown(data: dict[str, Any]) -> str:
    """The table, under a header that says what it is, the command that makes it and the
    conditions it was made in."""
    c, counts = data["conditions"], data["counts"]
    rows = data["rows"]
    scope = ""
    if data["patterns"]:
        scope += (f" Only the architectures matching "
                  f"{', '.join(f'`{p}`' for p in data['patterns'])}.")
    if data["limit"]:
        scope += f" Only the first {data['limit']} of them, in sorted order."
    done = ("" if data["complete"] else
            f"\n\n**Incomplete: {len(rows)} of {data['architectures']} architectures so "
            f"far** (the sweep is running, or was stopped).")
    lines = [
        "# transformers architectures under their own gradient checkpointing",
        "",
        f"Every model class transformers exports whose name ends in a head the `hf:NAME` "
        f"route takes a loss from ({', '.join(data['heads'])}), and that sets "
        f"`supports_gradient_checkpointing`, built "
        f"tiny and random-initialised by that route (two layers, 32 wide, dropout on), and "
        f"checked by `--impl hf` (its own `{c.get('toggle', 'gradient_checkpointing_enable')}()`)"
        f" against full "
        f"storage: non-reentrant (the default) and reentrant (`--impl-kwarg "
        f"use_reentrant=true`), each in fp32 and under bf16 autocast; one case each "
        f"(granularity layer, seed {SEED}, {data['steps']} optimizer steps).{scope} Made by:",
        "",
        "```sh",
        data["reproduce"],
        "```",
        "",
        f"`gradequiv zoo --library transformers --check {_check_target(data)}` re-runs "
        f"its rows and exits 1 where a verdict differs from this file's.",
        "",
        f"Conditions: torch {c['torch']}, transformers {c['transformers']}, Python "
        f"{c['python']}, {plural(c['threads'], 'thread')}, CPU ({c['cpu']}). The sweep took "
        f"{duration(data['wall_seconds'])} for {plural(len(rows), 'architecture')}: a "
        f"median of {data['median_seconds']:.2f} s each, {data['median_built_seconds']:.2f} s "
        f"for one that builds (its four checks, and the diagnosis of a failure), in one "
        f"process that imports torch and transformers once.{done}",
        "",
        f"**{counts['pass']} pass, {counts['fail']} fail, {counts['cannot build']} cannot "
        f"build.** PASS: every property held. FAIL: a property failed; beside it, the cause "
        f"the diagnosis names (docs/causes.md lists them) and the tensor the failure's "
        f"first line names, with its greatest absolute difference. ERROR: the "
        f"implementation raised, or the checks hung or ended their process. N/A: nothing "
        f"to check in that regime (the reason beside it). cannot build: the route cannot "
        f"build the architecture tiny, or its full-storage run fails (the reason beside "
        f"it): a limit of the route or of the model, not a finding against its "
        f"checkpointing.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in rows:
        cells = [row["architecture"], *verdicts(row), _cause_cell(row), f"{row['seconds']:.1f}"]
        lines.append("| " + " | ".join(_escape(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _check_target(data: dict[str, Any]) -> str:
    words = shlex.split(data["reproduce"])
    return shlex.quote(words[words.index("--out") + 1])


def _cause_cell(row: dict[str, Any]) -> str:
    """What a row's non-passing checks say, each said once with the columns it holds for."""
    if row["status"] != CHECKED:
        return one_line(row["reason"], 200)
    said: dict[str, list[str]] = {}
    for column, cell in row["checks"].items():
        if cell["verdict"] in (FAIL, ERROR):
            text = f"`{cell['cause']}`"
            if cell["cause"] in ("raised", "other", "process"):
                text += f": {one_line(exception_line(cell['first_failure']), 120)}"
            elif _headline(cell["first_failure"]):
                text += f" ({_headline(cell['first_failure'])})"
        elif cell["verdict"] in (NOT_APPLICABLE, CANNOT_BUILD):
            text = f"{cell['verdict']}: {one_line(cell['sentence'], 120)}"
        else:
            continue
        said.setdefault(text, []).append(column)
    return "; ".join(f"{', '.join(columns)}: {text}" for text, columns in said.items())


def _headline(first_failure: str) -> str:
    """The failing tensor and its greatest absolute difference, from a first-failure line
    ("gradients: grad of X: relative error ... greatest absolute difference D"); ""
    for any other line."""
    found = re.match(r"\w+: (.+?): relative error .*greatest absolute difference (\S+)$",
                     first_failure)
    return f"{found[1]}, greatest absolute difference {found[2]}" if found else ""


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def duration(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{seconds:.1f} s"


def read_verdicts(path: Path) -> dict[str, tuple[str, ...]]:
    """Architecture -> its four verdicts, from a table this command wrote (Markdown) or its
    JSON."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgument(f"--check={str(path)!r} could not be read ({exc}); name a "
                              f"table gradequiv zoo wrote, e.g. {DEFAULT_OUT}") from exc
    if path.suffix == ".json":
        try:
            rows = json.loads(text)["rows"]
            return {row["architecture"]: verdicts(row) for row in rows}
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"--check={str(path)!r} is not the JSON of gradequiv zoo "
                                  f"({type(exc).__name__}: {exc}); name the --json file it "
                                  f"wrote, or its Markdown table") from exc
    found: dict[str, tuple[str, ...]] = {}
    lines = text.splitlines()
    header = "| " + " | ".join(COLUMNS) + " |"
    if header in lines:
        for line in lines[lines.index(header) + 2:]:
            if not line.startswith("|"):
                break
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            if len(cells) == len(COLUMNS):
                found[cells[0]] = tuple(cells[1:1 + len(CONFIGS)])
    if not found:
        raise InvalidArgument(f"--check={str(path)!r} holds no table of gradequiv zoo (a "
                              f"header row '{header}' and rows under it); name a table it "
                              f"wrote, e.g. {DEFAULT_OUT}")
    return found

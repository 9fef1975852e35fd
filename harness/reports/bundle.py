"""A report folder as one object: report.json, and mutants.json and profile.json when present.

Every output format (``gradequiv report DIR --format ...``) is rendered from
this, never from a live run, so what CI shows is what the JSON says.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.reports.schema_check import Validator

__all__ = ["ReportBundle", "check_report", "load_bundle", "report_schema"]


def report_schema() -> dict[str, Any]:
    """The JSON Schema of report.json, as shipped in the package."""
    text = files("gradequiv.harness.reports").joinpath("report.schema.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


@functools.cache
def _report_validator() -> Validator:
    return Validator(report_schema())


def check_report(data: Any, path: Path) -> None:
    """Refuse ``data`` (read from ``path``) unless it is a report.json of schema version 1:
    an exit-2 error, one line, names the file, where the first problem is, the rule it
    breaks, and the fix."""
    try:
        problem = _report_validator().first_problem(data)
    except RecursionError:
        what = "at $: it is nested too deeply to be a report"
    else:
        if problem is None:
            _check_verdict(data, path)
            return
        what = str(problem).replace("\n", "\\n").replace("\r", "\\r")  # one line, always
    raise InvalidArgument(f"{str(path)!r} is not a valid report (schema version 1): {what}; "
                          f"it was not written by this gradequiv version's check, or was "
                          f"edited: re-run `gradequiv check --report-dir {path.parent}`")


def _check_verdict(data: dict[str, Any], path: Path) -> None:
    """Refuse a report whose stored verdict is not the one its cases, tests and failures
    give (exit 2, one line naming the field): an edited verdict never gates as a pass."""
    from gradequiv.harness.reports.report import verdict_disagreement

    disagreement = verdict_disagreement(data)
    if disagreement is not None:
        raise InvalidArgument(f"{str(path)!r}: {disagreement}: the stored verdict disagrees "
                              f"with what the report holds (edited or damaged); re-run "
                              f"`gradequiv check --report-dir {path.parent}`")


@dataclass
class ReportBundle:
    folder: Path
    report: dict[str, Any] | None = None  # report.json of `check`
    mutants: dict[str, Any] | None = None  # mutants.json of `mutants`
    profile: dict[str, Any] | None = None  # profile.json of `profile`

    def parts(self) -> list[tuple[str, dict[str, Any]]]:
        """The reports present, in reading order: ("check" | "mutants" | "profile", data)."""
        named = (("check", self.report), ("mutants", self.mutants), ("profile", self.profile))
        return [(name, data) for name, data in named if data is not None]

    @property
    def verdict(self) -> str:
        """fail if any part fails; incomplete if a part stopped early without failing;
        unchecked when no part checks anything (a profile alone): never a pass for a check
        that did not run."""
        parts = [p for p in (self.report, self.mutants) if p is not None]
        if not parts:
            return "unchecked"
        if any(p.get("verdict") != "pass" for p in parts):
            return "fail"
        if any(not p.get("complete", True) for p in parts):
            return "incomplete"
        return "pass"

    @property
    def heading(self) -> str:
        """The verdict as a page's heading says it: what the folder holds when it is no
        verdict at all."""
        if self.verdict == "unchecked":
            return "profile only (nothing checked)"
        return self.verdict.upper()


def load_bundle(folder: Path | str) -> ReportBundle:
    """Read a report folder; an exit-2 error names what is missing or unreadable."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InvalidArgument(f"report folder {str(folder)!r} does not exist; pass the folder "
                              f"given to --report-dir")
    bundle = ReportBundle(folder)
    for attr, name, command in (("report", "report.json", "check"),
                                ("mutants", "mutants.json", "mutants"),
                                ("profile", "profile.json", "profile")):
        path = folder / name
        if not path.exists():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise InvalidArgument(f"{str(path)!r} is not readable JSON ({exc}); re-run "
                                  f"`gradequiv {command}` to write it again") from exc
        if attr == "report" and (not isinstance(data, dict) or data.get("schema_version") == 1):
            check_report(data, path)  # never render a report that breaks its schema
        version = data.get("schema_version") if isinstance(data, dict) else None
        if version != 1:
            raise InvalidArgument(f"{str(path)!r} has schema_version={version!r}; this "
                                  f"gradequiv reads version 1")
        setattr(bundle, attr, data)
    if bundle.report is None and bundle.mutants is None and bundle.profile is None:
        raise InvalidArgument(f"report folder {str(folder)!r} holds none of report.json, "
                              f"mutants.json, profile.json; run `gradequiv check --report-dir "
                              f"{folder}` first")
    return bundle

"""The end of a check run in the terminal: each minimal failure once, its cause first.

Tests that fail on the same minimal case are one entry (a fault usually
breaks several properties); named cases, which are not shrunk, get one line
each, and only say their cause in full where it differs from one already
given. The reproduce line is the short one (the case read from a file in the
report folder) where the run has a folder. Every line goes out :func:`printable`: a
message is the implementation's, and an ESC in it would reach the user's terminal.
"""

from __future__ import annotations

from typing import Any

from gradequiv.harness.reports.diagnosis import distinct_faults
from gradequiv.harness.reports.findings import failure_groups
from gradequiv.harness.reports.text import bounded, printable

__all__ = ["headline_lines", "output_lines", "summary_lines"]

#: named-case failures listed one per line before the rest are counted
NAMED_LINES = 12
#: lines of each stream the implementation printed shown for a failure (report.json keeps more)
OUTPUT_LINES = 20


def headline_lines(failures: list[dict[str, Any]]) -> list[str]:
    """The likely cause, or where the run found several faults, each of them, most
    important first, with the case that shows it and its command: a user who fixes the
    first meets no second one unannounced."""
    faults = distinct_faults(failures)
    if len(faults) <= 1:
        return [_shown(f"likely cause: {f['sentence']}") for f in faults]
    lines = [f"likely causes ({len(faults)} distinct faults):"]
    for number, fault in enumerate(faults, start=1):
        lines.append(f"  {number}. {fault['sentence']}")
        lines.append(f"     seen in {fault['found_in']}: {fault['case']}; "
                     f"reproduce: {fault.get('reproduce_file') or fault['reproduce']}")
    return [_shown(line) for line in lines]


def _shown(line: str) -> str:
    """One line as the terminal gets it: bounded, each control character spelled out (a
    newline in it too: it is one line)."""
    return printable(bounded(line)).replace("\n", "\\n")


def summary_lines(failures: list[dict[str, Any]], errors: dict[str, str]) -> list[str]:
    """Lines for ``failures`` (minimal failures, each with ``test`` and, where known,
    ``diagnosis``) and ``errors`` (tests that failed without one: test -> last line)."""
    lines: list[str] = []
    drawn = [g.failures for g in failure_groups(
        {"minimal_failures": [f for f in failures if not f["test"].startswith("test_named_case")]})]
    named = [f for f in failures if f["test"].startswith("test_named_case")]
    causes: dict[str, int] = {}
    for number, group in enumerate(drawn, start=1):
        first = group[0]
        tests = ", ".join(f["test"] for f in group)
        props = ", ".join(dict.fromkeys(f["property"] for f in group))
        flaky = " [flaky: passed when run again]" if any(f["flaky"] for f in group) else ""
        same = next((f["same_cause_as"] for f in group if f.get("same_cause_as")), None)
        known = next((n for n, g in enumerate(drawn, start=1)
                      if any(f["test"] == same for f in g)), None)
        unshrunk = f" [not shrunk: same cause as minimal failure {known}]" if known else ""
        lines.append(f"minimal failure {number}: {first['description']}{flaky}{unshrunk}")
        lines.append(f"    fails: {props} ({tests})")
        diagnosis = first.get("diagnosis")
        if diagnosis:
            causes.setdefault(diagnosis["cause"], number)
            lines.append(f"    cause: {diagnosis['sentence']}")
        lines.append(f"    {first['message'].splitlines()[0]}")
        if first.get("localisation"):
            lines.append(f"    {first['localisation']}")
        lines.append(f"    reproduce: {first.get('reproduce_file') or first['reproduce']}")
        lines += output_lines(first)
    if named:
        lines.append(f"named cases failing: {len(named)}")
        for failure in named[:NAMED_LINES]:
            name = failure["test"].removeprefix("test_named_case[").removesuffix("]")
            diagnosis = failure.get("diagnosis")
            if diagnosis is None:
                said = failure["message"].splitlines()[0]
            elif diagnosis["cause"] in causes:
                said = (f"same cause as minimal failure {causes[diagnosis['cause']]} "
                        f"({diagnosis['cause']})")
            else:
                said = diagnosis["sentence"]
            lines.append(f"    {name} ({failure['property']}): {said}")
            lines += output_lines(failure, indent="        ")
        if len(named) > NAMED_LINES:
            lines.append(f"    ... and {len(named) - NAMED_LINES} more (report.json lists "
                         f"them all)")
    for test, last in errors.items():
        lines.append(f"{test}: failed without a verdict: {last}")
    return [_shown(line) for line in lines]


def output_lines(failure: dict[str, Any], indent: str = "    ") -> list[str]:
    """What the implementation printed during a failing case: the last lines of each
    stream, indented under the failure."""
    lines = []
    for stream, text in (failure.get("output") or {}).items():
        shown = text.rstrip("\n").splitlines()
        if not shown:
            continue
        cut = f", its last {OUTPUT_LINES} lines" if len(shown) > OUTPUT_LINES else ""
        lines.append(f"{indent}the implementation printed to {stream}{cut}:")
        lines += [_shown(f"{indent}  | {line}") for line in shown[-OUTPUT_LINES:]]
    return lines

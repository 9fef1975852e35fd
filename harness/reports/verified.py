"""Whether a passing check report verified something, decided again from what it holds.

A report's ``verdict`` is a claim; a gate trusts it only where the report backs it: as many
cases as its summary says, each with gradients compared and passing, every property test
ended, every figure finite. A report written by a process the implementation shared (it can
patch what the comparison calls, or write the file itself) or edited by hand can read "pass"
over nothing; these checks catch a report that says so inconsistently, not one forged whole
and consistently (no check can: see docs/reference.md, "What a pass proves").

No torch here: the supervisor and ``gradequiv report`` use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

#: the property every verified case must have compared and passed: the claim itself
CORE_PROPERTY = "gradients"


def why_unverified(report: dict[str, Any]) -> str | None:
    """The field of a passing check report that shows it verified nothing, or holds less
    than it says (``cases[3].properties: gradients compared 0 tensors``), or None."""
    cases = report.get("cases")
    if not isinstance(cases, list) or not cases:
        return "cases=[] (no case was verified)"
    summary = report.get("summary") or {}
    for key, expected in (("run", len(cases)), ("passed", len(cases)), ("failed", 0)):
        if summary.get(key) != expected:
            return (f"summary.{key}={summary.get(key)!r} but cases holds {len(cases)} "
                    f"case(s), all passing")
    tests = report.get("tests")
    if not isinstance(tests, dict) or not tests:
        return "tests={} (no property test ended)"
    for index, case in enumerate(cases):
        why = case_unverified(case)
        if why is not None:
            return f"cases[{index}].{why}"
    for where, value in _numbers(report, ""):
        if not math.isfinite(value):
            return f"{where}={value!r} (a figure that is not a finite number)"
    return None


def case_unverified(case: Any) -> str | None:
    """Why one passing case record verified nothing (``properties: ...``), or None."""
    if not isinstance(case, dict):
        return f"{case!r} is not a case record"
    properties = case.get("properties")
    if not isinstance(properties, list) or not properties:
        return "properties=[] (no property was checked)"
    statuses = {p.get("name"): p for p in properties if isinstance(p, dict)}
    core = statuses.get(CORE_PROPERTY)
    if core is None:
        return f"properties: no {CORE_PROPERTY} property"
    compared = core.get("compared")
    if not isinstance(compared, int) or compared < 1 or core.get("status") != "pass":
        return (f"properties: {CORE_PROPERTY} {core.get('status')!r} with {compared!r} "
                f"tensor(s) compared")
    for prop in statuses.values():
        if prop.get("status") not in ("pass", "n/a"):
            return f"properties: {prop.get('name')} {prop.get('status')!r} in a passing case"
        if isinstance(prop.get("max_floor"), str):  # written so where it was not finite
            return f"properties: {prop.get('name')} max_floor={prop['max_floor']!r}"
    return None


def _numbers(value: Any, where: str) -> Iterator[tuple[str, float]]:
    """Every float the report holds, with its path (NaN and Infinity parse as floats)."""
    if isinstance(value, float):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{where}[{index}]")


def why_not_what_was_sent(report: dict[str, Any], sent: list[dict[str, Any]]) -> str | None:
    """Why ``report`` does not hold the cases the checking process sent as they finished
    (``sent``, by their reproduce lines), or None: the report a supervisor reads back must
    be the run it followed."""
    held = {case.get("reproduce") for case in report.get("cases") or []
            if isinstance(case, dict)}
    said = {record.get("reproduce") for record in sent}
    if held != said:
        missing, extra = len(said - held), len(held - said)
        return (f"report.json holds {len(held)} case(s) where the checking process sent "
                f"{len(said)} ({missing} missing, {extra} it never sent)")
    return None

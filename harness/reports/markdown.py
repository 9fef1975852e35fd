"""The Markdown summary: the verdict and diagnosis first, then failures with their commands.

Sized for a CI job summary (GitHub's $GITHUB_STEP_SUMMARY): a reader sees in
the first lines whether the build should stop and why, and can copy one
command to reproduce the first failure locally.

Text from the run (messages, names, a user's module names, what it printed) is the
implementation's: a CI page renders HTML and Markdown in it, so it goes through
:func:`_md` (escaped), :func:`_code` (a code span it cannot close) or :func:`_fenced`
(a block it cannot close).
"""

from __future__ import annotations

import dataclasses
import re
from html import escape
from typing import Any

from gradequiv.harness.regime import describe
from gradequiv.harness.reports.bundle import ReportBundle
from gradequiv.harness.reports.findings import FailureGroup, failure_groups, find, headline_command
from gradequiv.harness.reports.report import bounded_report
from gradequiv.harness.reports.tables import (
    mutants_summary,
    mutants_table,
    profile_recommendation,
    profile_summary,
    profile_tables,
)
from gradequiv.harness.reports.text import encodable, printable

__all__ = ["mutants_markdown", "profile_markdown", "render_markdown"]

MAX_FAILURES = 10


def render_markdown(bundle: ReportBundle) -> str:
    if bundle.report is not None:  # a report.json written by another version, or edited
        bundle = dataclasses.replace(bundle, report=bounded_report(bundle.report))
    lines = [f"## gradequiv: {bundle.heading}", ""]
    if bundle.verdict == "unchecked":
        lines += ["This folder holds a profile only: memory and step time were measured, no "
                  "gradient was checked. Run `gradequiv check --report-dir` on it for a "
                  "verdict.", ""]
    sections = {"check": _check, "mutants": _mutants, "profile": _profile}
    for name, data in bundle.parts():
        lines += sections[name](data)
    return encodable("\n".join(lines).rstrip() + "\n")


#: Markdown's marks anywhere in a line: code, emphasis, links and images, tables, strikes,
#: GitHub's mathematics
_MARKS = re.compile(r"([\\`*\[\]|~$])")
#: ``_`` opens emphasis only after a character that is no letter or digit
_OPENING_UNDERSCORE = re.compile(r"(?<![0-9A-Za-z])_")
#: what makes a line a heading, quote, list item, rule or setext underline
_LINE_START = re.compile(r"^(\s*\d*)([-+=#.)])")


def _md(text: Any) -> str:
    """``text`` from the run as one line of Markdown that shows it as it is: no HTML, link,
    image, emphasis or line structure of its own, control characters spelled out."""
    line = " ".join(printable(str(text)).splitlines())
    line = _OPENING_UNDERSCORE.sub(r"\\_", _MARKS.sub(r"\\\1", escape(line, quote=False)))
    return _LINE_START.sub(lambda m: m.group(1) + "\\" + m.group(2), line)


def _code(text: Any) -> str:
    """``text`` as a code span that no backtick in it can close (one line)."""
    line = " ".join(printable(str(text)).splitlines())
    ticks = "`" * (max((len(run) for run in re.findall("`+", line)), default=0) + 1)
    pad = " " if line.startswith("`") or line.endswith("`") else ""
    return f"{ticks}{pad}{line}{pad}{ticks}"


def _fenced(text: str, info: str) -> list[str]:
    """``text`` as a fenced block whose fence is longer than any run of backticks in it, so
    no line of it can close the block."""
    shown = printable(text).rstrip("\n")
    fence = "`" * max(3, max((len(run) for run in re.findall("`+", shown)), default=0) + 1)
    return [fence + info, shown, fence]


def _check(report: dict[str, Any]) -> list[str]:
    impl = report["implementation"]
    kwargs = "".join(f", {_md(k)}={_md(v)}" for k, v in impl["kwargs"].items())
    summary = report["summary"]
    tests = report.get("tests", {})
    passed = sum(v == "passed" for v in tests.values())
    head = (f"**{report['verdict'].upper()}**: {_code(impl['spec'])} ({_md(impl['adapter'])}"
            f"{kwargs}), {summary['run']} cases, {summary['failed']} failing")
    if summary.get("shrink_attempts"):
        head += f" ({summary['shrink_attempts']} more tried while shrinking: counted, not kept)"
    if tests:
        head += f"; {passed} of {len(tests)} property tests passed"
    lines = [*_diagnosis(report),
             head + ("." if report["complete"] else
                     ". **Incomplete**: the run stopped early; these are the cases that finished."),
             ""]
    findings = find(report)
    sites = ", ".join(f"{site} ({n} cases, {bad} failing)"
                      for site, (n, bad) in sorted(findings.sites.items()))
    lines += [f"- **How close:** {_md(findings.closeness())}.",
              f"- **How consistent:** {_md(findings.consistency())}.",
              f"- **Random sites exercised:** {_md(sites or 'none')}.", *_floor(report), ""]
    groups = failure_groups(report)
    if groups:
        lines += ["### Failures", ""]
        said = ((report.get("failure") or {}).get("diagnosis") or {}).get("evidence") or []
        for group in groups[:MAX_FAILURES]:
            lines += _failure(group, said)
        if len(groups) > MAX_FAILURES:
            lines += [f"... and {len(groups) - MAX_FAILURES} more in report.json.", ""]
    if tests:
        lines += ["| property test | outcome |", "|---|---|"]
        lines += [f"| {_md(name)} | {_md(outcome)} |" for name, outcome in tests.items()]
        lines.append("")
    lines += [_conditions(report["conditions"]), ""]
    if report.get("regime"):
        sentence = describe(report["regime"])
        lines += [_md(sentence[:1].upper() + sentence[1:]) + ".", ""]
    return lines


def _diagnosis(report: dict[str, Any]) -> list[str]:
    """The headline failure's diagnosis, its evidence and its short command: nothing where
    the report has no diagnosis."""
    diagnosis = (report.get("failure") or {}).get("diagnosis") or {}
    if not diagnosis.get("sentence"):
        return []
    faults = report.get("faults") or []
    if len(faults) > 1:  # every fault the run found, each with its case and command
        lines = [f"### {len(faults)} distinct faults", ""]
        for number, fault in enumerate(faults, start=1):
            lines += [f"{number}. **{_md(fault['sentence'])}** (seen in "
                      f"{_md(fault['found_in'])}: {_md(fault['case'])}): "
                      f"{_code(fault.get('reproduce_file') or fault['reproduce'])}"]
        return [*lines, ""]
    lines = [f"### {_md(diagnosis['sentence'])}", ""]
    evidence = [f"- {_md(e)}" for e in diagnosis.get("evidence") or []]
    lines += [*evidence, ""] if evidence else []
    command = headline_command(report)
    return lines + ([*_fenced(command, "sh"), ""] if command else [])


def _failure(group: FailureGroup, said: list[str]) -> list[str]:
    """One case's minimal failures, with every property and test it fails; evidence the
    headline's diagnosis (``said``) already lists is not listed twice."""
    names = [f"{_code(f['property'])}{' (flaky: passed on replay)' if f.get('flaky') else ''}"
             for f in group.failures if f.get("property")]
    tests = f" ({_md(', '.join(group.tests))})" if group.tests else ""
    lines = [f"**{', '.join(dict.fromkeys(names)) or 'case'}**{tests}: "
             f"{_md(group.description)}", ""]
    for sentence in group.sentences:
        lines += [f"**{_md(sentence)}**", ""]
    if group.evidence and group.evidence == list(said):
        lines += ["Evidence: as in the diagnosis above.", ""]
    elif group.evidence:
        lines += [*(f"- {_md(e)}" for e in group.evidence), ""]
    for text in [*group.messages, *group.localisations]:  # a quote, line by line
        lines += [*(f"> {_md(line)}" for line in str(text).splitlines() or [""]), ""]
    lines += [*_fenced(group.command, "sh"), ""]
    output: dict[str, str] = next(
        (f["output"] for f in group.failures if f.get("output")), {})
    for stream, text in output.items():
        if text.strip():
            lines += [f"The implementation printed to {_md(stream)}:", "",
                      *_fenced(text, "text"), ""]
    return lines


def _floor(report: dict[str, Any]) -> list[str]:
    floor = report.get("statistics", {}).get("max_noise_floor")
    if floor is None:
        return []
    switch = "on" if report["conditions"].get("deterministic_algorithms") else "off"
    cases = report["statistics"].get("noise_floor_cases")
    if cases == 0:
        return [f"- **Noise floor:** not measured: every case passed against a floor of zero, "
                f"the strictest bound (deterministic algorithms {switch})."]
    over = "" if cases is None else f"; over the {cases} case(s) that ran it"
    return [f"- **Noise floor:** the two full-storage runs differ by at most {floor:.3g} "
            f"(relative{over}; deterministic algorithms {switch})."]


def _conditions(conditions: dict[str, Any]) -> str:
    keys = ("torch", "device", "device_name", "threads", "deterministic_algorithms", "seed",
            "profile", "examples_per_property", "python", "gradequiv")
    return "Conditions: " + ", ".join(f"{k} {_md(conditions[k])}" for k in keys
                                      if k in conditions)


def mutants_markdown(mutants: dict[str, Any]) -> str:
    """mutants.md, from the dict that goes to mutants.json (report.md shows the same)."""
    return "\n".join(_mutants_body(mutants)) + "\n"


def profile_markdown(profile: dict[str, Any]) -> str:
    """profile.md, from the dict that goes to profile.json (report.md shows the same).

    Without a ``plot`` (``ProfileResult.to_dict()`` alone) it is the table the command
    prints.
    """
    return "\n".join(_profile_body(profile)) + "\n"


def _mutants(mutants: dict[str, Any]) -> list[str]:
    return ["### Deliberately broken implementations", "", *_mutants_body(mutants), ""]


def _mutants_body(mutants: dict[str, Any]) -> list[str]:
    return [f"**{mutants_summary(mutants)}**", "", *mutants_table(mutants).markdown()]


def _profile(profile: dict[str, Any]) -> list[str]:
    return ["### Memory and step time per granularity", "", *_profile_body(profile), ""]


def _profile_body(profile: dict[str, Any]) -> list[str]:
    lines = [profile_summary(profile)]
    for caption, table in profile_tables(profile):
        lines += ["", *([caption, ""] if caption else []), *table.markdown()]
    for k, (sentence, batches) in enumerate(profile_recommendation(profile)):
        lines += ["", f"**{sentence}**" if k == 0 else sentence]
        lines += ["", *batches.markdown()] if batches is not None else []
    if profile.get("plot"):
        lines += ["", f"![memory against step time]({profile['plot']})"]
    return lines

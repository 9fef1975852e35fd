"""The Markdown summary: the verdict and diagnosis first, then failures with their commands.

Sized for a CI job summary (GitHub's $GITHUB_STEP_SUMMARY): a reader sees in
the first lines whether the build should stop and why, and can copy one
command to reproduce the first failure locally.
"""

from __future__ import annotations

from typing import Any

from gradequiv.harness.reports.bundle import ReportBundle
from gradequiv.harness.reports.findings import FailureGroup, failure_groups, find, headline_command
from gradequiv.harness.reports.tables import (
    mutants_summary,
    mutants_table,
    profile_recommendation,
    profile_summary,
    profile_tables,
)

__all__ = ["mutants_markdown", "profile_markdown", "render_markdown"]

MAX_FAILURES = 10


def render_markdown(bundle: ReportBundle) -> str:
    lines = [f"## gradequiv: {bundle.heading}", ""]
    if bundle.verdict == "unchecked":
        lines += ["This folder holds a profile only: memory and step time were measured, no "
                  "gradient was checked. Run `gradequiv check --report-dir` on it for a "
                  "verdict.", ""]
    sections = {"check": _check, "mutants": _mutants, "profile": _profile}
    for name, data in bundle.parts():
        lines += sections[name](data)
    return "\n".join(lines).rstrip() + "\n"


def _check(report: dict[str, Any]) -> list[str]:
    impl = report["implementation"]
    kwargs = "".join(f", {k}={v}" for k, v in impl["kwargs"].items())
    summary = report["summary"]
    tests = report.get("tests", {})
    passed = sum(v == "passed" for v in tests.values())
    head = (f"**{report['verdict'].upper()}**: `{impl['spec']}` ({impl['adapter']}{kwargs}), "
            f"{summary['run']} cases, {summary['failed']} failing")
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
    lines += [f"- **How close:** {findings.closeness()}.",
              f"- **How consistent:** {findings.consistency()}.",
              f"- **Random sites exercised:** {sites or 'none'}.", *_floor(report), ""]
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
        lines += [f"| {name} | {outcome} |" for name, outcome in tests.items()]
        lines.append("")
    lines += [_conditions(report["conditions"]), ""]
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
            lines += [f"{number}. **{fault['sentence']}** (seen in {fault['found_in']}: "
                      f"{fault['case']}): `{fault.get('reproduce_file') or fault['reproduce']}`"]
        return [*lines, ""]
    lines = [f"### {diagnosis['sentence']}", ""]
    evidence = [f"- {e}" for e in diagnosis.get("evidence") or []]
    lines += [*evidence, ""] if evidence else []
    command = headline_command(report)
    return lines + (["```sh", command, "```", ""] if command else [])


def _failure(group: FailureGroup, said: list[str]) -> list[str]:
    """One case's minimal failures, with every property and test it fails; evidence the
    headline's diagnosis (``said``) already lists is not listed twice."""
    names = [f"`{f['property']}`{' (flaky: passed on replay)' if f.get('flaky') else ''}"
             for f in group.failures if f.get("property")]
    tests = f" ({', '.join(group.tests)})" if group.tests else ""
    lines = [f"**{', '.join(dict.fromkeys(names)) or 'case'}**{tests}: {group.description}", ""]
    for sentence in group.sentences:
        lines += [f"**{sentence}**", ""]
    if group.evidence and group.evidence == list(said):
        lines += ["Evidence: as in the diagnosis above.", ""]
    elif group.evidence:
        lines += [*(f"- {e}" for e in group.evidence), ""]
    for text in [*group.messages, *group.localisations]:
        lines += [f"> {text}", ""]
    lines += ["```sh", group.command, "```", ""]
    output: dict[str, str] = next(
        (f["output"] for f in group.failures if f.get("output")), {})
    for stream, text in output.items():
        if text.strip():
            fence = "~~~~" if "```" in text else "```"
            lines += [f"The implementation printed to {stream}:", "", fence + "text",
                      text.rstrip("\n"), fence, ""]
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
    return "Conditions: " + ", ".join(f"{k} {conditions[k]}" for k in keys if k in conditions)


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

"""A self-contained HTML page: verdict, diagnosis, failures, heatmaps, findings, conditions.

No network: styles are inline and every picture is a PNG embedded as a
``data:`` URI, so the page opens the same from a CI artifact, a mail or a
laptop without internet. The diagnosis comes first: a reader wants to know
why it failed and how to re-run it before any table. Per minimal failure a
heatmap of relative gradient error per layer and parameter, all on one
colour scale, shows where the fault sits (one layer, every layer, only the
attention's weights ...), which a table of thirty numbers hides.

Every text on the page is escaped (``html.escape``), and the page goes out
:func:`~gradequiv.harness.reports.text.printable`: a message is the implementation's.
"""

from __future__ import annotations

import base64
import dataclasses
from html import escape
from typing import Any

from gradequiv.harness.regime import describe
from gradequiv.harness.reports.bundle import ReportBundle
from gradequiv.harness.reports.figures import MISSING_MATPLOTLIB, frontier_png, gradient_heatmap_png
from gradequiv.harness.reports.findings import (
    FailureGroup,
    error_scale,
    failure_groups,
    find,
    headline_command,
    layer_errors,
)
from gradequiv.harness.reports.report import bounded_report
from gradequiv.harness.reports.tables import (
    Table,
    mutants_summary,
    mutants_table,
    profile_recommendation,
    profile_summary,
    profile_tables,
)
from gradequiv.harness.reports.text import printable

__all__ = ["heatmap_cases", "render_html"]

MAX_HEATMAPS = 6
#: Minimal failures shown open; the others are one click away, so the heatmaps stay near.
OPEN_FAILURES = 5

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 .pass { color: #1a7f37; } h1 .fail, h1 .incomplete { color: #cf222e; }
h1 .unchecked { color: #9a6700; }
.diagnosis { border-left: 5px solid #cf222e; padding: .2em 0 .2em 1em; margin: 1em 0 2em; }
.diagnosis .sentence { font-size: 22px; line-height: 1.3; font-weight: 600; margin: 0 0 .4em; }
.failure { border-top: 1px solid #ddd; padding-top: .4em; margin-bottom: 1.2em; }
.failure .sentence { font-size: 16px; font-weight: 600; margin: .2em 0; }
table { border-collapse: collapse; margin: .5em 0 1.5em; }
td, th { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } tr.fail td { background: #fff0f0; }
pre { background: #f6f8fa; padding: .6em; overflow-x: auto; white-space: pre-wrap; }
pre.command { overflow-wrap: anywhere; } summary { cursor: pointer; font-weight: 600; }
img { max-width: 100%; border: 1px solid #eee; } .small { color: #666; font-size: 12px; }
"""


def render_html(bundle: ReportBundle) -> str:
    if bundle.report is not None:  # a report.json written by another version, or edited
        bundle = dataclasses.replace(bundle, report=bounded_report(bundle.report))
    parts = [f"<h1>gradequiv: <span class='{bundle.verdict}'>{escape(bundle.heading)}</span>"
             "</h1>"]
    if bundle.verdict == "unchecked":
        parts.append(f"<p>{_UNCHECKED}</p>")
    sections = {"check": _check, "mutants": _mutants, "profile": _profile}
    for name, data in bundle.parts():
        parts += sections[name](data)
    body = "\n".join(parts)
    return printable(
        f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>gradequiv report: {escape(bundle.heading)}</title><style>{_STYLE}</style>"
        f"</head><body>\n{body}\n</body></html>\n")


#: What a folder without report.json or mutants.json says instead of a verdict.
_UNCHECKED = ("This folder holds a profile only: memory and step time were measured, no "
              "gradient was checked. Run <code>gradequiv check --report-dir</code> on it for a "
              "verdict.")


def _img(png: bytes | None, alt: str) -> str:
    if png is None:
        return f"<p class='small'>({escape(MISSING_MATPLOTLIB)}: no picture)</p>"
    data = base64.b64encode(png).decode("ascii")
    return f"<img alt='{escape(alt)}' src='data:image/png;base64,{data}'>"


def _table(table: Table) -> str:
    out = ["<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in table.head) + "</tr>"]
    for i, row in enumerate(table.rows):
        mark = table.marks[i] if i < len(table.marks) else ""
        cls = f" class='{mark}'" if mark else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>")
    return "\n".join(out) + "</table>"


def _list(items: list[str], cls: str = "") -> list[str]:
    if not items:
        return []
    attr = f" class='{cls}'" if cls else ""
    return [f"<ul{attr}>" + "".join(f"<li>{escape(i)}</li>" for i in items) + "</ul>"]


def _check(report: dict[str, Any]) -> list[str]:
    parts = _diagnosis(report)
    if not report["complete"]:
        parts.append("<p><b>Incomplete:</b> the run stopped early; below are the cases that "
                     "finished.</p>")
    groups = failure_groups(report)
    if report.get("minimal_failures"):
        said = ((report.get("failure") or {}).get("diagnosis") or {}).get("evidence") or []
        parts.append("<h2>Minimal failures</h2>")
        for group in groups[:OPEN_FAILURES]:
            parts += _failure(group, said)
        if len(groups) > OPEN_FAILURES:
            rest = len(groups) - OPEN_FAILURES
            parts.append(f"<details><summary>{rest} more minimal failure"
                         f"{'' if rest == 1 else 's'}</summary>")
            for group in groups[OPEN_FAILURES:]:
                parts += _failure(group, said)
            parts.append("</details>")
    parts += _heatmaps(report, groups)
    parts += _findings(report)
    parts.append("<h2>Cases</h2>")
    rows, classes = [], []
    for r in report["cases"]:
        statuses = " ".join(f"{p['name']}:{p['status']}" for p in r["properties"])
        rows.append([r["description"], r["verdict"], statuses,
                     r["first_failure"] or r["error"] or ""])
        classes.append("fail" if r["verdict"] == "fail" else "")
    failing = sum(c == "fail" for c in classes)
    parts.append(f"<details><summary>{len(rows)} case{'' if len(rows) == 1 else 's'} "
                 f"({failing} failing)</summary>")
    parts.append(_table(Table(["case", "verdict", "properties", "first failure"], rows,
                              classes)))
    parts.append("</details>")
    parts.append("<h2>Conditions</h2>")
    rows = [[k, str(v)] for k, v in report["conditions"].items()]
    if report.get("regime"):
        rows.append(["training regime", describe(report["regime"])])
    parts.append(_table(Table(["", ""], rows)))
    return parts


def _diagnosis(report: dict[str, Any]) -> list[str]:
    """The headline failure's diagnosis, in large type, with its evidence and the short
    command that reproduces it (nothing where the report has no diagnosis)."""
    failure = report.get("failure") or {}
    diagnosis = failure.get("diagnosis") or {}
    if not diagnosis.get("sentence"):
        return []
    faults = report.get("faults") or []
    if len(faults) > 1:  # every fault the run found, each with its case and command
        items = "".join(
            f"<li><p class='sentence'>{escape(f['sentence'])}</p><p class='small'>seen in "
            f"{escape(f['found_in'])}: {escape(f['case'])}</p>"
            f"<pre class='command'>{escape(f.get('reproduce_file') or f['reproduce'])}</pre>"
            f"</li>" for f in faults)
        return ["<section class='diagnosis'>", f"<p>{len(faults)} distinct faults:</p>",
                f"<ol>{items}</ol>", "</section>"]
    parts = ["<section class='diagnosis'>",
             f"<p class='sentence'>{escape(diagnosis['sentence'])}</p>",
             *_list([str(e) for e in diagnosis.get("evidence") or []], "evidence")]
    command = headline_command(report)
    if command:
        parts += ["<p class='small'>Reproduce:</p>",
                  f"<pre class='command'>{escape(command)}</pre>"]
    return [*parts, "</section>"]


def _failure(group: FailureGroup, said: list[str]) -> list[str]:
    """One case's minimal failures: its properties and tests, diagnosis, messages, command.
    Evidence the headline's diagnosis (``said``) already lists is not listed twice, nor a
    message the evidence quotes."""
    names = [f"{f['property']}{' (flaky: passed on replay)' if f.get('flaky') else ''}"
             for f in group.failures if f.get("property")]
    tests = f" <span class='small'>({escape(', '.join(group.tests))})</span>" \
        if group.tests else ""
    parts = ["<div class='failure'>",
             f"<p><b>{escape(', '.join(dict.fromkeys(names)) or 'case')}</b>{tests}: "
             f"{escape(group.description)}</p>"]
    parts += [f"<p class='sentence'>{escape(s)}</p>" for s in group.sentences]
    if group.evidence and group.evidence == list(said):
        parts.append("<p class='small'>Evidence: as in the diagnosis above.</p>")
    else:
        parts += _list(group.evidence)
    text = "\n".join([*group.messages, *group.localisations])
    parts += [f"<pre>{escape(text)}</pre>"] if text else []
    parts.append(f"<pre class='command'>{escape(group.command)}</pre>")
    return [*parts, "</div>"]


def heatmap_cases(report: dict[str, Any], groups: list[FailureGroup] | None = None
                  ) -> list[tuple[str, dict[str, Any]]]:
    """The records a page draws, with their titles: the minimal failures' own cases (never
    every failing case a search tried), those with a gradient difference first, at most
    ``MAX_HEATMAPS``."""
    by_reproduce = {r["reproduce"]: r for r in report["cases"]}
    drawn: list[tuple[bool, str, dict[str, Any]]] = []
    for group in failure_groups(report) if groups is None else groups:
        record = by_reproduce.get(group.reproduce)
        if record is None:
            continue
        rows, _, grid = layer_errors(record)
        if not rows:
            continue
        failing = [p["name"] for p in record["properties"] if p["status"] == "fail"]
        names = ", ".join(failing or group.properties or ["error"])
        title = f"{names} failing: {record['description'] or group.description}"
        drawn.append((not any(v != 0 for row in grid for v in row if v == v), title, record))
    drawn.sort(key=lambda d: d[0])  # stable: the report's order within each kind
    return [(title, record) for _, title, record in drawn[:MAX_HEATMAPS]]


def _heatmaps(report: dict[str, Any], groups: list[FailureGroup]) -> list[str]:
    cases = heatmap_cases(report, groups)
    if not cases:
        return []
    scale = error_scale([record for _, record in cases])
    parts = ["<h2>Where the gradients diverge</h2>",
             f"<p class='small'>Relative gradient error per layer and parameter, one colour "
             f"scale ({scale[0]:.0e} to {scale[1]:.0e}) for every picture: white is bitwise "
             f"equal, blue inf or NaN, grey no such parameter.{_more(len(cases), groups)}</p>"]
    for title, record in cases:
        parts.append(f"<p>{escape(title)}</p>")
        parts.append(_img(gradient_heatmap_png(record, scale=scale, title=title),
                          f"gradient error, {title}"))
    return parts


def _more(drawn: int, groups: list[FailureGroup]) -> str:
    return f" {drawn} of {len(groups)} failing cases drawn." if len(groups) > drawn else ""


def _findings(report: dict[str, Any]) -> list[str]:
    impl, summary = report["implementation"], report["summary"]
    kwargs = ", ".join(f"{k}={v}" for k, v in impl["kwargs"].items())
    findings = find(report)
    shrunk = summary.get("shrink_attempts")
    tried = (f" ({shrunk} more tried while shrinking failures: counted, not kept)"
             if shrunk else "")
    sites = ", ".join(f"{site} ({n} cases, {bad} failing)"
                      for site, (n, bad) in sorted(findings.sites.items()))
    return ["<h2>Findings</h2>",
            f"<p><b>{escape(impl['spec'])}</b> ({escape(impl['adapter'])}"
            f"{', ' + escape(kwargs) if kwargs else ''}): {summary['run']} cases, "
            f"{summary['failed']} failing{escape(tried)}.</p>",
            "<ul>"
            f"<li><b>How close:</b> {escape(findings.closeness())}.</li>"
            f"<li><b>How consistent:</b> {escape(findings.consistency())}.</li>"
            f"<li><b>Random sites exercised:</b> {escape(sites or 'none')}.</li></ul>"]


def _mutants(mutants: dict[str, Any]) -> list[str]:
    return ["<h2>Deliberately broken implementations</h2>",
            f"<p><b>{escape(mutants_summary(mutants))}</b></p>", _table(mutants_table(mutants))]


def _profile(profile: dict[str, Any]) -> list[str]:
    parts = ["<h2>Memory and step time per granularity</h2>",
             f"<p>{escape(profile_summary(profile))}</p>"]
    for caption, table in profile_tables(profile):
        parts += [f"<p>{escape(caption)}</p>"] if caption else []
        parts.append(_table(table))
    for k, (sentence, batches) in enumerate(profile_recommendation(profile)):
        parts.append(f"<p><b>{escape(sentence)}</b></p>" if k == 0 else
                     f"<p>{escape(sentence)}</p>")
        parts += [_table(batches)] if batches is not None else []
    return [*parts, _img(frontier_png(profile), "memory against step time")]

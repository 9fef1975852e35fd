"""A self-contained HTML page: verdict, findings, failures, heatmaps, frontier, conditions.

No network: styles are inline and every picture is a PNG embedded as a
``data:`` URI, so the page opens the same from a CI artifact, a mail or a
laptop without internet. Per failing case a heatmap of relative gradient
error per layer and parameter shows where the fault sits (one layer, every
layer, only the attention's weights ...), which a table of thirty numbers
hides.
"""

from __future__ import annotations

import base64
from html import escape
from typing import Any

from gradequiv.harness.reports.bundle import ReportBundle
from gradequiv.harness.reports.figures import MISSING_MATPLOTLIB, frontier_png, gradient_heatmap_png
from gradequiv.harness.reports.findings import find
from gradequiv.harness.reports.tables import (
    Table,
    mutants_summary,
    mutants_table,
    profile_summary,
    profile_tables,
)

__all__ = ["render_html"]

MAX_HEATMAPS = 6

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 .pass { color: #1a7f37; } h1 .fail, h1 .incomplete { color: #cf222e; }
table { border-collapse: collapse; margin: .5em 0 1.5em; }
td, th { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } tr.fail td { background: #fff0f0; }
pre { background: #f6f8fa; padding: .6em; overflow-x: auto; white-space: pre-wrap; }
img { max-width: 100%; border: 1px solid #eee; } .small { color: #666; font-size: 12px; }
"""


def render_html(bundle: ReportBundle) -> str:
    parts = [f"<h1>gradequiv: <span class='{bundle.verdict}'>{bundle.verdict.upper()}</span>"
             "</h1>"]
    sections = {"check": _check, "mutants": _mutants, "profile": _profile}
    for name, data in bundle.parts():
        parts += sections[name](data)
    body = "\n".join(parts)
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>gradequiv report: {escape(bundle.verdict)}</title><style>{_STYLE}</style>"
            f"</head><body>\n{body}\n</body></html>\n")


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


def _check(report: dict[str, Any]) -> list[str]:
    impl, summary = report["implementation"], report["summary"]
    kwargs = ", ".join(f"{k}={v}" for k, v in impl["kwargs"].items())
    findings = find(report)
    parts = [f"<p><b>{escape(impl['spec'])}</b> ({escape(impl['adapter'])}"
             f"{', ' + escape(kwargs) if kwargs else ''}): {summary['run']} cases, "
             f"{summary['failed']} failing.</p>"]
    if not report["complete"]:
        parts.append("<p><b>Incomplete:</b> the run stopped early; below are the cases that "
                     "finished.</p>")
    sites = ", ".join(f"{site} ({n} cases, {bad} failing)"
                      for site, (n, bad) in sorted(findings.sites.items()))
    parts.append("<ul>"
                 f"<li><b>How close:</b> {escape(findings.closeness())}.</li>"
                 f"<li><b>How consistent:</b> {escape(findings.consistency())}.</li>"
                 f"<li><b>Random sites exercised:</b> {escape(sites or 'none')}.</li></ul>")
    failures = report.get("minimal_failures", [])
    if failures:
        parts.append("<h2>Minimal failures</h2>")
        for f in failures:
            parts.append(f"<p><b>{escape(f['property'])}</b>"
                         f"{' (flaky)' if f['flaky'] else ''}: {escape(f['description'])}</p>"
                         f"<pre>{escape(f['message'])}\n{escape(f.get('localisation', ''))}"
                         f"\n\n{escape(f['reproduce'])}</pre>")
    failing = [r for r in report["cases"] if r["verdict"] == "fail"]
    if failing:
        parts.append("<h2>Where the gradients diverge</h2>")
        for record in sorted(failing, key=lambda r: r["case"]["model"].get("n_layer", 0),
                             reverse=True)[:MAX_HEATMAPS]:
            parts.append(f"<p>{escape(record['description'])}</p>")
            parts.append(_img(gradient_heatmap_png(record), f"gradient error {record['name']}"))
    parts.append("<h2>Cases</h2>")
    rows, classes = [], []
    for r in report["cases"]:
        statuses = " ".join(f"{p['name']}:{p['status']}" for p in r["properties"])
        rows.append([r["description"], r["verdict"], statuses,
                     r["first_failure"] or r["error"] or ""])
        classes.append("fail" if r["verdict"] == "fail" else "")
    parts.append(_table(Table(["case", "verdict", "properties", "first failure"], rows,
                              classes)))
    parts.append("<h2>Conditions</h2>")
    parts.append(_table(Table(["", ""], [[k, str(v)] for k, v in report["conditions"].items()])))
    return parts


def _mutants(mutants: dict[str, Any]) -> list[str]:
    return ["<h2>Deliberately broken implementations</h2>",
            f"<p><b>{escape(mutants_summary(mutants))}</b></p>", _table(mutants_table(mutants))]


def _profile(profile: dict[str, Any]) -> list[str]:
    parts = ["<h2>Memory and step time per granularity</h2>",
             f"<p>{escape(profile_summary(profile))}</p>"]
    for caption, table in profile_tables(profile):
        parts += [f"<p>{escape(caption)}</p>"] if caption else []
        parts.append(_table(table))
    return [*parts, _img(frontier_png(profile), "memory against step time")]

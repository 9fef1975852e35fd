"""Reports stay valid whatever text the implementation brings: an exception message, what it
printed, or a module name holding HTML, ``]]>``, control characters, a lone surrogate or
five megabytes. junit.xml parses, report.md and report.html show no markup of its own, the
terminal gets no control character, nothing is fatal, and every file stays under 1 MB."""

from __future__ import annotations

import copy
import json
import re
import xml.dom.minidom
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_rendering import _bundle, _minimal, _record, _report
from torch.utils.checkpoint import checkpoint

from gradequiv.harness import Case, Implementation, verify
from gradequiv.harness.cli import main
from gradequiv.harness.options import CheckOptions
from gradequiv.harness.reports.html_page import render_html
from gradequiv.harness.reports.junit import render_junit
from gradequiv.harness.reports.markdown import render_markdown
from gradequiv.harness.reports.report import assemble_check_report, verdict_record
from gradequiv.harness.reports.terminal import headline_lines, output_lines, summary_lines
from gradequiv.harness.reports.text import FIELD_CHARS, REPEAT_CHARS, bounded, encodable
from gradequiv.properties.plugin import _Gatherer
from gradequiv.properties.runtime import FAILURE_KEY

#: a user's module named to break a page (and its picture: a ``$`` pair is mathematics)
SEGMENT = "<img src=x onerror=alert(1)>$\\frac{$"
#: every kind of trouble a message can carry: markup, a CDATA end, a fence, control
#: characters (NUL, ESC clearing the screen, BEL, CR, C1's CSI), a lone surrogate, a
#: non-character, a link and a table cell
HOSTILE = (f"<script>alert(1)</script> {SEGMENT} ]]> ``` \x00\x1b[2J\x07\rverdict: pass\x9b "
           "\ud800 \ufffe [x](javascript:alert(1)) ![t](http://t/t.png) **b** | _i_ ")
#: what a page or a terminal must never receive raw
CONTROLS = ("\x00", "\x1b", "\x07", "\r", "\x9b", "\ud800")
MEGABYTE = 1 << 20


def _hostile_report(text: str) -> dict[str, Any]:
    """A failing report (test_rendering's) with ``text`` in every field that takes text from
    the run: messages, tracebacks, warnings, summaries, sentences, evidence, localisations,
    outputs, the implementation's spec, test names and a user's module names."""
    tensor = f"blocks.0.{SEGMENT}.weight"
    minimal = _record(1, {tensor: 0.3, "blocks.1.attn.weight": 0.0})
    tried = _record(2, {tensor: 0.5})
    records = [_record(0), minimal, tried]
    for record in (minimal, tried):
        record |= {"error": text, "error_at": "step 1 backward", "first_failure": text,
                   "warnings": [text], "output": {"stdout": text, "stderr": text}}
        record["properties"][0] |= {"summary": text, "failures": [text]}
    failures = [_minimal(minimal), _minimal(minimal, "trajectory", "test_trajectory"),
                _minimal(tried, "gradients", f"test_named_case[{SEGMENT}]")]
    for failure in failures:
        failure |= {"message": text, "localisation": text,
                    "output": {"stdout": text, "stderr": ""},
                    "first_diverging_op": {"segment": SEGMENT, "index": 0, "op": "bernoulli_",
                                           "module": SEGMENT, "forward": text,
                                           "recompute": text, "rel_error": 1.0,
                                           "differing": 0.5, "random": True}}
        failure["diagnosis"] = {"cause": "raised", "sentence": text, "evidence": [text, text],
                                "also": [], "faults": [{"cause": "raised", "sentence": text}]}
    report = _report(records, failures)
    report["failure"] |= {"message": text, "diagnosis": failures[0]["diagnosis"],
                          "output": {"stdout": text, "stderr": text}}
    report["faults"] = [{"cause": c, "sentence": f"{c}: {text}", "case": text,
                         "found_in": text, "reproduce": f"gradequiv check {text}"}
                        for c in ("raised", "leak")]
    report["implementation"] |= {"spec": f"mod:{SEGMENT}{text}", "kwargs": {"k": text}}
    report["tests"] = {f"test_named_case[{SEGMENT}]": "failed", "test_gradients": "failed"}
    for record in records:  # a user's model: its own module names
        record["case"]["model_kind"] = "external"
    return report


def _outside_code(markdown: str) -> str:
    """``markdown`` without its fenced blocks and code spans (where text is shown as it is),
    as CommonMark reads them; an unclosed fence runs to the end."""
    kept, fence = [], ""
    for line in markdown.splitlines():
        opening = re.match(r" {0,3}(`{3,}|~{3,})", line)
        if fence:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= \
                    len(fence) and not line.strip().strip(fence[0]):
                fence = ""
            continue
        if opening:
            fence = opening.group(1)
            continue
        kept.append(line)
    text = "\n".join(kept)
    spans = re.compile(r"(?<!`)(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
    return spans.sub("", text.replace("\\`", ""))


def test_junit_is_well_formed_xml_whatever_a_message_holds() -> None:
    xml_text = render_junit(_hostile_report(HOSTILE))
    data = xml_text.encode("utf-8")  # a lone surrogate cannot even be written
    xml.dom.minidom.parseString(data)
    suite = ET.fromstring(data)
    failed = [e for e in suite.iter() if e.tag in ("failure", "error")]
    assert failed and all("\\x1b[2J" in (e.text or "") for e in failed)
    assert "]]>" not in xml_text.replace("]]&gt;", "")  # text, never markup
    assert xml_text.count("characters XML cannot hold were replaced") == 1


def test_report_md_shows_text_from_the_run_and_no_markup_of_its_own() -> None:
    markdown = render_markdown(_bundle(_hostile_report(HOSTILE)))
    markdown.encode("utf-8")
    assert not any(c in markdown for c in CONTROLS)
    prose = _outside_code(markdown)
    assert not re.search(r"<[A-Za-z!/?]", prose), "raw HTML in report.md"
    assert not re.search(r"(?<!\\)\]\(", prose)  # no link, no image
    assert "&lt;script&gt;" in prose and "\\x1b\\[2J" in prose  # said, escaped
    assert not re.search(r"(?<!\\)\$", prose)  # no mathematics either
    # the output holds ``` and stays one block: the fence around it is longer
    printed = markdown.index("The implementation printed to stdout:")
    block = markdown[printed:].split("\n\n", 2)[1]
    assert block.startswith("````text\n") and block.rstrip().endswith("\n````")


def test_report_html_escapes_every_text() -> None:
    page = render_html(_bundle(_hostile_report(HOSTILE)))
    page.encode("utf-8")
    assert "<script" not in page and SEGMENT not in page
    assert not any(c in page for c in CONTROLS)
    assert "&lt;img src=x onerror=alert(1)&gt;$\\frac{$" in page and "\\x1b[2J" in page


def test_the_terminal_gets_control_characters_spelled_out() -> None:
    report = _hostile_report(HOSTILE)
    failures = report["minimal_failures"]
    lines = [*headline_lines(failures),
             *summary_lines(failures, {"test_inference": HOSTILE}),
             *output_lines({"output": {"stdout": f"one\n{HOSTILE}\nthree"}})]
    shown = "\n".join(lines)
    shown.encode("utf-8")
    assert not any(c in shown for c in CONTROLS)
    assert "\\x1b[2J" in shown and "\\x0dverdict: pass" in shown  # no line overwritten
    assert "  | one" in shown and "  | three" in shown  # newlines that are lines stay lines


def test_a_lone_surrogate_in_report_json_renders_every_format(tmp_path: Path) -> None:
    report = _hostile_report(HOSTILE)
    (tmp_path / "report.json").write_text(json.dumps(report))  # escaped: \ud800
    assert main(["report", str(tmp_path), "--format", "all"]) == 0
    for name in ("report.md", "report.html", "junit.xml"):
        text = (tmp_path / name).read_text(encoding="utf-8")
        assert "\ud800" not in text
    xml.dom.minidom.parse(str(tmp_path / "junit.xml"))


def test_a_long_text_is_kept_once_and_cut_where_it_repeats_saying_how_much() -> None:
    long = HOSTILE + "x" * (5 * MEGABYTE)
    once = bounded(long)
    said = re.search(r" \[\.\.\. (\d+) characters cut\] ", once)
    assert len(once) == FIELD_CHARS and said is not None
    assert len(once) - len(said.group()) + int(said.group(1)) == len(long)  # each one said
    assert once.startswith(HOSTILE) and bounded(once) == once
    traceback = "Traceback (most recent call last):\n  File x\n" + long + "\nTail\n"
    assert bounded(traceback).split("\n")[2].startswith(HOSTILE)  # the raise kept in full
    hostile = _hostile_report(long)
    report = assemble_check_report(
        options=CheckOptions(impl="mod:attr"), impl=None, device=torch.device("cpu"),
        records=copy.deepcopy(hostile["cases"]), outcomes={"test_gradients": "failed"},
        failures=copy.deepcopy(hostile["minimal_failures"]), complete=True)
    assert len(json.dumps(report)) < MEGABYTE / 4
    texts = [t for t in _strings(report) if "characters cut]" in t]
    kept = [t for t in texts if len(t) > REPEAT_CHARS]
    assert kept and all(len(t) <= FIELD_CHARS for t in texts)
    assert len(kept) < len(texts) / 2  # the rest cut where it repeats
    kept_once = report["failure"]["diagnosis"]["sentence"]  # the headline's, first read
    assert kept_once == encodable(bounded(long))
    assert len(report["failure"]["message"]) <= REPEAT_CHARS  # it repeats the sentence


def _strings(data: Any) -> list[str]:
    if isinstance(data, str):
        return [data]
    if isinstance(data, dict):
        return [s for value in data.values() for s in _strings(value)]
    if isinstance(data, list):
        return [s for value in data for s in _strings(value)]
    return []


def test_the_suite_keeps_a_failure_s_texts_bounded_from_the_start() -> None:
    """A minimal failure's message and localisation, and a test's failure without one, are
    bounded as the run receives them, before any diagnosis or summary reads them."""
    gatherer = _Gatherer(SimpleNamespace(workerinput={}))  # as a worker: writes no file
    long = HOSTILE + "x" * (5 * MEGABYTE)
    failure = {"property": "gradients", "message": long, "localisation": long,
               "flaky": False, "case": _record(1)["case"], "description": "case 1",
               "reproduce": "gradequiv check --case 1"}
    for test, properties in (("test_gradients", [(FAILURE_KEY, failure)]),
                             ("test_inference", [])):
        gatherer.pytest_runtest_logreport(SimpleNamespace(  # type: ignore[arg-type]
            nodeid=f"properties/test_recompute.py::{test}", user_properties=properties,
            failed=True, when="call", outcome="failed", longrepr=f"E   RuntimeError: {long}"))
    (kept,) = gatherer.failures
    assert len(json.dumps(kept)) < 4 * FIELD_CHARS  # its diagnosis included
    assert "characters cut]" in kept["message"] and "characters cut]" in kept["localisation"]
    assert len(gatherer.errors["test_inference"]) <= FIELD_CHARS


class _RaisesHostile(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(HOSTILE + "x" * (5 * MEGABYTE))


#: calls of :func:`raises_hostile` so far
_CALLS: list[int] = []


def raises_hostile(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """An implementation whose backward raises five megabytes of trouble, after printing
    some in its first call (``test_hostile_text:raises_hostile``): the case's run, whose
    output the report keeps; the replay and the localisation run outside pytest's capture,
    and what an implementation prints there goes to the terminal as it is, its own doing."""
    if not _CALLS:
        print(HOSTILE.replace("\ud800", "") + "y" * MEGABYTE)
    _CALLS.append(1)
    out = checkpoint(fn, *args, use_reentrant=False, **kwargs)
    if isinstance(out, tuple):
        return (_RaisesHostile.apply(out[0]), *out[1:])
    return _RaisesHostile.apply(out)


def test_a_record_bounds_the_implementation_s_exception_where_it_is_made() -> None:
    impl = Implementation("test_hostile_text:raises_hostile", raises_hostile)
    verdict = verify(impl, Case(), device="cpu")
    assert verdict.error is not None and len(verdict.error) > 5 * MEGABYTE
    verdict.warnings = [verdict.error]
    record = verdict_record(impl, verdict, torch.device("cpu"))
    assert len(json.dumps(record)) < 4 * FIELD_CHARS
    assert "RuntimeError: <script>" in record["error"] and "characters cut]" in record["error"]
    assert "\ud800" not in record["error"] and "\ufffd" in record["error"]


def test_a_5_mb_message_leaves_every_report_file_under_1_mb(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole run: the suite's records and failures, report.json, every format, the
    terminal."""
    _CALLS.clear()
    code = main(["check", "--in-process", "--impl", "test_hostile_text:raises_hostile",
                 "--case", "1L-layer-dropout", "--report-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 1 and "verdict: FAIL" in out
    assert not [c for c in CONTROLS if c in out + err], (out + err)[:3000]
    assert main(["report", str(tmp_path), "--format", "all"]) == 0
    for name in ("report.json", "report.md", "report.html", "junit.xml"):
        assert (tmp_path / name).stat().st_size < MEGABYTE, name
    report = json.loads((tmp_path / "report.json").read_text())
    assert "characters cut]" in report["failure"]["message"]
    assert "characters cut]" in report["failure"]["output"]["stdout"]
    assert "\\x1b[2J" in out  # said: the sentence, the message, what it printed
    xml.dom.minidom.parse(str(tmp_path / "junit.xml"))
    assert not re.search(r"<[A-Za-z!/?]", _outside_code((tmp_path / "report.md").read_text()))

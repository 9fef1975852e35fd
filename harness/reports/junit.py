"""JUnit XML: one testcase per property and case family, failures carrying the minimal case.

CI systems draw their test tabs from JUnit. A family is the cases that share
a dtype regime and a recompute granularity kind (``layer``, ``every``,
``group``, ...), so a tab says "gradients [bf16-autocast, attention]" failed,
not one of thirty drawn shapes. Each failing testcase carries its smallest
failing case (the property suite's shrunk example when there is one) and the
command that reproduces it.

A message may hold characters XML 1.0 cannot (NUL, ESC, a lone surrogate): they are
spelled out (``\\x1b``) and the file says so once, so it stays well-formed whatever the
implementation raised.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from typing import Any

from gradequiv.harness.reports.report import bounded_report
from gradequiv.harness.reports.text import spelled

__all__ = ["case_family", "render_junit"]

#: what XML 1.0 cannot hold: C0 controls but tab, newline and CR, surrogates, U+FFFE, U+FFFF
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
#: said once, where the first replacement was made
_REPLACED = "(characters XML cannot hold were replaced by escapes such as \\x1b)"


def case_family(case: dict[str, Any]) -> str:
    kind = case["granularity"].split(":")[0]
    return f"{case.get('model_kind', 'transformer')}, {case['dtype']}, {kind}"


def _size(case: dict[str, Any]) -> int:
    model = case["model"]
    batch = case.get("batch") or {"batch_size": 1, "seq_len": 1}  # a user's model: unknown
    return int(model.get("n_layer", 1) * model.get("n_embd", model.get("width", 1))
               * batch["batch_size"] * batch["seq_len"])


def render_junit(report: dict[str, Any]) -> str:
    report = bounded_report(report)  # one written by another version, or edited
    impl = report["implementation"]["spec"]
    groups: dict[tuple[str, str], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for record in report["cases"]:
        family = case_family(record["case"])
        for prop in record["properties"]:
            groups.setdefault((prop["name"], family), []).append((record, prop))
    shrunk = {(f["property"], case_family(f["case"])): f
              for f in reversed(report.get("minimal_failures", []))}
    suite = ET.Element("testsuite", name=f"gradequiv[{impl}]")
    failures = errors = skipped = 0
    for (prop_name, family), members in sorted(groups.items()):
        seconds = sum(sum(r["seconds"].values()) / max(len(r["properties"]), 1)
                      for r, _ in members)
        testcase = ET.SubElement(suite, "testcase", classname=f"gradequiv.{impl}",
                                 name=f"{prop_name} [{family}]", time=f"{seconds:.3f}")
        failing = [(r, p) for r, p in members if p["status"] == "fail" or r["error"]]
        if failing:
            record, prop = min(failing, key=lambda rp: _size(rp[0]["case"]))
            minimal = shrunk.get((prop_name, family))
            case = minimal["case"] if minimal else record["case"]
            message = (minimal["message"] if minimal else
                       prop["summary"] or record["first_failure"] or record["error"] or "failed")
            reproduce = minimal["reproduce"] if minimal else record["reproduce"]
            element = ET.SubElement(testcase, "error" if record["error"] else "failure",
                                    message=message.splitlines()[0], type=prop_name)
            located = minimal.get("localisation", "") if minimal else ""
            element.text = (f"{len(failing)} of {len(members)} cases fail.\n{message}\n"
                            f"{located}\n"
                            f"minimal case: {json.dumps(case, sort_keys=True)}\n"
                            f"reproduce: {reproduce}\n")
            errors += bool(record["error"])
            failures += not record["error"]
        elif all(p["status"] == "n/a" for _, p in members):
            ET.SubElement(testcase, "skipped", message=members[0][1]["summary"] or "n/a")
            skipped += 1
        else:
            out = ET.SubElement(testcase, "system-out")
            out.text = f"{len(members)} cases pass\n"
    caught = {name for (name, _), members in groups.items()
              if any(p["status"] == "fail" or r["error"] for r, p in members)}
    for test, outcome in report.get("tests", {}).items():
        name = test.removeprefix("test_")
        covered = bool(caught) if name.startswith("named_case") else name in caught
        if outcome == "failed" and not covered:
            # The suite failed where no single case did (a named case, a replay, an error).
            testcase = ET.SubElement(suite, "testcase", classname=f"gradequiv.{impl}",
                                     name=f"{test} [property suite]", time="0")
            ET.SubElement(testcase, "failure", message=f"{test} failed; see report.json",
                          type="suite")
            failures += 1
    if not report.get("complete", True):
        testcase = ET.SubElement(suite, "testcase", classname=f"gradequiv.{impl}",
                                 name="run complete", time="0")
        ET.SubElement(testcase, "error", message="the run stopped before all cases finished",
                      type="incomplete")
        errors += 1
    suite.set("tests", str(len(suite)))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    suite.set("skipped", str(skipped))
    _xml_safe(suite)
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


def _xml_safe(suite: ET.Element) -> None:
    """Spell out what XML cannot hold in every text and attribute of ``suite``, and say so
    once: in the text of the first failure, error or skip that held some, else the suite's
    ``system-err``."""
    replaced: list[ET.Element] = []
    for element in suite.iter():
        texts = [element.text or "", *element.attrib.values()]
        if not any(_NOT_XML.search(t) for t in texts):
            continue
        replaced.append(element)
        if element.text:
            element.text = _NOT_XML.sub(spelled, element.text)
        for name, value in list(element.attrib.items()):
            element.set(name, _NOT_XML.sub(spelled, value))
    if not replaced:
        return
    said = next((e for e in replaced if e.tag in ("failure", "error", "skipped")), None)
    if said is None:
        said = ET.SubElement(suite, "system-err")
    said.text = f"{said.text or ''}{_REPLACED}\n"

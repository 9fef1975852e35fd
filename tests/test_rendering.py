"""How report.md and report.html read, from small report dicts: the diagnosis first, one
entry per failing case, heatmaps of the minimal failures on one colour scale, a collapsed
case table, no PASS for a folder nothing was checked in, and the random sites of a user's
model."""

from __future__ import annotations

import copy
import html
import json
import re
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness.cli import main
from gradequiv.harness.reports import html_page
from gradequiv.harness.reports.bundle import ReportBundle, check_report, load_bundle
from gradequiv.harness.reports.findings import error_scale, failure_groups, find, layer_errors
from gradequiv.harness.reports.html_page import MAX_HEATMAPS, heatmap_cases, render_html
from gradequiv.harness.reports.markdown import render_markdown

SENTENCE = "The recompute drew other dropout masks: the RNG state was not restored."
EVIDENCE = ["first diverging op: bernoulli_ in blocks.0.attn", "every failing case has dropout"]
SHORT = "gradequiv check --impl torch --case gradequiv-report/cases/minimal-1.json"


def _case(seed: int, kind: str = "transformer", dropout: float = 0.1) -> dict[str, Any]:
    model = ({"n_layer": 2, "attn_dropout": dropout} if kind == "transformer"
             else {"factory": "mypkg.models:build"})
    return {"name": "", "model_kind": kind, "model": model,
            "batch": {"batch_size": 1, "seq_len": 4, "padding": False},
            "granularity": "layer", "dtype": "fp32", "seed": seed, "steps": 2}


def _check(name: str, error: float) -> dict[str, Any]:
    return {"property": "gradients", "name": f"grad of {name}", "passed": error == 0,
            "rel_error": error, "bound": 1e-6, "floor": 0.0, "max_abs": error, "cosine": 1.0,
            "mismatched": int(error != 0), "numel": 4, "max_ulps": int(error != 0)}


def _record(seed: int, errors: dict[str, float] | None = None,
            kind: str = "transformer") -> dict[str, Any]:
    """One case; failing where any of ``errors`` (tensor -> relative error) is non-zero."""
    errors = errors if errors is not None else {"blocks.0.attn.weight": 0.0}
    failing = any(errors.values())
    record: dict[str, Any] = {
        "name": "", "description": f"2L x 8w x 4t, layer, fp32, seed {seed}",
        "case": _case(seed, kind), "verdict": "fail" if failing else "pass",
        "first_failure": "grad differs" if failing else None,
        "reproduce": f"gradequiv check --case '{{\"seed\": {seed}}}'", "error": None,
        "error_at": None, "warnings": [], "seconds": {}, "held_bytes": {}, "held_on": {},
        "properties": [{"name": "gradients", "status": "fail" if failing else "pass",
                        "summary": "", "failures": [],
                        "checks": [_check(n, e) for n, e in errors.items()]}]}
    if failing:
        record["gradient_errors"] = {f"grad of {n}": e for n, e in errors.items()}
    return record


def _minimal(record: dict[str, Any], prop: str = "gradients", test: str = "test_gradients",
             diagnosed: bool = True) -> dict[str, Any]:
    failure: dict[str, Any] = {
        "property": prop, "message": f"{prop} differ", "flaky": False, "case": record["case"],
        "description": record["description"], "reproduce": record["reproduce"], "test": test,
        "localisation": "first diverging op: bernoulli_ in blocks.0.attn"}
    if diagnosed:
        failure |= {"diagnosis": {"cause": "rng-not-restored", "sentence": SENTENCE,
                                  "evidence": EVIDENCE},
                    "reproduce_file": SHORT}
    return failure


def _report(records: list[dict[str, Any]], failures: list[dict[str, Any]]) -> dict[str, Any]:
    failed = [r for r in records if r["verdict"] == "fail"]
    headline = None
    if failures:
        first = failures[0]
        headline = {"case": first["description"], "property": first["property"],
                    "message": first["message"], "flaky": False, "minimal_case": first["case"],
                    "reproduce": first["reproduce"], "first_mismatch": None}
        if "diagnosis" in first:
            headline["diagnosis"] = first["diagnosis"]
    return {"schema_version": 1, "tool": "gradequiv", "command": "check",
            "verdict": "fail" if failed or failures else "pass", "complete": True, "run": None,
            "implementation": {"spec": "torch", "adapter": "function", "kwargs": {}},
            "conditions": {"gradequiv": "0", "torch": "2", "python": "3", "device": "cpu",
                           "threads": 1, "seed": 0},
            "summary": {"run": len(records), "passed": len(records) - len(failed),
                        "failed": len(failed), "shrink_attempts": 17},
            "cases": records, "failure": headline, "tests": {}, "minimal_failures": failures}


def _failing_report() -> dict[str, Any]:
    """Three cases: one passes, two fail; the first failing one is the minimal failure of two
    tests, the other a case the search tried on the way."""
    minimal = _record(1, {"blocks.0.attn.weight": 0.3, "blocks.1.attn.weight": 0.0})
    tried = _record(2, {"blocks.0.attn.weight": 0.5, "blocks.1.attn.weight": 0.2})
    return _report([_record(0), minimal, tried],
                   [_minimal(minimal), _minimal(minimal, "trajectory", "test_trajectory")])


def _bundle(report: dict[str, Any]) -> ReportBundle:
    check_report(report, Path("report.json"))  # the dicts here are reports the schema allows
    return ReportBundle(Path("."), report=report)


def test_the_diagnosis_comes_first_then_the_minimal_failures_then_the_cases() -> None:
    page = render_html(_bundle(_failing_report()))
    sentence, failures = page.index(SENTENCE), page.index("<h2>Minimal failures</h2>")
    assert page.index("</h1>") < sentence < page.index(EVIDENCE[0]) < failures
    assert page.index(SHORT) < failures  # the short command, not the case JSON
    assert failures < page.index("<h2>Cases</h2>")
    assert re.search(r"class='sentence'>[^<]*not restored", page)  # in the large type
    text = render_markdown(_bundle(_failing_report()))
    lines = text.splitlines()
    assert lines[0] == "## gradequiv: FAIL" and lines[2] == f"### {SENTENCE}"
    assert text.index(f"- {EVIDENCE[0]}") < text.index(SHORT) < text.index("**FAIL**")
    assert text.index("**FAIL**") < text.index("### Failures")


def test_without_a_diagnosis_nothing_comes_before_the_failures() -> None:
    report = _failing_report()
    del report["failure"]["diagnosis"]
    for failure in report["minimal_failures"]:
        del failure["diagnosis"], failure["reproduce_file"]
    page = render_html(_bundle(report))
    assert "class='diagnosis'" not in page and "class='sentence'" not in page
    assert html.escape(report["minimal_failures"][0]["reproduce"]) in page  # the long one
    assert render_markdown(_bundle(report)).startswith("## gradequiv: FAIL\n\n**FAIL**")


def test_minimal_failures_of_one_case_are_one_entry_naming_every_property() -> None:
    report = _failing_report()
    assert [len(g.failures) for g in failure_groups(report)] == [2]
    page = render_html(_bundle(report))
    assert page.count("<div class='failure'>") == 1
    entry = page[page.index("<div class='failure'>"):]
    assert "gradients, trajectory" in entry and "test_gradients, test_trajectory" in entry
    assert "gradients: gradients differ\ntrajectory: trajectory differ" in entry
    assert entry.count(SHORT) == 1
    text = render_markdown(_bundle(report))
    assert text.count("(test_gradients, test_trajectory)") == 1
    assert "**`gradients`, `trajectory`**" in text
    # the headline's case: its evidence (the localisation among it) is said once, above
    for rendered in (page, text):
        assert rendered.count(EVIDENCE[0]) == 1 and "as in the diagnosis above" in rendered
    other = _record(3, {"blocks.0.attn.weight": 0.2})
    report["cases"].append(other)
    report["minimal_failures"].append(_minimal(other))
    report["minimal_failures"][-1]["diagnosis"]["evidence"] = ["the attention's mask moved"]
    page = render_html(_bundle(report))
    assert page.count("<div class='failure'>") == 2
    assert "<li>the attention&#x27;s mask moved</li>" in page
    assert page.count(EVIDENCE[0]) == 2  # the other case's localisation, not in its evidence
    report["minimal_failures"][-1]["diagnosis"]["evidence"] = ["gradients differ"]
    assert failure_groups(report)[-1].messages == []  # its message is in its evidence


def test_heatmaps_are_drawn_only_for_the_minimal_failures_cases() -> None:
    pytest.importorskip("matplotlib")
    report = _failing_report()
    page = render_html(_bundle(report))
    assert page.count("<img") == 1  # the minimal case, not the other failing case
    (title, record), = heatmap_cases(report)
    assert record is report["cases"][1]
    assert "gradients failing: 2L x 8w x 4t, layer, fp32, seed 1" == title  # never blank
    many = [_record(i, {"blocks.0.attn.weight": 0.1 * i}) for i in range(1, 10)]
    page = render_html(_bundle(_report(many, [_minimal(r) for r in many])))
    assert page.count("<img") == MAX_HEATMAPS
    assert f"{MAX_HEATMAPS} of 9 failing cases drawn" in page


def test_every_heatmap_of_a_page_shares_one_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    one_layer = _record(1, {"blocks.0.mlp.weight": 2e-5, "blocks.1.mlp.weight": 0.4,
                            "blocks.2.mlp.weight": 0.0})
    small = _record(2, {"blocks.0.mlp.weight": 3e-3})
    low, high = error_scale([one_layer, small])
    assert (low, high) == pytest.approx((1e-5, 1.0))
    assert error_scale([small]) != (low, high)  # the page's scale, not each picture's own
    assert error_scale([_record(3, {"w": 0.3, "v": 0.5})]) == pytest.approx((0.1, 1.0))
    tiny = _record(4, {"blocks.0.w": 1e-11, "blocks.1.w": 0.9})
    low, high = error_scale([tiny])  # not 12 decades: a fault in one layer must stand out
    assert high / low == pytest.approx(1e6)
    assert error_scale([_record(5, {"w": float("inf"), "v": 0.02})])[1] == pytest.approx(0.1)
    seen: list[tuple[float, float] | None] = []
    monkeypatch.setattr(html_page, "gradient_heatmap_png",
                        lambda record, *, scale=None, title=None: seen.append(scale) or b"png")
    records = [one_layer, small]
    render_html(_bundle(_report(records, [_minimal(r) for r in records])))
    assert seen == [error_scale(records)] * 2


def test_a_heatmap_never_draws_a_small_error_as_bitwise_equal() -> None:
    from gradequiv.harness.reports.figures import _heat_value

    low, high = 1e-5, 1.0
    assert _heat_value(0.0, low, high) < low  # the white under the scale: bitwise equal
    assert _heat_value(1e-9, low, high) == low  # the palest colour on the scale
    assert _heat_value(float("inf"), low, high) > high and _heat_value(0.3, low, high) == 0.3


def test_the_case_table_is_collapsed() -> None:
    page = render_html(_bundle(_failing_report()))
    assert "<details><summary>3 cases (2 failing)</summary>" in page
    table = page[page.index("<h2>Cases</h2>"):page.index("<h2>Conditions</h2>")]
    assert table.index("<details>") < table.index("<table>") < table.index("</details>")


def test_a_folder_without_a_check_is_not_a_pass(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    profile = {"schema_version": 1, "command": "profile", "implementation": "torch",
               "case": {}, "conditions": {"torch": "2", "device": "cpu", "threads": 1,
                                          "steps": 2, "warmup": 1, "shape": "2L x 8w"},
               "rows": [{"granularity": "none", "held_bytes": 100, "peak_backward_bytes": 200,
                         "step_s": {"p50": 0.01, "p95": 0.02, "p99": 0.03}, "forward_s": 0.004,
                         "backward_s": 0.006, "recompute_s": 0.0, "tokens_per_s": 100.0,
                         "overhead_vs_none": 0.0, "memory_saved_vs_none": 0.0,
                         "on_frontier": True}],
               "plot": None, "plot_missing": None}
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    assert main(["report", str(tmp_path), "--format", "md"]) == 0
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("## gradequiv: profile only (nothing checked)\n")
    assert "PASS" not in text
    assert main(["report", str(tmp_path), "--format", "html"]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "profile only (nothing checked)" in page and "PASS" not in page
    assert main(["report", str(tmp_path), "--format", "md", "--fail-on-verdict"]) == 1
    assert "nothing was checked" in capsys.readouterr().err
    assert load_bundle(tmp_path).verdict == "unchecked"
    mutants = {"verdict": "pass", "complete": True}  # mutants only: their own verdict
    assert ReportBundle(tmp_path, mutants=mutants, profile=profile).heading == "PASS"


def test_a_user_s_model_has_unknown_random_sites_unless_one_diverged() -> None:
    record = _record(1, {"net.fc.weight": 0.2}, kind="external")
    failure = _minimal(record) | {"first_diverging_op": None}
    assert find(_report([record], [failure])).sites == {"unknown (your own model)": [1, 1]}
    failure["first_diverging_op"] = {"segment": "net", "index": 3, "op": "bernoulli_",
                                     "module": "net.drop", "forward": "", "recompute": "",
                                     "rel_error": 1.0, "differing": 0.5, "random": True}
    report = _report([record], [failure])
    assert find(report).sites == {"bernoulli_ in net.drop": [1, 1]}
    assert "bernoulli_ in net.drop (1 cases, 1 failing)" in render_markdown(_bundle(report))
    reference = _report([_record(2, {"blocks.0.w": 0.0})], [])
    reference["cases"][0]["case"]["model"]["attn_dropout"] = 0.0
    assert find(reference).sites == {"none (deterministic model)": [1, 0]}


def test_tensors_are_counted_from_compared_where_checks_keep_the_worst() -> None:
    report = _failing_report()
    assert find(report).gradient_tensors == 5  # no totals: one per check
    for record in report["cases"]:
        record["properties"][0] |= {"compared": 30, "bitwise_equal": 28}
    found = find(report)
    assert (found.gradient_tensors, found.bitwise_equal) == (90, 84)
    assert found.worst_rel_error == pytest.approx(0.5)


def test_the_heatmap_grid_reads_every_tensor_from_gradient_errors() -> None:
    record = _record(1, {"blocks.0.attn.weight": 0.3})
    record["gradient_errors"] |= {"grad of blocks.1.attn.weight": "inf",
                                  "grad of input blocks.0-1:x": 0.1, "grad of wte.weight": 0.0}
    rows, columns, grid = layer_errors(record)  # the checks hold only the worst tensor
    assert rows == ["blocks.0", "blocks.1", "other"]
    assert columns == ["attn.weight", "wte.weight"]
    assert grid[0][0] == 0.3 and grid[1][0] == float("inf") and grid[2][1] == 0.0


def test_the_shrink_attempts_are_counted_on_the_page() -> None:
    report = _failing_report()
    assert "17 more tried while shrinking" in render_html(_bundle(report))
    assert "17 more tried while shrinking" in render_markdown(_bundle(report))
    del report["summary"]["shrink_attempts"]
    assert "shrinking" not in render_markdown(_bundle(copy.deepcopy(report)))

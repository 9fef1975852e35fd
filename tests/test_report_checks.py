"""``gradequiv report`` refuses a report.json that breaks its schema: the validator of
``reports.schema_check`` agrees with jsonschema on the shipped schema, the command says what
is wrong in one line (exit 2), and the validator refuses a schema it cannot check."""

from __future__ import annotations

import fnmatch
import json
import random
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness.cli import main
from gradequiv.harness.reports.bundle import report_schema
from gradequiv.harness.reports.schema_check import (
    Problem,
    UnsupportedSchema,
    Validator,
    first_problem,
)

jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parent.parent


def check_record(name: str = "grad of wte.weight", passed: bool = True) -> dict[str, Any]:
    return {"property": "gradients", "name": name, "passed": passed, "rel_error": 0.0,
            "bound": 9.5e-07, "floor": 0.0, "max_abs": "inf", "cosine": 1.0, "mismatched": 0,
            "numel": 1024, "max_ulps": None}


def case() -> dict[str, Any]:
    return {"name": "2L-layer", "model_kind": "transformer", "model": {"n_layer": 2},
            "batch": {"batch_size": 2, "seq_len": 8, "padding": True}, "granularity": "layer",
            "dtype": "fp32", "seed": 3, "steps": 2, "grad_mode": "backward",
            "inference": False}


def valid_report() -> dict[str, Any]:
    """A failing run's report, by hand, touching every part of the schema."""
    return {
        "schema_version": 1, "tool": "gradequiv", "command": "check", "verdict": "fail",
        "complete": True,
        "run": {"id": "r1", "started": "2026-01-01T00:00:00+00:00",
                "command": "gradequiv check --impl torch", "pid": 42},
        "implementation": {"spec": "torch", "adapter": "function",
                           "kwargs": {"preserve_rng_state": "false"}},
        "conditions": {"gradequiv": "0.1.0", "torch": "2.4.0", "python": "3.11.7",
                       "device": "cpu", "threads": 2, "seed": 0,
                       "deterministic_algorithms": False, "profile": "ci",
                       "examples_per_property": 20},
        "summary": {"run": 1, "passed": 0, "failed": 1},
        "cases": [{
            "name": "2L-layer", "description": "2L, layer, fp32", "case": case(),
            "verdict": "fail", "first_failure": "gradients", "reproduce": "gradequiv check",
            "error": None, "error_at": None, "warnings": ["w"],
            "seconds": {"full": 1.5, "recompute": 2},
            "held_bytes": {"full": 100, "recompute": None},
            "held_on": {"full": {"cpu": 100}, "recompute": None},
            "properties": [
                {"name": "gradients", "status": "fail", "summary": "1 tensor off",
                 "failures": ["grad of wte.weight"],
                 "checks": [check_record(passed=False), check_record("grad of x")]},
                {"name": "inference", "status": "n/a", "summary": "none", "failures": [],
                 "checks": []},
            ],
        }],
        "failure": {"case": "2L-layer", "property": "gradients", "message": None,
                    "flaky": False, "minimal_case": case(), "reproduce": "gradequiv check",
                    "first_mismatch": check_record(passed=False)},
        "tests": {"test_gradients": "failed", "test_rng": "passed"},
        "minimal_failures": [{
            "property": "gradients", "message": "off", "flaky": False, "case": case(),
            "description": "2L", "reproduce": "gradequiv check", "test": "test_gradients",
            "localisation": "blocks.0",
            "first_diverging_op": {"segment": "blocks.0", "index": 0, "op": "aten.mm",
                                   "module": "attn", "forward": "f", "recompute": "r",
                                   "rel_error": None, "differing": 0.5, "random": True},
        }],
        "statistics": {"cases_per_regime": {"dtype fp32": 1}, "worst_relative_error": 0.25,
                       "max_noise_floor": 0.0},
    }


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(report: dict[str, Any]) -> None:
        target: Any = report
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
    return edit


def _drop(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def edit(report: dict[str, Any]) -> None:
        target: Any = report
        for step in path[:-1]:
            target = target[step]
        del target[path[-1]]
    return edit


#: name -> (an edit of the valid report, in place or returning a new instance; the JSON
#: path and keyword of the first problem our validator must find)
BROKEN: dict[str, tuple[Callable[[dict[str, Any]], Any], str, str]] = {
    "no summary (a v1 file of an older writer)": (_drop(("summary",)), "$", "required"),
    "verdict not in the enum": (_set(("verdict",), "maybe"), "$.verdict", "enum"),
    "schema_version true, not 1": (_set(("schema_version",), True), "$.schema_version",
                                    "const"),
    "complete a string": (_set(("complete",), "yes"), "$.complete", "type"),
    "a case without its verdict": (_drop(("cases", 0, "verdict")), "$.cases[0]", "required"),
    "cases an object": (_set(("cases",), {"0": {}}), "$.cases", "type"),
    "a bool where an integer is wanted": (_set(("summary", "run"), True), "$.summary.run",
                                          "type"),
    "a fraction where an integer is wanted": (_set(("conditions", "threads"), 1.5),
                                              "$.conditions.threads", "type"),
    "below the minimum": (_set(("summary", "failed"), -1), "$.summary.failed", "minimum"),
    "above the maximum": (_set(("minimal_failures", 0, "first_diverging_op", "differing"), 2),
                          "$.minimal_failures[0].first_diverging_op.differing", "maximum"),
    "null where a string is wanted": (_set(("cases", 0, "reproduce"), None),
                                      "$.cases[0].reproduce", "type"),
    "an extra level of nesting": (_set(("cases",), [[valid_report()["cases"][0]]]),
                                  "$.cases[0]", "type"),
    "a check's number neither a number nor inf/nan": (
        _set(("cases", 0, "properties", 0, "checks", 0, "cosine"), "one"),
        "$.cases[0].properties[0].checks[0].cosine", "enum"),
    "a bad property name deep down": (_set(("cases", 0, "properties", 1, "name"), "speed"),
                                      "$.cases[0].properties[1].name", "enum"),
    "a failure missing its reproduce line": (_drop(("failure", "reproduce")), "$.failure",
                                             "required"),
    "a failure that is a string": (_set(("failure",), "boom"), "$.failure", "oneOf"),
    "run.pid a string": (_set(("run", "pid"), "42"), "$.run.pid", "type"),
    "kwargs values must be strings": (_set(("implementation", "kwargs", "x"), 1),
                                      "$.implementation.kwargs.x", "type"),
    "held_on's inner values integers": (_set(("cases", 0, "held_on", "full", "cpu"), 1.5),
                                        "$.cases[0].held_on.full.cpu", "type"),
    "an odd key in tests": (_set(("tests", "test a's"), "maybe"), "$.tests['test a\\'s']",
                            "enum"),
    "a report that is a list": (lambda report: [report], "$", "type"),
}


def broken(name: str) -> Any:
    """The valid report with the damage ``name`` done to it."""
    report = valid_report()
    return BROKEN[name][0](report) or report


def js_errors(instance: Any) -> list[Any]:
    """Every error jsonschema finds, with those inside oneOf branches."""
    def walk(errors: Any) -> Iterator[Any]:
        for error in errors:
            yield error
            yield from walk(error.context)
    return list(walk(jsonschema.Draft202012Validator(report_schema()).iter_errors(instance)))


def assert_agrees(instance: Any) -> Problem | None:
    """Ours and jsonschema agree on validity, and our first problem is one of its errors."""
    ours = first_problem(instance, report_schema())
    theirs = js_errors(instance)
    assert (ours is None) == (not theirs), (ours, [e.message for e in theirs])
    if ours is not None:
        found = {(e.json_path, e.validator) for e in theirs}
        assert (ours.path, ours.keyword) in found, (ours, found)
    return ours


def test_the_shipped_schema_is_a_valid_draft_2020_12_schema_we_implement() -> None:
    jsonschema.Draft202012Validator.check_schema(report_schema())
    Validator(report_schema())  # raises UnsupportedSchema on a keyword it does not know


def test_a_valid_report_is_valid_to_both() -> None:
    assert assert_agrees(valid_report()) is None
    for fine in (_set(("failure",), None), _set(("run",), None), _drop(("run",)),
                 _set(("cases", 0, "seconds", "full"), 1.0),
                 _set(("conditions", "threads"), 2.0),  # 2.0 is an integer in 2020-12
                 _set(("cases", 0, "properties", 0, "checks", 0, "rel_error"), "nan"),
                 _set(("failure", "first_mismatch"), None)):
        report = valid_report()
        fine(report)
        assert assert_agrees(report) is None


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_report_is_refused_by_both_at_the_same_place(name: str) -> None:
    ours = assert_agrees(broken(name))
    assert ours is not None
    _, path, keyword = BROKEN[name]
    assert (ours.path, ours.keyword) == (path, keyword), ours


def test_random_damage_is_judged_as_jsonschema_judges_it() -> None:
    """Delete a member or replace a value anywhere in the report, 400 times over."""
    draw = random.Random(20240601)
    values = [None, True, False, 0, -1, 1, 2.5, "", "pass", "inf", [], {}, [1], {"a": 1}]

    def places(node: Any, path: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
        yield path
        children = node.items() if isinstance(node, dict) else enumerate(node) \
            if isinstance(node, list) else ()
        for key, child in children:
            yield from places(child, (*path, key))

    refused = 0
    for _ in range(400):
        report = valid_report()
        path = draw.choice(list(places(report, ()))[1:])
        if draw.random() < 0.3:
            _drop(path)(report)
        else:
            _set(path, draw.choice(values))(report)
        refused += assert_agrees(report) is not None
    assert refused > 200  # the damage is mostly damage


def write_report(folder: Path, report: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "report.json"
    path.write_text(json.dumps(report) if not isinstance(report, str) else report)
    return path


def test_report_without_summary_is_exit_2_one_line_no_traceback(tmp_path: Path) -> None:
    path = write_report(tmp_path / "gradequiv-report", broken(
        "no summary (a v1 file of an older writer)"))
    done = subprocess.run([sys.executable, "-m", "gradequiv.harness", "report",
                           str(path.parent)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr == (
        f"gradequiv: error: {str(path)!r} is not a valid report (schema version 1): at $: "
        f"'summary' is a required property; it was not written by this gradequiv version's "
        f"check, or was edited: re-run `gradequiv check --report-dir {path.parent}`\n")
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]  # none rendered


@pytest.mark.parametrize("content, says", [
    (broken("a case without its verdict"), "at $.cases[0]: 'verdict' is a required property"),
    (broken("a bool where an integer is wanted"),
     "at $.summary.run: true is not of type 'integer'"),
    (broken("a report that is a list"), "at $: [{\"schema_version\": 1, "),
    ('{"schema_version": 1, "tool": "gradequiv",', "is not readable JSON"),
    ("\xff not text", "is not readable JSON"),
    ("[" * 100_000 + "]" * 100_000, "is not readable JSON"),
    ({"schema_version": 2}, "has schema_version=2; this gradequiv reads version 1"),
], ids=["case-field", "bool-int", "a-list", "syntax", "not-utf8", "too-deep", "version-2"])
def test_a_bad_report_json_is_exit_2_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: Any, says: str) -> None:
    path = write_report(tmp_path, content)
    if content == "\xff not text":
        path.write_bytes(b"\xff not text")
    for fmt in ("md", "html", "junit", "all"):
        assert main(["report", str(tmp_path), "--format", fmt]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("gradequiv: error: "), err
        assert says in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_valid_report_still_renders(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    write_report(tmp_path, valid_report())
    assert main(["report", str(tmp_path), "--format", "md"]) == 0
    assert (tmp_path / "report.md").read_text().startswith("## gradequiv: FAIL")


@pytest.mark.parametrize("schema, says", [
    ({"type": "string", "pattern": "^a"}, "'pattern' is not implemented"),
    ({"properties": {"a": {"items": {"minLength": 1}}}}, "#/properties/a/items: the keyword "
                                                         "'minLength'"),
    ({"$defs": {"x": {"anyOf": [{"type": "null"}]}}}, "'anyOf' is not implemented"),
    ({"oneOf": [{"type": "null"}, {"format": "date"}]}, "#/oneOf/1: the keyword 'format'"),
    ({"additionalProperties": {"exclusiveMinimum": 0}}, "'exclusiveMinimum'"),
    ({"$ref": "#/$defs/missing"}, "points at nothing"),
    ({"$ref": "other.json#/x"}, "only '#/...' pointers"),
    ({"properties": {"a": {"$id": "a.json"}}}, "'$id' below the root"),
    ({"type": "float"}, "names no JSON type"),
    ({"$schema": "http://json-schema.org/draft-07/schema#"}, "only https://json-schema.org"),
    ({"items": [{"type": "string"}]}, "a schema is an object or a boolean"),
])
def test_the_validator_refuses_a_schema_it_cannot_check(schema: dict[str, Any],
                                                         says: str) -> None:
    with pytest.raises(UnsupportedSchema) as caught:
        Validator(schema)
    assert says in str(caught.value)


def test_the_schema_ships_in_the_wheel() -> None:
    """setuptools' package-data puts report.schema.json in gradequiv.harness.reports."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package = "gradequiv.harness.reports"
    assert package in config["packages"]
    assert config["package-dir"]["gradequiv.harness"] == "harness"
    assert any(fnmatch.fnmatch("report.schema.json", pattern)
               for pattern in config["package-data"][package])
    assert (ROOT / "harness" / "reports" / "report.schema.json").is_file()

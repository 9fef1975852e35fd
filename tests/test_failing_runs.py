"""A failing run: each fault shrunk once, its cause said once, a small report, a short replay."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness import find_case
from gradequiv.harness.cli import main
from gradequiv.harness.reports.report import SHRINK_KEY
from gradequiv.harness.reports.terminal import summary_lines

NO_RNG = ["--impl", "torch", "--impl-kwarg", "preserve_rng_state=false"]


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The default check (profile ci, seed 0) of torch's checkpoint without RNG restore."""
    folder = tmp_path_factory.mktemp("failing")
    out = io.StringIO()  # capsys is per test; the run is shared by the module's tests
    with contextlib.redirect_stdout(out):
        code = main(["check", *NO_RNG, "--report-dir", str(folder), "--in-process"])
    report = json.loads((folder / "report.json").read_text())
    return {"code": code, "out": out.getvalue(), "report": report, "folder": folder}


@pytest.mark.slow
def test_a_failing_default_run_keeps_a_report_under_a_megabyte(
        failing_run: dict[str, Any]) -> None:
    assert failing_run["code"] == 1
    size = (failing_run["folder"] / "report.json").stat().st_size
    assert size < 1_000_000, f"report.json is {size} bytes"


@pytest.mark.slow
def test_cases_tried_while_shrinking_are_counted_not_kept(failing_run: dict[str, Any]) -> None:
    report = failing_run["report"]
    assert report["summary"]["shrink_attempts"] > 0
    assert all(SHRINK_KEY not in r for r in report["cases"])
    kept = {r["reproduce"] for r in report["cases"]}
    assert all(f["reproduce"] in kept for f in report["minimal_failures"])  # minimal ones stay
    assert len(kept) == len(report["cases"]) == report["summary"]["run"]


@pytest.mark.slow
def test_one_fault_is_shrunk_once_and_its_minimal_case_reused(
        failing_run: dict[str, Any]) -> None:
    failures = failing_run["report"]["minimal_failures"]
    reused = [f for f in failures if "found_by" in f]
    assert reused, "every failing property test searched on its own"
    for failure in reused:
        founder = next(f for f in failures if f["test"] == failure["found_by"])
        assert failure["reproduce"] == founder["reproduce"]


@pytest.mark.slow
def test_the_cause_is_said_first_and_each_minimal_failure_once(
        failing_run: dict[str, Any]) -> None:
    out, report = failing_run["out"], failing_run["report"]
    summary = out[out.index("= gradequiv ="):]
    assert summary.count("likely cause: the recompute does not restore the RNG state") == 1
    assert report["failure"]["diagnosis"]["cause"] == "rng-not-restored"
    drawn = {f["reproduce"] for f in report["minimal_failures"]
             if not f["test"].startswith("test_named_case")}
    assert summary.count("minimal failure ") - summary.count("as minimal failure") \
        == len(drawn)  # each distinct minimal case once, however many tests share it
    assert "FAILURES" not in out and "short test summary" not in out
    assert "/gradequiv-" not in summary  # no temporary folder of the suite


@pytest.mark.slow
def test_a_later_test_meeting_a_fault_already_shrunk_reports_it_unshrunk(
        failing_run: dict[str, Any]) -> None:
    """With only the RNG not restored, test_outputs finds outputs that differ (a later
    micro-batch's forward draws from the stream the re-run moved) on a case test_gradients'
    minimal failure does not cover; its cause is the same, so it is not shrunk again: one
    shrink in the run, and the search goes on for other faults."""
    from gradequiv.properties.runtime import SHRINK_TRIES

    report = failing_run["report"]
    outputs = next(f for f in report["minimal_failures"] if f["test"] == "test_outputs")
    assert outputs.get("same_cause_as") == "test_gradients"
    assert report["summary"]["shrink_attempts"] <= SHRINK_TRIES
    assert [f["cause"] for f in report["faults"]] == ["rng-not-restored"]
    assert "[not shrunk: same cause as minimal failure 1]" in failing_run["out"]


@pytest.mark.slow
def test_the_short_reproduce_line_replays_the_case_from_its_file(
        failing_run: dict[str, Any], tmp_path: Path) -> None:
    first = failing_run["report"]["minimal_failures"][0]
    args = shlex.split(first["reproduce_file"])
    assert len(first["reproduce_file"]) < 200 and args[-1].endswith("minimal-1.json")
    assert json.loads(Path(args[-1]).read_text()) == first["case"]
    assert main([*args[1:], "--report-dir", str(tmp_path / "again"), "--in-process"]) == 1
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    assert again["cases"][0]["case"] == first["case"]


def test_a_zero_shrink_budget_reports_the_failure_as_found(
        pytester: pytest.Pytester, tmp_path: Path, capsys: Any) -> None:
    result = pytester.runpytest(
        "--pyargs", "gradequiv.properties", "-p", "no:cacheprovider", "-k",
        "test_gradients and not named", "--gradequiv-impl=torch",
        "--gradequiv-impl-kwarg=preserve_rng_state=false", "--gradequiv-examples=3",
        "--gradequiv-seed=0", "--gradequiv-shrink-budget=0", f"--gradequiv-report-dir={tmp_path}")
    result.assert_outcomes(failed=1)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["shrink_attempts"] == 0
    assert main(["check", *NO_RNG, "--shrink-budget", "soon"]) == 2
    assert "--shrink-budget='soon' is not a number" in capsys.readouterr().err


def test_a_bigger_case_costs_more() -> None:
    small, large = find_case("1L-layer-dropout"), find_case("4Lx128x64-layer-dropout")
    assert 0 < small.cost() < large.cost()


def _failure(test: str, reproduce: str, cause: str, prop: str = "gradients") -> dict[str, Any]:
    return {"test": test, "reproduce": reproduce, "property": prop, "flaky": False,
            "description": f"case {reproduce}", "message": f"{prop} differ\nmore",
            "diagnosis": {"cause": cause, "sentence": f"because {cause}", "evidence": []}}


def test_the_summary_groups_tests_by_case_and_names_named_cases_in_a_line() -> None:
    lines = summary_lines([
        _failure("test_outputs", "A", "rng-not-restored", "outputs"),
        _failure("test_gradients", "A", "rng-not-restored"),
        _failure("test_buffers", "B", "buffers-updated-twice", "buffers"),
        _failure("test_named_case[one]", "C", "rng-not-restored"),
        _failure("test_named_case[two]", "D", "leak", "recompute"),
    ], {"test_inference": "RuntimeError: boom"})
    text = "\n".join(lines)
    assert text.count("minimal failure 1: case A") == 1 and "minimal failure 2: case B" in text
    assert "fails: outputs, gradients (test_outputs, test_gradients)" in text
    assert "one (gradients): same cause as minimal failure 1 (rng-not-restored)" in text
    assert "two (recompute): because leak" in text
    assert "test_inference: failed without a verdict: RuntimeError: boom" in text


def test_a_count_of_ulps_beyond_rounding_is_said_in_words() -> None:
    from gradequiv.harness.reports.findings import ulps

    assert ulps(3) == "3 ULPs"
    assert ulps(1_982_634_603) == "over 1024 ULPs: no rounding difference"


@pytest.mark.parametrize(("spec", "name"), [
    ("torch", "2L-layer-bf16-dropout"),
    ("gradequiv.harness.implementations.faults:no_rng_restore", "1L-layer-dropout"),
    ("gradequiv.harness.implementations.faults:gradient_skew", "1L-layer-dropout"),
    ("gradequiv.harness.implementations.faults:autocast_lost", "2L-layer-bf16-dropout"),
])
def test_a_shrink_try_leaves_out_the_floor_only_where_the_verdict_cannot_need_it(
        spec: str, name: str) -> None:
    from gradequiv.harness import resolve, verify

    impl, case = resolve(spec), find_case(name)
    whole, quick = verify(impl, case), verify(impl, case, floor_when_needed=True)
    # a whole verdict runs the floor only where it fails against a zero floor
    assert whole.floor_measured == (not whole.passed) and quick.passed == whole.passed
    def statuses(verdict: Any) -> list[tuple[str, bool | None, str]]:
        # the same lines but for what they say of the floor (measured, or why not)
        return [(p.name, p.passed, re.sub(r" \(noise floor [^)]*\)", "", p.first_failure))
                for p in verdict.properties]

    assert statuses(quick) == statuses(whole)
    if whole.passed or spec.endswith("no_rng_restore"):  # bitwise equal, or far past a cap
        assert not quick.floor_measured and "floor" not in quick.seconds


def test_the_floor_matters_only_between_a_reordered_sum_and_the_dtype_s_cap() -> None:
    from gradequiv.harness.engine.compare import Tolerance
    from gradequiv.harness.engine.verify import PropertyResult, TensorCheck, _floor_matters

    def checked(passed: bool, rel: float, bound: float) -> list[PropertyResult]:
        check = TensorCheck("gradients", "grad of w", passed, rel, bound, 0.0, rel, 1.0, 1, 1)
        return [PropertyResult("gradients", passed, checks=[check])]

    bf16 = Tolerance("bf16-autocast")
    assert _floor_matters(checked(False, 1e-4, 9.5e-7), bf16)  # a floor may forgive it
    assert not _floor_matters(checked(False, 0.5, 9.5e-7), bf16)  # past the cap: no floor will
    assert not _floor_matters(checked(True, 0.0, 9.5e-7), bf16)
    assert not _floor_matters(checked(False, 1.0, 0.0), bf16)  # an integer tensor
    assert not _floor_matters(checked(False, 1e-4, 1e-5), Tolerance("fp32", rtol=1e-5))


def test_every_distinct_fault_is_in_the_headline_of_the_terminal_and_report_md() -> None:
    """Two faults, each in cases of its own (a drawn minimal failure, a named case) and a
    third said as a further fault of one case: all three, in that order, each with where it
    was seen and its command; a cause seen again is not listed twice."""
    from gradequiv.harness.reports.diagnosis import distinct_faults
    from gradequiv.harness.reports.markdown import _diagnosis
    from gradequiv.harness.reports.terminal import headline_lines

    failures = [_failure("test_outputs", "A", "rng-not-restored", "outputs"),
                _failure("test_named_case[one]", "C", "rng-not-restored"),
                _failure("test_named_case[two]", "D", "autocast-lost")]
    failures[2]["diagnosis"]["faults"] = [
        {"cause": "autocast-lost", "sentence": "because autocast-lost"},
        {"cause": "leak", "sentence": "because leak"}]
    faults = distinct_faults(failures)
    assert [(f["cause"], f["found_in"]) for f in faults] == [
        ("rng-not-restored", "minimal failure 1"), ("autocast-lost", "named case two"),
        ("leak", "named case two")]
    lines = headline_lines(failures)
    assert lines[0] == "likely causes (3 distinct faults):"
    assert lines[1:3] == ["  1. because rng-not-restored",
                          "     seen in minimal failure 1: case A; reproduce: A"]
    assert headline_lines(failures[:2]) == ["likely cause: because rng-not-restored"]
    markdown = _diagnosis({"failure": failures[0], "faults": faults})
    assert markdown[0] == "### 3 distinct faults"
    assert markdown[2] == ("1. **because rng-not-restored** (seen in minimal failure 1: case A): "
                           "`A`")


def test_faults_a_declaration_settles_come_last_and_more_cases_come_first() -> None:
    """Most important first: a fault the user's training meets (more failing cases first)
    before one a declaration settles (torch.autograd.grad written into .grad), however
    early that one was found."""
    from gradequiv.harness.reports.diagnosis import distinct_faults

    failures = [_failure("test_gradients", "A", "grad-touched"),
                _failure("test_outputs", "B", "input-captured"),
                _failure("test_named_case[one]", "C", "rng-not-restored"),
                _failure("test_named_case[two]", "D", "rng-not-restored"),
                _failure("test_named_case[three]", "E", "grad-touched")]
    assert [f["cause"] for f in distinct_faults(failures)] == [
        "rng-not-restored", "input-captured", "grad-touched"]
    assert [f["found_in"] for f in distinct_faults(failures)] == [
        "named case one", "minimal failure 2", "minimal failure 1"]


def test_two_different_exceptions_are_two_faults_and_one_exception_is_one() -> None:
    """"raised" is no fault of its own: the exception is. The same exception on cases of
    other shapes (numbers in its message) stays one fault."""
    from gradequiv.harness.reports.diagnosis import distinct_faults

    def raised(test: str, reproduce: str, line: str) -> dict[str, Any]:
        failure = _failure(test, reproduce, "raised")
        failure["diagnosis"]["sentence"] = (f"the implementation raised during step 1 "
                                            f"backward: {line}")
        return failure

    failures = [raised("test_gradients", "A", "RuntimeError: shape [2, 4] is invalid"),
                raised("test_named_case[one]", "B", "RuntimeError: shape [8, 16] is invalid"),
                raised("test_named_case[two]", "C", "KeyError: 'rng'")]
    assert [f["reproduce"] for f in distinct_faults(failures)] == ["A", "C"]


@pytest.mark.slow
def test_shrink_tries_skip_the_memory_watch_and_the_minimal_case_is_kept_whole(
        failing_run: dict[str, Any]) -> None:
    """Cases tried while shrinking a property other than recompute watch no memory (and run
    one step where the property reads no later one); the minimal case, replayed whole, is
    the record the report keeps."""
    report = failing_run["report"]
    assert report["summary"]["shrink_attempts"] > 0
    checked = 0
    for failure in report["minimal_failures"]:
        record = next(r for r in report["cases"] if r["reproduce"] == failure["reproduce"])
        if record["error"]:  # the implementation raised (torch refuses a re-run whose
            continue         # experts took other tokens: other shapes): nothing to check
        said = " ".join(p["summary"] for p in record["properties"])
        assert "not checked: " not in said, failure["reproduce"]
        checked += 1
    assert checked


def test_a_probe_verdict_is_never_handed_to_a_test_that_needs_more() -> None:
    from gradequiv.harness import resolve
    from gradequiv.properties.runtime import VerdictCache

    cache, impl, case = VerdictCache(), resolve("torch"), find_case("1L-layer-dropout")
    probe, fresh = cache.verify(impl, case, "cpu", probe="outputs")
    assert fresh and not probe.memory_watched and probe.first_step_only
    assert cache.verify(impl, case, "cpu", probe="gradients") == (probe, False)  # step 1 too
    every, fresh = cache.verify(impl, case, "cpu", probe="rng")  # reads the later steps
    assert fresh and not every.first_step_only and not every.memory_watched
    whole, fresh = cache.verify(impl, case, "cpu")
    assert fresh and whole.memory_watched and not whole.first_step_only
    assert cache.verify(impl, case, "cpu", probe="outputs") == (whole, False)  # serves all
    assert cache.verify(impl, case, "cpu", probe="recompute") == (whole, False)


@pytest.mark.parametrize("name", ["2L-layer-bf16-dropout", "1L-layer-dropout"])
def test_a_verdict_passing_against_a_zero_floor_is_the_one_a_measured_floor_gives(
        name: str) -> None:
    """The floor only raises bounds: where every property holds against a floor of zero,
    the floor path is left out, and running it changes no property's status."""
    import torch

    from gradequiv.harness import resolve, verify
    from gradequiv.harness.engine.compare import Tolerance
    from gradequiv.harness.engine.runner import run_path
    from gradequiv.harness.engine.verify import _check_all

    impl, case = resolve("torch"), find_case(name)
    verdict = verify(impl, case)
    assert verdict.passed and not verdict.floor_measured and "floor" not in verdict.seconds
    cpu = torch.device("cpu")
    full = run_path(case, None, device=cpu, count_memory=True)
    recompute = run_path(case, impl, device=cpu, count_memory=True, start_from=full)
    floor = run_path(case, None, device=cpu, start_from=full)
    measured = _check_all(case, full, floor, recompute, Tolerance(regime=case.dtype))
    assert [(p.name, p.passed) for p in measured] == \
        [(p.name, p.passed) for p in verdict.properties]


def test_a_failing_verdict_measures_the_floor_for_its_figures() -> None:
    from gradequiv.harness import resolve, verify

    verdict = verify(resolve("gradequiv.harness.implementations.faults:no_rng_restore"),
                     find_case("1L-layer-dropout"))
    assert not verdict.passed and verdict.floor_measured and "floor" in verdict.seconds


@pytest.mark.slow
def test_a_floor_that_cannot_change_a_verdict_is_not_measured_and_says_so(
        failing_run: dict[str, Any]) -> None:
    """A case failing past its dtype's cap fails at any noise floor: its floor path does not
    run, and its line says so instead of reporting a floor of 0 nobody measured; the drawn
    minimal failures, replayed, measure theirs."""
    report = failing_run["report"]
    unmeasured = [r for r in report["cases"] if r["verdict"] == "fail"
                  and not r.get("floor_measured", True)]
    assert unmeasured  # named cases of the RNG fault: errors of 0.1 and more
    for record in unmeasured:
        assert "noise floor not measured" in record["first_failure"]
        checks = [c for p in record["properties"] for c in p["checks"]]
        assert checks and all(c["floor_measured"] is False for c in checks)
    drawn = [f for f in report["minimal_failures"] if not f["test"].startswith("test_named")]
    assert drawn
    measured = 0
    for failure in drawn:
        record = next(r for r in report["cases"] if r["case"] == failure["case"])
        if record["error"]:  # raised in backward (a mixture of experts routed otherwise)
            continue
        assert record.get("floor_measured", True), failure["description"]
        assert "(noise floor 0)" in record["first_failure"]
        measured += 1
    assert measured


@pytest.mark.slow
def test_a_leaking_run_searches_op_by_op_only_its_drawn_minimal_failure(
        tmp_path: Path) -> None:
    """A leak shows in bytes alone: the drawn minimal failure is searched op by op (and
    says every recomputed op matched), while the named cases failing the same way are not
    (each search and its pattern experiments cost seconds on the large ones), and each
    still names the minimal failure's cause."""
    from gradequiv.properties.assertions import MEMORY_ONLY

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["check", "--impl",
                     "gradequiv.harness.implementations.faults:saved_inputs_kept",
                     "--report-dir", str(tmp_path), "--in-process"])
    assert code == 1
    failures = json.loads((tmp_path / "report.json").read_text())["minimal_failures"]
    named = [f for f in failures if f["test"].startswith("test_named_case")]
    drawn = [f for f in failures if not f["test"].startswith("test_named_case")]
    assert named and drawn
    assert all(f["localisation"] == MEMORY_ONLY for f in named)
    assert all(f["localisation"].startswith("no diverging op found") for f in drawn)
    assert {f["diagnosis"]["cause"] for f in failures} == {"leak"}
    assert "same cause as minimal failure 1 (leak)" in out.getvalue()

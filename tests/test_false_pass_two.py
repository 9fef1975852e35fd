"""Never a false pass, round two: nothing verified is no pass, a run can always be
stopped, and every mistake lands on whoever made it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness.cli import main

TESTS = Path(__file__).resolve().parent
ONE = ["--case", "1L-layer-dropout"]


def _report(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "report.json").read_text()))


@pytest.fixture(scope="module")
def failing_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real failing run's folder: torch's checkpoint without RNG restore, one case."""
    folder = tmp_path_factory.mktemp("failing")
    assert main(["check", "--impl", "torch", "--impl-kwarg", "preserve_rng_state=false",
                 *ONE, "--no-shrink", "--in-process", "--report-dir", str(folder)]) == 1
    return folder


def test_report_refuses_a_verdict_edited_to_pass(
        failing_report: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = _report(failing_report)
    report["verdict"] = "pass"
    (tmp_path / "report.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert main(["report", str(tmp_path), "--format", "md", "--fail-on-verdict"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert "verdict='pass' but cases[0].verdict='fail'" in err[0]
    assert not (tmp_path / "report.md").exists()


def test_report_refuses_a_pass_with_a_failure_left_in(
        failing_report: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every case edited to pass too: the failure and the test outcomes still say fail."""
    report = _report(failing_report)
    report["verdict"] = "pass"
    for case in report["cases"]:
        case["verdict"] = "pass"
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert main(["report", str(tmp_path), "--format", "md", "--fail-on-verdict"]) == 2
    assert "verdict='pass' but minimal_failures holds" in capsys.readouterr().err


HUGE_CASE = json.dumps({
    "batch": {"batch_size": 2, "padding": True, "seq_len": 8}, "dtype": "fp32",
    "grad_mode": "backward", "granularity": "layer", "model_kind": "transformer",
    "model": {"n_embd": 1_000_000, "n_head": 2, "n_layer": 1, "vocab_size": 100_000},
    "seed": 1, "steps": 2})


@pytest.mark.parametrize(("args", "said"), [
    (["--model", "user_models:residual_stack", *ONE],
     "--case='1L-layer-dropout' is a case of the transformer model, so "
     "--model='user_models:residual_stack' would not be checked"),
    (["--adapter", "toggle", *ONE],
     "--adapter='toggle': built-in --impl='torch' is called through the 'function' adapter "
     "only"),
    (["--adapter", "wrapper", *ONE], "--adapter='wrapper': built-in --impl='torch'"),
    (["--case-timeout", "5", *ONE], "--case-timeout=5 needs the supervised child that "
                                    "--in-process turns off"),
    (["--case", HUGE_CASE], "its model would hold about 1.21e+13 parameters (n_layer=1, "
                            "n_embd=1000000"),
], ids=["model-with-named-case", "builtin-toggle", "builtin-wrapper", "in-process-timeout",
        "case-too-large"])
def test_options_that_cannot_go_together_are_exit_2_in_one_line(
        args: list[str], said: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["check", "--impl", "torch", *args, "--in-process"]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [err.strip()] and said in err, err
    assert "internal error" not in err and "verdict" not in out


@pytest.mark.parametrize(("factory", "said"), [
    ("nan_loss", "--model='hostile_models:nan_loss': its loss is nan on full storage, "
                 "without recompute: nothing could be compared"),
    ("float_loss", "--model='hostile_models:float_loss': its loss_fn returned float "),
    ("loss_wants_a_dict", "--model='hostile_models:loss_wants_a_dict': its loss_fn raised "
                          "on the model's outputs (a float32 tensor of shape [4, 3])"),
])
def test_a_factory_s_mistake_is_exit_2_naming_the_factory(
        factory: str, said: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    code = main(["check", "--impl", "torch", "--model", f"hostile_models:{factory}",
                 "--examples", "1", "--in-process"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    errors = [line for line in err.splitlines() if line.startswith("gradequiv:")]
    assert len(errors) == 1 and said in errors[0], err
    assert "reproduce_failure" not in out + err and "verdict: pass" not in out


def test_nan_on_both_sides_is_unverified_not_equal() -> None:
    import torch

    from gradequiv.harness.engine.compare import Tolerance, measure_pairs

    nan = torch.full((4,), float("nan"))
    one_nan = torch.tensor([1.0, float("nan"), 3.0, 4.0])
    everywhere, among_finite = measure_pairs([(nan, nan.clone()), (one_nan, one_nan.clone())])
    assert everywhere.mismatched == 4 and not Tolerance().passes(everywhere, 1.0)
    assert among_finite.mismatched == 0 and Tolerance().passes(among_finite, 0.0)


def test_a_full_storage_loss_of_nan_verifies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the factory check (the pytest route has none): the case is not verified, and
    says whose fault it is, with the tensor."""
    from gradequiv.harness import verify
    from gradequiv.harness.engine.case import Case
    from gradequiv.models import ExternalConfig

    monkeypatch.syspath_prepend(str(TESTS))
    case = Case(model=ExternalConfig("hostile_models:nan_loss"), dtype="fp32")
    with pytest.raises(RuntimeError, match="verifies nothing: its loss is nan; this is a "
                                           "fault of the model, not of the implementation"):
        verify("torch", case)


def test_a_suite_that_verifies_nothing_fails_without_hypothesis_s_advice(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    from gradequiv.harness.commands.check import run_suite
    from gradequiv.harness.implementations.resolve import resolve
    from gradequiv.harness.options import SuiteRun, check_options

    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    options = check_options(impl="torch", model="hostile_models:nan_loss", examples=1,
                            profile="ci")
    code = run_suite(SuiteRun(options, resolve("torch")), ["-q", "--tb=no", "-rN"])
    out, err = capfd.readouterr()
    assert code == 1, out + err
    assert "reproduce_failure" not in out and "You can reproduce" not in out, out
    assert "failed without a verdict: gradequiv.harness.engine.verify.FullStorageError: the " \
        "full-storage path of case" in out
    assert "verifies nothing: its loss is nan" in out and "verdict: FAIL" in out


@pytest.mark.parametrize(("spec", "adapter", "said"), [
    ("wrong_impls:returns_none", None,
     "WrongReturn: the implementation returned NoneType None where the segment returns "
     "tensors"),
    ("wrong_impls:returns_flattened", None,
     "WrongReturn: the implementation returned float32[16, 16] for blocks.0 where the "
     "segment returns float32[2, 8, 16] (full storage's same call)"),
    ("wrong_impls:returns_float64", None,
     "WrongReturn: the implementation returned float64[2, 8, 16] for blocks.0 where the "
     "segment returns float32[2, 8, 16]"),
    ("wrong_impls:wrapper_returns_a_str", "wrapper",
     "WrongReturn: the implementation (--adapter wrapper) returned str 'checkpointed' for "
     "blocks.0, not a module"),
])
def test_a_wrong_return_is_named_by_what_it_returned(
        spec: str, adapter: str | None, said: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradequiv.harness import verify
    from gradequiv.harness.engine.spread import find_case
    from gradequiv.harness.errors import exception_line
    from gradequiv.harness.implementations.resolve import resolve

    monkeypatch.syspath_prepend(str(TESTS))
    verdict = verify(resolve(spec, adapter=adapter), find_case("1L-layer-dropout"))
    assert not verdict.passed and verdict.error is not None
    assert said in exception_line(verdict.error), verdict.error

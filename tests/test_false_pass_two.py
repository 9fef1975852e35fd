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

"""A run owns its report folder, and the CI gate passes only a whole report of its own run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness.cli import main

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
GRADEQUIV = Path(sys.executable).with_name("gradequiv")
ONE = ["--case", "1L-layer-dropout"]


def _stale_pass(folder: Path) -> None:
    """What an earlier, passing run of another implementation left in the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    report = {"schema_version": 1, "tool": "gradequiv", "command": "check", "verdict": "pass",
              "complete": True, "run": {"id": "an-earlier-run", "started": "2026-01-01",
                                        "command": "gradequiv check", "pid": 1},
              "implementation": {"spec": "torch", "adapter": "function", "kwargs": {}},
              "conditions": {}, "summary": {"run": 1, "passed": 1, "failed": 0}, "cases": [],
              "failure": None}
    (folder / "report.json").write_text(json.dumps(report))
    (folder / "report.md").write_text("gradequiv: PASS\n")
    (folder / ".report.json.abc123").write_text("half a file")


def _gate(folder: Path, impl: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GRADEQUIV=str(GRADEQUIV), PYTHONPATH=str(TESTS))
    return subprocess.run(["bash", str(ROOT / "ci" / "gate.sh"), "--impl", impl,
                           "--report-dir", str(folder), "--", *extra],
                          capture_output=True, text=True, env=env, cwd=TESTS, timeout=600,
                          check=False)


@pytest.mark.slow
def test_a_run_clears_what_an_earlier_run_left_and_says_who_wrote_the_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _stale_pass(tmp_path)
    monkeypatch.setenv("GRADEQUIV_RUN_ID", "this-run")
    assert main(["check", "--impl", "wrong_impls:skewed_gradients", *ONE,
                 "--report-dir", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["run"]["id"] == "this-run" and report["run"]["pid"] == os.getpid()
    assert report["verdict"] == "fail"
    # the stale view went with its report; check writes this run's beside report.json
    assert (tmp_path / "report.md").read_text() != "gradequiv: PASS\n"
    assert not list(tmp_path.glob(".report.json.*"))


def test_a_report_dir_that_is_a_file_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "taken"
    blocker.write_text("")
    assert main(["check", "--impl", "torch", *ONE, "--report-dir", str(blocker)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradequiv: error: --report-dir=") and "cannot be written" in err


@pytest.mark.slow
def test_an_implementation_that_ends_the_process_with_0_fails_the_gate(tmp_path: Path) -> None:
    _stale_pass(tmp_path)
    done = _gate(tmp_path, "wrong_impls:exits_quietly", *ONE)
    assert done.returncode == 1, done.stderr
    assert "the implementation ended the process during" in done.stderr
    # the run's own report, written from its first moment, says so: never the stale pass
    report: dict[str, Any] = json.loads((tmp_path / "report.json").read_text())
    assert report["complete"] is False and report["verdict"] == "fail"
    assert report["run"]["id"].startswith("gate-")
    assert (tmp_path / "report.md").read_text() != "gradequiv: PASS\n"


def test_the_gate_never_renders_a_report_of_another_run(tmp_path: Path) -> None:
    """A usage error ends the run before it claims the folder: the stale report stays, and
    the gate neither renders it nor passes."""
    _stale_pass(tmp_path)
    done = _gate(tmp_path, "torch", "--examples", "0")
    assert done.returncode == 2
    assert "not by run 'gate-" in done.stderr
    assert (tmp_path / "report.md").read_text() == "gradequiv: PASS\n"  # not rendered anew
    assert not (tmp_path / "report.html").exists()


def test_the_gate_passes_its_own_whole_report(tmp_path: Path) -> None:
    _stale_pass(tmp_path)
    done = _gate(tmp_path, "torch", *ONE)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads((tmp_path / "report.json").read_text())
    assert report["run"]["id"].startswith("gate-") and report["complete"]
    assert (tmp_path / "report.html").exists()


@pytest.mark.slow
def test_an_interrupt_keeps_every_case_that_finished(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Cases are written as they finish, not when their property test ends."""
    assert main(["check", "--impl", "wrong_impls:interrupts_later", "--examples", "20",
                 "--report-dir", str(tmp_path)]) == 130
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["complete"] is False and report["verdict"] == "fail"
    assert len(report["cases"]) >= 2
    assert report["tests"] == {} or "test_outputs" not in report["tests"]

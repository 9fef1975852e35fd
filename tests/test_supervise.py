"""``gradequiv check`` supervises the process that runs the implementation.

Whatever the implementation does to that process (exits, is killed, hangs,
calls ``sys.exit``, leaves a thread running), the run never ends as a pass,
says which case it was in, and keeps every case that finished.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness.cli import main

TESTS = Path(__file__).resolve().parent
GRADEQUIV = Path(sys.executable).with_name("gradequiv")
ONE = ["--case", "1L-layer-dropout"]
#: enough examples that the implementations below get their 40th call mid-run
MANY = ["--examples", "6"]


def _report(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "report.json").read_text()))


def _check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The console script, as a user runs it, from the tests' folder."""
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    return subprocess.run([str(GRADEQUIV), "check", *args], capture_output=True, text=True,
                          env=env, cwd=TESTS, timeout=timeout, check=False)


def _ended_report(folder: Path) -> dict[str, Any]:
    report = _report(folder)
    assert report["complete"] is False and report["verdict"] == "fail"
    assert report["failure"]["property"] == "process"
    assert report["summary"]["run"] == len(report["cases"]) >= 1
    return report


def test_an_exit_mid_run_fails_and_keeps_every_finished_case(tmp_path: Path) -> None:
    done = _check("--impl", "wrong_impls:exits_later", *MANY, "--report-dir", str(tmp_path))
    assert done.returncode == 1, done.stderr
    assert "the implementation ended the process during" in done.stderr
    assert "exit status 0" in done.stderr
    report = _ended_report(tmp_path)
    failure = report["failure"]
    assert failure["message"].startswith("the implementation ended the process during ")
    assert failure["case"] in failure["message"] and failure["minimal_case"] is not None
    assert failure["reproduce"].startswith("gradequiv check --impl wrong_impls:exits_later")
    # every case the child finished is kept, not only those its last report write held
    kept = int(done.stderr.split("gradequiv: ")[-1].split(" case(s) finished")[0])
    assert kept == len(report["cases"])


def test_an_exit_at_the_first_call_fails_without_a_report(tmp_path: Path) -> None:
    done = _check("--impl", "wrong_impls:exits_quietly", *ONE, "--report-dir", str(tmp_path))
    assert done.returncode == 1, done.stderr
    assert "the implementation ended the process during 1L x 16w" in done.stderr
    assert not (tmp_path / "report.json").exists()  # the gate reads that as no pass


def test_a_kill_mid_run_names_the_signal(tmp_path: Path) -> None:
    done = _check("--impl", "wrong_impls:killed_later", *MANY, "--report-dir", str(tmp_path))
    assert done.returncode == 1, done.stderr
    assert "killed by SIGKILL" in done.stderr
    _ended_report(tmp_path)


def test_a_hang_is_stopped_after_the_case_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    done = _check("--impl", "wrong_impls:hangs_later", *MANY, "--case-timeout", "3",
                  "--report-dir", str(tmp_path), timeout=300)
    assert done.returncode == 1, done.stderr
    assert "the implementation hung during" in done.stderr and "(--case-timeout)" in done.stderr
    assert time.monotonic() - started < 120
    _ended_report(tmp_path)


def test_sys_exit_in_the_implementation_is_its_failure(tmp_path: Path) -> None:
    done = _check("--impl", "wrong_impls:calls_sys_exit", *ONE, "--no-shrink",
                  "--report-dir", str(tmp_path))
    assert done.returncode == 1, done.stderr
    report = _report(tmp_path)
    assert report["complete"] is True and report["verdict"] == "fail"
    assert "the implementation called sys.exit(3)" in report["cases"][0]["error"]


def test_a_thread_left_running_is_reported_not_waited_for(tmp_path: Path) -> None:
    done = _check("--impl", "wrong_impls:leaves_a_thread", *ONE, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "left 1 thread(s) running (forgotten-prefetcher)" in done.stderr


def test_sigterm_reaches_the_child_which_keeps_its_finished_cases(tmp_path: Path) -> None:
    marker = tmp_path / "slow-now"
    env = dict(os.environ, PYTHONPATH=str(TESTS), GRADEQUIV_TEST_SLEEP_AFTER=str(marker))
    folder = tmp_path / "report"
    with subprocess.Popen([str(GRADEQUIV), "check", "--impl", "wrong_impls:sleepy",
                           "--examples", "20", "--report-dir", str(folder)],
                          cwd=TESTS, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as run:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (folder / "report.json").exists():
            time.sleep(0.2)
        marker.touch()
        time.sleep(2)
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    report = _report(folder)
    assert report["complete"] is False and report["verdict"] == "fail"
    assert report["cases"]


def test_a_usage_error_found_in_the_child_is_exit_2_in_one_line(tmp_path: Path) -> None:
    done = _check("--impl", "torch", "--case", '{"dtype": "fp16"}', timeout=300)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("gradequiv: error")]
    assert len(errors) == 1 and "Traceback" not in done.stderr


def test_in_process_runs_in_this_process(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--impl", "torch", *ONE, "--in-process",
                 "--report-dir", str(tmp_path)]) == 0
    assert "verdict: pass" in capsys.readouterr().out  # printed here, not by a child
    assert _report(tmp_path)["run"]["pid"] == os.getpid()


def test_a_second_run_into_a_busy_folder_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "slow-now"
    marker.touch()
    env = dict(os.environ, PYTHONPATH=str(TESTS), GRADEQUIV_TEST_SLEEP_AFTER=str(marker))
    folder = tmp_path / "report"
    with subprocess.Popen([str(GRADEQUIV), "check", "--impl", "wrong_impls:sleepy",
                           "--examples", "20", "--report-dir", str(folder)],
                          cwd=TESTS, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL) as first:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (folder / ".gradequiv.lock").exists():
            time.sleep(0.1)
        second = _check("--impl", "torch", *ONE, "--report-dir", str(folder))
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    assert second.returncode == 2, second.stderr
    assert "is in use by run" in second.stderr and f"pid {first.pid}" in second.stderr

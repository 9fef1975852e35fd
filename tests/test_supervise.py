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
#: enough examples that the implementations below get their 20th call mid-run
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


@pytest.mark.slow
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
    assert "**Incomplete**" in (tmp_path / "report.md").read_text()  # rendered again


def test_an_exit_at_the_first_call_leaves_a_report_with_no_case(tmp_path: Path) -> None:
    """report.json is written from the first moment: an end before any case finished
    still leaves one, incomplete, failing, with the line that ended the run."""
    done = _check("--impl", "wrong_impls:exits_quietly", *ONE, "--report-dir", str(tmp_path))
    assert done.returncode == 1, done.stderr
    assert "the implementation ended the process during 1L x 16w" in done.stderr
    report = _report(tmp_path)
    assert report["complete"] is False and report["verdict"] == "fail"
    assert report["cases"] == [] and report["summary"]["run"] == 0
    assert report["failure"]["property"] == "process"
    assert report["failure"]["message"].startswith(
        "the implementation ended the process during 1L x 16w")
    assert main(["report", str(tmp_path), "--format", "md", "--fail-on-verdict"]) == 1


@pytest.mark.slow
def test_a_hang_in_the_first_case_leaves_a_report_with_the_line(tmp_path: Path) -> None:
    done = _check("--impl", "wrong_impls:hangs", *ONE, "--case-timeout", "3",
                  "--report-dir", str(tmp_path), timeout=300)
    assert done.returncode == 1, done.stderr
    report = _report(tmp_path)
    assert report["complete"] is False and report["verdict"] == "fail" and not report["cases"]
    assert report["failure"]["message"].startswith("the implementation hung during 1L x 16w")
    assert "(--case-timeout)" in report["failure"]["message"]


def test_a_run_killed_before_its_child_started_has_a_report_already(tmp_path: Path) -> None:
    """The supervisor writes report.json before the child exists: a SIGKILL to the whole
    run at any moment leaves a valid report that is no pass."""
    from gradequiv.harness.options import check_options
    from gradequiv.harness.reports.bundle import load_bundle
    from gradequiv.harness.reports.report import starting_report

    options = check_options(impl="torch", report_dir=tmp_path, profile="ci")
    report = starting_report(options, {"id": "x", "started": "now", "command": "gradequiv",
                                       "pid": 1})
    (tmp_path / "report.json").write_text(json.dumps(report))
    bundle = load_bundle(tmp_path)  # valid against the schema, its verdict consistent
    assert bundle.verdict == "fail" and bundle.report is not None
    assert bundle.report["complete"] is False


@pytest.mark.slow
def test_a_kill_mid_run_names_the_signal(tmp_path: Path) -> None:
    done = _check("--impl", "wrong_impls:killed_later", *MANY, "--report-dir", str(tmp_path))
    assert done.returncode == 1, done.stderr
    assert "killed by SIGKILL" in done.stderr
    _ended_report(tmp_path)


@pytest.mark.slow
def test_a_hang_is_stopped_after_the_case_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    done = _check("--impl", "wrong_impls:hangs_later", *MANY, "--case-timeout", "3",
                  "--report-dir", str(tmp_path), timeout=300)
    assert done.returncode == 1, done.stderr
    assert "the implementation hung during" in done.stderr and "(--case-timeout)" in done.stderr
    assert time.monotonic() - started < 120
    _ended_report(tmp_path)


@pytest.mark.slow
def test_a_hang_is_one_line_not_an_interruption(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """Nobody interrupted: one line says which case hung, not pytest's KeyboardInterrupt
    and "interrupted" (a child stopped with SIGTERM had time to print both)."""
    from gradequiv.harness.commands import supervise

    monkeypatch.setattr(supervise, "STOP_GRACE_S", 60.0)  # time enough to print anything
    monkeypatch.chdir(TESTS)
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    code = main(["check", "--impl", "wrong_impls:hangs_later", *MANY, "--case-timeout", "3"])
    out, err = capfd.readouterr()
    assert code == 1, err
    said = out + err
    assert "KeyboardInterrupt" not in said and "interrupted" not in said, said
    hung = [line for line in said.splitlines() if "hung" in line]
    assert len(hung) == 1 and hung[0].startswith("gradequiv: FAIL: the implementation hung "
                                                 "during "), hung


@pytest.mark.slow
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
    assert ("the implementation left 1 thread(s) running: forgotten-prefetcher (started at "
            "wrong_impls:") in done.stderr
    assert "still shutting down" not in done.stderr  # it exited without waiting for it


def test_a_thread_torch_started_is_never_blamed_on_the_implementation() -> None:
    """torch's own non-daemon thread (its prefetch pool) outlives the run: the process exits
    without waiting for it, and says nothing of it."""
    done = _check("--impl", "wrong_impls:uses_a_torch_thread", *ONE, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "thread" not in done.stderr, done.stderr


def test_a_slow_exit_after_the_verdict_is_no_fault_of_the_implementation(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What kept "the implementation left a thread running" coming at the end of long runs
    of --impl torch: no thread at all, but the process's teardown (its final garbage
    collection, on a loaded machine) outlasting the wait. The verdict stands; nobody is
    blamed."""
    from gradequiv.harness.commands import supervise

    monkeypatch.setattr(supervise, "EXIT_GRACE_S", 1.0)
    monkeypatch.chdir(TESTS)
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    assert main(["check", "--impl", "wrong_impls:slow_to_exit", *ONE]) == 0
    err = capsys.readouterr().err
    assert "the implementation" not in err, err
    assert "still shutting down 1 s after its verdict and was stopped; the verdict stands" in err


def test_a_process_left_running_is_named_and_stopped() -> None:
    done = _check("--impl", "wrong_impls:leaves_a_process", *ONE, timeout=300)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stderr.splitlines() if "process(es)" in line)
    assert line.startswith("gradequiv: warning: the implementation left 1 process(es) "
                           "running: pid "), done.stderr
    assert "-c import time; time.sleep(120)); stopped with SIGTERM" in line
    pid = int(line.split("pid ")[1].split(" ")[0])
    deadline = time.monotonic() + 30
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(pid)


def _running(pid: int) -> bool:
    """Whether process ``pid`` is alive (a zombie, stopped and waiting to be reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_a_spec_the_resolver_refuses_is_exit_2_in_one_line() -> None:
    """Two colons: pkgutil's "invalid format" was a traceback from the child and exit 1,
    "the implementation ended the process during start-up"."""
    done = _check("--impl", "os:path:join", *ONE, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "gradequiv: error: --impl='os:path:join' has 2 colons; a 'module:attr' reference has "
        "one, between the module's dotted path and the attribute: did you mean "
        "'os.path:join'?"]


def test_a_fault_of_the_harness_in_the_child_is_said_as_its_own(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A crash of the harness's own start-up in the child is never the implementation's
    failure: the child says so and tells the supervisor its code."""
    from gradequiv.harness import cli
    from gradequiv.harness.commands import supervise

    read, write = os.pipe()
    monkeypatch.setenv(supervise.CHANNEL_FD, str(write))

    def broken(argv: list[str], channel: Any) -> int:
        raise RuntimeError("the harness broke")

    monkeypatch.setattr(cli, "_run", broken)
    assert main(["check", "--impl", "torch", "--in-process"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "gradequiv: internal error: RuntimeError: the harness broke; this is a fault of "
        "gradequiv, not of the implementation: please report it with the traceback above")
    with os.fdopen(read) as pipe:
        assert json.loads(pipe.read()) == {"event": "end", "code": 1}


@pytest.mark.slow
def test_sigterm_reaches_the_child_which_keeps_its_finished_cases(tmp_path: Path) -> None:
    marker = tmp_path / "slow-now"
    env = dict(os.environ, PYTHONPATH=str(TESTS), GRADEQUIV_TEST_SLEEP_AFTER=str(marker))
    folder = tmp_path / "report"
    with subprocess.Popen([str(GRADEQUIV), "check", "--impl", "wrong_impls:sleepy",
                           "--examples", "20", "--report-dir", str(folder)],
                          cwd=TESTS, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as run:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not _has_cases(folder):  # written from the start
            time.sleep(0.2)
        marker.touch()
        time.sleep(2)
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    report = _report(folder)
    assert report["complete"] is False and report["verdict"] == "fail"
    assert report["cases"]


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_stop_ends_a_child_that_ignores_signals(tmp_path: Path, how: signal.Signals) -> None:
    """An implementation that ignores SIGINT and SIGTERM and works on: the run still stops
    (its child killed after the grace), exit 130, the report incomplete, never a pass."""
    marker = tmp_path / "ignoring-now"
    env = dict(os.environ, PYTHONPATH=str(TESTS), GRADEQUIV_TEST_MARKER=str(marker))
    folder = tmp_path / "report"
    with subprocess.Popen([str(GRADEQUIV), "check", "--impl", "wrong_impls:ignores_stop_signals",
                           *ONE, "--report-dir", str(folder)],
                          cwd=TESTS, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as run:
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not marker.exists():
                assert run.poll() is None
                time.sleep(0.1)
            run.send_signal(how)
            _, err = run.communicate(timeout=120)  # the implementation sleeps 600 s
        finally:
            run.kill()
    assert run.returncode == 130, err
    assert f"gradequiv: interrupted: the run was interrupted ({how.name}) during 1L x 16w" in err
    assert "did not stop within 5 s of the signal and was killed" in err
    report = _report(folder)
    assert report["complete"] is False and report["verdict"] == "fail"
    assert report["failure"]["message"].startswith(f"the run was interrupted ({how.name})")


def _has_cases(folder: Path) -> bool:
    try:
        return bool(_report(folder)["cases"])
    except (OSError, ValueError):
        return False


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


def test_an_implementation_that_closes_stdout_and_stderr_fails_itself(tmp_path: Path) -> None:
    """Closing file descriptors 1 and 2 in the child was pytest's INTERNALERROR and exit 2;
    the run's own output stays whole and the implementation fails its case."""
    done = _check("--impl", "wrong_impls:closes_its_streams", *ONE, "--no-shrink",
                  "--report-dir", str(tmp_path), timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "INTERNALERROR" not in done.stdout + done.stderr
    assert "verdict: FAIL" in done.stdout
    report = _report(tmp_path)
    assert report["complete"] is True and report["verdict"] == "fail"
    assert "the implementation raised" in report["cases"][0]["error"] or \
        "Bad file descriptor" in report["cases"][0]["error"]

"""``check --threads``: torch's intra-op threads for the run (default 1), validated once, set
in the process that runs the implementation before its first case, and left as found.

The suite's tensors are tiny: more threads buy nothing on an idle machine and cost
many times the run beside other jobs (tests/bench/bench_load.py measures it). What
is tested here is the setting, not the time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness.cli import build_parser, main, options_from_args
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.options import CheckOptions, check_options
from gradequiv.harness.validate import threads

GRADEQUIV = Path(sys.executable).with_name("gradequiv")
#: where :func:`counting_checkpoint` writes the thread count it ran under
PROBE = "GRADEQUIV_TEST_THREADS_FILE"


def counting_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's checkpoint, writing down torch's intra-op threads while a case runs."""
    import torch
    from torch.utils.checkpoint import checkpoint

    with open(os.environ[PROBE], "a", encoding="utf-8") as out:
        out.write(f"{torch.get_num_threads()}\n")
    return checkpoint(function, *args, use_reentrant=False, **kwargs)


def _options(*args: str) -> CheckOptions:
    return options_from_args(build_parser().parse_args(["check", "--impl", "torch", *args]))


def test_one_thread_by_default_a_count_or_auto_when_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADEQUIV_THREADS", raising=False)
    assert _options().threads == 1
    assert _options("--threads", "3").threads == 3
    assert _options("--threads", "auto").threads is None  # torch's default
    monkeypatch.setenv("GRADEQUIV_THREADS", "auto")
    assert _options().threads is None
    assert _options("--threads", "2").threads == 2  # the command line wins
    assert check_options(impl="torch").threads == 1  # the plugin's and mutants' default
    for count in (1, 4, None):
        options = check_options(impl="torch", threads=count)
        assert CheckOptions.from_json(options.to_json()).threads == count


@pytest.mark.parametrize("value, message", [
    ("0", "--threads=0: must be from 1 to 1024, or auto for torch's default; "
          "write e.g. --threads 1"),
    ("2000", "--threads=2000: must be from 1 to 1024"),
    ("two", "--threads='two' is not a thread count: a whole number from 1 to 1024, or auto "
            "for torch's default; write e.g. --threads 1"),
    ("-1", "--threads='-1' is not a thread count"),
    ("1.5", "--threads='1.5' is not a thread count"),
    ("", "--threads='' is not a thread count"),
])
def test_a_bad_thread_count_is_exit_2_and_one_line(
        value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--impl", "torch", "--threads", value])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gradequiv: error: ") and message in err


def test_a_bad_environment_setting_names_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GRADEQUIV_THREADS", "many")
    assert main(["check", "--impl", "torch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "GRADEQUIV_THREADS='many' is not a thread count" in err
    assert "write e.g. GRADEQUIV_THREADS=1" in err


def test_the_validator_takes_typed_values_too() -> None:
    assert threads("t", 5) == 5 and threads("t", None) is None and threads("t", " AUTO ") is None
    with pytest.raises(InvalidArgument, match="t=True is not a thread count"):
        threads("t", True)


def test_the_setting_holds_for_the_run_and_is_undone_after() -> None:
    import torch

    from gradequiv.harness.commands.check import torch_threads

    before = torch.get_num_threads()
    with torch_threads(3):
        assert torch.get_num_threads() == 3
    assert torch.get_num_threads() == before
    with torch_threads(None):  # auto: left as it is
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("asked, expected", [([], 1), (["--threads", "3"], 3)])
def test_the_supervised_child_runs_every_case_with_the_count(
        asked: list[str], expected: int, tmp_path: Path) -> None:
    probe = tmp_path / "threads.txt"
    env = {k: v for k, v in os.environ.items() if k != "GRADEQUIV_THREADS"}
    env.update({PROBE: str(probe), "PYTHONPATH": str(Path(__file__).resolve().parent)})
    done = subprocess.run(
        [str(GRADEQUIV), "check", "--impl", "test_threads:counting_checkpoint", "--case",
         "1L-layer-dropout", "--report-dir", str(tmp_path / "r"), *asked],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    header = done.stdout.splitlines()[0]
    plural = "thread" if expected == 1 else "threads"
    arg = asked[-1] if asked else "1"
    assert header.endswith(f", {expected} {plural} (--threads {arg})"), header
    counts = set(probe.read_text().split())
    assert counts == {str(expected)}  # every call, in every case, ran with the count
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["conditions"]["threads"] == expected


def test_the_pytest_route_runs_the_suite_with_the_count_and_leaves_it_after(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv("GRADEQUIV_THREADS", raising=False)
    before = torch.get_num_threads()
    pytester.makepyfile(test_seen="""
        import torch

        def test_threads():
            assert torch.get_num_threads() == 3
    """)
    pytester.runpytest("--gradequiv-impl", "torch", "--gradequiv-threads", "3").assert_outcomes(
        passed=1)
    assert torch.get_num_threads() == before
    monkeypatch.setenv("GRADEQUIV_THREADS", "none")
    result = pytester.runpytest("--gradequiv-impl", "torch")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gradequiv-threads='none' is not a thread count*"])

"""The pytest plugin, driven with pytester: options, ini, env, fixture, header, report."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness import PROPERTIES, default_cases
from gradequiv.harness.cli import main

#: property tests and named cases: the tests of one run over the whole spread
SUITE_TESTS = len(PROPERTIES) + len(default_cases())
SUITE = ["--pyargs", "gradequiv.properties", "-p", "no:cacheprovider"]
ONE_CASE = "--gradequiv-case=1L-layer-dropout"


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(*SUITE, *args)


def report_of(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "report.json").read_text())


def test_the_header_says_how_to_reproduce_the_run(pytester: pytest.Pytester) -> None:
    result = run(pytester, "--gradequiv-impl=torch", "--gradequiv-seed=7", ONE_CASE)
    result.stdout.fnmatch_lines(["gradequiv: Using --gradequiv-seed=7 (profile *impl torch)"])
    result.assert_outcomes(passed=len(PROPERTIES))


def test_ini_keys_configure_the_run(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngradequiv_impl = torch\ngradequiv_seed = 21\n"
                     "gradequiv_case = 1L-layer-dropout\n")
    result = run(pytester)
    result.stdout.fnmatch_lines(["*Using --gradequiv-seed=21*impl torch*"])
    result.assert_outcomes(passed=len(PROPERTIES))


def test_environment_beats_ini_and_the_command_line_beats_both(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\ngradequiv_seed = 21\n")
    monkeypatch.setenv("GRADEQUIV_IMPL", "torch")
    monkeypatch.setenv("GRADEQUIV_SEED", "11")
    monkeypatch.setenv("GRADEQUIV_CASE", "1L-layer-dropout")
    run(pytester).stdout.fnmatch_lines(["*Using --gradequiv-seed=11*"])
    run(pytester, "--gradequiv-seed=3").stdout.fnmatch_lines(["*Using --gradequiv-seed=3*"])


def test_impl_kwargs_from_the_environment_reach_the_implementation(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADEQUIV_IMPL_KWARG", "preserve_rng_state=false")
    result = run(pytester, "--gradequiv-impl=torch", ONE_CASE)
    result.assert_outcomes(passed=4, failed=3)  # outputs, buffers, inference, recompute hold


def test_a_conftest_can_override_the_implementation_fixture(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        "import pytest, wrong_impls\n"
        "from gradequiv.harness import Implementation\n"
        "@pytest.fixture(scope='session')\n"
        "def recompute_impl():\n"
        "    return Implementation('mine', wrong_impls.no_op)\n"
    )
    result = run(pytester, ONE_CASE)
    result.assert_outcomes(passed=len(PROPERTIES) - 1, failed=1)
    result.stdout.fnmatch_lines(["minimal failure 1: *", "    fails: recompute (test_recompute)",
                                 "*did not run again in backward*",
                                 # only this pytest run knows the fixture: it replays the case
                                 "    reproduce: python -m pytest * --gradequiv-case *"])


def test_without_an_implementation_every_test_says_how_to_give_one(
        pytester: pytest.Pytester) -> None:
    result = run(pytester, ONE_CASE)
    result.assert_outcomes(errors=len(PROPERTIES))
    result.stdout.fnmatch_lines(["*no implementation to check: pass --gradequiv-impl SPEC*"])


@pytest.mark.parametrize("option, message", [
    ("--gradequiv-profile=fast", "--gradequiv-profile='fast' is not one of ci, dev, thorough"),
    ("--gradequiv-seed=-2", "--gradequiv-seed=-2: must be at least 0"),
    ("--gradequiv-examples=some", "--gradequiv-examples='some' is not a whole number"),
    ("--gradequiv-device=tpu", "--gradequiv-device='tpu' is not one of auto, cpu, cuda"),
    ("--gradequiv-rtol=-1", "--gradequiv-rtol=-1.0: must be a finite number >= 0"),
])
def test_bad_options_are_usage_errors(pytester: pytest.Pytester, option: str,
                                      message: str) -> None:
    result = run(pytester, "--gradequiv-impl=torch", option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


def test_the_report_is_written_with_every_case_and_the_regimes(
        pytester: pytest.Pytester, tmp_path: Path) -> None:
    result = run(pytester, "--gradequiv-impl=torch", "--gradequiv-examples=3",
                 "--gradequiv-profile=ci", f"--gradequiv-report-dir={tmp_path}")
    result.assert_outcomes(passed=SUITE_TESTS)
    report = report_of(tmp_path)
    assert report["verdict"] == "pass" and report["complete"] is True
    assert len(report["cases"]) == 3 + len(default_cases())  # the tests drew the same three
    assert report["conditions"]["profile"] == "ci"
    regimes = report["statistics"]["cases_per_regime"]
    assert sum(v for k, v in regimes.items() if k.startswith("dtype")) == 3 + len(default_cases())


@pytest.mark.slow
def test_a_broken_implementation_shrinks_to_one_layer_and_its_command_fails_again(
        pytester: pytest.Pytester, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run(pytester, "--gradequiv-impl=torch", "--gradequiv-impl-kwarg",
                 "preserve_rng_state=false", "--gradequiv-profile=ci", "--gradequiv-seed=0",
                 "-k", "test_gradients", f"--gradequiv-report-dir={tmp_path / 'suite'}")
    result.assert_outcomes(failed=1)
    failure = report_of(tmp_path / "suite")["failure"]
    minimal = failure["minimal_case"]
    assert minimal["model"]["n_layer"] == 1 and minimal["model"]["n_embd"] <= 8
    assert minimal["batch"]["batch_size"] * minimal["batch"]["seq_len"] <= 4
    assert minimal["grad_mode"] == "backward" and minimal["inference"] is False
    assert failure["property"] == "gradients" and failure["flaky"] is False
    args = shlex.split(failure["reproduce"])
    assert args[:2] == ["gradequiv", "check"]
    assert main([*args[1:], "--report-dir", str(tmp_path / "again")]) == 1
    again = report_of(tmp_path / "again")["failure"]
    assert again["minimal_case"] == minimal


@pytest.mark.slow  # starts two xdist workers, each importing torch
def test_the_suite_spreads_over_xdist_workers(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    result = pytester.runpytest_subprocess(
        *SUITE, "-n", "2", "--gradequiv-impl=torch", "--gradequiv-examples=2",
        "--gradequiv-profile=ci", f"--gradequiv-report-dir={tmp_path}")
    result.assert_outcomes(passed=SUITE_TESTS)
    report = report_of(tmp_path)
    assert report["verdict"] == "pass" and len(report["tests"]) == SUITE_TESTS
    assert len(report["cases"]) >= 13


def test_the_plugin_imports_neither_torch_nor_hypothesis() -> None:
    import subprocess
    import sys

    code = ("import sys, gradequiv.properties.plugin; "
            "print(sorted(m for m in ('torch', 'hypothesis') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_a_failure_that_does_not_come_back_on_replay_is_called_flaky(
        pytester: pytest.Pytester, tmp_path: Path) -> None:
    result = run(pytester, "--gradequiv-impl=wrong_impls:wrong_only_at_first", ONE_CASE,
                 "-k", "test_gradients", f"--gradequiv-report-dir={tmp_path}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FLAKY (passed on replay: nondeterministic)*",
                                 "minimal failure 1: * [[]flaky: passed when run again[]]"])
    assert report_of(tmp_path)["failure"]["flaky"] is True


def test_each_xdist_worker_gets_its_own_gpu_round_robin() -> None:
    from gradequiv.properties.plugin import gpu_for_worker

    visible = ["5", "7"]
    assert [gpu_for_worker(f"gw{k}", visible) for k in range(5)] == ["5", "7", "5", "7", "5"]
    assert gpu_for_worker("gw0", []) is None and gpu_for_worker("master", visible) is None


@pytest.mark.slow
def test_xdist_workers_see_one_gpu_each(pytester: pytest.Pytester, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker pins CUDA_VISIBLE_DEVICES at configure time, before any test runs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setenv("SEEN_DIR", str(tmp_path))
    pytester.makepyfile(test_seen="""
        import os
        from pathlib import Path

        def test_record(worker_id):
            seen = Path(os.environ["SEEN_DIR"]) / worker_id
            seen.write_text(os.environ["CUDA_VISIBLE_DEVICES"])
    """)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider",
                                           "--gradequiv-impl=torch", "--dist=each")
    result.assert_outcomes(passed=2)
    seen = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert seen == {"gw0": "5", "gw1": "7"}


def test_the_reproduce_line_of_a_fixture_implementation_replays_its_failure(
        pytester: pytest.Pytester) -> None:
    """`gradequiv check --impl ours` cannot rebuild what a conftest built: the line is the
    pytest command of this run, set to replay the one case."""
    pytester.makeconftest(
        "import pytest, wrong_impls\n"
        "from gradequiv.harness import Implementation\n"
        "@pytest.fixture(scope='session')\n"
        "def recompute_impl():\n"
        "    return Implementation('ours', wrong_impls.no_op)\n"
    )
    first = run(pytester, "--gradequiv-examples=2", "--gradequiv-seed=0",
                "-k", "test_recompute and not named")
    first.assert_outcomes(passed=len(PROPERTIES) - 1, failed=1)
    line = next(s for s in first.stdout.lines if s.startswith("    reproduce: "))
    args = shlex.split(line.removeprefix("    reproduce: "))
    assert args[:3] == ["python", "-m", "pytest"] and "--gradequiv-impl" not in args
    assert "-k" not in args and "--gradequiv-examples=2" not in args
    again = pytester.runpytest(*args[3:])
    again.assert_outcomes(passed=len(PROPERTIES) - 1, failed=1)  # the one case, replayed
    again.stdout.fnmatch_lines(["    fails: recompute (test_recompute)"])


USERS_SUITE = '''
import pytest

@pytest.mark.parametrize("case", [1, 2, 3])
def test_a_parameter_named_case(case):
    assert case > 0

def test_recompute_impl_is_not_ours(request):
    assert "recompute_impl" not in request.fixturenames
    with pytest.raises(pytest.FixtureLookupError):
        request.getfixturevalue("recompute_impl")

def test_fails_as_it_would():
    assert False
'''


def test_an_unrelated_suite_sees_nothing_of_gradequiv(pytester: pytest.Pytester) -> None:
    """A project that installs gradequiv runs its own suite: no header, no summary, no
    fixture, and the outcomes it gets without the plugin."""
    pytester.makepyfile(test_users=USERS_SUITE)
    with_plugin = pytester.runpytest("-p", "no:cacheprovider", "-rA")
    without = pytester.runpytest("-p", "no:cacheprovider", "-rA", "-p", "no:gradequiv")
    with_plugin.assert_outcomes(passed=4, failed=1)
    without.assert_outcomes(passed=4, failed=1)
    lines = [*with_plugin.stdout.lines, *with_plugin.stderr.lines]
    ours = [line for line in lines if "gradequiv" in line.lower()
            and not line.startswith(("rootdir:", "plugins:"))  # pytest's own list
            and str(pytester.path) not in line]
    assert ours == []
    assert with_plugin.ret == without.ret == 1


def test_the_plugin_acts_when_asked_by_an_option_or_a_variable(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_users="def test_one():\n    pass\n")
    asked = pytester.runpytest("-p", "no:cacheprovider", "--gradequiv-seed=5")
    asked.stdout.fnmatch_lines(["gradequiv: Using --gradequiv-seed=5*"])
    monkeypatch.setenv("GRADEQUIV_SEED", "6")
    pytester.runpytest("-p", "no:cacheprovider").stdout.fnmatch_lines(
        ["gradequiv: Using --gradequiv-seed=6*"])

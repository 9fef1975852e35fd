"""``gradequiv check``: exit codes, one-line errors, the report, same seed same result."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness import PROPERTIES, default_cases
from gradequiv.harness.cli import main

FAST = ["--examples", "2"]
#: property tests and named cases: what one check run's report lists as tests
SUITE_TESTS = len(PROPERTIES) + len(default_cases())
ONE = ["--case", "1L-layer-dropout"]


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """check in this process (its output in capsys); tests/test_supervise.py runs it
    supervised, as users do."""
    code = main(["check", "--in-process", *args])
    out, err = capsys.readouterr()
    return code, out, err


def read_report(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "report.json").read_text())


def test_torch_passes_with_exit_0_and_a_pass_report(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = check(capsys, "--impl", "torch", *FAST, "--report-dir", str(tmp_path))
    assert code == 0 and "verdict: pass" in out and "Using --gradequiv-seed=0" in out
    report = read_report(tmp_path)
    assert report["schema_version"] == 1 and report["verdict"] == "pass"
    assert report["complete"] is True and report["failure"] is None
    summary = report["summary"]
    assert summary["run"] == summary["passed"] >= 13 and summary["failed"] == 0
    assert set(report["tests"].values()) == {"passed"} and len(report["tests"]) == SUITE_TESTS
    assert report["conditions"]["torch"] and report["conditions"]["threads"] >= 1
    gradients = report["cases"][1]["properties"][1]
    assert gradients["compared"] == gradients["bitwise_equal"] > 0  # every tensor equal,
    assert gradients["checks"] == []  # so none is kept: a record keeps only the worst


def test_no_rng_restore_exits_1_and_names_the_first_mismatched_gradient(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = check(capsys, "--impl", "torch", "--impl-kwarg", "preserve_rng_state=false",
                         *ONE, "--report-dir", str(tmp_path))
    assert code == 1 and "verdict: FAIL" in out
    failure = read_report(tmp_path)["failure"]
    # The headline tensor is inside a re-run segment, not the embedding outside them all.
    assert failure["first_mismatch"]["name"].startswith("grad of blocks.")
    assert failure["message"].startswith("grad of blocks.")
    assert failure["diagnosis"]["cause"] == "rng-not-restored"
    assert "--impl-kwarg preserve_rng_state=false" in failure["reproduce"]
    assert "reproduce: gradequiv check" in out
    minimal = read_report(tmp_path)["minimal_failures"][0]
    assert minimal["first_diverging_op"]["op"].startswith("bernoulli")
    assert "first diverging op: bernoulli" in out  # in the terminal summary too
    # every view beside report.json, as `gradequiv report --format all` renders them
    page = (tmp_path / "report.html").read_text()
    assert "does not restore the RNG state" in page and "first diverging op: bernoulli" in page
    assert ET.parse(tmp_path / "junit.xml").getroot().get("failures") != "0"


def test_the_reproduce_command_reruns_exactly_that_case(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    check(capsys, "--impl", "torch", "--impl-kwarg", "preserve_rng_state=false",
          "--case", "2L-layer-manual-attn", "--report-dir", str(tmp_path / "a"))
    first = read_report(tmp_path / "a")["failure"]
    argv = first["reproduce"]
    args = __import__("shlex").split(argv)[2:]  # drop "gradequiv check"
    code, _, _ = check(capsys, *args, "--report-dir", str(tmp_path / "b"))
    again = read_report(tmp_path / "b")
    assert code == 1 and len(again["cases"]) == 1
    assert again["failure"]["first_mismatch"] == first["first_mismatch"]


@pytest.mark.slow  # three whole check runs; tests/test_determinism.py holds a failing pair
def test_same_seed_same_report_and_another_seed_another(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def cases(seed: str, name: str) -> list[dict[str, Any]]:
        check(capsys, "--impl", "torch", "--examples", "3", "--seed", seed,
              "--report-dir", str(tmp_path / name))
        records = read_report(tmp_path / name)["cases"]
        for record in records:
            record.pop("seconds")
        return records

    assert cases("5", "a") == cases("5", "b")
    assert cases("6", "c") != cases("5", "a")


@pytest.mark.slow
def test_an_implementation_that_raises_fails_every_case_and_the_run_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = check(capsys, "--impl", "wrong_impls:raises_in_backward", "--examples", "3",
                       "--report-dir", str(tmp_path))
    assert code == 1
    report = read_report(tmp_path)
    # the gradient-penalty case is drawn only for an implementation that claims it
    unclaimed = sum(c.grad_mode == "create-graph" for c in default_cases())
    assert len(report["tests"]) == SUITE_TESTS - unclaimed and report["complete"] is True
    # The control case selects no segment, so the implementation is never called.
    verdicts = {c["name"]: c["verdict"] for c in report["cases"] if c["name"]}
    assert verdicts.pop("control-none") == "pass" and set(verdicts.values()) == {"fail"}
    failing = [c for c in report["cases"] if c["verdict"] == "fail"]
    assert all("RuntimeError: recompute buffer was freed" in c["error"] for c in failing)


def test_an_interrupted_run_leaves_a_valid_report_marked_incomplete(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = check(capsys, "--impl", "wrong_impls:interrupts", "--case",
                         "1L-layer-dropout", "--report-dir", str(tmp_path))
    assert code == 130 and "interrupted" in err
    report = read_report(tmp_path)
    assert report["complete"] is False and report["cases"] == []
    assert report["verdict"] == "fail"


@pytest.mark.parametrize("args, message", [
    (["--impl", "nosuchmodule:fn"], "could not be imported: ModuleNotFoundError"),
    (["--impl", "torch.utils.checkpoint:checkpointt"],
     "did you mean 'torch.utils.checkpoint:checkpoint'?"),
    (["--impl", "torchh"], "did you mean 'torch'?"),
    (["--impl", "torch.utils.checkpoint"], "nor a 'module:attr' reference"),
    (["--impl", "torch:__version__"], "which is not callable"),
    (["--impl", "torch", "--examples", "-1"], "--examples=-1: must be at least 1"),
    (["--impl", "torch", "--examples", "many"], "'many' is not a whole number"),
    (["--impl", "torch", "--seed", "-3"], "--seed=-3: must be at least 0"),
    (["--impl", "torch", "--seed", str(2**64)], "must be at most 4294967295"),
    (["--impl", "torch", "--no-shrink", "--examples", "0"], "--examples=0: must be at least 1"),
    (["--impl", "torch", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["--impl", "torch", "--impl-kwarg", "novalue"], "is not KEY=VALUE"),
    (["--impl", "torch", "--impl-kwarg", "bogus=1"],
     "--impl='torch' has no option 'bogus'; its options are use_reentrant, preserve_rng_state"),
    (["--impl", "torch", "--impl-kwarg", "preserve_rng_state=maybe"],
     "preserve_rng_state='maybe' is not true or false"),
    (["--impl", "torch-offload-wrapper", "--impl-kwarg", "pin_memory=true"], "it takes none"),
    (["--impl", "wrong_impls:patches_forward_in_place", "--impl-kwarg", "depth=2"],
     "takes no keyword 'depth' (its parameters: module)"),
    (["--impl", "torch", "--adapter", "decorator"], "invalid choice: 'decorator'"),
    (["--impl", "torch", "--case", "nosuch"], "known names: control-none"),
    (["--impl", "torch", "--case", '{"dtype": "fp8"}'], "dtype='fp8' is not one of"),
    (["--impl", "torch", "--case", '{"model": {"n_embd": 10, "n_head": 3}}'],
     "n_embd=10 is not divisible by n_head=3"),
    (["--impl", "torch", "--case", '{"granularity": "every:x"}'], "needs a whole number"),
    (["--impl", "torch", "--case", "{not json"], "is not valid JSON"),
    # cases that build but cannot run here: refused before the first case, not failed
    (["--impl", "torch", "--case", '{"model_kind": "batchnorm", "grad_mode": "accumulate", '
      '"batch": {"batch_size": 2, "seq_len": 1}}'], "2 samples in each of the 2 micro-batches"),
    (["--impl", "torch", "--case", '{"model": {"max_seq_len": 8}, "batch": {"seq_len": 16}}'],
     "seq_len=16 exceeds max_seq_len=8"),
    (["--impl", "torch", "--case", '{"model_kind": "batchnorm", "granularity": "attention"}'],
     "granularity='attention' does not apply to the batchnorm model"),
    (["--impl", "torch", "--case", "/nonexistent/case.json"], "could not be read"),
    (["--impl", "torch", "--rtol", "-1"], "must be a finite number >= 0"),
    (["--impl", "torch", "--shard", "3/2"], "'3/2' is not I/N with 1 <= I <= N"),
    (["--impl", "torch", "--shard", "1"], "'1' is not I/N"),
    ([], "the following arguments are required: --impl"),
])
def test_bad_input_is_exit_2_and_one_line(args: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = check(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gradequiv: error: ")
    assert message in err


def test_cuda_on_a_machine_without_it_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = check(capsys, "--impl", "torch", "--device", "cuda")
    assert code == 2 and "torch.cuda.is_available() is False" in err


def test_the_console_script_runs_as_a_module() -> None:
    done = subprocess.run([sys.executable, "-m", "gradequiv.harness", "check", "--impl", "x"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "gradequiv: error: --impl='x'" in done.stderr


def test_a_case_file_replays_that_case(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    case_file = tmp_path / "case.json"
    case_file.write_text('{"granularity": "mlp", "seed": 4}')
    code, out, _ = check(capsys, "--impl", "torch", "--case", str(case_file),
                         "--report-dir", str(tmp_path / "r"))
    cases = read_report(tmp_path / "r")["cases"]
    assert code == 0 and len(cases) == 1
    assert cases[0]["case"]["granularity"] == "mlp" and cases[0]["case"]["seed"] == 4


def test_the_report_is_readable_by_others(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    check(capsys, "--impl", "torch", *ONE, "--report-dir", str(tmp_path))
    assert (tmp_path / "report.json").stat().st_mode & 0o044 == 0o044


def test_long_runs_print_progress_lines(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from gradequiv.properties import plugin

    monkeypatch.setattr(plugin._Progress, "FIRST_S", 0.0)
    monkeypatch.setattr(plugin._Progress, "EVERY_S", 0.0)
    code, out, _ = check(capsys, "--impl", "wrong_impls:skewed_gradients", *ONE)
    progress = [line for line in out.splitlines() if line.startswith("gradequiv: 1 case")]
    assert code == 1 and progress
    assert progress[0].startswith("gradequiv: 1 case verified, 1 failing, ")
    assert "FAILED: 1L x" in progress[0]


@pytest.mark.slow
def test_shards_split_the_named_cases_and_draw_different_cases(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names, drawn = [], []
    for index in (1, 2):
        folder = tmp_path / f"shard{index}"
        code, out, _ = check(capsys, "--impl", "torch", "--examples", "6",
                             "--shard", f"{index}/2", "--report-dir", str(folder))
        report = read_report(folder)
        assert code == 0 and report["conditions"]["shard"] == f"{index}/2"
        assert f"shard {index}/2" in out and report["conditions"]["examples_per_property"] == 3
        tests = report["tests"]
        names.append({t for t in tests if t.startswith("test_named_case")})
        drawn.append({json.dumps(c["case"], sort_keys=True) for c in report["cases"]
                      if not c["name"]})  # drawn cases have no name
    from gradequiv.harness import default_cases

    assert not names[0] & names[1]
    assert len(names[0] | names[1]) == len(default_cases())
    assert drawn[0] != drawn[1]


def test_deterministic_runs_record_it_and_leave_torch_as_found(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    assert not torch.are_deterministic_algorithms_enabled()
    code, _, _ = check(capsys, "--impl", "torch", *ONE, "--deterministic",
                       "--report-dir", str(tmp_path))
    report = read_report(tmp_path)
    assert code == 0 and report["conditions"]["deterministic_algorithms"] is True
    # every case ran its floor path, passing or not: CPU kernels, no noise at all
    assert report["statistics"]["noise_floor_cases"] == report["summary"]["run"] > 0
    assert report["statistics"]["max_noise_floor"] == 0.0
    assert not torch.are_deterministic_algorithms_enabled()


def test_what_the_implementation_prints_is_shown_for_the_failing_case(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Print-debugging in an implementation: its stdout and stderr during the failing case
    are in the terminal, in report.json (the case and the headline failure) and report.md."""
    code, out, _ = check(capsys, "--impl", "wrong_impls:prints_and_fails", *ONE,
                         "--no-shrink", "--report-dir", str(tmp_path))
    assert code == 1 and "verdict: FAIL" in out
    assert "the implementation printed to stdout" in out
    assert "  | debug: checkpointing " in out and "  | debug: about to recompute" in out
    report = read_report(tmp_path)
    output = report["failure"]["output"]
    assert output["stdout"].startswith("debug: checkpointing ")
    assert output["stderr"].startswith("debug: about to recompute\n")
    assert report["cases"][0]["output"] == output
    assert all("output" not in c for c in report["cases"] if c["verdict"] == "pass")
    markdown = (tmp_path / "report.md").read_text()
    assert "The implementation printed to stderr:" in markdown
    assert "debug: about to recompute" in markdown


def test_a_long_output_is_kept_bounded() -> None:
    from gradequiv.harness.reports.report import OUTPUT_CHARS, bounded_output

    kept = bounded_output("x" * (OUTPUT_CHARS + 10) + "end", "")
    assert kept["stdout"] == "[... 13 characters cut]\n" + ("x" * (OUTPUT_CHARS - 3)) + "end"
    assert kept["stderr"] == ""


def test_check_writes_every_view_beside_report_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = check(capsys, "--impl", "torch", *ONE, "--report-dir", str(tmp_path))
    assert code == 0
    markdown = (tmp_path / "report.md").read_text()
    assert markdown.startswith("## gradequiv") and "**PASS**: `torch`" in markdown
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "junit.xml", "report.html", "report.json", "report.md"]
    assert "<title>gradequiv report: PASS</title>" in (tmp_path / "report.html").read_text()


def test_a_spec_with_two_colons_is_refused_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = check(capsys, "--impl", "os:path:join", *ONE)
    assert code == 2
    assert err == ("gradequiv: error: --impl='os:path:join' has 2 colons; a 'module:attr' "
                   "reference has one, between the module's dotted path and the attribute: "
                   "did you mean 'os.path:join'?\n")


@pytest.mark.parametrize("body, missing", [
    ("from not_installed_lib.checkpointing import checkpoint\n", "not_installed_lib"),
    ("from torch.utils.checkpoint import no_such_checkpoint\n", "no_such_checkpoint"),
])
@pytest.mark.parametrize("adapter", ["function", "toggle"])
def test_an_implementation_whose_module_fails_an_import_is_exit_2_naming_it(
        body: str, missing: str, adapter: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The module is found and its own import fails: the line said to check that the module
    is on PYTHONPATH, where it is."""
    name = f"impl_failing_import_{adapter}_{missing}"
    (tmp_path / f"{name}.py").write_text(body + "def impl(*args, **kwargs):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = check(capsys, "--impl", f"{name}:impl", "--adapter", adapter, *ONE)
    assert code == 2, err
    assert err.count("\n") == 1 and "PYTHONPATH" not in err
    assert f"importing {name!r} failed inside it" in err and missing in err


def test_the_current_folders_conftest_files_are_not_imported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Run from a project's root, the check imported its conftest.py and tests/conftest.py
    (pytest's anchor is the current folder when the suite is named as a package): one that
    set a default dtype changed what was verified, one whose import failed ended the check."""
    import torch

    marker = tmp_path / "imported"
    (tmp_path / "conftest.py").write_text(
        "import pathlib, torch\n"
        f"pathlib.Path({str(marker)!r}).write_text('root')\n"
        "torch.set_default_dtype(torch.float64)\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(
        "raise ImportError('no module named internal_dev_tool')\n")
    monkeypatch.chdir(tmp_path)
    try:
        code, out, _ = check(capsys, "--impl", "torch", *ONE, "--report-dir",
                             str(tmp_path / "report"))
    finally:
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
    assert code == 0 and "verdict: pass" in out, out
    assert not marker.exists() and dtype == torch.float32


def test_the_callers_pytest_options_and_plugins_do_not_reach_the_suite(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A CI's PYTEST_ADDOPTS (-k, --collect-only), PYTEST_PLUGINS and the plugins installed
    beside gradequiv reached the check's own pytest session: with -k one property test ran
    and the check said pass, with --collect-only none ran and it exited 0."""
    import os

    deselect_all = ("def pytest_collection_modifyitems(config, items):\n"
                    "    config.hook.pytest_deselected(items=list(items))\n"
                    "    items[:] = []\n")
    (tmp_path / "named_plugin.py").write_text(deselect_all)
    (tmp_path / "installed_plugin.py").write_text(deselect_all)
    dist = tmp_path / "installed_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: installed-plugin\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text("[pytest11]\ninstalled = installed_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    import importlib.metadata

    assert any(d.metadata["Name"] == "installed-plugin"  # pytest would load it
               for d in importlib.metadata.distributions())
    for addopts, plugins in [("--collect-only", ""), ("-k gradients", ""),
                             ("", "named_plugin"), ("", "")]:
        monkeypatch.setenv("PYTEST_ADDOPTS", addopts)
        monkeypatch.setenv("PYTEST_PLUGINS", plugins)
        code, out, _ = check(capsys, "--impl", "torch", *ONE, "--report-dir",
                             str(tmp_path / "report"))
        assert code == 0 and "7 of 7 property tests passed" in out, (addopts, plugins, out)
        assert os.environ["PYTEST_ADDOPTS"] == addopts  # put back for the caller
        assert "PYTEST_DISABLE_PLUGIN_AUTOLOAD" not in os.environ

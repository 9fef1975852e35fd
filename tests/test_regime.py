"""The training regime a user states (issue 50; the schedule a pipeline user trains with,
issue 48): read from ``[tool.gradequiv]``, ``--regime`` and ``regime=``; only it is drawn;
the report says what was left out and that the verdict holds for it only."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from gradequiv.harness.api import _argv
from gradequiv.harness.cli import main
from gradequiv.harness.engine.spread import default_cases
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.options import CheckOptions, check_options
from gradequiv.harness.regime import Regime, stated_regime
from gradequiv.models.kinds import DTYPES
from gradequiv.properties.strategies import cases, external_cases

BF16_ONE_PASS = """\
[tool.gradequiv]
dtypes = ["bf16-autocast"]
backward = "outside-autocast"
loss-parts = 1
"""


def _project(folder: Path, text: str = BF16_ONE_PASS) -> Path:
    (folder / "pyproject.toml").write_text(text)
    return folder


def test_the_nearest_pyproject_with_the_table_states_it_and_the_command_line_replaces_keys(
        tmp_path: Path) -> None:
    _project(tmp_path)
    inner = tmp_path / "pkg" / "sub"
    inner.mkdir(parents=True)
    (tmp_path / "pkg" / "pyproject.toml").write_text("[project]\nname = 'x'\n")  # no table
    regime = stated_regime(start=inner)
    assert regime.dtypes == ("bf16-autocast",)
    assert regime.backward_autocast() == (False,)
    assert regime.loss_parts == 1
    assert str(tmp_path / "pyproject.toml") in regime.source
    both = stated_regime(["loss-parts=2", "schedules=one,1f1b"], start=inner)
    assert (both.dtypes, both.loss_parts, both.schedules) == (("bf16-autocast",), 2,
                                                              ("one", "1f1b"))
    assert "--regime" in both.source and "pyproject.toml" in both.source
    assert not stated_regime(start=tmp_path.parent).stated or \
        stated_regime(start=tmp_path.parent).source != regime.source


@pytest.mark.parametrize(("text", "said"), [
    ("[tool.gradequiv]\ndtype = ['fp32']\n", "'dtype' is not a key of the training regime"),
    ("[tool.gradequiv]\ndtypes = ['fp64']\n", "'fp64' is not one of fp32"),
    ("[tool.gradequiv]\nloss-parts = 4\n", "loss-parts = 4: write the most parts"),
    ("[tool.gradequiv]\nbackward = 1\n", "backward = 1: write outside-autocast or"),
    ("[tool.gradequiv\n", "is not valid TOML"),
])
def test_a_wrong_table_is_refused_with_the_value_and_the_rule(tmp_path: Path, text: str,
                                                              said: str) -> None:
    _project(tmp_path, text)
    with pytest.raises(InvalidArgument, match=said.replace("[", r"\[")) as caught:
        stated_regime(start=tmp_path)
    assert "pyproject.toml" in str(caught.value)


def test_the_options_carry_the_regime_across_processes_and_to_the_api_s_child(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(_project(tmp_path))
    options = check_options(impl="torch", regime={"grad_modes": ["backward"]})
    assert CheckOptions.from_json(options.to_json()).regime == options.regime
    assert options.regime.grad_modes == ("backward",) and options.regime.loss_parts == 1
    argv = _argv(options, 600)
    given = [argv[i + 1] for i, a in enumerate(argv) if a == "--regime"]
    assert stated_regime(given, read_pyproject=False).to_dict()["stated"] == \
        options.regime.to_dict()["stated"]


def test_nothing_stated_draws_everything_and_says_nothing() -> None:
    regime = stated_regime(read_pyproject=False)
    assert not regime.stated and regime.left_out() == [] and regime == Regime()


_REGIMES = [
    Regime(dtypes=("bf16-autocast",), backward=("outside-autocast",), loss_parts=1,
           source="test"),
    Regime(dtypes=("fp32", "fp16-autocast"), backward=("inside-autocast",), source="test"),
    Regime(schedules=("1f1b",), grad_modes=("backward", "accumulate"), loss_parts=2,
           source="test"),
]


@pytest.mark.parametrize("regime", _REGIMES, ids=["bf16-one-pass", "inside", "1f1b-only"])
def test_every_drawn_case_lies_within_the_regime(regime: Regime) -> None:
    seen: set[Any] = set()

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases(regime=regime))
    def within(case: Any) -> None:
        assert regime.outside(case) == "", case
        seen.add((case.dtype, case.schedule, case.backward_passes))

    within()
    assert {d for d, _, _ in seen} <= set(regime.dtypes)
    if "one" not in regime.schedules:  # every plain step runs a stated schedule
        assert {s for _, s, _ in seen} - {"one"} == {"1f1b"}


def test_a_user_model_s_declared_regimes_meet_the_stated_ones() -> None:
    regime = Regime(dtypes=("fp16-autocast",), source="pyproject.toml")
    with pytest.raises(InvalidArgument, match="none in common"):
        external_cases("user_models:checkpointing_stack", regime=regime).example()


def test_the_named_cases_outside_the_regime_are_the_ones_it_does_not_run() -> None:
    regime = _REGIMES[0]
    kept = [c for c in default_cases() if not regime.outside(c)]
    assert kept and all(c.dtype == "bf16-autocast" and c.backward_passes == 1 for c in kept)
    two = replace(kept[0], backward_passes=2)
    assert "its loss is backpropagated in 2 parts" in regime.outside(two)
    assert "its precision fp32 is not among dtypes" in regime.outside(replace(kept[0],
                                                                              dtype="fp32"))
    assert set(DTYPES) - {"bf16-autocast"} <= set(" ".join(regime.left_out()).replace(
        ",", " ").split())


def test_a_checkpoint_right_only_in_the_stated_regime_passes_it_and_the_report_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Done when (issue 50): bf16 with the backward outside autocast and one backward pass
    makes a checkpoint right only there pass; the report says what was not drawn. The same
    checkpoint fails its cases outside the regime (replayed here: the slow test below runs
    the whole check without a regime)."""
    monkeypatch.chdir(_project(tmp_path))
    report_dir = tmp_path / "report"
    code = main(["check", "--impl", "regime_impls:bf16_one_pass_checkpoint", "--examples", "10",
                 "--report-dir", str(report_dir)])
    out = capfd.readouterr().out
    assert code == 0, out
    report = json.loads((report_dir / "report.json").read_text())
    assert report["regime"]["stated"] == {"dtypes": ["bf16-autocast"],
                                          "backward": ["outside-autocast"], "loss-parts": 1}
    left = report["regime"]["left_out"]
    assert "precisions fp32, fp16-autocast, bf16-model" in left
    assert "losses backpropagated in 2 or 3 parts" in left
    assert all(c["case"]["dtype"] == "bf16-autocast" for c in report["cases"])
    assert "the verdict holds for this regime only" in out
    assert "Training regime stated in" in (report_dir / "report.md").read_text()
    assert "the verdict holds for this regime only" in (report_dir / "report.html").read_text()


@pytest.mark.parametrize("outside", [{"dtype": "fp16-autocast"},
                                     {"backward_passes": 2, "seed": 1}])
def test_the_same_checkpoint_fails_where_the_regime_leaves_it_out(
        outside: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    case = next(c for c in default_cases() if c.name == "2L-layer-two-losses-dropout")
    case = replace(case, **{"name": "", "backward_passes": 1, **outside})
    code = main(["check", "--impl", "regime_impls:bf16_one_pass_checkpoint",
                 "--case", json.dumps(case.to_dict()), "--regime", "dtypes=fp32"])
    assert code == 1, capfd.readouterr().out


@pytest.mark.slow
def test_undeclared_the_check_fails_the_checkpoint_on_both_left_out_regimes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["check", "--impl", "regime_impls:bf16_one_pass_checkpoint", "--examples", "20",
                 "--report-dir", str(tmp_path / "r")])
    out = capfd.readouterr().out
    assert code == 1, out
    causes = {f["cause"] for f in json.loads((tmp_path / "r" / "report.json").read_text())
              ["faults"]}
    assert {"autocast-lost", "second-pass"} <= causes, causes


def test_a_wrong_regime_on_the_command_line_exits_2(capfd: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--impl", "torch", "--regime", "loss-parts=many"])
    assert code == 2
    err = capfd.readouterr().err
    assert "--regime: loss-parts = 'many'" in err and "1 to 3" in err


def test_a_regime_that_leaves_the_implementation_nothing_is_refused(
        capfd: pytest.CaptureFixture[str]) -> None:
    """torch's reentrant checkpoint does not take a gradient penalty (it declares so): a
    regime of gradient penalties only leaves nothing to draw."""
    code = main(["check", "--impl", "torch-reentrant", "--regime", "grad-modes=create-graph"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert "none in common" in err and "create-graph" in err


def test_the_plugin_reads_the_table_and_its_own_option(pytester: pytest.Pytester) -> None:
    """Under pytest: the suite's named cases are those of the regime, the summary says
    what was not drawn, and a wrong ``--gradequiv-regime`` is a usage error."""
    pytester.makepyprojecttoml(BF16_ONE_PASS)
    suite = ["--pyargs", "gradequiv.properties", "-p", "no:cacheprovider",
             "--gradequiv-impl=torch", "--gradequiv-examples=2"]
    result = pytester.runpytest(*suite)
    inside = [c for c in default_cases() if not _REGIMES[0].outside(c)]
    result.assert_outcomes(passed=7 + len(inside))
    result.stdout.fnmatch_lines(["*training regime stated in *pyproject.toml [[]tool.gradequiv[]]"
                                 ": not drawn: precisions fp32, fp16-autocast, bf16-model*"])
    wrong = pytester.runpytest(*suite, "--gradequiv-regime=dtypes=fp64")
    assert wrong.ret == pytest.ExitCode.USAGE_ERROR
    wrong.stderr.fnmatch_lines(["*--gradequiv-regime: dtypes = 'fp64': 'fp64' is not one of*"])


@pytest.mark.slow
def test_a_checkpoint_exact_under_1f1b_passes_a_check_stated_as_1f1b(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Done when (issue 48), in one process: a checkpoint whose RNG state the first backward
    pass uses up is exact wherever each forward has one backward; stated as 1F1B with one
    backward pass it passes, and the loss in parts it never runs still fails it."""
    monkeypatch.chdir(tmp_path)
    stated = ["--regime", "schedules=one,1f1b", "--regime", "loss-parts=1"]
    code = main(["check", "--impl", "regime_impls:one_pass_checkpoint", "--examples", "10",
                 *stated])
    assert code == 0, capfd.readouterr().out
    assert "micro-batch schedules gpipe, gpipe-reverse, summed" in capfd.readouterr().out
    code = main(["check", "--impl", "regime_impls:one_pass_checkpoint",
                 "--case", "2L-layer-two-losses-dropout"])
    assert code == 1, capfd.readouterr().out

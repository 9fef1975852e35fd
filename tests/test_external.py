"""Bring your own model (--model): the suite on a user's residual stack, routed unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradequiv.harness import Case, Implementation, resolve, verify
from gradequiv.harness.cli import main
from gradequiv.harness.implementations.faults import MUTANTS
from gradequiv.models import ExternalConfig, InvalidArgument, parse_granularity
from gradequiv.models.external import reproducibility_problem

MODEL = "user_models:residual_stack"


@pytest.mark.slow
def test_torch_passes_on_a_user_model_and_the_report_names_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--impl", "torch", "--model", MODEL, "--examples", "3",
                 "--report-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert {c["case"]["model_kind"] for c in report["cases"]} == {"external"}
    assert "test_named_case[model-layer-bf16-autocast]" in report["tests"]
    gradients = report["cases"][0]["properties"][1]
    assert gradients["name"] == "gradients" and gradients["compared"] > 0


@pytest.mark.slow
def test_no_rng_restore_is_caught_and_located_in_the_user_s_dropout(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--impl", "torch", "--impl-kwarg", "preserve_rng_state=false",
                 "--model", MODEL, "--examples", "3", "--report-dir", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    located = [f["first_diverging_op"] for f in report["minimal_failures"]
               if f["first_diverging_op"]]
    assert located and located[0]["module"] == "blocks.0.dropout"  # as the user named it
    tensors = {name for r in report["cases"] for name in r.get("gradient_errors", {})}
    assert "grad of blocks.2.linear.weight" in tensors
    assert not any("inner." in name for name in tensors)


@pytest.mark.parametrize("name", ["kwargs-dropped", "autocast-lost", "no-op"])
def test_mutants_are_caught_on_a_user_model(name: str) -> None:
    """The routing hands the implementation the user's own call: keyword arguments,
    autocast and all; a fault in any of them shows."""
    mutant = next(m for m in MUTANTS if m.name == name)
    impl = Implementation(name, mutant.impl)
    verdicts = [verify(impl, Case(model=ExternalConfig(MODEL), dtype=dtype))
                for dtype in ("fp32", "bf16-autocast")]
    assert not all(v.passed for v in verdicts)


def test_the_reproduce_line_of_a_user_model_case_replays_the_user_s_batch() -> None:
    """The factory builds the batch from the seed (8 x 16 here): the line embeds no default
    batch of the reference model's, and its case builds the user's batch again."""
    import shlex

    import torch

    from gradequiv.harness.reports.report import reproduce_command
    from gradequiv.models import build

    case = Case(model=ExternalConfig(MODEL), seed=3)
    line = reproduce_command(resolve("torch"), case, torch.device("cpu"))
    text = shlex.split(line)[-1]
    assert "batch" not in json.loads(text)
    replayed = Case.from_json(text)
    assert replayed == case
    assert build(replayed.model, replayed.batch, replayed.seed, "cpu").inputs[0].shape == (8, 16)


def test_only_segment_granularities_apply_to_a_user_model() -> None:
    case = Case(model=ExternalConfig(MODEL), granularity=parse_granularity("attention"))
    with pytest.raises(InvalidArgument, match="use none, layer or every:K"):
        verify(resolve("torch"), case)
    every2 = verify(resolve("torch"), Case(model=ExternalConfig(MODEL),
                                           granularity=parse_granularity("every:2")))
    assert every2.passed


@pytest.mark.parametrize("spec, message", [
    ("user_models:wrong_segment", "segment 'blocks.9' is not a submodule"),
    ("user_models:nosuch", "could not be imported"),
    ("user_models", "is not 'package.module:attr'"),
])
def test_a_broken_factory_is_exit_2(spec: str, message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--in-process", "--impl", "torch", "--model", spec]) == 2
    assert message in capsys.readouterr().err


def test_a_factory_that_ignores_its_seed_is_exit_2_not_a_failing_torch(
        capfd: pytest.CaptureFixture[str]) -> None:
    """Its two full-storage runs would differ (a noise floor of 0.038 against an error of
    0.020), failing or excusing the implementation: the model is named, before any case."""
    assert main(["check", "--impl", "torch", "--model", "user_models:ignores_its_seed"]) == 2
    err = capfd.readouterr().err
    assert ("--model='user_models:ignores_its_seed' is not reproducible: two builds with "
            "seed 0 differ in parameter blocks.0.linear.weight (") in err
    assert "the factory must seed every random draw from its seed argument" in err


@pytest.mark.parametrize("factory", ["residual_stack", "seeds_the_global_generator"])
def test_a_factory_drawing_from_its_seed_or_the_seeded_global_generator_is_reproducible(
        factory: str) -> None:
    """residual_stack draws its weights from the global generator, which the harness seeds;
    the other seeds that generator itself: both build the same model twice."""
    assert reproducibility_problem(ExternalConfig(f"user_models:{factory}")) is None


def test_the_first_difference_of_two_builds_is_named() -> None:
    problem = reproducibility_problem(ExternalConfig("user_models:ignores_its_seed"), seed=5)
    assert problem is not None
    assert problem.startswith("--model='user_models:ignores_its_seed' is not reproducible: "
                              "two builds with seed 5 differ in parameter "
                              "blocks.0.linear.weight (256 of 256 elements differ, greatest "
                              "difference ")
    assert problem.endswith("or gradequiv cannot tell recompute noise from model noise")


def test_a_factory_that_hands_out_one_model_twice_is_not_reproducible() -> None:
    """Equal, but each path would train the same weights: the second starts where the first
    stopped."""
    problem = reproducibility_problem(ExternalConfig("user_models:same_model_every_call"))
    assert problem is not None
    assert "two builds with seed 0 share parameter blocks.0.norm.weight" in problem
    assert "must build a new model on every call" in problem

"""A user's model through torch's pipeline schedules, cut into stages by the split function
they name (``--split``), as torchtitan's ``pipeline_llm`` takes one: the recompute installed
on the model's own segments runs inside the stages, and full storage runs the same split,
schedule and micro-batches. The refusals need no ranks; the runs start two gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gradequiv.harness.engine.case import Case
from gradequiv.harness.engine.path import prepare
from gradequiv.harness.engine.pipeline import (
    Pipelining,
    pipeline_refusal,
    split_stages,
    user_split_refusal,
)
from gradequiv.models import ExternalConfig, InvalidArgument

TESTS = Path(__file__).parent
CASE = Case(model=ExternalConfig("user_models:residual_stack"), dtype="fp32")  # 8 rows
SPLIT = "pipeline_models:residual_stack_split"


@pytest.fixture(autouse=True)
def _models_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The factory and the split live in tests/: the ranks (spawned) import them too."""
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def test_the_split_stages_hold_the_models_own_blocks_and_compute_its_forward() -> None:
    path = prepare(CASE, None, torch.device("cpu"))
    stages = split_stages(path, 2, SPLIT)
    inner = path.model.inner  # type: ignore[union-attr]
    assert [s.inner.blocks[0] for s in stages] == [inner.blocks[0], inner.blocks[2]]
    assert stages[-1].inner.head is inner.head and stages[0].inner.head is None
    held = sorted(id(p) for s in stages for p in s.parameters())
    assert held == sorted(id(p) for p in inner.parameters())
    path.model.eval()  # no dropout: the two stages give the model's logits
    x = path.inputs[0]
    assert torch.equal(stages[1](stages[0](x)), path.model(x))


def test_a_user_model_without_a_split_is_refused_naming_the_option() -> None:
    why = pipeline_refusal(CASE, Pipelining("gpipe", 2))
    assert why is not None and "--split module:function" in why
    assert pipeline_refusal(CASE, Pipelining("gpipe", 2, split=SPLIT)) is None


@pytest.mark.parametrize(("split", "says"), [
    ("pipeline_models:one_stage_short", "returned 1 stage(s) for n_stages=2"),
    ("pipeline_models:not_modules", "returned a function as stage 0"),
    ("pipeline_models:copied_blocks", "that is not the model's"),
    ("pipeline_models:no_such_function", "could not be imported"),
])
def test_a_split_that_gives_no_such_stages_is_refused_before_any_rank(split: str,
                                                                      says: str) -> None:
    why = user_split_refusal(CASE, Pipelining("gpipe", 2, split=split), 2)
    assert why is not None and says in why
    with pytest.raises(InvalidArgument, match="--split="):
        split_stages(prepare(CASE, None, torch.device("cpu")), 2, split)


def test_a_split_beside_the_reference_transformer_is_refused() -> None:
    from gradequiv.harness import find_case

    why = pipeline_refusal(find_case("4L-group2-dropout-untied"),
                           Pipelining("gpipe", 2, split=SPLIT))
    assert why is not None and "split by layers" in why


def test_rows_that_do_not_divide_into_the_micro_batches_are_refused() -> None:
    why = user_split_refusal(CASE, Pipelining("gpipe", 3, split=SPLIT), 2)
    assert why is not None and "8 rows, with micro_batches=3" in why
    assert user_split_refusal(CASE, Pipelining("gpipe", 4, split=SPLIT), 2) is None


@pytest.mark.parametrize(("words", "says"), [
    (["--split", SPLIT], "without --model"),
    (["--model", "user_models:residual_stack"], "needs --split"),
    (["--model", "user_models:residual_stack", "--split", "pipeline_models:not_modules"],
     "returned a function as stage 0"),
    (["--model", "user_models:residual_stack", "--split", SPLIT, "--micro-batches", "3",
      "--case", CASE.to_json()], "8 rows, with micro_batches=3"),
    (["--model", "user_models:residual_stack", "--split", "pipeline_models:one_stage_short",
      "--case", CASE.to_json()], "returned 1 stage(s)"),
])
def test_the_command_exits_2_with_the_rule_before_starting_ranks(
        words: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    from gradequiv.harness.cli import main

    assert main(["distributed", "--impl", "torch", "--wrapper", "pp", *words]) == 2
    assert says in capsys.readouterr().err


def _each(runs: list[tuple[str, Pipelining]]) -> list[Any]:
    from gradequiv.harness import resolve
    from gradequiv.harness.commands.distributed import RankPool
    from gradequiv.harness.engine.parallel import Parallel

    with RankPool(resolve("torch"), world_size=2, timeout_s=120) as pool:
        return [pool.run(CASE, Parallel("pp", pipeline=layout), impl=resolve(impl))
                for impl, layout in runs]


def test_torch_checkpoint_passes_and_a_stack_per_stage_fails_on_the_split_user_model(
        ) -> None:
    """GPipe and 1F1B on two gloo ranks, two micro-batches of four rows: torch's checkpoint
    passes every property the ranks check; a checkpoint that pops its boundaries from one
    stack per stage re-runs micro-batch 0's backward with micro-batch 1's inputs."""
    stack = "pipeline_impls:stage_stack_checkpoint"
    layouts = [Pipelining(s, 2, split=SPLIT) for s in ("gpipe", "1f1b")]
    verdicts = _each([(impl, layout) for impl in ("torch", stack) for layout in layouts])
    for verdict in verdicts[:2]:
        assert verdict.passed, (verdict.error, verdict.failures)
        for rank in verdict.verdicts:
            checked = {p.name for p in rank.properties if p.passed}
            assert {"outputs", "gradients", "recompute"} <= checked
    for verdict in verdicts[2:]:
        assert not verdict.passed and verdict.error is None, verdict.error
        assert any("grad of blocks." in line for line in verdict.failures), verdict.failures
    # where they first part: under GPipe the last stage's re-run of micro-batch 0 pops
    # micro-batch 1's boundary; under 1F1B that stage's backward of micro-batch 0 runs
    # before its next forward, and what parts first is its weights' gradients (the blocks'
    # are missing on the recompute path: the failures say so)
    gpipe, one_f_one_b = verdicts[2:]
    assert gpipe.locus == {"stage": 1, "rank": 1, "micro_batch": 0, "step": 1,
                           "what": "input gradient"}
    assert one_f_one_b.locus == {"stage": 1, "rank": 1, "micro_batch": 0, "step": 1,
                                 "what": "weight gradients"}
    assert one_f_one_b.first_failure.endswith(
        "first differs at stage 1 (rank 1), micro-batch 0: its weights' gradients summed up "
        "to this micro-batch (step 1)")
    assert all(verdict.locus is None for verdict in verdicts[:2])


@pytest.mark.distributed
def test_torch_checkpoint_passes_every_schedule_on_the_split_user_model() -> None:
    """Every schedule of torch 2.13, zero-bubble ones included (four stages, one block or
    the head each, where a rank holds two): the weight pass re-runs a block a second time
    and torch's checkpoint serves it."""
    from gradequiv.harness.engine.schedules import PIPELINE_SCHEDULES

    layouts = [Pipelining(s, 2 if kind.stages_per_rank == 1 else 4, split=SPLIT)
               for s, kind in PIPELINE_SCHEDULES.items()]
    for layout, verdict in zip(layouts, _each([("torch", lay) for lay in layouts]),
                               strict=True):
        assert verdict.passed, (layout.schedule, verdict.error, verdict.failures)
        assert len(verdict.verdicts) == 2


@pytest.mark.distributed
def test_a_drawn_run_with_the_split_fails_the_stack_and_replays_with_split(
        capsys: pytest.CaptureFixture[str]) -> None:
    from gradequiv.harness.cli import main

    assert main(["distributed", "--impl", "pipeline_impls:stage_stack_checkpoint",
                 "--wrapper", "pp", "--model", "user_models:residual_stack", "--split", SPLIT,
                 "--schedule", "1f1b", "--examples", "4"]) == 1
    out = capsys.readouterr().out
    assert "split by pipeline_models:residual_stack_split" in out
    assert f"--split {SPLIT}" in out.split("reproduce: ")[1]


CARRIED = Case(model=ExternalConfig("pipeline_models:mixing_stack"), dtype="fp32")
CARRY = "pipeline_models:carry_input_split"


def test_an_input_a_user_stage_hands_on_unchanged_leaves_as_a_copy() -> None:
    """Every stage of the carrying split returns ``(x, x0)`` with ``x0`` the tensor it was
    given: the stage hands on a copy (zero bubble's input pass detaches each stage output
    in place, which would detach the stage's own input), equal, and the gradient still
    reaches the input through it."""
    path = prepare(CARRIED, None, torch.device("cpu"))
    stages = split_stages(path, 4, CARRY)
    x, x0 = (torch.randn(8, 16).requires_grad_() for _ in range(2))
    out, carried = stages[1](x, x0)
    assert carried is not x0 and torch.equal(carried, x0)
    first_out, first_carried = stages[0](x0)
    assert first_carried is not x0 and torch.equal(first_carried, x0)
    carried.sum().backward()
    assert torch.equal(x0.grad, torch.ones_like(x0))  # type: ignore[arg-type]


@pytest.mark.distributed
def test_torch_checkpoint_passes_zero_bubble_where_a_user_stage_hands_its_input_on() -> None:
    """Each block reads the model's input ``x0`` (a product: what its re-run saves depends on
    whether ``x0`` needs a gradient), and every stage hands ``x0`` on as it came. Were the
    stage's output its own input, zero bubble's input pass would detach it, and torch's
    checkpoint would raise at the weight pass ("A different number of tensors was saved",
    torch 2.13): a fault of the split's plumbing, not of the recompute."""
    layouts = [Pipelining(s, 4, split=CARRY)
               for s in ("interleaved-zero-bubble", "zbv-zero-bubble")]
    from gradequiv.harness import resolve
    from gradequiv.harness.commands.distributed import RankPool
    from gradequiv.harness.engine.parallel import Parallel

    with RankPool(resolve("torch"), world_size=2, timeout_s=120) as pool:
        for layout in layouts:
            verdict = pool.run(CARRIED, Parallel("pp", pipeline=layout))
            assert verdict.passed, (layout.schedule, verdict.error, verdict.failures)

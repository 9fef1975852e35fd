"""Where a pipeline case's two paths first part (``engine.boundaries``), without ranks: the
watch on a stage's per-micro-batch calls, and the order in which differences are taken."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import torch
from torch import nn

from gradequiv.harness.engine.boundaries import Locus, first_difference, watch_for


class _Stage:
    """A stage as torch's schedule calls it: one chunk at a time, the input gradient left
    in ``bwd_cache``, the weights' gradients accumulated."""

    def __init__(self, index: int, broken_chunk: int | None = None) -> None:
        self.stage_index, self.broken_chunk = index, broken_chunk
        self.submod = nn.Linear(2, 2)
        self.bwd_cache: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self.inputs: dict[int, torch.Tensor] = {}

    def forward_one_chunk(self, chunk: int, args: tuple[Any, ...]) -> torch.Tensor:
        self.inputs[chunk] = args[0].detach().requires_grad_()
        return self.submod(self.inputs[chunk])

    def backward_one_chunk(self, chunk: int, loss: Any = None,
                           full_backward: bool = True) -> None:
        out = self.submod(self.inputs[chunk]).sum()
        scale = 2.0 if chunk == self.broken_chunk else 1.0
        (out * scale).backward()
        self.bwd_cache[chunk] = (self.inputs[chunk].grad, None)

    def backward_weight_one_chunk(self, chunk: int) -> None:
        raise RuntimeError("freed")


def _path(side: str, broken_chunk: int | None) -> None:
    torch.manual_seed(0)
    stage = _Stage(1, broken_chunk)
    watch = watch_for(side)
    watch.attach(stage)
    watch.step = 1
    for chunk in (0, 1):
        stage.forward_one_chunk(chunk, (torch.ones(3, 2) * (chunk + 1),))
    for chunk in (0, 1):
        stage.backward_one_chunk(chunk)


def test_the_watch_finds_the_micro_batch_whose_backward_parts() -> None:
    _path("full", None)
    _path("recompute", None)
    assert first_difference(rank=3) is None
    _path("recompute", broken_chunk=1)  # micro-batch 0 right, 1's gradients doubled
    assert first_difference(rank=3) == Locus(1, 3, 1, 1, "input gradient")
    _path("full", None)  # the next case: nothing to compare until its recompute runs
    assert first_difference(rank=3) is None


def test_the_pass_that_raised_is_named_with_its_stage_and_micro_batch() -> None:
    watch = watch_for(None)
    stage = _Stage(2)
    watch.attach(stage)
    with pytest.raises(RuntimeError, match="freed"):
        stage.backward_weight_one_chunk(0)
    assert watch.where_raised(rank=1) == "stage 2 (rank 1), micro-batch 0, in its weight pass"


def test_the_earliest_difference_follows_the_flow_of_a_step() -> None:
    """Outputs first stage first, then the backward's gradients last stage first; within a
    stage its micro-batches in order, the input gradient before the weights'."""
    found = [Locus(0, 0, 1, 2, "output"),  # a later step: last
             Locus(0, 0, 0, 1, "weight gradients"),  # the first stage's backward: after 1's
             Locus(1, 1, 1, 1, "input gradient"),
             Locus(1, 1, 1, 1, "weight gradients"),
             Locus(1, 1, 0, 1, "weight gradients"),  # micro-batch 0 before 1
             Locus(2, 0, 1, 1, "output")]  # forward before any backward
    ordered = sorted(found, key=lambda locus: locus.order)
    assert ordered == [found[5], found[4], found[2], found[3], found[1], found[0]]
    assert found[2].describe() == ("first differs at stage 1 (rank 1), micro-batch 1: the "
                                   "gradient it hands back for its input (step 1)")


def test_report_json_takes_either_kind_of_pipeline_locus() -> None:
    from gradequiv.harness.reports.bundle import report_schema

    item = report_schema()["properties"]["minimal_failures"]["items"]["properties"]
    check = jsonschema.Draft202012Validator(item["pipeline"])
    check.validate(Locus(1, 1, 0, 1, "input gradient").to_dict())
    check.validate({"where": "stage 2 (rank 0), micro-batch 0, in its weight pass"})
    with pytest.raises(jsonschema.ValidationError):
        check.validate({**Locus(1, 1, 0, 1, "output").to_dict(), "what": "loss"})

"""One way to make a path ready: the same model, routing, inputs and random stream for all.

Every command that trains a case (the verdict's runner, the op-level search,
the profile, the distributed ranks) builds the workload from the case's seed,
routes the selected segments through the implementation or plainly (the
full-storage path), seeds the one stream training draws from, and runs the
forward under the case's autocast. Written once here, so that two paths of
one case differ in the implementation only, never in how they were set up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradequiv.harness.engine.case import Case
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.models import Segment, Workload, build
from gradequiv.models.segments import RoutedModel

__all__ = ["PreparedPath", "build_path", "prepare", "seed_training_stream", "training_seed"]


def training_seed(case: Case) -> int:
    """The seed of the stream training draws from (dropout masks, drop-path, rrelu).

    ``case.seed`` itself makes the weights and the batch; one past it keeps the
    masks from being drawn off the same stream as the initial weights, while
    still fixed by the case, so every path, and a replay, draws the same ones.
    """
    return case.seed + 1


def seed_training_stream(seed: int, device: torch.device) -> None:
    """Seed the global generators the path draws from.

    Cheaper than ``torch.manual_seed``, which also queues a lazy seed for every
    CUDA device (with a stack trace) even where none is in use.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


@dataclass
class PreparedPath:
    """A case's workload on one device, its selected segments and its own inputs."""

    case: Case
    device: torch.device
    workload: Workload
    segments: list[Segment]
    inputs: tuple[Tensor | None, ...]  # leaf copies of the workload's inputs: see build_path
    targets: Tensor

    @property
    def model(self) -> RoutedModel:
        return self.workload.model

    def install(self, impl: Implementation | None) -> None:
        """Route the segments through ``impl``; ``None`` calls them plainly (full storage),
        still installed, so they stay observable as segments."""
        if impl is not None:
            impl.install(self.model, self.segments)
        else:
            self.model.router.install(self.segments, None)

    def seed(self, offset: int = 0) -> None:
        """Seed the training stream (``offset``: a distributed rank's own masks)."""
        seed_training_stream(training_seed(self.case) + offset, self.device)

    def not_activations(self) -> list[Tensor]:
        """Parameters, buffers and inputs: alive whether or not anything is recomputed, so
        never counted as held activation bytes."""
        return [*self.model.parameters(), *self.model.buffers(),
                *(t for t in self.inputs if t is not None)]

    def forward(self, call: Callable[..., Any] | None = None) -> tuple[Any, Tensor]:
        """Outputs and loss of one forward under the case's autocast (backward stays
        outside it); ``call``: the model as wrapped (compiled, DDP), by default itself."""
        with self.case.autocast(self.device):
            outputs = (self.model if call is None else call)(*self.inputs)
            return outputs, self.workload.loss_fn(outputs, self.targets)


def build_path(case: Case, device: torch.device) -> PreparedPath:
    """The workload from the case's seed, nothing installed, the stream not seeded yet.

    Inputs that require grad are copied into leaves of this path's own, so two
    paths never share an input gradient.
    """
    workload = build(case.model, case.batch, case.seed, device)
    inputs = tuple(
        t.detach().clone().requires_grad_() if t is not None and t.requires_grad else t
        for t in workload.inputs
    )
    return PreparedPath(case, device, workload, workload.segments(case.granularity), inputs,
                        workload.targets)


def prepare(case: Case, impl: Implementation | None, device: torch.device, *,
            seed_offset: int = 0) -> PreparedPath:
    """``build_path``, then ``impl`` installed, training mode on and the stream seeded.

    Callers that must catch what the installation raises (the runner) take
    the steps one by one instead.
    """
    path = build_path(case, device)
    path.install(impl)
    path.model.train()
    path.seed(seed_offset)
    return path

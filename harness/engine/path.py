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
from gradequiv.models.kinds import ACCUMULATED_MICRO_BATCHES
from gradequiv.models.segments import RoutedModel

__all__ = ["ADAPTER_PARAMETERS", "MICRO_BATCHES", "PreparedPath", "build_path", "micro_batches",
           "prepare", "seed_training_stream", "training_seed"]

#: Micro-batches accumulated per optimizer step when a case asks for accumulation.
MICRO_BATCHES = ACCUMULATED_MICRO_BATCHES


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

    def install(self, impl: Implementation | None) -> list[Segment]:
        """Route the segments through ``impl``; ``None`` calls them plainly (full storage),
        still installed, so they stay observable as segments. Returns the segments a toggle
        left plain (:meth:`Implementation.install`)."""
        if impl is not None:
            return impl.install(self.model, self.segments)
        self.model.router.install(self.segments, None)
        return []

    def seed(self, offset: int = 0) -> None:
        """Seed the training stream (``offset``: a distributed rank's own masks)."""
        seed_training_stream(training_seed(self.case) + offset, self.device)

    def not_activations(self) -> list[Tensor]:
        """Parameters, buffers and inputs: alive whether or not anything is recomputed, so
        never counted as held activation bytes."""
        return [*self.model.parameters(), *self.model.buffers(),
                *(t for t in self.inputs if t is not None)]

    def forward(self, call: Callable[..., Any] | None = None,
                batch: tuple[tuple[Tensor | None, ...], Tensor] | None = None
                ) -> tuple[Any, Tensor]:
        """Outputs and loss of one forward under the case's autocast (backward stays
        outside it); ``call``: the model as wrapped (compiled, DDP), by default itself;
        ``batch``: inputs and targets of one micro-batch, by default the whole batch."""
        inputs, targets = batch if batch is not None else (self.inputs, self.targets)
        with self.case.autocast(self.device):
            outputs = (self.model if call is None else call)(*inputs)
            return outputs, self.workload.loss_fn(outputs, targets)

    def micro_batches(self) -> list[tuple[tuple[Tensor | None, ...], Tensor]]:
        """The batches of one optimizer step: the whole batch, or its micro-batches when the
        case accumulates or has a schedule (made afresh each step: a slice's graph lives
        for one backward)."""
        n = self.case.micro_batch_count
        if n == 1:
            return [(self.inputs, self.targets)]
        return micro_batches(self.inputs, self.targets, n)

    def set_trainable(self, step: int) -> None:
        """Which parameters train at ``step`` (``case.trainable``), set before its forward:
        ``requires_grad_`` on the model's own parameters, as partial fine-tuning does."""
        trainable = self.case.trainable
        if trainable == "all":
            return
        if trainable == "adapters":
            if step == 1:
                for name, p in self.model.named_parameters():
                    p.requires_grad_(name.rsplit(".", 1)[-1] in ADAPTER_PARAMETERS)
                _make_input_require_grads(self.model)
            return
        frozen = trainable == "frozen-layer" or step % 2 == 1
        first = self.segments[0] if self.segments else None
        modules = (first.counted if first is not None else ())
        for module in modules:
            for p in module.parameters():
                p.requires_grad_(not frozen)


#: The parameters that train under ``trainable="adapters"``: the reference transformer's LoRA
#: pairs and steering vectors (``value_hooks``).
ADAPTER_PARAMETERS = ("lora_a", "lora_b", "steering")


def _make_input_require_grads(model: torch.nn.Module) -> None:
    """The token embedding's output requires grad, as ``enable_input_require_grads`` in
    transformers makes it for adapters over frozen embeddings (a reentrant checkpoint
    gives its segment no gradients when none of its inputs requires grad)."""
    embedding = getattr(model, "wte", None)
    if isinstance(embedding, torch.nn.Module):
        embedding.register_forward_hook(lambda _m, _a, out: out.requires_grad_(True))


def micro_batches(inputs: tuple[Tensor | None, ...], targets: Tensor, n: int
                  ) -> list[tuple[tuple[Tensor | None, ...], Tensor]]:
    """``n`` micro-batches: rows of the batch split along its first dimension, so that each
    micro-batch differs (a recompute that reuses an earlier one's inputs shows), or, where
    the batch has fewer rows than ``n`` or inputs of other shapes (a user's model), the
    whole batch ``n`` times. Slices of an input leaf send their gradient to the leaf."""
    rows = targets.shape[0] if targets.dim() else 0
    splittable = rows >= n and all(t is None or (t.dim() > 0 and t.shape[0] == rows)
                                   for t in inputs)
    if not splittable:
        return [(inputs, targets)] * n
    parts = [t.tensor_split(n) if t is not None else [None] * n for t in inputs]
    return [(tuple(p[k] for p in parts), targets.tensor_split(n)[k]) for k in range(n)]


def build_path(case: Case, device: torch.device) -> PreparedPath:
    """The workload from the case's seed, nothing installed, the stream not seeded yet.

    Inputs that require grad are copied into leaves of this path's own, so two
    paths never share an input gradient. A regime that casts the model (``bf16-model``)
    casts its float inputs with it.
    """
    workload = build(case.model, case.batch, case.seed, device)
    dtype = case.model_dtype
    if dtype is not None:
        workload.model.to(dtype)
    inputs = tuple(_own_input(t, dtype) for t in workload.inputs)
    return PreparedPath(case, device, workload, workload.segments(case.granularity), inputs,
                        workload.targets)


def _own_input(t: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    if t is None:
        return None
    if dtype is not None and t.is_floating_point():
        t = t.detach().to(dtype).requires_grad_(t.requires_grad)
    return t.detach().clone().requires_grad_() if t.requires_grad else t


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

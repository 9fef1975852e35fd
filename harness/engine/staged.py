"""One path of a case trained through torch's pipeline schedule on this rank, recorded as
``run_path`` records a path, so that ``verify`` compares two of them as it compares any.

Each rank holds its stages (``pipeline.StagedPath``) and runs ``schedule.step`` for every
optimizer step: the schedule's forwards, its backwards (split into an input pass and a
weight pass under zero bubble), the loss on the last stage, all of it torch's. What the
properties read is then put together on every rank: each parameter's gradient from the
rank whose stage holds it, the loss and the logits from the last stage, the segment calls
summed over the ranks, and the buffers and weights of each stage from its rank. The RNG
states are this rank's own (the two paths of one rank draw from one stream). What the
memory watch reads is not taken: the schedule's sends keep tensors the runner cannot
tell from held activations.
"""

from __future__ import annotations

import time
import traceback
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gradequiv.harness.engine.boundaries import watch_for
from gradequiv.harness.engine.global_state import snapshot
from gradequiv.harness.engine.path import build_path
from gradequiv.harness.engine.pipeline import RankStep, StagedPath
from gradequiv.harness.engine.runner import (
    LEARNING_RATE,
    MOMENTUM,
    PathRun,
    StepRecord,
    _count_calls,
    _counted_modules,
    _reset,
    _rng_states,
    start_step,
)
from gradequiv.models.segments import UserNames

if TYPE_CHECKING:
    from gradequiv.harness.engine.case import Case
    from gradequiv.harness.engine.parallel import RankSetup
    from gradequiv.harness.implementations.adapters import Implementation

__all__ = ["StagedPathError", "run_staged"]


class StagedPathError(RuntimeError):
    """A path raised on this rank inside the pipeline: the case ends on every rank.
    ``where``: the stage, micro-batch and pass that raised, in words ("" where it raised
    outside a stage's call)."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.where = where


class _InBackward:
    """The phase a segment's call falls in, read as it happens: inside autograd's engine
    (a backward pass the schedule started, between other micro-batches' forwards) or not;
    None inside the stages' metadata inference (their first step's extra forward and
    backward on fresh tensors, which no training step makes: not counted)."""

    def __init__(self) -> None:
        self.inferring = False
        self.tasks: set[int] = set()  # the backward passes (graph tasks) that re-ran a segment

    @property
    def index(self) -> int | None:
        if self.inferring:
            return None
        task = torch._C._current_graph_task_id()
        if task == -1:
            return 0
        self.tasks.add(task)
        return 1

    def watch(self, stage: Any) -> None:
        """Mark ``stage``'s metadata inference passes (torch 2.13's names; a stage without
        them infers nothing this way, and nothing is marked)."""
        for name in ("_forward_metadata_inference", "_backward_metadata_inference"):
            method = getattr(stage, name, None)
            if method is not None:
                setattr(stage, name, self._marked(method))

    def _marked(self, method: Any) -> Any:
        def marked(*args: Any, **kwargs: Any) -> Any:
            self.inferring = True
            try:
                return method(*args, **kwargs)
            finally:
                self.inferring = False

        return marked


def run_staged(case: Case, impl: Implementation | None, *, device: torch.device,
               ranks: RankSetup, start_from: PathRun | None = None,
               steps: int | None = None, count_memory: bool = False,
               compiled: Any = None) -> PathRun:
    """Train ``case`` through ``ranks``' pipeline on this rank (``impl=None``: full storage),
    every step from ``start_from``'s state where given, as ``run_path`` does
    (``count_memory`` and ``compiled`` are taken and not used: no memory is watched, and a
    compiled model is no stage)."""
    pipelining = ranks.parallel.pipeline
    assert pipelining is not None
    run = PathRun()
    path = build_path(case, device)
    model = path.model
    router = getattr(model, "router", None)
    names = UserNames(model)
    where = "setup"
    # what crosses the stages' boundaries, kept for full storage and the recompute (a
    # failing case says where they first part); the floor's path is compared with nothing
    watch = watch_for("full" if impl is None and start_from is None
                      else "recompute" if impl is not None else None)
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            path.install(impl)
            if router is not None and start_from is not None:
                router.expected = start_from.returns
            counted = _counted_modules(names, path.segments)
            phase = _InBackward()
            calls = _count_calls(counted, phase)
            params = names.parameters()
            optimizer = torch.optim.SGD([p for _, p in params], lr=LEARNING_RATE,
                                        momentum=MOMENTUM)
            model.train()
            path.seed(ranks.rank)  # each rank its own stream, the same on both paths
            staged = StagedPath(path, pipelining, ranks.rank, ranks.world_size)
            for stage in staged.torch_stages:
                phase.watch(stage)
                watch.attach(stage)
            mine = {n for n, _ in staged.local_parameters}
            held = {id(b) for stage in staged.stages for b in stage.buffers()}
            own_buffers = [(n, b) for n, b in names.buffers() if id(b) in held]  # its stages'
            n_steps = case.steps if steps is None else steps
            for step in range(1, n_steps + 1):
                where = f"step {step} start"
                watch.step = step
                start_step(step, run, start_from, params, optimizer, device)
                optimizer.zero_grad(set_to_none=True)
                _reset(calls)
                phase.tasks.clear()
                where = f"step {step} (the schedule's forwards and backwards)"
                done = staged.step(optimize=False)
                run.steps.append(_record(done, params, own_buffers, calls, device,
                                         pipelining.micro_batches, len(phase.tasks)))
                optimizer.step()
            where = "the end"
            run.params = _gathered({n: p.detach() for n, p in params if n in mine})
        except Exception as exc:
            # One process's path cannot fail alone here: its peers wait on its sends for
            # ever. The rank ends the case with what it raised (the pool says so).
            side = "full-storage" if impl is None else "recompute"
            raised_in = watch.where_raised(ranks.rank)
            at = f"{where}, {raised_in}" if raised_in else where
            raise StagedPathError(
                f"the {side} path raised on rank {ranks.rank} at {at} under "
                f"{ranks.parallel.describe()}:\n{traceback.format_exc()}", raised_in) from exc
    run.seconds = time.perf_counter() - started
    run.global_state = snapshot()
    run.returns = router.returns if router is not None else []
    run.warnings = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    return run


def _record(done: RankStep, params: list[tuple[str, Any]],
            own_buffers: list[tuple[str, Tensor]], calls: dict[str, list[int]],
            device: torch.device,
            micro_batches: int, tasks: int) -> StepRecord:
    """The step as ``run_path`` records one, put together from every rank. ``tasks``: the
    backward passes on this rank that re-ran a segment; a schedule that splits backward
    into an input pass and weight passes (torch's weight pass asks autograd once per group
    of parameters) makes several per micro-batch, and each may re-run a segment once."""
    local = {
        "grads": {f"param:{n}": g for n, g in done.grads.items()},
        "buffers": {n: b.detach().clone() for n, b in own_buffers},
        "loss": torch.stack(done.losses).sum() / micro_batches if done.losses else None,
        "outputs": done.output,
        "calls": {n: list(c) for n, c in calls.items()},
        "passes": -(-tasks // micro_batches),
    }
    every = _all(local)
    grads: dict[str, Tensor | None] = {f"param:{n}": None for n, _ in params}
    buffers: dict[str, Tensor] = {}
    summed = {n: [0] * len(c) for n, c in calls.items()}
    loss = outputs = None
    for seen in every:
        grads.update(seen["grads"])
        buffers.update(seen["buffers"])
        for n, counts in seen["calls"].items():
            summed[n] = [a + b for a, b in zip(summed[n], counts)]
        if seen["loss"] is not None:
            loss, outputs = seen["loss"], seen["outputs"]
    assert loss is not None and outputs is not None, "no rank held the last stage"
    return StepRecord(loss=loss, outputs=outputs, grads=grads, buffers=buffers,
                      rng=_rng_states(device), calls=summed,
                      backward_passes=max(1, *(seen["passes"] for seen in every)))


def _all(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (small: one step's record of a small model)."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def _gathered(local: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each rank's tensors by name, joined: every stage's from the rank that holds it."""
    joined: dict[str, Tensor] = {}
    for seen in _all(local):
        joined.update(seen)
    return joined

"""What crosses each pipeline stage's boundary, per micro-batch, on this rank: the stage's
forward output and the gradient it hands back for its input, kept on both paths, so that a
failing pipeline case can say where full storage and recompute first part: the stage (and
its rank) and the micro-batch. The stage's weights' gradients as they stand after each
micro-batch's backward are kept too: the first stage hands no gradient back (its input is
the tokens), and a fault there shows in its weights only.

All are read from torch's own ``PipelineStage`` calls (``forward_one_chunk`` returns the
output; ``backward_one_chunk`` leaves the input gradient in ``bwd_cache``; a full backward
or a weight pass leaves the weights' gradients summed so far), not recomputed: the watch
costs a clone of each, and sees the pass that was running when a path raised (the
forward, a full backward, zero bubble's input pass or its weight pass).

The earliest difference is taken in the order data flows within an optimizer step: the
stages' outputs first stage first, then the backward's gradients last stage first
(backward runs from the loss), each stage's micro-batches in order (the input gradient
before the weights'); an earlier step before a later.
Boundaries are compared bitwise: on one device the two paths run the same ops in the same
order, and a correct recompute leaves them bitwise equal (what the verdict itself bounds
is the parameters' gradients; this only says where they started to part).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["BoundaryWatch", "Locus", "first_difference", "watch_for"]

#: what a locus names, in the order a micro-batch of one stage makes them
WHAT = ("output", "input gradient", "weight gradients")
#: the passes a stage runs for a micro-batch, by the method torch's schedule calls
_FORWARD, _BACKWARD, _INPUT, _WEIGHT = "forward", "backward", "input pass", "weight pass"


@dataclass(frozen=True)
class Locus:
    """Where the two paths first part: the stage (its index, and the rank that holds it),
    the micro-batch, the optimizer step and what differs there."""

    stage: int
    rank: int
    micro_batch: int
    step: int
    what: str  # one of WHAT: its forward output, its input's gradient, its weights'

    @property
    def order(self) -> tuple[int, int, int, int, int]:
        """Its place in the flow of a step: outputs first stage first, then the backward's
        gradients last stage first (stage numbers negated), micro-batches in order."""
        backward = self.what != "output"
        return (self.step, int(backward), -self.stage if backward else self.stage,
                self.micro_batch, WHAT.index(self.what))

    def describe(self) -> str:
        said = {"output": "its forward output",
                "input gradient": "the gradient it hands back for its input",
                "weight gradients": "its weights' gradients summed up to this micro-batch"
                }[self.what]
        return (f"first differs at stage {self.stage} (rank {self.rank}), micro-batch "
                f"{self.micro_batch}: {said} (step {self.step})")

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "rank": self.rank, "micro_batch": self.micro_batch,
                "step": self.step, "what": self.what}


@dataclass
class BoundaryWatch:
    """One path's boundaries on this rank, by (step, stage, micro-batch), and the pass that
    was running when the path raised."""

    step: int = 0
    outputs: dict[tuple[int, int, int], tuple[Tensor, ...]] = field(default_factory=dict)
    input_grads: dict[tuple[int, int, int], tuple[Tensor, ...]] = field(default_factory=dict)
    weight_grads: dict[tuple[int, int, int], tuple[Tensor, ...]] = field(default_factory=dict)
    running: tuple[int, int, str] | None = None  # (stage, micro-batch, pass)
    raised_in: tuple[int, int, str] | None = None  # the pass running when it first raised

    def attach(self, stage: Any) -> None:
        """Wrap ``stage``'s (a torch ``PipelineStage``) per-micro-batch calls."""
        index = stage.stage_index
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        weight = stage.backward_weight_one_chunk
        params = list(stage.submod.parameters())

        def weights_after(chunk: int) -> None:
            self.weight_grads[self.step, index, chunk] = _kept(
                [p.grad for p in params if p.grad is not None])

        def forward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            output = self._running(index, chunk, _FORWARD, forward, chunk, *args, **kwargs)
            self.outputs[self.step, index, chunk] = _kept(output)
            return output

        def backward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            split = kwargs.get("full_backward", args[1] if len(args) > 1 else True) is False
            done = self._running(index, chunk, _INPUT if split else _BACKWARD, backward,
                                 chunk, *args, **kwargs)
            grads = stage.bwd_cache.get(chunk)
            if grads:
                self.input_grads[self.step, index, chunk] = _kept(grads)
            if not split:
                weights_after(chunk)
            return done

        def backward_weight_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            done = self._running(index, chunk, _WEIGHT, weight, chunk, *args, **kwargs)
            weights_after(chunk)
            return done

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def _running(self, index: int, chunk: int, kind: str, method: Any, *args: Any,
                 **kwargs: Any) -> Any:
        self.running = (index, chunk, kind)
        try:
            return method(*args, **kwargs)
        except BaseException:
            self.raised_in = self.raised_in or self.running
            raise

    def where_raised(self, rank: int) -> str:
        """The pass that raised, in words ("" where none did inside a stage's call)."""
        if self.raised_in is None:
            return ""
        stage, chunk, kind = self.raised_in
        return f"stage {stage} (rank {rank}), micro-batch {chunk}, in its {kind}"


def _kept(value: Any) -> tuple[Tensor, ...]:
    """The tensors of a stage's output or input gradients, detached copies (None and
    non-tensors left out: what crossed the boundary as a tensor)."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    return tuple(t.detach().clone() for t in items if isinstance(t, Tensor))


#: this rank's last full-storage and recompute paths' watches (``staged.run_staged``)
_WATCHES: dict[str, BoundaryWatch] = {}


def watch_for(side: str | None) -> BoundaryWatch:
    """A fresh watch for one path: kept as this rank's ``side`` ("full" or "recompute")
    for :func:`first_difference`; ``None`` (a path nothing compares it with, the floor's):
    kept nowhere."""
    watch = BoundaryWatch()
    if side == "full":  # a new case: the last one's recompute is compared with nothing
        _WATCHES.pop("recompute", None)
    if side is not None:
        _WATCHES[side] = watch
    return watch


def first_difference(rank: int) -> Locus | None:
    """Where this rank's last full-storage and recompute paths first part, at its stages'
    boundaries; None where every boundary is bitwise equal (or a path was not watched)."""
    full, recompute = _WATCHES.get("full"), _WATCHES.get("recompute")
    if full is None or recompute is None:
        return None
    found: list[Locus] = []
    for what, ours, theirs in (("output", full.outputs, recompute.outputs),
                               ("input gradient", full.input_grads, recompute.input_grads),
                               ("weight gradients", full.weight_grads,
                                recompute.weight_grads)):
        for (step, stage, chunk), tensors in ours.items():
            other = theirs.get((step, stage, chunk))
            if other is None or not _equal(tensors, other):
                found.append(Locus(stage, rank, chunk, step, what))
    return min(found, key=lambda locus: locus.order, default=None)


def _equal(a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))

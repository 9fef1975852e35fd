"""Recompute faults that a pipeline runtime meets (``--impl pipeline_impls:NAME``): each is
right where a step runs one forward and then its backward, and wrong once micro-batches are
in flight, as torch's schedules keep them.

- ``module_slot_checkpoint``: the boundary and the RNG state kept in one slot per module,
  as torchgpipe's and early pippy's stash keyed by partition, not by micro-batch: the next
  micro-batch's forward overwrites the slot before the first one's backward re-runs.
- ``frees_after_first_pass``: the saved inputs let go of by the first backward through the
  call, as a checkpoint that frees its stash when backward reaches it: right where each
  micro-batch has one backward (GPipe, 1F1B), wrong under zero bubble, whose weight pass
  is a second backward through the same call.
- ``stage_stack_checkpoint``: every call's boundary and RNG state pushed on one stack per
  process (per stage, where a rank holds one), each backward taking the top: right wherever
  backward runs the calls in the reverse of their forwards (one process, its micro-batches
  summed into one backward, which autograd runs latest first), wrong under torch's
  schedules, which run micro-batch 0's backward first.
- ``autocast_read_at_rerun``: the re-run computes under whatever autocast is on when
  backward reaches it, not the state the forward ran under: right where the loop's backward
  runs inside the forward's autocast block, wrong under a schedule, which enters autocast
  per stage in its forward and runs every backward outside it (the re-run in fp32, the
  forward in bf16).

The correct peers beside them are ``correct_impls:call_keyed_stash_checkpoint`` (a stash
keyed by a token only the call's autograd context holds) and
``correct_impls:graph_task_checkpoint`` (saved-tensor hooks, one re-run per backward pass).
"""

from __future__ import annotations

from typing import Any

import torch
from correct_impls import call_parts

#: module -> (its last call's inputs, the RNG state before it): one slot each
_SLOTS: dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}
#: (inputs, RNG state) of the calls whose backward has not run yet, latest on top
_STACK: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]] = []


class _Kept(torch.autograd.Function):
    """Reentrant: the segment run without a graph, its inputs and RNG state kept where
    ``keep`` says (``slot``: one per module, under ``key``; ``frees``: on the call's own
    context until its first backward; ``call``: on the call's own context; ``stack``: on
    ``_STACK``), re-run in backward under whatever autocast is on then."""

    @staticmethod
    def forward(ctx: Any, run: Any, keep: str, key: int, n_params: int,
                *tensors: torch.Tensor) -> Any:
        inputs = tensors[:len(tensors) - n_params]
        ctx.run, ctx.keep, ctx.key = run, keep, key
        ctx.needs = [t.requires_grad for t in inputs]
        ctx.params = tensors[len(tensors) - n_params:]
        kept = (tuple(t.detach() for t in inputs), torch.get_rng_state())
        if keep == "slot":
            _SLOTS[key] = kept
        elif keep == "stack":
            _STACK.append(kept)
        else:
            ctx.kept = kept
        with torch.no_grad():
            return run(list(inputs))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if ctx.keep == "slot":
            saved, rng = _SLOTS[ctx.key]  # whichever call filled the slot last
        elif ctx.keep == "stack":
            saved, rng = _STACK.pop()  # whichever call was pushed last
        else:
            kept = ctx.kept
            if ctx.keep == "frees":
                ctx.kept = None  # freed: the first backward has it
            if kept is None:
                raise RuntimeError("the checkpoint's saved inputs were freed by an earlier "
                                   "backward pass")
            saved, rng = kept
        inputs = [t.detach().requires_grad_(n) for t, n in zip(saved, ctx.needs)]
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(rng)
            out = ctx.run(inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        wanted = [t for t in inputs if t.requires_grad] + list(ctx.params)
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                       allow_unused=True))
        input_grads = [next(got) if n else None for n in ctx.needs]
        return (None, None, None, None, *input_grads, *got)


def _kept(keep: str, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    run, tensors, params = call_parts(function, args, kwargs)
    if keep == "stack" and not torch.is_grad_enabled():
        return function(*args, **kwargs)  # no backward will pop it (an inference pass)
    return _Kept.apply(run, keep, id(function), len(params),  # type: ignore[no-untyped-call]
                       *tensors, *params)


def module_slot_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Reentrant, its inputs and RNG state in one slot per module (see the module's doc)."""
    return _kept("slot", function, args, kwargs)


def frees_after_first_pass(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Reentrant, its saved inputs freed by the first backward through the call (see the
    module's doc)."""
    return _kept("frees", function, args, kwargs)


def stage_stack_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Reentrant, every call's inputs and RNG state on one stack per process, each backward
    popping the top: the boundary kept per stage, in forward order, instead of per
    micro-batch. A stage's list of boundaries is what Megatron's 1F1B loop keeps
    (``input_tensors``, taken back with ``pop(0)``: oldest first, as 1F1B runs backward);
    taken from the end it is right only where backward runs latest first. torch's own stage
    had the fault on its backward side (pytorch/pytorch#139404, "stage only stores most
    recent backward result": kept per stage, not indexed by micro-batch, wrong once
    backwards are reordered)."""
    return _kept("stack", function, args, kwargs)


def autocast_read_at_rerun(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Reentrant, its inputs and RNG state its own, the re-run under the autocast state of
    the moment backward reaches it, as fairscale's ``checkpoint_wrapper`` re-runs (it asks
    ``torch.is_autocast_enabled()`` inside backward; facebookresearch/fairscale#1199), as
    Megatron's ``tensor_parallel.checkpoint`` re-runs outside the forward's FP8 autocast
    (NVIDIA/Megatron-LM#7538), and as torch's reentrant checkpoint kept only part of the
    forward's state (pytorch/pytorch#71124, fixed by #71169). Right where the loop runs
    backward inside the forward's autocast block; a pipeline stage enters autocast in its
    forward only, and the schedule runs backward outside it."""
    return _kept("call", function, args, kwargs)

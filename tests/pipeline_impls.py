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

The correct peer beside it is ``correct_impls:call_keyed_stash_checkpoint`` (a stash keyed
by a token only the call's autograd context holds).
"""

from __future__ import annotations

from typing import Any

import torch
from correct_impls import call_parts

#: module -> (its last call's inputs, the RNG state before it): one slot each
_SLOTS: dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}


class _ModuleSlot(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: Any, key: int | None, n_params: int,
                *tensors: torch.Tensor) -> Any:
        inputs = tensors[:len(tensors) - n_params]
        ctx.run, ctx.key, ctx.needs = run, key, [t.requires_grad for t in inputs]
        ctx.params = tensors[len(tensors) - n_params:]
        kept = (tuple(t.detach() for t in inputs), torch.get_rng_state())
        if key is None:  # this call's own, until its first backward
            ctx.kept = kept
        else:
            _SLOTS[key] = kept
        with torch.no_grad():
            return run(list(inputs))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if ctx.key is None:
            kept, ctx.kept = ctx.kept, None  # freed: the first backward has it
            if kept is None:
                raise RuntimeError("the checkpoint's saved inputs were freed by an earlier "
                                   "backward pass")
            saved, rng = kept
        else:
            saved, rng = _SLOTS[ctx.key]  # whichever call filled the slot last
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
        return (None, None, None, *input_grads, *got)


def module_slot_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Reentrant, its inputs and RNG state in one slot per module (see the module's doc)."""
    run, tensors, params = call_parts(function, args, kwargs)
    return _ModuleSlot.apply(run, id(function), len(params),  # type: ignore[no-untyped-call]
                             *tensors, *params)


def frees_after_first_pass(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Reentrant, its saved inputs freed by the first backward through the call (see the
    module's doc)."""
    run, tensors, params = call_parts(function, args, kwargs)
    return _ModuleSlot.apply(run, None, len(params),  # type: ignore[no-untyped-call]
                             *tensors, *params)

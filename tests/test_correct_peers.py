"""Correct recompute code that does what real code does with segments: no false alarms.

Each implementation here is correct (bitwise equal to full storage on the CPU) and arranges
its checkpoints in a way the harness must not read as a fault: torch's checkpoint nested
inside itself, each layer of a group checkpointed on its own inside the group's call,
torch's checkpoint with ``early_stop=False`` and ``determinism_check="none"`` (called
directly and through ``checkpoint_wrapper(checkpoint_fn=...)``), and a boundary store that
keeps each distinct tensor once and still gives each argument position its own leaf.
Every one passes every case of the default spread (the sweep is marked slow); the cases
of the segments that are no plain layer call pass in the default suite too.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradequiv.harness import Case, Implementation, default_cases, verify
from gradequiv.harness.implementations.torch_builtins import flat_outputs, tensors_positional
from gradequiv.models.transformer import MLP, Attention


@contextlib.contextmanager
def _checkpointed(modules: list[nn.Module]) -> Iterator[None]:
    """Each of ``modules`` runs its forward through torch's non-reentrant checkpoint while
    the context is open (its hooks still run around it, in ``__call__``)."""
    for module in modules:
        module.forward = functools.partial(  # type: ignore[method-assign]
            checkpoint, type(module).forward.__get__(module), use_reentrant=False)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def nested_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """torch's non-reentrant checkpoint around the segment, and again around each attention
    and MLP inside it (in its forward and in its recompute alike)."""
    inner = [m for m in function.modules() if isinstance(m, (Attention, MLP))
             and m is not function] if isinstance(function, nn.Module) else []

    def run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        with _checkpointed(inner):
            return function(*inner_args, **inner_kwargs)

    return checkpoint(run, *args, use_reentrant=False, **kwargs)


def per_layer_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """checkpoint_sequential's way: a group of layers is not checkpointed whole; each of its
    layers is, on its own, inside the group's call. A single layer is checkpointed plainly."""
    blocks = getattr(function, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    with _checkpointed(list(blocks)):
        return function(*args, **kwargs)


def no_early_stop_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """torch's checkpoint recomputing the whole segment (no early stop), unchecked."""
    return checkpoint(function, *args, use_reentrant=False, early_stop=False,
                      determinism_check="none", **kwargs)


def no_early_stop_wrapper(module: nn.Module) -> nn.Module:
    """The same through torch's ``checkpoint_wrapper(checkpoint_fn=...)``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(module, checkpoint_fn=functools.partial(
        checkpoint, use_reentrant=False, early_stop=False, determinism_check="none"))


def deduplicating_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A reentrant checkpoint whose boundary store keeps each distinct tensor once (the
    first layer gets the embedding as ``x`` and as ``x0``: one tensor, two positions) and
    in the recompute gives each argument position its own leaf, a view of the stored one,
    so that each position's gradient is its own and autograd sums them into the tensor."""
    call, inputs = tensors_positional(function, args, kwargs)
    unique: list[Any] = []
    where: dict[int, int] = {}
    index: list[int] = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            if id(value) not in where:
                where[id(value)] = len(unique)
                unique.append(value)
            index.append(where[id(value)])
        else:
            index.append(len(unique))
            unique.append(value)
    SHARED.append(len(index) - len(unique))

    def run(*stored: Any) -> Any:
        positions = [stored[i].view_as(stored[i]) if isinstance(stored[i], torch.Tensor)
                     and stored[i].requires_grad else stored[i] for i in index]
        return call(*positions)

    flat, rebuild = flat_outputs(run)  # a reentrant checkpoint follows no tensor in a dict
    return rebuild(checkpoint(flat, *unique, use_reentrant=True))


#: Per call of the deduplicating checkpoint: how many argument positions share a stored tensor.
SHARED: list[int] = []
#: Like torch's reentrant checkpoint, it refuses ``torch.autograd.grad``.
deduplicating_checkpoint.gradequiv_unsupported = ("autograd-grad",)  # type: ignore[attr-defined]

PEERS = [
    Implementation("nested-checkpoint", nested_checkpoint),
    Implementation("per-layer-in-group", per_layer_checkpoint),
    Implementation("no-early-stop", no_early_stop_checkpoint),
    Implementation("no-early-stop-wrapper", no_early_stop_wrapper, adapter="wrapper"),
    Implementation("deduplicating-boundary", deduplicating_checkpoint),
]
#: The named cases whose segments are no plain positional layer call, and the group ones.
NEW_KINDS = ("2L-layer-bf16-nested-inputs-dropout",
             "2L-layer-inplace-ops-manual-attn-relu-dropout", "2L-layer-value-hooks-dropout",
             "2L-layer-outside-params-dropout", "4L-group2-dropout-untied")
CASES = {case.name: case for case in default_cases()}


def _check(impl: Implementation, case: Case) -> None:
    if case.grad_mode not in impl.grad_modes:
        pytest.skip(f"{impl.spec} does not claim {case.grad_mode}")
    verdict = verify(impl, case)
    assert verdict.passed, f"{impl.spec} on {case.name}: {verdict.first_failure}"
    assert verdict.error is None


@pytest.mark.parametrize("name", NEW_KINDS)
@pytest.mark.parametrize("impl", PEERS, ids=lambda i: i.spec)
def test_each_peer_passes_the_new_segment_kinds(impl: Implementation, name: str) -> None:
    _check(impl, CASES[name])


@pytest.mark.slow  # every peer over every named case
@pytest.mark.parametrize("name", [n for n in CASES if n not in NEW_KINDS])
@pytest.mark.parametrize("impl", PEERS, ids=lambda i: i.spec)
def test_each_peer_passes_the_default_spread(impl: Implementation, name: str) -> None:
    _check(impl, CASES[name])


def test_the_peers_really_nest_and_split() -> None:
    """The nested checkpoint runs the attention and MLP through checkpoints of their own,
    and the per-layer one checkpoints each layer of a group and not the group."""
    seen: list[str] = []
    real = checkpoint

    def watch(function: Any, *args: Any, **kwargs: Any) -> Any:
        owner = getattr(function, "__self__", function)
        seen.append(type(owner).__name__)
        return real(function, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.modules[__name__], "checkpoint", watch)
        verdict = verify(Implementation("nested", nested_checkpoint), CASES["2L-layer-nodropout"])
        assert verdict.passed, verdict.first_failure
        assert {"Attention", "MLP", "function"} <= set(seen)
        seen.clear()
        verdict = verify(Implementation("per-layer", per_layer_checkpoint),
                         CASES["4L-group2-dropout-untied"])
        assert verdict.passed, verdict.first_failure
        assert set(seen) == {"Block"}


def test_the_deduplicating_store_keeps_a_shared_tensor_once() -> None:
    """The first layer's ``x`` and ``x0`` are one tensor: stored once, two leaves, and the
    gradients still match full storage's."""
    SHARED.clear()
    verdict = verify(Implementation("dedup", deduplicating_checkpoint),
                     CASES["2L-layer-nodropout"])
    assert verdict.passed, verdict.first_failure
    assert max(SHARED) == 1 and min(SHARED) == 0  # the first layer's call, then the others

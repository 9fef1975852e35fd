"""Which forward calls of a segment saved tensors for backward: those a recompute must re-run.

A segment that saved nothing (a pruned layer returning its input, a view of its
input) has nothing to recompute: torch's non-reentrant checkpoint re-runs a
segment only when backward unpacks a tensor it saved. So on the full-storage
path each call of a counted module is read back from the graph it built: the
autograd nodes created from the call's start on (by their sequence numbers)
that its outputs reach, and whether any of them holds a saved tensor.

Nothing is hooked into autograd itself: a saved-tensors hook on the reference
path would hold each saved output in a reference cycle and silence autograd's
check of in-place changes to saved tensors. A graph the call built but does not
return (kept on the module) is not seen.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node

from gradequiv.harness.engine.outputs import tensor_leaves

__all__ = ["SavedCalls"]

#: Per autograd node type, its attributes that hold saved tensors.
_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


class SavedCalls:
    """Count, per counted module, its forward calls that saved a tensor for backward.

    ``counts[name]`` is ``[calls that saved]``, zeroed like the runner's call counters.
    """

    def __init__(self, counted: Mapping[str, nn.Module]) -> None:
        self.counts: dict[str, list[int]] = {}
        for name, module in counted.items():
            starts: list[int] = []  # the sequence number at each open call's start
            counter = self.counts[name] = [0]
            module.register_forward_pre_hook(functools.partial(_start, starts), prepend=True)
            module.register_forward_hook(functools.partial(_end, starts, counter),
                                         always_call=True)


def _start(starts: list[int], _module: nn.Module, _args: Any) -> None:
    starts.append(torch._C._autograd._get_sequence_nr())


def _end(starts: list[int], counter: list[int], _module: nn.Module, _args: Any,
         output: Any) -> None:
    since = starts.pop()
    if torch.is_grad_enabled():
        counter[0] += saved_since(output, since)


def saved_since(output: Any, since: int) -> bool:
    """Whether a node created at sequence number ``since`` or later, reached from the
    tensors in ``output``, saved a tensor for backward."""
    todo: list[Node | None] = [t.grad_fn for t in tensor_leaves(output)]
    seen: set[int] = set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or node._sequence_nr() < since:
            continue
        seen.add(id(node))
        if _holds_saved(node):
            return True
        todo += [child for child, _ in node.next_functions]
    return False


def _holds_saved(node: Node) -> bool:
    attrs = _SAVED_ATTRS.get(type(node))
    if attrs is None:
        attrs = _SAVED_ATTRS[type(node)] = tuple(
            a for a in dir(node) if a.startswith("_raw_saved_"))
    # A SavedTensor, or a tuple or list of them (TensorList saves, a Function's ctx);
    # None where an optional tensor was not given.
    return any(getattr(node, a) not in (None, (), []) for a in attrs)

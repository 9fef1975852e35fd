"""Which tensor argument of a segment an implementation captured instead of passing.

A hand-written checkpoint (a ``torch.autograd.Function``) sees only the tensors it is
given as inputs. A keyword tensor bound by a closure, or tensors nested in a dict, are
reached in the re-run as the very tensors of the caller's graph: the re-run's inner
backward goes on into that graph and frees it (the next segment sharing the tensor raises
"Trying to backward through the graph a second time"), or, where none of the Function's
inputs requires grad, nothing is recomputed and their gradients are lost. The experiment
that tells which argument: the same case with one argument at a time handed to the
implementation as positional tensors (:func:`passing`); the argument whose passing takes
the fault away is the one captured. :func:`watched` records the arguments a segment is
called with, which of them reach it as the caller's own tensors with grad off (inside a
Function's forward: the mark of one captured, where a detached copy is one dropped), and
the line of the user's code that calls it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradequiv.harness.errors import is_users
from gradequiv.harness.implementations.adapters import Implementation

__all__ = ["Argument", "Calls", "passing", "watched"]


@dataclass(frozen=True)
class Argument:
    """A tensor-holding argument of a segment's call: by keyword (``keyword``) or the
    positional one at ``index``, a structure holding tensors; ``name`` says which."""

    name: str
    keyword: bool
    index: int = -1


@dataclass
class Calls:
    """What :func:`watched` saw: the tensor-holding keyword arguments and nested positional
    ones of the first call, those whose own tensors (requiring grad) reached the segment
    with grad off (``seen``), and the user's line that called the segment."""

    arguments: list[Argument] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    frame: str = ""


def _arguments(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Argument]:
    """The keyword arguments holding a tensor, then the positional structures holding one
    (a positional tensor is an input the Function sees), named as the segment names them."""
    found = [Argument(k, True) for k, v in kwargs.items() if _holds_tensor(v)]
    try:
        names = [p.name for p in inspect.signature(function).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    for i, value in enumerate(args):
        if not isinstance(value, torch.Tensor) and _holds_tensor(value):
            said = f"{names[i]} (a {type(value).__name__} holding tensors)" if i < len(names) \
                else f"positional argument {i} (a {type(value).__name__} holding tensors)"
            found.append(Argument(said, False, i))
    return found


def _holds_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(value)[0])


def _value(argument: Argument, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if argument.keyword:
        return kwargs.get(argument.name)
    return args[argument.index] if argument.index < len(args) else None


def _same_tensors(given: Any, original: Any) -> bool:
    """Whether ``given`` holds the very tensors of ``original``, one of them requiring grad."""
    theirs = [t for t in tree_flatten(original)[0] if isinstance(t, torch.Tensor)]
    ours = [t for t in tree_flatten(given)[0] if isinstance(t, torch.Tensor)]
    return len(ours) == len(theirs) and any(t.requires_grad for t in theirs) and all(
        a is b for a, b in zip(ours, theirs))


class _Segment(nn.Module):
    """A segment module's stand-in: the same parameters (an implementation may read them),
    called through ``call``."""

    def __init__(self, module: nn.Module, call: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self._call = call

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)


def _standing_in(function: Any, call: Callable[..., Any]) -> Any:
    """``call`` in ``function``'s place, a module where ``function`` is one."""
    return _Segment(function, call) if isinstance(function, nn.Module) else call


def _caller() -> str:
    """The innermost frame of the user's code on the stack: ``file:line in function:
    source``, or "" where none is."""
    stack = traceback.extract_stack(sys._getframe(2))
    users = [f for f in stack if is_users(f.filename)]
    if not users:
        return ""
    frame = users[-1]
    said = f"{frame.filename}:{frame.lineno} in {frame.name}"
    return f"{said}: {frame.line.strip()}" if frame.line else said


def watched(impl: Implementation) -> tuple[Implementation, Calls]:
    """``impl`` (a function adapter's) with its segment calls watched, and what it saw."""
    calls = Calls()
    target = impl.target

    @functools.wraps(target)
    def call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        arguments = _arguments(function, args, kwargs)
        if not calls.arguments:
            calls.arguments = arguments

        def segment(*inner: Any, **inner_kwargs: Any) -> Any:
            if not calls.frame:
                calls.frame = _caller()
            if not torch.is_grad_enabled():
                calls.seen.update(a.name for a in arguments if _same_tensors(
                    _value(a, inner, inner_kwargs), _value(a, args, kwargs)))
            return function(*inner, **inner_kwargs)

        return target(_standing_in(function, segment), *args, **kwargs)

    return dataclasses.replace(impl, target=call), calls


def passing(impl: Implementation, argument: Argument) -> Implementation:
    """``impl`` handed ``argument``'s tensors as positional inputs after the segment's own
    (the call rebinds them where they were): what a checkpoint that passes it would see."""
    target = impl.target

    @functools.wraps(target)
    def call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        value = kwargs[argument.name] if argument.keyword else args[argument.index]
        leaves, spec = tree_flatten(value)
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        count = len(args)
        rest = {k: v for k, v in kwargs.items() if not (argument.keyword and k == argument.name)}

        def rebound(*inputs: Any, **options: Any) -> Any:
            filled = list(leaves)
            for i, tensor in zip(slots, inputs[count:]):
                filled[i] = tensor
            given, named = list(inputs[:count]), dict(options)
            if argument.keyword:
                named[argument.name] = tree_unflatten(filled, spec)
            else:
                given[argument.index] = tree_unflatten(filled, spec)
            return function(*given, **named)

        return target(_standing_in(function, rebound), *args, *(leaves[i] for i in slots),
                      **rest)

    return dataclasses.replace(impl, target=call)

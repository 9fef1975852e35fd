"""How a model hands its segments to a recompute implementation.

A reference model never calls a checkpointable segment directly: it calls
``self.router(module, *args, **kwargs)``. The router is shared by every module
of one model and decides, per segment module, whether to call it plainly or
through the plugged-in implementation. This keeps the model's parameter names
identical whatever the granularity, so one state_dict fits every path.

A user's model calls its submodules itself: :mod:`.external` routes them through
the same :class:`Router` (:meth:`Router.run`) without setting anything on them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradequiv.models.granularity import Granularity, layer_runs

#: ``call(module, *args, **kwargs)``: how one selected segment is run.
SegmentCall = Callable[..., Any]


@dataclass(frozen=True)
class Segment:
    """One checkpointable unit: its dotted name and the module that runs it.

    ``counted`` are the modules whose forward calls prove the segment ran
    (the segment itself, or the layers of a group).
    """

    name: str
    module: nn.Module
    counted: tuple[nn.Module, ...]


def layer_segments(granularity: Granularity, layers: Sequence[tuple[str, nn.Module]]
                   ) -> list[Segment]:
    """The segments of one layer each that ``granularity`` selects out of ``layers``
    (name, module), by the rule every model shares (:func:`layer_runs`).

    ``layers`` may be sub-blocks, one per layer (attention or MLP only).
    """
    return [Segment(*layers[run.start], (layers[run.start][1],))
            for run in layer_runs(granularity, len(layers))]


class WrongReturn(TypeError):
    """The implementation returned what no segment returns: named by what it returned,
    before the model raises on it."""


def return_signature(value: Any) -> Any:
    """What a segment call returned, without its values: structure, shapes and dtypes.

    Named fields keep their names: a dict's keys, a dataclass's fields (a ``ModelOutput``
    like one) and a named tuple's, as ``("fields", type name, ((name, signature), ...))``.
    """
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    fields: tuple[str, ...] | None = getattr(type(value), "_fields", None)
    if isinstance(value, tuple) and fields is not None:  # a named tuple
        return ("fields", type(value).__name__,
                tuple((k, return_signature(v)) for k, v in zip(fields, value)))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(return_signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, return_signature(v)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ("fields", type(value).__name__, tuple(
            (f.name, return_signature(getattr(value, f.name))) for f in dataclasses.fields(value)))
    return (type(value).__name__,)


def describe_signature(signature: Any) -> str:
    """``bfloat16[2, 8, 16]``, ``tuple(float32[2, 8], None)``, ``dict(x: float32[4])``,
    ``LayerOutput(hidden_states: float32[2, 8, 16], attentions: None)``."""
    kind = signature[0]
    if kind == "tensor":
        return f"{str(signature[2]).removeprefix('torch.')}{list(signature[1])}"
    if kind in ("dict", "fields"):
        fields = ", ".join(f"{k}: {describe_signature(v)}" for k, v in signature[-1])
        return f"{signature[1] if kind == 'fields' else 'dict'}({fields})"
    if len(signature) == 2:
        return f"{kind}({', '.join(describe_signature(v) for v in signature[1])})"
    return "None" if kind == "NoneType" else str(kind)


def _container(signature: Any) -> str:
    """What kind of thing a signature is, in words: ``a dict``, ``a tuple of 2``."""
    kind = signature[0]
    if kind == "fields":
        return f"a {signature[1]}"
    if kind == "dict":
        return "a dict"
    if kind != "tensor" and len(signature) == 2:
        return f"a {kind} of {len(signature[1])}"
    return describe_signature(signature)


_NONE = ("NoneType",)


def structure_change(got: Any, expected: Any, where: str = "") -> str | None:
    """Where the structure of ``got`` (a :func:`return_signature`) first parts from
    ``expected``'s, in words naming the field or item ("its field 'attentions' (None) is
    missing"); None where both have the same structure (shapes and dtypes aside)."""
    of = f" of {where}" if where else ""
    if _kind(got) != _kind(expected):
        if _leaf(got) or _leaf(expected):  # a tensor, None or another value
            return (f"{f'its {where}' if where else 'the output'} is "
                    f"{describe_signature(got)} where the segment returns "
                    f"{describe_signature(expected)}")
        dropped = _none_fields_dropped(got, expected)
        return (f"{dropped}{_container(got)} came back{of} where the segment returns "
                f"{_container(expected)}")
    if got[0] in ("dict", "fields"):
        mine, theirs = dict(got[-1]), dict(expected[-1])
        missing = [f"{name!r} ({describe_signature(sig)})" for name, sig in theirs.items()
                   if name not in mine]
        if missing:
            listed = " and ".join(", ".join(missing).rsplit(", ", 1))
            return (f"its field {listed}{of} is missing" if len(missing) == 1
                    else f"its fields {listed}{of} are missing")
        for name in mine:
            if name not in theirs:
                return f"a field {name!r}{of} was added"
        return next((found for name, sig in theirs.items() if (found := structure_change(
            mine[name], sig, f"field {name!r}{of}"))), None)
    if len(expected) != 2 or got[0] == "tensor":
        return None
    mine, theirs = got[1], expected[1]
    for i, sig in enumerate(theirs):
        if i < len(mine) and _kind(mine[i]) == _kind(sig):
            found = structure_change(mine[i], sig, f"item {i}{of}")
            if found:
                return found
        elif i < len(mine) and mine[i:] == theirs[i + 1:]:
            return (f"its item {i}{of} ({describe_signature(sig)}) was dropped and the "
                    f"{len(mine) - i} after it moved up one place")
        elif i >= len(mine):
            return f"its item {i}{of} ({describe_signature(sig)}) is missing"
        else:
            return structure_change(mine[i], sig, f"item {i}{of}")
    return f"{len(mine) - len(theirs)} items were added{of}" if len(mine) > len(theirs) else None


def _none_fields_dropped(got: Any, expected: Any) -> str:
    """"its None fields 'a' and 'b' were dropped: " where ``got`` is a plain sequence of
    ``expected``'s named fields but those that are None; "" otherwise."""
    if expected[0] not in ("dict", "fields") or got[0] in ("dict", "fields", "tensor") \
            or len(got) != 2:
        return ""
    nones = [name for name, sig in expected[-1] if sig == _NONE]
    if not nones or tuple(got[1]) != tuple(sig for _, sig in expected[-1] if sig != _NONE):
        return ""
    names = " and ".join(", ".join(repr(n) for n in nones).rsplit(", ", 1))
    if len(nones) == 1:
        return f"its None field {names} was dropped: "
    return f"its None fields {names} were dropped: "


def _kind(signature: Any) -> Any:
    """A signature's kind alone: a tensor whatever its shape and dtype, None or another
    value, a container of a type (a dataclass or named tuple by its name)."""
    return signature[:2] if signature[0] == "fields" else signature[:1]


def _leaf(signature: Any) -> bool:
    return signature[0] == "tensor" or len(signature) == 1


class Router:
    """Calls each segment plainly, or through the call installed for it.

    Every selected segment's calls' :func:`return_signature` is kept in order
    (``returns``: the forward's calls, as a re-run calls the segment itself); given
    full storage's (``expected``), a routed call that returns another structure, shape
    or dtype than full storage's same call is a :class:`WrongReturn`, raised where the
    implementation returned it rather than wherever the model trips over it.
    """

    def __init__(self) -> None:
        self._calls: dict[int, SegmentCall] = {}
        self.on_call: Callable[[str, tuple[Any, ...], dict[str, Any]], None] | None = None
        self._names: dict[int, str] = {}
        self.returns: list[Any] = []
        self.expected: list[Any] | None = None

    def install(self, segments: list[Segment], call: SegmentCall | None) -> None:
        """Route ``segments`` through ``call`` (``None``: call them plainly)."""
        self._names = {id(s.module): s.name for s in segments}
        self._calls.clear()
        if call is not None:
            self.enable(call)

    def enable(self, call: SegmentCall, modules: Sequence[nn.Module] | None = None) -> None:
        """Route the installed segments among ``modules`` (default: all) through ``call``."""
        keys = self._names if modules is None else [id(m) for m in modules if self.installed(m)]
        self._calls.update(dict.fromkeys(keys, call))

    def routes(self, module: nn.Module) -> bool:
        """Whether calls of ``module`` go through an implementation."""
        return id(module) in self._calls

    def installed(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of the selected segments."""
        return id(module) in self._names

    def notify(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Tell ``on_call`` that segment ``module`` is called with these arguments."""
        if self.on_call is not None and id(module) in self._names:
            self.on_call(self._names[id(module)], args, kwargs)

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.run(module, module, *args, **kwargs)

    def run(self, segment: nn.Module, function: Callable[..., Any], /, *args: Any,
            **kwargs: Any) -> Any:
        """Run ``segment`` by calling ``function`` (the segment itself, or its bound call):
        plainly, or as what the installed call is given."""
        self.notify(segment, args, kwargs)
        call = self._calls.get(id(segment))
        returned = function(*args, **kwargs) if call is None else call(function, *args,
                                                                         **kwargs)
        if id(segment) not in self._names:  # a call inside a segment (its re-run's too)
            return returned
        signature = return_signature(returned)
        index = len(self.returns)
        self.returns.append(signature)
        if call is not None and self.expected is not None and index < len(self.expected) \
                and signature != self.expected[index]:
            name = self._names.get(id(segment), type(segment).__name__)
            expected = self.expected[index]
            changed = structure_change(signature, expected)
            if changed:
                raise WrongReturn(
                    f"the output structure of {name} changed: {changed}; the implementation "
                    f"returned {describe_signature(signature)} where the segment returns "
                    f"{describe_signature(expected)} (full storage's same call); return what "
                    f"function(*args, **kwargs) returns, None fields included")
            raise WrongReturn(
                f"the implementation returned {describe_signature(signature)} for {name} "
                f"where the segment returns {describe_signature(expected)} "
                f"(full storage's same call); return what function(*args, **kwargs) returns")
        return returned


def attach_router(model: nn.Module) -> Router:
    """Give ``model`` and all its submodules one shared, unregistered router."""
    router = Router()
    for module in model.modules():
        object.__setattr__(module, "router", router)
    return router


class RoutedModel(nn.Module):
    """Base of the reference models: a shared router and an HF-style toggle."""

    router: Router

    def segments(self, granularity: Any) -> list[Segment]:
        raise NotImplementedError

    def user_view(self) -> nn.Module:
        """The module whose names the model's author wrote (reports name tensors by it)."""
        return self

    def gradient_checkpointing_enable(self, checkpoint_fn: SegmentCall | None = None) -> None:
        """Recompute the installed segments through ``checkpoint_fn`` (torch's by default).

        This is what a ``toggle`` implementation calls: the model turns recompute
        on itself, for the segments the harness selected.
        """
        if checkpoint_fn is None:
            from torch.utils.checkpoint import checkpoint

            def checkpoint_fn(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
                return checkpoint(module, *args, use_reentrant=False, **kwargs)

        self.router.enable(checkpoint_fn)


def user_view(model: nn.Module) -> nn.Module:
    """``model.user_view()`` where the model has one, else the model itself."""
    view = getattr(model, "user_view", None)
    return view() if callable(view) else model


#: Name parts that module wrappers insert (torch's checkpoint wrapper, FSDP, torch.compile):
#: left out of a name nothing else can give back.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def unwrapped_name(name: str) -> str:
    """``layers.0._checkpoint_wrapped_module.attn.weight`` -> ``layers.0.attn.weight``."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


class UserNames:
    """The names the user's model gives its parameters, buffers and modules, read before
    an implementation is installed: a toggle or wrapper that wraps, renames or replaces
    modules (torch's ``apply_activation_checkpointing`` adds ``_checkpoint_wrapped_module``)
    changes none of them. Each tensor and module is followed by identity; one the
    installation made is named by its new name without the wrappers' parts."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        view = user_view(model)
        self._params = {id(p): n for n, p in view.named_parameters()}
        self._buffers = {id(b): n for n, b in view.named_buffers()}
        self._modules: dict[int, str] = {id(m): n for n, m in view.named_modules()}
        # the objects themselves, so that no id above is reused while this lives
        self._keep = [*view.parameters(), *view.buffers(), *view.modules()]

    def parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The model's parameters now, by the user's names."""
        return [(self._params.get(id(p)) or unwrapped_name(n), p)
                for n, p in user_view(self._model).named_parameters()]

    def buffers(self) -> list[tuple[str, Any]]:
        """The model's buffers now, by the user's names."""
        return [(self._buffers.get(id(b)) or unwrapped_name(n), b)
                for n, b in user_view(self._model).named_buffers()]

    def module(self, module: nn.Module, default: str) -> str:
        """A module's name in the user's model (``default`` where it has none)."""
        name = self._modules.get(id(module))
        if name is not None:
            return name
        now = {id(m): n for n, m in user_view(self._model).named_modules()}
        return str(unwrapped_name(now[id(module)])) if id(module) in now else default

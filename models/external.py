"""Bring your own model: a factory names the model, its fixed batch, its loss and its segments.

The reference models call their segments through the router; a user's model
calls its own submodules directly, and is run exactly as its code runs it.
Nothing is set on the user's modules: each named segment's class is swapped,
on the instance, for a subclass of its own class (same name, same module) that
overrides ``__call__`` only, as ``torch.nn.utils.parametrize`` does. That
``__call__`` hands the router the module and its own bound ``__call__`` (the
class's, hooks and all): the implementation gets what ``checkpoint(module, x)``
would run, so the segment's forward pre-hooks and hooks run inside the first
run and again in the recompute, ``function.__self__`` is the user's module with
its parameters, and a ``wrapper`` gets the user's module itself. The harness's
state lives in that ``__call__``'s closure and in the router, which hangs on
:class:`ExternalModel` only, never on a module of the user's.

A call of the segment made while the router runs it (a wrapper calling the
module it wraps, a checkpoint calling ``function.__self__``) or while autograd
runs a backward (the recompute of a wrapper or hand-written checkpoint) is the
implementation re-running it: it goes to the module's own ``__call__``
directly, never through the implementation again.

A factory is ``f(seed: int) -> UserModel``, named ``package.module:attr``
like an implementation; it must build the same model and batch for the same
seed (:func:`reproducibility_problem` builds it twice to see): every path of a
case builds its own, and a factory that draws from anything but its seed makes
the two full-storage runs differ, a noise floor that hides recompute's errors.
"""

from __future__ import annotations

import difflib
import functools
import os
import pkgutil
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from torch import Tensor, nn

from gradequiv.harness.errors import InvalidArgument
from gradequiv.models.granularity import SINGLE_LAYERS, Granularity
from gradequiv.models.segments import RoutedModel, Router, Segment, layer_segments
from gradequiv.models.user_model import SegmentName, UserModel

__all__ = ["ExternalConfig", "ExternalModel", "UserModel", "declared_regimes", "load_user_model",
           "reproducibility_problem", "segment_names"]


@dataclass(frozen=True)
class ExternalConfig:
    """A user's model, by the factory that builds it."""

    factory: str  # package.module:attr, called as factory(seed) -> UserModel; or hf:NAME

    @property
    def has_randomness(self) -> bool:
        return True  # unknown: assume the model draws random numbers

    def __post_init__(self) -> None:
        module, sep, attr = self.factory.partition(":")
        if not (module and sep and attr):
            raise InvalidArgument(
                f"--model={self.factory!r} is not 'package.module:attr'; name a function "
                f"that takes a seed and returns gradequiv.models.UserModel")


def segment_names(model: nn.Module, segments: Sequence[SegmentName]) -> list[str]:
    """The dotted names of ``segments`` in ``model``: names as given, a class as every
    instance of it (outermost only, in the model's order). A name or class that matches
    nothing is InvalidArgument, saying which names exist."""
    modules = dict(model.named_modules())
    names: list[str] = []
    for entry in segments:
        if isinstance(entry, type):
            found = [n for n, m in modules.items() if n and isinstance(m, entry)]
            outer = [n for n in found if not any(n.startswith(o + ".") for o in found)]
            if not outer:
                raise InvalidArgument(
                    f"segment class {entry.__qualname__} has no instance in the model; "
                    f"{_known_names(modules)}")
            names += outer
        elif not isinstance(entry, str) or entry not in modules or entry == "":
            hint = difflib.get_close_matches(str(entry), [n for n in modules if n], n=1)
            fix = f"did you mean {hint[0]!r}? " if hint else ""
            raise InvalidArgument(
                f"segment {entry!r} is not a submodule of the model; {fix}"
                f"{_known_names(modules)}")
        else:
            names.append(entry)
    return list(dict.fromkeys(names))  # a class and a name (or two classes) may overlap


def _known_names(modules: dict[str, nn.Module]) -> str:
    """What a factory could name instead: the repeated blocks (by class, with their first
    and last names), then the top-level submodules."""
    classes = Counter(type(m) for n, m in modules.items() if n and "." in n)
    repeated = [cls for cls, k in classes.most_common() if k > 1 and len(list(cls.__mro__)) > 2
                and cls.__module__.split(".")[0] != "torch"][:4]
    said = []
    for cls in repeated:
        where = [n for n, m in modules.items() if type(m) is cls]
        said.append(f"{cls.__name__} ({len(where)}: {where[0]} ... {where[-1]})")
    top = [n for n in modules if n and "." not in n]
    text = f"the model's top-level submodules are {', '.join(top[:12]) or 'none'}"
    if said:
        text = (f"its repeated blocks are {'; '.join(said)} (name them, or pass the class "
                f"itself in segments for every instance); {text}")
    return text


def _route_calls(module: nn.Module, router: Router) -> None:
    """Send every call of ``module`` through ``router`` (see the module docstring)."""
    cls = type(module)
    own_call: Callable[..., Any] = cls.__call__
    function = MethodType(own_call, module)  # module.__call__ as its class defines it
    running = [0]  # > 0 while the router runs this segment

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if running[0] or _in_backward():  # the implementation re-running it
            return own_call(self, *args, **kwargs)
        running[0] += 1
        try:
            return router.run(self, function, *args, **kwargs)
        finally:
            running[0] -= 1

    module.__class__ = type(cls.__name__, (cls,), {
        "__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _in_backward() -> bool:
    """Whether autograd runs a backward now (on this thread). A compiled forward (traced,
    where this cannot be asked) is never inside one."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class ExternalModel(RoutedModel):
    """A user's model with its named segments sent through the router."""

    router: Router

    def __init__(self, inner: nn.Module, segments: Sequence[SegmentName],
                 input_keys: Sequence[str] = ()) -> None:
        super().__init__()
        self.inner = inner
        self.router = Router()  # on this wrapper only: the user's modules carry nothing
        self.input_keys = tuple(input_keys)  # the last inputs go to forward by these keywords
        modules = dict(inner.named_modules())
        self._segments = [(name, modules[name]) for name in segment_names(inner, segments)]
        for _, module in self._segments:
            _route_calls(module, self.router)

    def segments(self, granularity: Granularity) -> list[Segment]:
        if not isinstance(granularity, SINGLE_LAYERS):
            raise InvalidArgument(
                f"granularity={str(granularity)!r}: a --model case recomputes its named "
                f"segments: use none, layer or every:K")
        return layer_segments(granularity, self._segments)

    def selected(self) -> list[nn.Module]:
        """The user's submodules selected for recompute (for toggles that pick their own)."""
        return [module for _, module in self._segments if self.router.installed(module)]

    def selected_names(self) -> list[str]:
        """Their dotted names, as the user's model names them (what a toggle is handed)."""
        return [name for name, module in self._segments if self.router.installed(module)]

    def user_view(self) -> nn.Module:
        return self.inner  # "blocks.0.linear.weight", as the user's model names it

    def forward(self, *inputs: Any) -> Any:
        k = len(inputs) - len(self.input_keys)
        return self.inner(*inputs[:k], **dict(zip(self.input_keys, inputs[k:])))


def load_user_model(config: ExternalConfig, seed: int) -> UserModel:
    """Import the factory, call it with ``seed``, and check what it returned."""
    from gradequiv.models.library import library_factory

    if os.getcwd() not in sys.path:  # the factory may live in the current directory
        sys.path.insert(0, os.getcwd())
    try:  # a library's architecture by name (hf:NAME), else the user's own factory
        factory = library_factory(config.factory) or pkgutil.resolve_name(config.factory)
    except (ImportError, AttributeError, ValueError) as exc:
        raise InvalidArgument(
            f"--model={config.factory!r} could not be imported: {type(exc).__name__}: {exc}; "
            f"check that the module is on PYTHONPATH or in the current directory") from exc
    built = factory(seed)
    if not isinstance(built, UserModel):
        raise InvalidArgument(
            f"--model={config.factory!r} returned {type(built).__name__}; return "
            f"gradequiv.models.UserModel(model, inputs, targets, loss_fn, segments)")
    if not built.segments:
        raise InvalidArgument(f"--model={config.factory!r} names no segments to recompute")
    if isinstance(built.segments, (str, type)):
        built.segments = [built.segments]
    if not isinstance(built.inputs, (tuple, dict)):
        built.inputs = tuple(built.inputs)
    if built.regimes is not None:
        from gradequiv.models.kinds import DTYPES

        unknown = [r for r in built.regimes if r not in DTYPES]
        if unknown or isinstance(built.regimes, str):
            raise InvalidArgument(
                f"--model={config.factory!r}: regimes={built.regimes!r} names "
                f"{unknown or built.regimes!r}, no precision regime; the regimes are "
                f"{', '.join(DTYPES)}")
    return built


@functools.lru_cache(maxsize=16)
def declared_regimes(factory: str) -> tuple[str, ...] | None:
    """The precision regimes the factory says its model runs (None: every one), read from
    one build with seed 0."""
    return seeded_user_model(ExternalConfig(factory), 0).regimes


def reproducibility_problem(config: ExternalConfig, seed: int = 0) -> str | None:
    """Build the user's model twice from ``seed``, as every path of a case builds it, and say
    what differs between the two builds (None: nothing).

    Compared bitwise, on the CPU: the parameters and buffers (names, shapes, dtypes,
    values), the inputs and the targets, the segments; and the two builds must not share a
    parameter or buffer, since each path trains its own. A factory that draws from the
    global generator is fine: the harness seeds it with ``seed`` before each call.
    """
    first, second = (seeded_user_model(config, seed) for _ in range(2))
    shared = _shared_tensor(first, second)
    if shared is not None:
        return (f"--model={config.factory!r} is not reproducible: two builds with seed {seed} "
                f"share {shared} (the same tensor in both); the factory must build a new model "
                f"on every call, since each path of a case trains its own")
    difference = _first_difference(first, second)
    if difference is None:
        return None
    return (f"--model={config.factory!r} is not reproducible: two builds with seed {seed} "
            f"differ in {difference}; the factory must seed every random draw from its seed "
            f"argument (e.g. torch.manual_seed(seed) or a torch.Generator), or gradequiv "
            f"cannot tell recompute noise from model noise")


def seeded_user_model(config: ExternalConfig, seed: int) -> UserModel:
    """The factory called the one way every build calls it: the global CPU generator seeded
    with ``seed`` for the call, and put back after."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return load_user_model(config, seed)


def _shared_tensor(a: UserModel, b: UserModel) -> str | None:
    """A parameter or buffer two builds hold in common ("parameter NAME"), or None."""
    for kind, named_a, named_b in _named_tensors(a, b):
        for name, t in named_a.items():
            other = named_b.get(name)
            if other is not None and (t is other or (t.numel() > 0 and
                                                     t.data_ptr() == other.data_ptr())):
                return f"{kind} {name}"
    return None


def _named_tensors(a: UserModel, b: UserModel
                   ) -> list[tuple[str, dict[str, Tensor], dict[str, Tensor]]]:
    """(kind, build a's tensors by name, build b's) for parameters, then buffers."""
    return [("parameter", dict(a.model.named_parameters()), dict(b.model.named_parameters())),
            ("buffer", dict(a.model.named_buffers()), dict(b.model.named_buffers()))]


def _first_difference(a: UserModel, b: UserModel) -> str | None:
    """The first thing two builds do not agree on, as "<what> (<how>)"."""
    if list(a.segments) != list(b.segments):
        return f"the segments ({a.segments} and {b.segments})"
    for kind, named_a, named_b in _named_tensors(a, b):
        if list(named_a) != list(named_b):
            only = [n for n in [*named_a, *named_b] if n not in named_a or n not in named_b]
            where = f"{only[0]!r} is in one build only" if only else "their order differs"
            return f"the {kind} names ({where})"
        for name, t in named_a.items():
            how = _tensor_difference(t, named_b[name])
            if how:
                return f"{kind} {name} ({how})"
    if a.input_names() != b.input_names():
        return f"the inputs ({', '.join(a.input_names())} and {', '.join(b.input_names())})"
    for name, x, y in zip(a.input_names(), a.flat_inputs(), b.flat_inputs()):
        how = _tensor_difference(x, y)
        if how:
            return f"input {name.removeprefix('arg')} ({how})"
    how = _tensor_difference(a.targets, b.targets)
    return f"the targets ({how})" if how else None


def _tensor_difference(a: Tensor | None, b: Tensor | None) -> str:
    """How two tensors differ ("" if bitwise equal): existence, shape, dtype, requires_grad,
    then values (NaN equal to NaN in the same place)."""
    if a is None or b is None:
        return "" if a is None and b is None else "None in one build, a tensor in the other"
    for attr in ("shape", "dtype", "requires_grad"):
        if getattr(a, attr) != getattr(b, attr):
            return f"{attr} {getattr(a, attr)} and {getattr(b, attr)}"
    x, y = a.detach().cpu(), b.detach().cpu()
    if torch.equal(x, y):
        return ""
    if x.is_floating_point() or x.is_complex():
        both_nan = x.isnan() & y.isnan()
        x, y = x.masked_fill(both_nan, 0), y.masked_fill(both_nan, 0)
        if torch.equal(x, y):
            return ""
    differ = x != y
    share = f"{int(differ.sum())} of {x.numel()} elements differ"
    if x.is_floating_point():
        greatest = (x.double() - y.double()).abs()[differ].max()
        share += f", greatest difference {float(greatest):.3g}"
    return share

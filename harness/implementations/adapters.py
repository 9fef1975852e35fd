"""An implementation, resolved: what to call, through which of the three adapter kinds.

``function``: ``impl(function, *args, **kwargs)``, torch.utils.checkpoint's
calling convention, called where the model would call the segment.
``wrapper``: ``impl(module) -> module``, applied once per selected segment.
``toggle``: ``impl(model)``, given the user's own model (never gradequiv's wrapper of
it); the model turns recompute on itself (HF's ``gradient_checkpointing_enable``). A
toggle with a ``segments`` parameter is handed the selected segments' dotted names; one
without chooses its own segments (:attr:`Implementation.chooses_segments`). A toggle
that checkpoints fewer than it is handed (transformers' ``every_n_layers``) returns the
dotted names of the modules it does checkpoint: the segments outside them are left plain,
and must then not run again in backward.
Turning a SPEC into one of these is :mod:`.resolve`'s job.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from gradequiv.harness import validate
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.implementations.torch_builtins import OFFLOAD, SELECTIVE
from gradequiv.harness.options import ADAPTERS
from gradequiv.models import Segment
from gradequiv.models.kinds import CASE_FEATURES, GRAD_MODES, OPT_IN_GRAD_MODES
from gradequiv.models.segments import Router, WrongReturn, user_view

if TYPE_CHECKING:
    from gradequiv.harness.implementations.compiled import CompileSpec



@dataclass
class Implementation:
    """A resolved implementation: what to call, how, and with which options."""

    spec: str
    target: Callable[..., Any]
    adapter: str = "function"
    kwargs: dict[str, Any] = field(default_factory=dict)
    compiled: CompileSpec | None = None  # set for the compile-... SPECs
    default_adapter: str = "function"  # the adapter SPEC implies: not repeated in commands

    @property
    def chooses_segments(self) -> bool:
        """Whether it is a toggle that picks the segments itself: one that takes no
        ``segments`` argument, so a user's model is checkpointed where the toggle says
        (its cases' granularity is "the toggle's")."""
        return self.adapter == "toggle" and not takes_segments(self.target)

    @property
    def offloads(self) -> bool:
        """Whether it keeps activations in host memory instead of recomputing them
        (``gradequiv_strategy = "offload"`` on the target)."""
        return getattr(self.target, "gradequiv_strategy", "recompute") == OFFLOAD

    @property
    def selective(self) -> bool:
        """Whether it saves some ops' outputs by policy and recomputes the rest
        (``gradequiv_strategy = "selective"``: torch's selective checkpoint)."""
        return getattr(self.target, "gradequiv_strategy", "recompute") == SELECTIVE

    @property
    def grad_modes(self) -> tuple[str, ...]:
        """The ways of asking for gradients it supports, declared on its target in one of two
        lists of ``GRAD_MODES`` names: every mode but those in ``gradequiv_unsupported``
        (torch's reentrant checkpoint refuses ``torch.autograd.grad`` by design, loudly),
        and of the opt-in modes (``OPT_IN_GRAD_MODES``: double backward) only those in
        ``gradequiv_supports``. Told to run reentrant (``use_reentrant=true``, the
        wrapper's ``reentrant=true``), it supports neither ``autograd-grad`` nor
        ``create-graph``."""
        refused, claimed = _declared(self.target)
        if self.kwargs.get("use_reentrant") is True or self.kwargs.get("reentrant") is True:
            refused |= {"autograd-grad", "create-graph"}
        return tuple(mode for mode in GRAD_MODES if mode not in refused
                     and (mode not in OPT_IN_GRAD_MODES or mode in claimed))

    def declines(self, grad_mode: str, features: tuple[str, ...] = (), *,
                 unclaimed: bool = True) -> str:
        """Why it is not checked on cases that ask for gradients by ``grad_mode``, or have one
        of ``features`` (``CASE_FEATURES``): its own declaration, read from its target here
        for every route (``check``, the plugin's option, a conftest's fixture, ``verify``);
        "" where it is checked. ``unclaimed=False``: an opt-in mode it does not claim is
        still run (``verify`` forcing it there, to see what it does)."""
        refused, _ = _declared(self.target)
        declined = [f for f in features if f in refused]
        if declined:
            return (f"{self.spec} declares gradequiv_unsupported = "
                    f"{tuple(sorted(refused))!r} (the case has {', '.join(declined)})")
        if grad_mode in self.grad_modes:
            return ""
        if grad_mode in refused:
            return f"{self.spec} declares gradequiv_unsupported = {tuple(sorted(refused))!r}"
        if grad_mode in OPT_IN_GRAD_MODES:
            if not unclaimed:
                return ""
            return (f"{grad_mode} is opt-in and {self.spec} does not claim it "
                    f"(gradequiv_supports = ({grad_mode!r},) would)")
        return f"{self.spec} is told to run reentrant, which refuses {grad_mode}"

    def __post_init__(self) -> None:
        if self.adapter not in ADAPTERS:
            raise InvalidArgument(
                f"--adapter={self.adapter!r} is not one of {', '.join(ADAPTERS)}"
            )
        _declared(self.target)  # a misspelt grad mode is exit 2 now, not a mode never drawn

    def install(self, model: nn.Module, segments: list[Segment]) -> list[Segment]:
        """Route the selected ``segments`` of ``model`` through this implementation; return
        those a toggle left plain (it said which modules it checkpoints: none of them is or
        is inside one of those), which must then not re-run."""
        router = cast(Router, getattr(model, "router"))  # noqa: B009  # a RoutedModel's
        router.install(segments, None)
        if not segments:
            return []
        if self.adapter == "function":
            target, options = self.target, self.kwargs

            def call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
                clash = options.keys() & kwargs.keys()
                if clash:
                    raise InvalidArgument(
                        f"--impl-kwarg {sorted(clash)} clash with the segment's own keyword "
                        f"arguments; rename them in the implementation"
                    )
                return _checked_return(target(function, *args, **options, **kwargs))

            router.enable(call)
        elif self.adapter == "wrapper":
            for s in segments:  # the segment's module itself, as users wrap their layers
                wrapped = self.target(s.module, **self.kwargs)
                if not isinstance(wrapped, nn.Module):
                    raise WrongReturn(
                        f"the implementation (--adapter wrapper) returned "
                        f"{type(wrapped).__name__} {_brief(wrapped)} for {s.name}, not a "
                        f"module; a wrapper returns the module that runs in its place")
                router.enable(functools.partial(_call_wrapped, wrapped), [s.module])
        else:  # the user's own model; the selected segments where the toggle takes them
            chosen = {"segments": [s.name for s in segments]} \
                if takes_segments(self.target) else {}
            return _left_plain(segments, self.target(user_view(model), **chosen,
                                                     **self.kwargs))
        return []

    def command_args(self) -> list[str]:
        """The command-line options that name this implementation again."""
        args = ["--impl", self.spec]
        if self.adapter != self.default_adapter:
            args += ["--adapter", self.adapter]
        for key, value in self.kwargs.items():
            args += ["--impl-kwarg", f"{key}={_format_value(value)}"]
        return args


def _brief(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:36] + "..."


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a ModelOutput's kind
        return any(_holds_tensor(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def _checked_return(value: Any) -> Any:
    """What a function-adapter implementation returned, when it holds a tensor; else a
    :class:`WrongReturn` saying what it was (None, a str, a number)."""
    if not _holds_tensor(value):
        raise WrongReturn(f"the implementation returned {type(value).__name__} "
                          f"{_brief(value)} where the segment returns tensors; return what "
                          f"function(*args, **kwargs) returns")
    return value


def takes_segments(target: Callable[..., Any]) -> bool:
    """Whether a toggle names a ``segments`` parameter (handed the selected names)."""
    try:
        parameter = inspect.signature(target).parameters.get("segments")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _left_plain(segments: list[Segment], checkpointed: Any) -> list[Segment]:
    """The ``segments`` outside every module a toggle says it checkpoints (its return: a
    list of dotted names; anything else says nothing, and every segment is checkpointed)."""
    if not isinstance(checkpointed, (list, tuple)) or \
            not all(isinstance(name, str) for name in checkpointed):
        return []
    return [s for s in segments
            if not any(s.name == name or s.name.startswith(name + ".") for name in checkpointed)]


def _call_wrapped(wrapped: Callable[..., Any], _function: Callable[..., Any], /, *args: Any,
                  **kwargs: Any) -> Any:
    """A wrapped segment's call, in the router's place of ``function``."""
    return wrapped(*args, **kwargs)


def _declared(target: Callable[..., Any]) -> tuple[set[str], set[str]]:
    """The grad modes ``target`` refuses (``gradequiv_unsupported``) and claims
    (``gradequiv_supports``); a name that is no grad mode is refused with the known ones."""
    lists = {attr: getattr(target, attr, ()) for attr in ("gradequiv_unsupported",
                                                           "gradequiv_supports")}
    for attr, names in lists.items():
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise InvalidArgument(f"{attr}={names!r} on {target!r}: a tuple of grad mode "
                                  f"names is needed, e.g. {attr} = ({GRAD_MODES[-1]!r},)")
        known = GRAD_MODES + (CASE_FEATURES if attr == "gradequiv_unsupported" else ())
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise InvalidArgument(f"{attr} on {target!r} names {', '.join(map(repr, unknown))}, "
                                  f"no grad mode or case feature; the names are "
                                  f"{', '.join(known)}")
    return set(lists["gradequiv_unsupported"]), set(lists["gradequiv_supports"])


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


#: ``KEY=VALUE`` items as keyword arguments (the one parser: :func:`validate.impl_kwargs`).
parse_impl_kwargs = validate.impl_kwargs

"""Plugging in an implementation: SPEC resolution and the three adapter kinds.

``function``: ``impl(function, *args, **kwargs)``, torch.utils.checkpoint's
calling convention, called where the model would call the segment.
``wrapper``: ``impl(module) -> module``, applied once per selected segment.
``toggle``: ``impl(model)``; the model turns recompute on itself for the
segments the harness selected (HF's ``gradient_checkpointing_enable``).
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib
import os
import pkgutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, cast

from torch import nn

from gradequiv.harness import compiled, peers
from gradequiv.models import InvalidArgument, Segment
from gradequiv.models.segments import Router

ADAPTERS = ("function", "wrapper", "toggle")
ENTRY_POINT_GROUP = "gradequiv.implementations"


def torch_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """torch.utils.checkpoint, non-reentrant (the variant torch recommends)."""
    from torch.utils.checkpoint import checkpoint

    kwargs.setdefault("use_reentrant", False)
    return checkpoint(function, *args, **kwargs)


_REENTRANT_OPTIONS = ("preserve_rng_state", "determinism_check", "debug", "context_fn")


def torch_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """torch.utils.checkpoint with ``use_reentrant=True``.

    The reentrant variant refuses keyword arguments for the function, so they
    are bound with functools.partial, as users of this variant do.
    """
    from torch.utils.checkpoint import checkpoint

    options = {k: kwargs.pop(k) for k in _REENTRANT_OPTIONS if k in kwargs}
    bound = functools.partial(function, **kwargs) if kwargs else function
    return checkpoint(bound, *args, use_reentrant=True, **options)


BUILTINS: dict[str, tuple[Callable[..., Any], str]] = {
    "torch": (torch_checkpoint, "function"),
    "torch-reentrant": (torch_reentrant_checkpoint, "function"),
    "torch-sac": (peers.torch_sac, "function"),
    "torch-wrapper": (peers.torch_wrapper, "wrapper"),
    "torch-offload": (peers.torch_offload, "function"),
    "torch-offload-wrapper": (peers.torch_offload_wrapper, "wrapper"),
    "fairscale": (peers.fairscale_wrapper, "wrapper"),
    "deepspeed": (peers.deepspeed_checkpoint, "function"),
    "deepspeed-nonreentrant": (peers.deepspeed_nonreentrant, "function"),
    "megatron": (peers.megatron_checkpoint, "function"),
    "hf": (peers.hf_gradient_checkpointing, "toggle"),
}


@dataclass
class Implementation:
    """A resolved implementation: what to call, how, and with which options."""

    spec: str
    target: Callable[..., Any]
    adapter: str = "function"
    kwargs: dict[str, Any] = field(default_factory=dict)
    compiled: compiled.CompileSpec | None = None  # set for the compile-... SPECs

    @property
    def offloads(self) -> bool:
        """Whether it keeps activations in host memory instead of recomputing them
        (``gradequiv_strategy = "offload"`` on the target)."""
        return getattr(self.target, "gradequiv_strategy", "recompute") == peers.OFFLOAD

    def __post_init__(self) -> None:
        if self.adapter not in ADAPTERS:
            raise InvalidArgument(
                f"--adapter={self.adapter!r} is not one of {', '.join(ADAPTERS)}"
            )

    def install(self, model: nn.Module, segments: list[Segment]) -> None:
        """Route the selected ``segments`` of ``model`` through this implementation."""
        router = cast(Router, getattr(model, "router"))  # noqa: B009  # set by attach_router
        router.install(segments, None)
        if not segments:
            return
        if self.adapter == "function":
            target, options = self.target, self.kwargs

            def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
                clash = options.keys() & kwargs.keys()
                if clash:
                    raise InvalidArgument(
                        f"--impl-kwarg {sorted(clash)} clash with the segment's own keyword "
                        f"arguments; rename them in the implementation"
                    )
                return target(module, *args, **options, **kwargs)

            router.enable(call)
        elif self.adapter == "wrapper":
            wrapped = {id(s.module): self.target(s.module, **self.kwargs) for s in segments}
            router.enable(lambda module, *a, **k: wrapped[id(module)](*a, **k))
        else:
            self.target(model, **self.kwargs)

    def command_args(self) -> list[str]:
        """The command-line options that name this implementation again."""
        args = ["--impl", self.spec]
        if self.adapter != BUILTINS.get(self.spec, (None, "function"))[1]:
            args += ["--adapter", self.adapter]
        for key, value in self.kwargs.items():
            args += ["--impl-kwarg", f"{key}={_format_value(value)}"]
        return args


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def parse_impl_kwargs(items: Iterable[str]) -> dict[str, Any]:
    """Parse repeated ``KEY=VALUE``; values read as Python literals, true/false/none too."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise InvalidArgument(
                f"--impl-kwarg={item!r} is not KEY=VALUE with KEY a Python identifier; "
                f"write e.g. --impl-kwarg preserve_rng_state=false"
            )
        parsed[key] = _parse_value(raw.strip())
    return parsed


def _parse_value(raw: str) -> Any:
    words = {"true": True, "false": False, "none": None, "null": None}
    if raw.lower() in words:
        return words[raw.lower()]
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def resolve(
    spec: str, *, adapter: str | None = None, kwargs: dict[str, Any] | None = None
) -> Implementation:
    """Resolve SPEC: a built-in name, an entry point, or ``package.module:attr``."""
    if adapter is not None and adapter not in ADAPTERS:
        raise InvalidArgument(
            f"--adapter={adapter!r} is not one of {', '.join(ADAPTERS)}; pick one of those"
        )
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidArgument(
            f"--impl={spec!r} is empty; name a built-in ({', '.join(BUILTINS)}) "
            f"or a 'module:attr' reference"
        )
    if compiled.is_compile_spec(spec):
        chosen_spec = compiled.parse(spec)
        if adapter not in (None, "function"):
            raise InvalidArgument(f"--impl={spec!r} is a compiler setting; it takes no "
                                  f"--adapter (drop --adapter={adapter})")
        return Implementation(spec, compiled.segment_call(chosen_spec), "function",
                              dict(kwargs or {}), compiled=chosen_spec)
    if spec in BUILTINS:
        target, default_adapter = BUILTINS[spec]
        peers.require(spec, kwargs)  # a missing library or bad option: exit 2 before any case
        return Implementation(spec, target, adapter or default_adapter, dict(kwargs or {}))
    target = _from_entry_point(spec)
    if target is None:
        target = _from_reference(spec)
    if not callable(target):
        raise InvalidArgument(
            f"--impl={spec!r} resolved to {type(target).__name__} {target!r}, which is not "
            f"callable; point at a function or class"
        )
    chosen = str(adapter or getattr(target, "gradequiv_adapter", "function"))
    return Implementation(spec, target, chosen, dict(kwargs or {}))


def _from_entry_point(spec: str) -> Any:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == spec:
            try:
                return ep.load()
            except Exception as exc:
                raise InvalidArgument(
                    f"--impl={spec!r}: entry point {ep.value!r} failed to load: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
    return None


def _from_reference(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    names = sorted(BUILTINS) + sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    if not sep or not module_name or not attr:
        hint = difflib.get_close_matches(spec, names, n=1)
        fix = f"did you mean {hint[0]!r}?" if hint else "write e.g. 'mypkg.recompute:checkpoint'"
        raise InvalidArgument(
            f"--impl={spec!r} is not a built-in ({', '.join(names)}), nor an entry point in "
            f"{ENTRY_POINT_GROUP!r}, nor a 'module:attr' reference; {fix}"
        )
    if os.getcwd() not in sys.path:  # the module may live in the current directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise InvalidArgument(
            f"--impl={spec!r} could not be imported: {type(exc).__name__}: {exc}; check that "
            f"{module_name!r} is on PYTHONPATH or in the current directory"
        ) from exc
    try:
        return pkgutil.resolve_name(spec)
    except AttributeError as exc:
        public = [n for n in dir(module) if not n.startswith("_")]
        hint = difflib.get_close_matches(attr.split(".")[-1], public, n=1)
        fix = f"did you mean '{module_name}:{hint[0]}'?" if hint else "check the name"
        raise InvalidArgument(
            f"--impl={spec!r} could not be resolved: module {module_name!r} has no attribute "
            f"{attr!r}; {fix}"
        ) from exc

"""From a SPEC to an :class:`Implementation`: a built-in name, a compiler setting, an entry
point in ``gradequiv.implementations``, or ``package.module:attr``.

The table of built-ins lives here, once; ``--impl``'s help and every message
that lists the built-ins read it.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import pkgutil
import re
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.options import ADAPTERS

if TYPE_CHECKING:
    from gradequiv.harness.implementations.adapters import Implementation

ENTRY_POINT_GROUP = "gradequiv.implementations"

#: SPEC -> (its target in this package, the adapter it is called through). Targets load on
#: use, so the table is readable (``--help``) without importing torch.
BUILTINS: dict[str, tuple[str, str]] = {
    "torch": ("torch_builtins:torch_checkpoint", "function"),
    "torch-reentrant": ("torch_builtins:torch_reentrant_checkpoint", "function"),
    "torch-sac": ("torch_builtins:torch_sac", "function"),
    "torch-wrapper": ("torch_builtins:torch_wrapper", "wrapper"),
    "torch-patched": ("torch_builtins:torch_patched", "wrapper"),
    "torch-offload": ("torch_builtins:torch_offload", "function"),
    "torch-offload-wrapper": ("torch_builtins:torch_offload_wrapper", "wrapper"),
    "fairscale": ("libraries:fairscale_wrapper", "wrapper"),
    "deepspeed": ("libraries:deepspeed_checkpoint", "function"),
    "deepspeed-nonreentrant": ("libraries:deepspeed_nonreentrant", "function"),
    "deepspeed-partitioned": ("libraries:deepspeed_partitioned", "function"),
    "deepspeed-partitioned-cpu": ("libraries:deepspeed_partitioned_cpu", "function"),
    "megatron": ("libraries:megatron_checkpoint", "function"),
    "hf": ("libraries:hf_gradient_checkpointing", "toggle"),
    "diffusers": ("libraries:diffusers_gradient_checkpointing", "toggle"),
    "timm": ("libraries:timm_gradient_checkpointing", "toggle"),
}


def user_function(option: str, spec: str, shape: str) -> Callable[..., Any]:
    """The user's function an option (``--split``, ``--parallelize``) names by
    ``module:function``, the current directory searched too; ``shape`` says what it must be
    (``"function (model, mesh) -> model"``) where it is no callable."""
    if os.getcwd() not in sys.path:  # the module may live in the current directory
        sys.path.insert(0, os.getcwd())
    try:
        function = pkgutil.resolve_name(spec)
    except Exception as exc:
        raise InvalidArgument(f"{option}={spec!r} could not be imported: "
                              f"{type(exc).__name__}: {exc}; check that the module is on "
                              f"PYTHONPATH or in the current directory") from exc
    if not callable(function):
        raise InvalidArgument(f"{option}={spec!r} is a {type(function).__name__}, not a "
                              f"{shape}")
    return function  # type: ignore[no-any-return]


def builtin_target(spec: str) -> Callable[..., Any]:
    """The callable behind built-in SPEC."""
    module, _, attr = BUILTINS[spec][0].partition(":")
    target: Callable[..., Any] = getattr(
        importlib.import_module(f"gradequiv.harness.implementations.{module}"), attr)
    return target


def resolve(
    spec: str, *, adapter: str | None = None, kwargs: dict[str, Any] | None = None
) -> Implementation:
    """Resolve SPEC: a built-in name, an entry point, or ``package.module:attr``."""
    from gradequiv.harness.implementations import compiled
    from gradequiv.harness.implementations.adapters import Implementation

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
        default_adapter = BUILTINS[spec][1]
        if adapter not in (None, default_adapter):
            raise InvalidArgument(
                f"--adapter={adapter!r}: built-in --impl={spec!r} is called through the "
                f"{default_adapter!r} adapter only; drop --adapter (or write "
                f"--adapter {default_adapter})")
        target = builtin_target(spec)
        _require(spec, kwargs)  # a missing library or bad option: exit 2 before any case
        return Implementation(spec, target, adapter or default_adapter, dict(kwargs or {}),
                              default_adapter=default_adapter)
    target = _from_entry_point(spec)
    if target is None:
        target = _from_reference(spec)
    if not callable(target):
        raise InvalidArgument(
            f"--impl={spec!r} resolved to {type(target).__name__} {target!r}, which is not "
            f"callable; point at a function or class"
        )
    chosen = str(adapter or getattr(target, "gradequiv_adapter", "function"))
    _check_signature(spec, target, dict(kwargs or {}))
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
    _check_reference(spec, module_name, attr)
    if os.getcwd() not in sys.path:  # the module may live in the current directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if not _names_the_module(exc, module_name):  # found; an import in its body failed
            raise InvalidArgument(
                f"--impl={spec!r}: importing {module_name!r} failed inside it: "
                f"{type(exc).__name__}: {exc}; install what it imports, or check that "
                f"import") from exc
        raise InvalidArgument(
            f"--impl={spec!r} could not be imported: {type(exc).__name__}: {exc}; check that "
            f"{module_name!r} is on PYTHONPATH or in the current directory"
        ) from exc
    except Exception as exc:
        raise InvalidArgument(
            f"--impl={spec!r} could not be imported: {type(exc).__name__}: {exc}; check that "
            f"{module_name!r} is on PYTHONPATH or in the current directory"
        ) from exc
    try:
        return pkgutil.resolve_name(spec)
    except (ValueError, ImportError) as exc:  # e.g. an attribute whose import fails
        raise InvalidArgument(f"--impl={spec!r} could not be resolved: {type(exc).__name__}: "
                              f"{exc}; check the name") from exc
    except AttributeError as exc:
        public = [n for n in dir(module) if not n.startswith("_")]
        hint = difflib.get_close_matches(attr.split(".")[-1], public, n=1)
        fix = f"did you mean '{module_name}:{hint[0]}'?" if hint else "check the name"
        raise InvalidArgument(
            f"--impl={spec!r} could not be resolved: module {module_name!r} has no attribute "
            f"{attr!r}; {fix}"
        ) from exc


def _names_the_module(exc: ImportError, module_name: str) -> bool:
    """Whether an import failure is the reference's module (or a package above it) not
    being found, rather than an import its body makes failing."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return False
    return module_name == exc.name or module_name.startswith(exc.name + ".")


_DOTTED = re.compile(r"[^\W\d]\w*(\.[^\W\d]\w*)*")


def _check_reference(spec: str, module_name: str, attr: str) -> None:
    """A 'module:attr' reference is a dotted module path, one colon, a dotted attribute
    path; anything else is refused here, in words, before pkgutil's "invalid format"."""
    if ":" in attr:
        *parts, last = spec.split(":")
        raise InvalidArgument(
            f"--impl={spec!r} has {spec.count(':')} colons; a 'module:attr' reference has "
            f"one, between the module's dotted path and the attribute: did you mean "
            f"'{'.'.join(parts)}:{last}'?")
    for part, what in ((module_name, "module"), (attr, "attribute")):
        if not _DOTTED.fullmatch(part):
            raise InvalidArgument(
                f"--impl={spec!r}: {part!r} is not a dotted Python name, so it cannot be the "
                f"{what} of a 'module:attr' reference; write e.g. 'mypkg.recompute:checkpoint'")


def _require(spec: str, kwargs: dict[str, Any] | None) -> None:
    """A missing library or a bad option of a built-in: exit 2 before any case runs."""
    from gradequiv.harness.implementations import libraries, torch_builtins

    if spec in torch_builtins.OPTIONS:
        torch_builtins.check_options(spec, kwargs or {})
    libraries.require(spec)


def _check_signature(spec: str, target: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """An option the target's signature cannot take is exit 2 now, not a TypeError in
    every case; a target that takes ``**kwargs`` (or hides its signature) is trusted."""
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    named = {p.name for p in parameters
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    for name, value in kwargs.items():
        if name not in named:
            known = ", ".join(sorted(named)) or "none"
            raise InvalidArgument(f"--impl-kwarg {name}={value!r}: {spec!r} takes no keyword "
                                  f"{name!r} (its parameters: {known})")

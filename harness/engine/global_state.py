"""torch's process-global switches: a snapshot of them, what changed, and putting them back.

Outside the random generators (kept by ``verify`` with ``fork_rng``), torch has
switches that every later tensor op reads: the default dtype and device, grad
mode, the deterministic-algorithms switch, the thread count, autocast, the
float32 matmul precision and the cuDNN / cuBLAS / oneDNN / SDPA backend flags.
An implementation that sets one and leaves it changes every case after it (a
``torch.set_default_dtype(torch.float64)`` left behind ran the later fp32 and
bf16 cases in float64). ``verify`` takes a :func:`snapshot` when a case starts,
:func:`restore`s it before each path and after the case, and reports the
:func:`diff` between the recompute path's end state and full storage's.

A switch that this torch does not have (older releases lack some) is left out
of the snapshot; one whose getter raises (torch refuses to read the float32
matmul precision once its legacy and per-backend settings disagree) is kept as
"unreadable".

The global module hooks (``torch.nn.modules.module.register_module_forward_hook`` and
its kin: forward pre-hooks, backward hooks, buffer, parameter and module registration
hooks) are global state too: one left registered runs inside every later module call,
of full storage's paths as well. They are snapshot, diffed by the hooks' names and put
back with the switches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["REGIME_DEFAULTS", "GlobalState", "diff", "pin_regime", "pinned_lines", "restore",
           "snapshot", "unpin"]


@dataclass(frozen=True)
class GlobalState:
    """The switches' values, by label, in the order :func:`restore` sets them."""

    values: tuple[tuple[str, object], ...]

    def get(self, label: str) -> object:
        """The value of the switch ``label`` (None where this torch lacks it)."""
        return dict(self.values).get(label)


@dataclass(frozen=True)
class _Switch:
    label: str  # how a diff names it: "default dtype"
    get: Callable[[], object]  # raises AttributeError where this torch lacks it
    set: Callable[[object], None] | None  # None: cannot be put back (inference mode)


class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


def _attribute(label: str, dotted: str) -> _Switch:
    """A switch that is an attribute under ``torch``: "backends.cudnn.benchmark"."""
    parent, _, name = dotted.rpartition(".")

    def owner() -> object:
        return functools.reduce(getattr, parent.split("."), torch)

    def put(value: object) -> None:
        setattr(owner(), name, value)

    return _Switch(label, lambda: getattr(owner(), name), put)


def _call(label: str, getter: str, setter: str) -> _Switch:
    """A switch read and set by two functions under ``torch`` ("backends.cuda.flash_sdp_enabled",
    "backends.cuda.enable_flash_sdp"), looked up when used: older torch may lack them."""
    def find(dotted: str) -> Any:
        return functools.reduce(getattr, dotted.split("."), torch)

    def put(value: object) -> None:
        find(setter)(value)

    return _Switch(label, lambda: find(getter)(), put)


def _autocast(label: str, device_type: str) -> _Switch:
    return _Switch(label, lambda: torch.is_autocast_enabled(device_type),
                   lambda value: torch.set_autocast_enabled(device_type, bool(value)))


def _autocast_dtype(label: str, device_type: str) -> _Switch:
    def put(value: object) -> None:
        assert isinstance(value, torch.dtype)
        torch.set_autocast_dtype(device_type, value)

    return _Switch(label, lambda: torch.get_autocast_dtype(device_type), put)


def _set_default_dtype(value: object) -> None:
    assert isinstance(value, torch.dtype)
    torch.set_default_dtype(value)


def _set_default_device(value: object) -> None:
    # cpu is torch's own default: clear the setting rather than push a device mode for it.
    assert isinstance(value, torch.device)
    torch.set_default_device(None if value == torch.device("cpu") else value)


def _set_grad_enabled(value: object) -> None:
    torch.set_grad_enabled(bool(value))  # called, not entered: sets it for the thread


def _set_deterministic(value: object) -> None:
    torch.use_deterministic_algorithms(
        bool(value), warn_only=torch.is_deterministic_algorithms_warn_only_enabled())


def _set_deterministic_warn_only(value: object) -> None:
    torch.use_deterministic_algorithms(torch.are_deterministic_algorithms_enabled(),
                                       warn_only=bool(value))


def _set_anomaly(value: object) -> None:
    torch.set_anomaly_enabled(bool(value), torch.is_anomaly_check_nan_enabled())


def _set_threads(value: object) -> None:
    assert isinstance(value, int)
    torch.set_num_threads(value)


def _set_precision(value: object) -> None:
    torch.set_float32_matmul_precision(str(value))


#: Every switch, in the order restore sets them: the float32 matmul precision before the
#: legacy TF32 flags it also moves, and those before the per-backend ``fp32_precision``
#: settings (torch 2.9+) that both move, parents before children.
_SWITCHES: tuple[_Switch, ...] = (
    _Switch("default dtype", torch.get_default_dtype, _set_default_dtype),
    _Switch("default device", lambda: torch.get_default_device(), _set_default_device),
    _Switch("grad enabled", torch.is_grad_enabled, _set_grad_enabled),
    # Only a context manager enters inference mode; one left entered cannot be left here.
    _Switch("inference mode", torch.is_inference_mode_enabled, None),
    _Switch("anomaly detection", torch.is_anomaly_enabled, _set_anomaly),
    _Switch("deterministic algorithms", torch.are_deterministic_algorithms_enabled,
            _set_deterministic),
    _Switch("deterministic algorithms warn_only",
            torch.is_deterministic_algorithms_warn_only_enabled, _set_deterministic_warn_only),
    _attribute("deterministic fill_uninitialized_memory",
               "utils.deterministic.fill_uninitialized_memory"),
    _Switch("intra-op threads", torch.get_num_threads, _set_threads),
    _autocast("autocast on cpu", "cpu"),
    _autocast("autocast on cuda", "cuda"),
    _autocast_dtype("autocast dtype on cpu", "cpu"),
    _autocast_dtype("autocast dtype on cuda", "cuda"),
    _Switch("autocast cache", torch.is_autocast_cache_enabled,
            lambda v: torch.set_autocast_cache_enabled(bool(v))),
    _Switch("float32 matmul precision", torch.get_float32_matmul_precision, _set_precision),
    _attribute("cuda matmul allow_tf32", "backends.cuda.matmul.allow_tf32"),
    _attribute("cuda matmul allow_fp16_reduced_precision_reduction",
               "backends.cuda.matmul.allow_fp16_reduced_precision_reduction"),
    _attribute("cuda matmul allow_bf16_reduced_precision_reduction",
               "backends.cuda.matmul.allow_bf16_reduced_precision_reduction"),
    _attribute("cuda matmul allow_fp16_accumulation",
               "backends.cuda.matmul.allow_fp16_accumulation"),
    _attribute("cudnn enabled", "backends.cudnn.enabled"),
    _attribute("cudnn benchmark", "backends.cudnn.benchmark"),
    _attribute("cudnn deterministic", "backends.cudnn.deterministic"),
    _attribute("cudnn allow_tf32", "backends.cudnn.allow_tf32"),
    _attribute("mkldnn enabled", "backends.mkldnn.enabled"),
    _attribute("fp32_precision", "backends.fp32_precision"),
    _attribute("cuda matmul fp32_precision", "backends.cuda.matmul.fp32_precision"),
    _attribute("cudnn fp32_precision", "backends.cudnn.fp32_precision"),
    _attribute("cudnn conv fp32_precision", "backends.cudnn.conv.fp32_precision"),
    _attribute("cudnn rnn fp32_precision", "backends.cudnn.rnn.fp32_precision"),
    _attribute("mkldnn fp32_precision", "backends.mkldnn.fp32_precision"),
    _attribute("mkldnn matmul fp32_precision", "backends.mkldnn.matmul.fp32_precision"),
    _attribute("mkldnn conv fp32_precision", "backends.mkldnn.conv.fp32_precision"),
    _attribute("mkldnn rnn fp32_precision", "backends.mkldnn.rnn.fp32_precision"),
    _call("flash SDPA", "backends.cuda.flash_sdp_enabled", "backends.cuda.enable_flash_sdp"),
    _call("memory-efficient SDPA", "backends.cuda.mem_efficient_sdp_enabled",
          "backends.cuda.enable_mem_efficient_sdp"),
    _call("math SDPA", "backends.cuda.math_sdp_enabled", "backends.cuda.enable_math_sdp"),
    _call("cuDNN SDPA", "backends.cuda.cudnn_sdp_enabled", "backends.cuda.enable_cudnn_sdp"),
    _call("math SDPA fp16/bf16 reduction", "backends.cuda.fp16_bf16_reduction_math_sdp_allowed",
          "backends.cuda.allow_fp16_bf16_reduction_math_sdp"),
)


class _Hooks:
    """One kind of global module hook as registered: the hooks by handle id, with the
    flags torch keeps beside them (``always_call``, ``with_kwargs``, full backward)."""

    def __init__(self, hooks: tuple[tuple[int, object], ...],
                 extra: tuple[object, ...] = ()) -> None:
        self.hooks = hooks
        self.extra = extra

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _Hooks) and self.extra == other.extra
                and len(self.hooks) == len(other.hooks)
                and all(a[0] == b[0] and a[1] is b[1] for a, b in zip(self.hooks, other.hooks)))

    def __hash__(self) -> int:
        return hash(tuple(key for key, _ in self.hooks))

    def __repr__(self) -> str:
        return "[" + ", ".join(_hook_name(hook) for _, hook in self.hooks) + "]"

    def changes(self, before: _Hooks) -> str:
        """What changed from ``before``, by the hooks' names: "added mypkg.hook"."""
        old = {key for key, _ in before.hooks}
        new = {key for key, _ in self.hooks}
        said = [f"added {_hook_name(h)}" for key, h in self.hooks if key not in old]
        said += [f"removed {_hook_name(h)}" for key, h in before.hooks if key not in new]
        return ", ".join(said) or f"{before!r} -> {self!r}"


def _hook_name(hook: object) -> str:
    """A hook as a reader finds it in their code: ``module.qualified.name``."""
    target = getattr(hook, "func", hook)  # functools.partial
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None)
    return f"{module}.{name}" if module else str(name)


def _module_hooks(label: str, table: str, *extra: str) -> _Switch:
    """A kind of global module hook: the dict ``table`` of ``torch.nn.modules.module`` and
    the module-level values kept with it (the flags of its hooks)."""
    from torch.nn.modules import module as nn_module

    def get() -> object:
        hooks: dict[int, object] = getattr(nn_module, table)
        flags = tuple(_copy(getattr(nn_module, name)) for name in extra)
        return _Hooks(tuple(hooks.items()), flags)

    def put(value: object) -> None:
        assert isinstance(value, _Hooks)
        hooks: dict[int, object] = getattr(nn_module, table)
        hooks.clear()
        hooks.update(value.hooks)
        for name, flag in zip(extra, value.extra):
            current = getattr(nn_module, name)
            if isinstance(current, dict):
                current.clear()
                current.update(dict(flag))  # type: ignore[call-overload]
            else:
                setattr(nn_module, name, flag)

    return _Switch(label, get, put)


def _copy(value: object) -> object:
    return tuple(value.items()) if isinstance(value, dict) else value


#: The global module hooks, put back after the switches.
_HOOKS: tuple[_Switch, ...] = (
    _module_hooks("global module forward hooks", "_global_forward_hooks",
                  "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs"),
    _module_hooks("global module forward pre-hooks", "_global_forward_pre_hooks"),
    _module_hooks("global module backward hooks", "_global_backward_hooks",
                  "_global_is_full_backward_hook"),
    _module_hooks("global module backward pre-hooks", "_global_backward_pre_hooks"),
    _module_hooks("global module buffer registration hooks",
                  "_global_buffer_registration_hooks"),
    _module_hooks("global module parameter registration hooks",
                  "_global_parameter_registration_hooks"),
    _module_hooks("global module registration hooks", "_global_module_registration_hooks"),
)


class _Unreadable:
    """A switch whose getter raised: equal to another for the same reason."""

    def __init__(self, exc: Exception) -> None:
        self.reason = type(exc).__name__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Unreadable) and other.reason == self.reason

    def __hash__(self) -> int:
        return hash(self.reason)

    def __repr__(self) -> str:
        return f"unreadable ({self.reason})"


def _read(switch: _Switch) -> object:
    try:
        return switch.get()
    except AttributeError:
        return _ABSENT  # this torch has no such switch
    except Exception as exc:  # torch refuses to read it in this state
        return _Unreadable(exc)


def snapshot() -> GlobalState:
    """Every switch this torch has, as it is now (on the calling thread: grad mode,
    inference mode and autocast are per thread)."""
    values = ((s.label, _read(s)) for s in (*_SWITCHES, *_HOOKS))
    return GlobalState(tuple((label, v) for label, v in values if v is not _ABSENT))


#: The per-backend ``fp32_precision`` settings that decide an op's precision, each with the
#: settings it inherits from where it is "none" (its backend's, then the generic one), as
#: torch's Context::float32Precision reads them; all "none" is full precision.
_FP32_OPS: dict[str, tuple[str, ...]] = {
    "cuda matmul fp32_precision": ("fp32_precision",),
    "cudnn conv fp32_precision": ("cudnn fp32_precision", "fp32_precision"),
    "cudnn rnn fp32_precision": ("cudnn fp32_precision", "fp32_precision"),
    "mkldnn matmul fp32_precision": ("mkldnn fp32_precision", "fp32_precision"),
    "mkldnn conv fp32_precision": ("mkldnn fp32_precision", "fp32_precision"),
    "mkldnn rnn fp32_precision": ("mkldnn fp32_precision", "fp32_precision"),
}
_FP32_PARENTS = {parent for chain in _FP32_OPS.values() for parent in chain}


def _effective(state: GlobalState) -> dict[str, object]:
    """The switches as ops see them: an ``fp32_precision`` setting as the precision it
    gives its ops ("none" resolved through its parents), the parents themselves left out.
    So an implementation that saves and restores the legacy float32 matmul precision, which
    puts back "ieee" where "none" was, has changed nothing."""
    raw = dict(state.values)
    seen: dict[str, object] = {}
    for label, value in raw.items():
        if label in _FP32_PARENTS:
            continue
        if label in _FP32_OPS:
            chain = [value, *(raw.get(parent, "none") for parent in _FP32_OPS[label])]
            value = next((v for v in chain if v != "none"), "ieee")
        seen[label] = value
    return seen


def diff(before: GlobalState, after: GlobalState) -> list[str]:
    """Each switch that differs, readably: ``"default dtype torch.float32 -> torch.float64"``."""
    old, new = _effective(before), _effective(after)
    return [_change(label, old.get(label, _ABSENT), new.get(label, _ABSENT))
            for label in dict.fromkeys([*old, *new])
            if old.get(label, _ABSENT) != new.get(label, _ABSENT)]


def _change(label: str, old: object, new: object) -> str:
    if isinstance(old, _Hooks) and isinstance(new, _Hooks):
        return f"{label}: {new.changes(old)}"
    return f"{label} {_show(old)} -> {_show(new)}"


def restore(state: GlobalState) -> list[str]:
    """Set every switch that differs from ``state`` back to it; what still differs after (a
    switch that cannot be set, as inference mode left entered) comes back, as :func:`diff`."""
    now = snapshot()
    if now == state:
        return []
    wanted = dict(state.values)
    for switch in (*_SWITCHES, *_HOOKS):
        value = wanted.get(switch.label, _ABSENT)
        if switch.set is None or value is _ABSENT or isinstance(value, _Unreadable):
            continue
        if _read(switch) != value:
            try:
                switch.set(value)
            except Exception:  # noqa: S112  # reported below as not put back
                continue
    return diff(state, snapshot())


#: The switches that say what a case's regime means ("fp32" is float32 tensors, made on
#: the case's device, autocast entered by the case alone, gradients on), at torch's own
#: defaults: a run of the suite starts from these, whatever an import (the implementation's
#: module, a model factory's) or its caller set before it.
REGIME_DEFAULTS: dict[str, object] = {
    "default dtype": torch.float32,
    "default device": torch.device("cpu"),
    "grad enabled": True,
    "autocast on cpu": False,
    "autocast on cuda": False,
}


def pin_regime() -> dict[str, object]:
    """Set each switch of ``REGIME_DEFAULTS`` that differs back to torch's default (on the
    calling thread); what each was, for :func:`unpin` and for saying so."""
    changed: dict[str, object] = {}
    for switch in _SWITCHES:
        if switch.label not in REGIME_DEFAULTS or switch.set is None:
            continue
        value = _read(switch)
        if value is not _ABSENT and value != REGIME_DEFAULTS[switch.label]:
            changed[switch.label] = value
            switch.set(REGIME_DEFAULTS[switch.label])
    return changed


def pinned_lines(changed: dict[str, object]) -> list[str]:
    """:func:`pin_regime`'s changes, one readable line each."""
    return [f"{label} was {_show(value)} before the run (set by an import or the caller); the "
            f"cases ran with {_show(REGIME_DEFAULTS[label])}, as their regimes say"
            for label, value in changed.items()]


def unpin(changed: dict[str, object]) -> None:
    """Put back what :func:`pin_regime` changed."""
    for switch in _SWITCHES:
        if switch.label in changed and switch.set is not None:
            switch.set(changed[switch.label])


def _show(value: object) -> str:
    return str(value) if isinstance(value, torch.dtype | torch.device) else repr(value)

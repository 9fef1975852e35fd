"""What the comparison calls, fingerprinted before the implementation is imported.

The implementation runs in the process that compares its gradients and decides: a module
that replaces ``torch.equal``, a tensor method or one of gradequiv's own helpers can make
every comparison agree. Every attribute of torch, of the tensor classes, of the builtins
and of the gradequiv modules already imported is remembered (by identity) before the
implementation's code runs, and looked at again after each case and at the end: one
replaced is a run that cannot pass, and the report names it. The real libraries whose
checkpoints are checked replace none of them (transformers, PEFT, diffusers, fairscale,
megatron-core, DeepSpeed, measured), so this costs no false alarm there.

An implementation that patches and restores within one case, or that detects it is being
checked, is not caught here (docs/reference.md, "What a pass proves").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

#: modules whose own attributes the comparison and the verdict call (their submodules
#: that a checkpoint may legitimately wrap, torch.utils.checkpoint among them, are not)
_WATCHED_MODULES = ("torch", "torch.nn.functional", "torch.autograd", "torch.linalg",
                    "math", "builtins", "json", "operator")


@dataclass(frozen=True)
class Fingerprint:
    """Each watched attribute, by its owner's name and its own: the owner (a module, or
    torch.Tensor) and the object the attribute was."""

    objects: dict[tuple[str, str], tuple[Any, Any]]

    def replaced(self) -> list[str]:
        """The watched attributes that no longer hold the object they held (sorted). A
        module imported anew (pytest drops and re-imports test modules between in-process
        runs) has new objects of its own, not replaced ones: it is left out."""
        now = _watched()
        out = []
        for (owner, name), (holder, obj) in self.objects.items():
            current = now.get((owner, name))
            if current is not None and current[0] is not holder:
                continue
            if current is None and sys.modules.get(owner, holder) is not holder:
                continue
            if current is None or current[1] is not obj:
                out.append(f"{owner}.{name}")
        return sorted(out)


def fingerprint() -> Fingerprint:
    """The watched attributes as they are now (call it before the implementation's import).
    torch._dynamo is imported first: its import wraps ``torch.manual_seed``, and a
    checkpoint or an optimizer imports it lazily on first use."""
    import torch._dynamo  # noqa: F401

    return Fingerprint(_watched())


def _watched() -> dict[tuple[str, str], tuple[Any, Any]]:
    found: dict[tuple[str, str], tuple[Any, Any]] = {}
    for name in _WATCHED_MODULES:
        module = sys.modules.get(name)
        if module is not None:  # their functions: torch rebinds some of its classes itself
            _add(found, name, module, vars(module), classes=False)
    torch = sys.modules.get("torch")
    if torch is not None:
        for cls in reversed(torch.Tensor.__mro__[:-1]):  # the subclass's own entries win
            _add(found, "torch.Tensor", torch.Tensor, vars(cls))
    for name, module in list(sys.modules.items()):
        if name == "gradequiv" or name.startswith("gradequiv."):
            _add(found, name, module, vars(module))
    return found


def _add(found: dict[tuple[str, str], tuple[Any, Any]], owner: str, holder: Any,
         namespace: Any, *, classes: bool = True) -> None:
    """The callables of ``namespace`` (``classes=False``: not its classes; torch points
    ``torch.Storage`` at another class when the default dtype changes)."""
    for attr, obj in list(namespace.items()):
        if callable(obj) and not isinstance(obj, type(sys)) and (
                classes or not isinstance(obj, type)):
            found[(owner, attr)] = (holder, obj)


def said(replaced: list[str], *, most: int = 5) -> str:
    """The failure's words for ``replaced`` (non-empty)."""
    shown = ", ".join(replaced[:most])
    more = f" and {len(replaced) - most} more" if len(replaced) > most else ""
    return (f"the implementation's process replaced {shown}{more} after gradequiv bound "
            f"its comparison to them: a verdict from that process cannot be trusted, so "
            f"the run does not pass (put back what the implementation patches, or patch "
            f"it outside the checked code)")


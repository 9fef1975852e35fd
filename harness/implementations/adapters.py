"""An implementation, resolved: what to call, through which of the three adapter kinds.

``function``: ``impl(function, *args, **kwargs)``, torch.utils.checkpoint's
calling convention, called where the model would call the segment.
``wrapper``: ``impl(module) -> module``, applied once per selected segment.
``toggle``: ``impl(model)``; the model turns recompute on itself for the
segments the harness selected (HF's ``gradient_checkpointing_enable``).
Turning a SPEC into one of these is :mod:`.resolve`'s job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from gradequiv.harness import validate
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.implementations.torch_builtins import OFFLOAD
from gradequiv.harness.options import ADAPTERS
from gradequiv.models import Segment
from gradequiv.models.kinds import GRAD_MODES
from gradequiv.models.segments import Router

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
    def offloads(self) -> bool:
        """Whether it keeps activations in host memory instead of recomputing them
        (``gradequiv_strategy = "offload"`` on the target)."""
        return getattr(self.target, "gradequiv_strategy", "recompute") == OFFLOAD

    @property
    def grad_modes(self) -> tuple[str, ...]:
        """The ways of asking for gradients it supports: every one of ``GRAD_MODES`` but those
        its target lists in ``gradequiv_unsupported`` (torch's reentrant checkpoint refuses
        ``torch.autograd.grad`` by design, loudly), and ``autograd-grad`` when it is told to
        run reentrant (``use_reentrant=true``, the wrapper's ``reentrant=true``)."""
        refused = set(getattr(self.target, "gradequiv_unsupported", ()))
        if self.kwargs.get("use_reentrant") is True or self.kwargs.get("reentrant") is True:
            refused.add("autograd-grad")
        return tuple(mode for mode in GRAD_MODES if mode not in refused)

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
        if self.adapter != self.default_adapter:
            args += ["--adapter", self.adapter]
        for key, value in self.kwargs.items():
            args += ["--impl-kwarg", f"{key}={_format_value(value)}"]
        return args


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


#: ``KEY=VALUE`` items as keyword arguments (the one parser: :func:`validate.impl_kwargs`).
parse_impl_kwargs = validate.impl_kwargs

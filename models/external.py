"""Bring your own model: a factory names the model, its fixed batch, its loss and its segments.

The reference models call their segments through the router; a user's model
calls its own submodules directly. So each named segment's ``forward`` is
replaced (on the instance) by one that hands the call to the router with a
*shell*: a small module whose forward runs the submodule's original
``forward``. Whatever the implementation does with the shell (checkpoint it,
wrap it, re-run it in backward), every run goes through the shell's
``__call__``, so its hooks (the harness counts recompute with them) see it;
and a toggle that recomputes inside the submodule's own ``__call__`` (HF's
layers) reaches the shell the same way.

A factory is ``f(seed: int) -> UserModel``, named ``package.module:attr``
like an implementation; it must build the same model and batch for the same
seed.
"""

from __future__ import annotations

import os
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from gradequiv.harness.errors import InvalidArgument
from gradequiv.models.granularity import SINGLE_LAYERS, Granularity
from gradequiv.models.segments import (
    RoutedModel,
    Router,
    Segment,
    attach_router,
    layer_segments,
)

__all__ = ["ExternalConfig", "ExternalModel", "UserModel", "load_user_model"]


@dataclass(frozen=True)
class ExternalConfig:
    """A user's model, by the factory that builds it."""

    factory: str  # package.module:attr, called as factory(seed) -> UserModel

    @property
    def has_randomness(self) -> bool:
        return True  # unknown: assume the model draws random numbers

    def __post_init__(self) -> None:
        module, sep, attr = self.factory.partition(":")
        if not (module and sep and attr):
            raise InvalidArgument(
                f"--model={self.factory!r} is not 'package.module:attr'; name a function "
                f"that takes a seed and returns gradequiv.models.UserModel")


@dataclass
class UserModel:
    """What a factory returns: everything the harness needs to train one fixed batch."""

    model: nn.Module
    inputs: tuple[Tensor | None, ...]  # positional arguments of model.forward
    targets: Tensor
    loss_fn: Callable[[Any, Tensor], Tensor]
    segments: list[str]  # dotted names of the submodules to recompute, in call order


class _Shell(nn.Module):
    """The segment as the implementation sees it: calling it runs the user's submodule's
    own ``forward`` body. Its hooks are the harness's view of every run, first or again."""

    real: nn.Module  # set past nn.Module's registration: the user's model owns it
    body: Callable[..., Any]  # the submodule's original forward

    def __init__(self, real: nn.Module, body: Callable[..., Any]) -> None:
        super().__init__()
        object.__setattr__(self, "real", real)
        object.__setattr__(self, "body", body)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.body(*args, **kwargs)


class ExternalModel(RoutedModel):
    """A user's model with its named segments sent through the router."""

    router: Router

    def __init__(self, inner: nn.Module, segment_names: list[str]) -> None:
        super().__init__()
        self.inner = inner
        self._shells: list[tuple[str, _Shell]] = []
        attach_router(self)
        modules = dict(inner.named_modules())
        for name in segment_names:
            if name not in modules or name == "":
                raise InvalidArgument(
                    f"segment {name!r} is not a submodule of the model; known names start "
                    f"with: {', '.join(sorted(n for n in modules if n)[:8])}")
            real = modules[name]
            shell = _Shell(real, real.forward)
            object.__setattr__(shell, "router", self.router)
            self._shells.append((f"inner.{name}", shell))
            self._route(real, shell)

    def _route(self, real: nn.Module, shell: _Shell) -> None:
        router = self.router

        def forward(*args: Any, **kwargs: Any) -> Any:
            return router(shell, *args, **kwargs)  # the implementation, or the shell plainly

        object.__setattr__(real, "forward", forward)

    def segments(self, granularity: Granularity) -> list[Segment]:
        if not isinstance(granularity, SINGLE_LAYERS):
            raise InvalidArgument(
                f"granularity={str(granularity)!r}: a --model case recomputes its named "
                f"segments: use none, layer or every:K")
        return layer_segments(granularity, self._shells)

    def selected(self) -> list[nn.Module]:
        """The user's submodules selected for recompute (for toggles that pick their own)."""
        return [shell.real for _, shell in self._shells if self.router.installed(shell)]

    def forward(self, *inputs: Any) -> Any:
        return self.inner(*inputs)


def load_user_model(config: ExternalConfig, seed: int) -> UserModel:
    """Import the factory, call it with ``seed``, and check what it returned."""
    if os.getcwd() not in sys.path:  # the factory may live in the current directory
        sys.path.insert(0, os.getcwd())
    try:
        factory = pkgutil.resolve_name(config.factory)
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
    if not isinstance(built.inputs, tuple):
        built.inputs = tuple(built.inputs)
    return built

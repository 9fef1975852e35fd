"""Split functions for ``--wrapper pp --split tests.pipeline_models:NAME`` (each
``function(model, n_stages) -> [stage, ...]``), as a user writes one for their own model,
and ones that get it wrong, for the refusals."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from user_models import Residual, Stack, residual_stack

from gradequiv.models import UserModel


class StackPart(nn.Module):
    """A run of ``user_models.residual_stack``'s blocks, called as its forward calls them
    (``scale=0.5``), then its head where this part is the last."""

    def __init__(self, blocks: list[nn.Module], head: nn.Module | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5)
        return self.head(x) if self.head is not None else x


def _runs(units: list[Any], n_stages: int) -> list[list[Any]]:
    """``units`` as ``n_stages`` contiguous runs, the earliest the larger where they do not
    divide."""
    base, extra = divmod(len(units), n_stages)
    runs, start = [], 0
    for k in range(n_stages):
        stop = start + base + (k < extra)
        runs.append(units[start:stop])
        start = stop
    return runs


def residual_stack_split(model: nn.Module, n_stages: int) -> list[nn.Module]:
    """The stack's blocks then its head as ``n_stages`` contiguous runs; the head joins
    the last block's stage when the stages are fewer than the units."""
    units: list[Any] = [*model.blocks, None]  # type: ignore[misc]  # None: the head's place
    head: Any = model.head
    return [StackPart([u for u in run if u is not None], head if k == n_stages - 1 else None)
            for k, run in enumerate(_runs(units, n_stages))]


def one_stage_short(model: nn.Module, n_stages: int) -> list[nn.Module]:
    return residual_stack_split(model, n_stages)[:-1]


def not_modules(model: nn.Module, n_stages: int) -> list[object]:
    return [lambda x: x for _ in range(n_stages)]


def copied_blocks(model: nn.Module, n_stages: int) -> list[nn.Module]:
    """Stages built from copies: the recompute installed on the model's blocks never runs."""
    import copy

    return residual_stack_split(copy.deepcopy(model), n_stages)


# -- a stage that hands its input on unchanged -------------------------------------------------

class MixingBlock(Residual):
    """A residual block that reads the model's input beside the stream (every layer mixes
    ``x0`` back in, as the reference transformer's layers do), by a product: what its
    re-run saves depends on whether ``x0`` needs a gradient."""

    def forward(self, x: Tensor, x0: Tensor, *, scale: float = 1.0) -> Tensor:  # type: ignore[override]
        return x + scale * self.dropout(F.gelu(self.linear(self.norm(x) * x0)))


class MixingStack(Stack):
    def __init__(self, width: int, depth: int, p: float) -> None:
        super().__init__(width, depth, p)
        self.blocks = nn.ModuleList(MixingBlock(width, p) for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        x0 = x
        for block in self.blocks:
            x = block(x, x0, scale=0.5)
        return self.head(x)


def mixing_stack(seed: int) -> UserModel:
    """Four blocks that each read the model's input: split one block a stage, every stage
    but the last hands ``x0`` on as it came (``carry_input_split``)."""
    built = residual_stack(seed)  # its inputs and targets, its loss
    built.model = MixingStack(width=16, depth=4, p=0.2)
    built.segments = [f"blocks.{i}" for i in range(4)]
    return built


class CarryingPart(nn.Module):
    """A run of ``MixingStack``'s blocks taking ``(x, x0)`` (the first: the model's input,
    which is ``x0``) and handing ``(x, x0)`` on, ``x0`` the very tensor it was given; the
    last part ends with the head."""

    def __init__(self, blocks: list[nn.Module], head: nn.Module | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x: Tensor, x0: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        x0 = x if x0 is None else x0
        for block in self.blocks:
            x = block(x, x0, scale=0.5)
        return self.head(x) if self.head is not None else (x, x0)


def carry_input_split(model: nn.Module, n_stages: int) -> list[nn.Module]:
    """The blocks as ``n_stages`` contiguous runs, the head with the last."""
    head: Any = model.head
    return [CarryingPart(run, head if k == n_stages - 1 else None)
            for k, run in enumerate(_runs(list(model.blocks), n_stages))]  # type: ignore[arg-type]

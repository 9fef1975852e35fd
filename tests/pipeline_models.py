"""Split functions for ``--wrapper pp --split tests.pipeline_models:NAME`` (each
``function(model, n_stages) -> [stage, ...]``), as a user writes one for their own model,
and ones that get it wrong, for the refusals."""

from __future__ import annotations

from torch import Tensor, nn


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


def residual_stack_split(model: nn.Module, n_stages: int) -> list[nn.Module]:
    """The stack's blocks then its head as ``n_stages`` contiguous runs, the earliest the
    larger where they do not divide; the head joins the last block's stage when the stages
    are fewer than the units."""
    blocks = list(model.blocks)  # type: ignore[arg-type]
    units: list[nn.Module | None] = [*blocks, None]  # None: the head's place
    base, extra = divmod(len(units), n_stages)
    parts, start = [], 0
    for k in range(n_stages):
        stop = start + base + (k < extra)
        run = units[start:stop]
        parts.append(StackPart([u for u in run if u is not None],
                               model.head if k == n_stages - 1 else None))  # type: ignore[arg-type]
        start = stop
    return parts


def one_stage_short(model: nn.Module, n_stages: int) -> list[nn.Module]:
    return residual_stack_split(model, n_stages)[:-1]


def not_modules(model: nn.Module, n_stages: int) -> list[object]:
    return [lambda x: x for _ in range(n_stages)]


def copied_blocks(model: nn.Module, n_stages: int) -> list[nn.Module]:
    """Stages built from copies: the recompute installed on the model's blocks never runs."""
    import copy

    return residual_stack_split(copy.deepcopy(model), n_stages)

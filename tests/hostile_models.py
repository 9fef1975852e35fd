"""Models a hostile or careless user brings (``--model hostile_models:NAME``): a loss that
is NaN, a loss that is no tensor, outputs the loss cannot take."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradequiv.models import UserModel


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.gelu(self.linear(x))


class _Stack(nn.Module):
    def __init__(self, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _built(seed: int, loss_fn: object) -> UserModel:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = _Stack()
    inputs = (torch.randn(4, 8, generator=gen).requires_grad_(),)
    targets = torch.randint(0, 3, (4,), generator=gen)
    return UserModel(model, inputs, targets, loss_fn,  # type: ignore[arg-type]
                     segments=["blocks.0", "blocks.1"])


def _nan_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(outputs, targets) * float("nan")


def nan_loss(seed: int) -> UserModel:
    """A loss that is NaN on every path: nothing can be compared."""
    return _built(seed, _nan_loss)


def _float_loss(outputs: Tensor, targets: Tensor) -> float:
    return F.cross_entropy(outputs, targets).item()


def float_loss(seed: int) -> UserModel:
    """A loss function that returns a Python float, not a tensor."""
    return _built(seed, _float_loss)


def _dict_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(outputs["logits"], targets)  # type: ignore[index]


def loss_wants_a_dict(seed: int) -> UserModel:
    """A loss that reads ``outputs["logits"]`` from a model that returns a tensor."""
    return _built(seed, _dict_loss)

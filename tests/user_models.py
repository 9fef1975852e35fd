"""Models a user brings (``--model user_models:NAME``): factories of gradequiv.models.UserModel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradequiv.models import UserModel


class Residual(nn.Module):
    """x + dropout(gelu(linear(norm(x)))): a small residual block with a random op."""

    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(p)

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        return x + scale * self.dropout(F.gelu(self.linear(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, width: int, depth: int, p: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual(width, p) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5)  # a keyword argument the recompute must keep
        return self.head(x)


def residual_stack(seed: int) -> UserModel:
    gen = torch.Generator().manual_seed(seed)
    model = Stack(width=16, depth=3, p=0.2)
    inputs = (torch.randn(8, 16, generator=gen).requires_grad_(),)
    targets = torch.randint(0, 3, (8,), generator=gen)
    return UserModel(model, inputs, targets, F.cross_entropy,
                     segments=[f"blocks.{i}" for i in range(3)])


def wrong_segment(seed: int) -> UserModel:
    built = residual_stack(seed)
    built.segments = ["blocks.9"]
    return built


def ignores_its_seed(seed: int) -> UserModel:
    """The residual stack with weights and batch drawn after a reseed from the clock
    (``torch.seed()``): every build differs, whatever the seed."""
    del seed
    torch.seed()
    model = Stack(width=16, depth=3, p=0.2)
    inputs = (torch.randn(8, 16).requires_grad_(),)
    targets = torch.randint(0, 3, (8,))
    return UserModel(model, inputs, targets, F.cross_entropy,
                     segments=[f"blocks.{i}" for i in range(3)])


def seeds_the_global_generator(seed: int) -> UserModel:
    """Seeds the global generator itself and draws everything from it: reproducible."""
    torch.manual_seed(seed)
    model = Stack(width=16, depth=3, p=0.2)
    inputs = (torch.randn(8, 16).requires_grad_(),)
    targets = torch.randint(0, 3, (8,))
    return UserModel(model, inputs, targets, F.cross_entropy,
                     segments=[f"blocks.{i}" for i in range(3)])


_BUILT: dict[int, UserModel] = {}


def same_model_every_call(seed: int) -> UserModel:
    """Builds once per seed and hands the same model out again: equal, but shared."""
    if seed not in _BUILT:
        _BUILT[seed] = residual_stack(seed)
    return _BUILT[seed]

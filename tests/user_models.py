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


# -- unusual but real: what a new user brings (issue 26) ---------------------------------------

class Experts(nn.Module):
    """An MoE layer: a submodule named ``router`` picks one of two experts per row, and the
    layer returns the chosen index (an integer tensor) beside its hidden state."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.router = nn.Linear(width, 2)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        probs = self.router(x).softmax(-1)  # (B, 2)
        index = probs.argmax(-1)  # (B,), int64
        outs = torch.stack([expert(x) for expert in self.experts], 1)  # (B, 2, W)
        chosen = outs.gather(1, index[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]
        return x + self.dropout(probs.gather(1, index[:, None]) * chosen), index


class MoEStack(nn.Module):
    """Its layers live in a container named ``inner`` (as the harness's wrapper names the
    user's model); each layer's chosen expert feeds the next through an embedding."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inner = nn.ModuleList(Experts(width) for _ in range(depth))
        self.expert_embedding = nn.Embedding(2, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.inner:
            x, index = layer(x)
            x = x + self.expert_embedding(index)
        return self.head(x)


def moe_with_router(seed: int) -> UserModel:
    gen = torch.Generator().manual_seed(seed)
    model = MoEStack(width=16, depth=3)
    inputs = (torch.randn(8, 16, generator=gen).requires_grad_(),)
    targets = torch.randint(0, 3, (8,), generator=gen)
    return UserModel(model, inputs, targets, F.cross_entropy,
                     segments=[f"inner.{i}" for i in range(3)])


class Pruned(nn.Module):
    """A pruned layer: it returns its input, and saves nothing for backward."""

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        del scale
        return x


class Blocks(nn.Module):
    """Residual blocks, some of them pruned, dropped at random (LayerDrop) in training:
    the decision is made here, outside the blocks."""

    def __init__(self, blocks: list[nn.Module], layerdrop: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.layerdrop = layerdrop
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            if self.training and self.layerdrop and float(torch.rand(())) < self.layerdrop:
                continue
            x = block(x, scale=0.5)
        return self.head(x)


def _blocks_model(seed: int, blocks: list[nn.Module], layerdrop: float = 0.0) -> UserModel:
    gen = torch.Generator().manual_seed(seed)
    model = Blocks(blocks, layerdrop)
    inputs = (torch.randn(8, 16, generator=gen).requires_grad_(),)
    targets = torch.randint(0, 3, (8,), generator=gen)
    return UserModel(model, inputs, targets, F.cross_entropy,
                     segments=[f"blocks.{i}" for i in range(len(blocks))])


def pruned_layers(seed: int) -> UserModel:
    """Blocks 0 and 2 are pruned: ``every:2`` selects only them, ``layer`` all four."""
    return _blocks_model(seed, [Pruned(), Residual(16, 0.1), Pruned(), Residual(16, 0.1)])


def layerdrop(seed: int) -> UserModel:
    """Three blocks, each dropped with probability 0.5 at every training forward: some
    steps skip every selected block."""
    return _blocks_model(seed, [Residual(16, 0.1) for _ in range(3)], layerdrop=0.5)


def _track_input_mean(module: nn.Module, args: tuple[Tensor, ...]) -> None:
    """A running statistic of the block's input, kept by a forward pre-hook."""
    with torch.no_grad():
        module.input_mean.mul_(0.9).add_(0.1 * args[0].mean())


def hooked_running_mean(seed: int) -> UserModel:
    """Unsafe to recompute: a forward pre-hook on each segment updates a running statistic,
    and a recompute runs the hook again, as ``checkpoint(block, x)`` does in real code.
    (A forward hook after the block would be spared by torch's checkpoint, which stops
    its re-run once it has what backward needs.)"""
    built = residual_stack(seed)
    for block in built.model.blocks:
        block.register_buffer("input_mean", torch.zeros(()))
        block.register_forward_pre_hook(_track_input_mean)
    return built

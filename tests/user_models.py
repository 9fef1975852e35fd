"""Models a user brings (``--model user_models:NAME``): factories of gradequiv.models.UserModel."""

from __future__ import annotations

import functools
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
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


# -- not safe to recompute, whatever the checkpoint: the model's own doing (issue 25) ----------
# Each segment's forward changes or draws from something its re-run reads again; torch's
# checkpoint re-runs it faithfully and still computes something else.

class PowerIteration(Residual):
    """A spectrally normalised block, as ``spectral_norm`` keeps it: every training forward
    takes one power-iteration step and stores the new ``weight_u`` in a buffer, then divides
    the weight by the spectral norm it estimates; a re-run starts from the stored vector."""

    weight_u: Tensor

    def __init__(self, width: int) -> None:
        super().__init__(width, 0.0)
        self.register_buffer("weight_u", F.normalize(torch.ones(width), dim=0))

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        weight = self.linear.weight
        if self.training:
            with torch.no_grad():
                v = F.normalize(weight.t() @ self.weight_u, dim=0)
                self.weight_u.copy_(F.normalize(weight @ v, dim=0))
        v = F.normalize(weight.t() @ self.weight_u, dim=0).detach()
        sigma = self.weight_u @ weight @ v
        return x + scale * F.gelu(F.linear(self.norm(x), weight / sigma, self.linear.bias))


def power_iteration(seed: int) -> UserModel:
    """Unsafe: the re-run divides by another spectral norm (``weight_u`` moved on)."""
    return _blocks_model(seed, [PowerIteration(16) for _ in range(3)])


class EMACodebook(nn.Module):
    """A vector quantiser whose codebook follows the codes assigned to it by an exponential
    moving average, updated in the forward (VQ-VAE-2's EMA codebook)."""

    codebook: Tensor

    def __init__(self, width: int, codes: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.register_buffer("codebook", torch.linspace(-1, 1, codes * width).view(codes, width))

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        h = self.proj(x)  # (B, W)
        index = torch.cdist(h.detach(), self.codebook).argmin(-1)  # (B,)
        quantized = h + (self.codebook[index] - h).detach()  # straight through
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(index, self.codebook.shape[0]).to(h.dtype)  # (B, K)
                counts = onehot.sum(0)[:, None]  # (K, 1)
                means = onehot.t() @ h / counts.clamp(min=1)
                self.codebook.lerp_(torch.where(counts > 0, means, self.codebook), 0.5)
        return x + scale * self.out(F.gelu(quantized))


def ema_codebook(seed: int) -> UserModel:
    """Unsafe: the re-run quantises to the codebook the forward's update moved."""
    return _blocks_model(seed, [EMACodebook(16) for _ in range(3)])


class WarmupBlock(Residual):
    """A residual branch faded in over its first calls, counted by a plain attribute."""

    def __init__(self, width: int) -> None:
        super().__init__(width, 0.0)
        self.calls = 0

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        warmup = min(1.0, (self.calls + 1) / 4)
        self.calls += 1
        return super().forward(x, scale=scale * warmup)


def warmup_counter(seed: int) -> UserModel:
    """Unsafe: the re-run counts one call more and fades the branch in further."""
    return _blocks_model(seed, [WarmupBlock(16) for _ in range(3)])


class CoinFlipBlock(Residual):
    """A block that mirrors its features at random, by a coin of Python's own ``random``."""

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        if self.training and random.random() < 0.5:
            x = x.flip(-1)
        return super().forward(x, scale=scale)


def python_coin_flip(seed: int) -> UserModel:
    """Unsafe: the re-run tosses its coin again (Python's generator, seeded here)."""
    random.seed(seed)
    return _blocks_model(seed, [CoinFlipBlock(16, 0.0) for _ in range(3)])


class ManifoldMixup(Residual):
    """Manifold mixup inside the block: each forward mixes the batch with itself reversed,
    by a weight drawn from NumPy's global generator."""

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        if self.training:
            lam = float(np.random.beta(0.4, 0.4))
            x = lam * x + (1 - lam) * x.flip(0)
        return super().forward(x, scale=scale)


def numpy_mixup(seed: int) -> UserModel:
    """Unsafe: the re-run draws another mixing weight (NumPy's generator, seeded here)."""
    np.random.seed(seed)
    return _blocks_model(seed, [ManifoldMixup(16, 0.0) for _ in range(3)])


class NoisyBlock(Residual):
    """Gaussian noise added to the features in training, drawn from a NumPy generator the
    block holds (``np.random.default_rng``), or a Python ``random.Random`` one."""

    def __init__(self, width: int, rng: np.random.Generator | random.Random) -> None:
        super().__init__(width, 0.0)
        self.rng = rng

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        if self.training:
            if isinstance(self.rng, random.Random):
                noise = torch.tensor([self.rng.gauss(0.0, 0.1) for _ in range(x.shape[-1])])
            else:
                noise = torch.from_numpy(self.rng.normal(0.0, 0.1, x.shape[-1])).float()
            x = x + noise
        return super().forward(x, scale=scale)


def numpy_generator_noise(seed: int) -> UserModel:
    """Unsafe: the re-run draws other noise from the block's NumPy generator."""
    return _blocks_model(seed, [NoisyBlock(16, np.random.default_rng(seed + i))
                                for i in range(3)])


def python_generator_noise(seed: int) -> UserModel:
    """Unsafe: the re-run draws other noise from the block's ``random.Random``."""
    return _blocks_model(seed, [NoisyBlock(16, random.Random(seed + i)) for i in range(3)])


class OwnDropout(Residual):
    """Dropout by a mask drawn from a ``torch.Generator`` the block holds."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__(width, 0.0)
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        h = F.gelu(self.linear(self.norm(x)))
        if self.training:
            keep = torch.rand(h.shape, generator=self.generator) >= 0.3
            h = h * keep / 0.7
        return x + scale * h


def own_generator_dropout(seed: int) -> UserModel:
    """Unsafe: no checkpoint restores a generator of the model's own."""
    return _blocks_model(seed, [OwnDropout(16, seed + i) for i in range(3)])


class SideChannelBlock(Residual):
    """A block handed a per-call gate through a list its parent fills: it pops it."""

    def __init__(self, width: int) -> None:
        super().__init__(width, 0.0)
        self.gates: list[Tensor] = []

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        gate = self.gates.pop()
        return super().forward(x * gate, scale=scale)


class SideChannel(Blocks):
    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            block.gates.append(x.detach().mean(0).sigmoid())  # (W,)
            x = block(x, scale=0.5)
        return self.head(x)


def popped_side_channel(seed: int) -> UserModel:
    """Unsafe: the re-run pops from the list its forward emptied, and raises."""
    built = _blocks_model(seed, [SideChannelBlock(16) for _ in range(3)])
    built.model = SideChannel(list(built.model.blocks))  # the same blocks, their lists filled
    return built


class GatedByKeyword(Residual):
    """A block called with a dict of its inputs that takes its gate out of the dict, as
    code that pops its options from a ``**kwargs`` dict it was handed does."""

    def forward(self, inputs: dict[str, Tensor], *, scale: float = 1.0) -> Tensor:
        gate = inputs.pop("gate")
        return super().forward(inputs["hidden"] * gate, scale=scale)


class GatedStack(Blocks):
    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block({"hidden": x, "gate": x.detach().mean(0).sigmoid()}, scale=0.5)
        return self.head(x)


def popped_argument(seed: int) -> UserModel:
    """Unsafe: the re-run is handed the dict its forward took the gate out of, and raises."""
    built = _blocks_model(seed, [GatedByKeyword(16, 0.0) for _ in range(3)])
    built.model = GatedStack(list(built.model.blocks))  # the same blocks, called with a dict
    return built


class HalvesInPlace(Residual):
    """A block that halves the residual stream it is given in place, sparing a copy."""

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        x.mul_(0.5)
        return super().forward(x, scale=scale)


class Embedded(Blocks):
    """Blocks after an input projection (whose output backward does not need)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__(blocks)
        self.embed = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(self.embed(x))


def input_halved_in_place(seed: int) -> UserModel:
    """Unsafe: the re-run reads the input its forward halved, and halves it again."""
    built = _blocks_model(seed, [HalvesInPlace(16, 0.0) for _ in range(3)])
    built.model = Embedded(list(built.model.blocks))
    return built


# -- unusual, and safe to recompute ------------------------------------------------------------

class CountedBlock(Residual):
    """Counts its training calls in a buffer, skipping the re-run a recompute makes inside
    backward, as the reference model's counters do; the count changes nothing computed."""

    calls: Tensor

    def __init__(self, width: int) -> None:
        super().__init__(width, 0.1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        if self.training and torch._C._current_graph_task_id() == -1:  # not a re-run
            self.calls.add_(1)
        return super().forward(x, scale=scale)


def guarded_counter(seed: int) -> UserModel:
    return _blocks_model(seed, [CountedBlock(16) for _ in range(3)])


class PositionCacheBlock(Residual):
    """Adds a sinusoidal table, made on the first call for a width and cached: the re-run
    finds the cache its forward filled, with the same values in it."""

    def __init__(self, width: int) -> None:
        super().__init__(width, 0.1)
        self.tables: dict[int, Tensor] = {}

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        width = x.shape[-1]
        if width not in self.tables:
            position = torch.arange(width, dtype=torch.float32)
            self.tables[width] = torch.sin(position / 10.0)
        return super().forward(x + self.tables[width].to(x.dtype), scale=scale)


def lazy_position_cache(seed: int) -> UserModel:
    return _blocks_model(seed, [PositionCacheBlock(16) for _ in range(3)])


class OutsideCoins(Blocks):
    """Draws each block's residual scale from Python's ``random`` before calling it: the
    draw is the parent's, and the checkpoint keeps the scale it was given."""

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x, scale=0.25 + 0.5 * random.random())
        return self.head(x)


def random_outside_segment(seed: int) -> UserModel:
    random.seed(seed)
    built = _blocks_model(seed, [Residual(16, 0.1) for _ in range(3)])
    built.model = OutsideCoins(list(built.model.blocks))  # the same blocks, scaled at random
    return built


# -- shaped like the libraries' models (issue 37): what transformers, PEFT, timm, diffusers and
# torchtune do, without the libraries ------------------------------------------------------------

class BiasBlock(Residual):
    """A block that adds a position bias it is handed, as T5's layers add the first layer's."""

    def forward(self, x: Tensor, bias: Tensor | None = None, *, scale: float = 1.0) -> Tensor:
        out = super().forward(x, scale=scale)
        return out if bias is None else out + bias


class CheckpointingStack(nn.Module):
    """Shaped like a transformers model with frozen embeddings (a PEFT base): its own
    checkpointing switch, which under reentrant checkpoint makes the embeddings' output
    require grad (``enable_input_require_grads``, transformers' fix for adapters getting no
    gradient) and marks the constant position bias as requiring grad (T5). Full storage
    has neither: those tensors get a gradient on the recompute path only."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.embed.requires_grad_(False)  # frozen, as a PEFT base model's are
        self.blocks = nn.ModuleList(BiasBlock(width, 0.1) for _ in range(depth))
        self.head = nn.Linear(width, 3)
        self.gradient_checkpointing = False
        self.checkpointed: set[int] | None = None  # None: every block
        self.train_embeddings = False

    def set_grad_checkpointing(self, enable: bool = True, segments: list[str] | None = None,
                               *, train_embeddings: bool = False) -> None:
        self.gradient_checkpointing = enable
        if segments is not None:
            self.checkpointed = {int(name.rpartition(".")[2]) for name in segments}
        self.train_embeddings = train_embeddings  # a faulty toggle: unfreezes a frozen layer
        if train_embeddings:
            self.embed.requires_grad_(True)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)  # (B, T, W)
        on = self.gradient_checkpointing and self.training
        if on:
            h.requires_grad_(True)  # enable_input_require_grads
        position = torch.arange(tokens.shape[1], dtype=h.dtype)[:, None]  # (T, 1)
        bias = torch.sin(position / 4.0).expand(-1, h.shape[-1]).clone()  # (T, W), constant
        if on:
            bias.requires_grad_(True)  # T5: position_bias.requires_grad = True
        for i, block in enumerate(self.blocks):
            if on and (self.checkpointed is None or i in self.checkpointed):
                h = torch.utils.checkpoint.checkpoint(block, h, bias, use_reentrant=True)
            else:
                h = block(h, bias)
        return self.head(h.mean(1))


def _token_classifier(seed: int, make: Any, segments: list[Any], vocabulary: int = 10,
                      **kwargs: Any) -> UserModel:
    """A model ``make()`` of 4 x 6 token ids into 3 classes, built and batched from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = make()
    tokens = torch.randint(0, vocabulary, (4, 6), generator=gen)
    targets = torch.randint(0, 3, (4,), generator=gen)
    return UserModel(model, (tokens,), targets, F.cross_entropy, segments=segments, **kwargs)


def checkpointing_stack(seed: int) -> UserModel:
    return _token_classifier(seed, CheckpointingStack, [BiasBlock],  # reentrant: no
                             regimes=("fp32", "bf16-autocast"))  # torch.autograd.grad


def stack_checkpointing(model: nn.Module, segments: list[str]) -> None:
    """The toggle of ``CheckpointingStack``, handed the selected segments."""
    model.set_grad_checkpointing(True, segments)


stack_checkpointing.gradequiv_unsupported = ("autograd-grad",)  # type: ignore[attr-defined]


def stack_checkpointing_unfreezing(model: nn.Module, segments: list[str]) -> None:
    """A faulty toggle: it trains the frozen embeddings (their gradients on one path only)."""
    model.set_grad_checkpointing(True, segments, train_embeddings=True)


stack_checkpointing_unfreezing.gradequiv_unsupported = (  # type: ignore[attr-defined]
    "autograd-grad",)


class SharedBiasBlock(nn.Module):
    """Shaped like T5's block: the first computes a position bias from its own parameter,
    adds it and returns it for the later ones; the positional arguments go through the
    checkpoint, the keywords are bound by ``functools.partial`` (transformers'
    ``GradientCheckpointingLayer``)."""

    def __init__(self, width: int, first: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.1)
        self.relative = nn.Parameter(torch.randn(width) / 4) if first else None
        self.gradient_checkpointing = False
        self.reentrant_kwargs: dict[str, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.gradient_checkpointing and self.training:
            return torch.utils.checkpoint.checkpoint(
                functools.partial(super().__call__, **kwargs), *args, use_reentrant=True,
                **self.reentrant_kwargs)
        return super().__call__(*args, **kwargs)

    def forward(self, x: Tensor, position: Tensor | None = None, *,
                bias: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if position is None and self.relative is not None:
            position = self.relative * torch.linspace(0, 1, x.shape[-2])[:, None]
        out = x + self.dropout(F.gelu(self.linear(self.norm(x))))
        if position is not None:
            out = out + position
        return (out if bias is None else out + bias), position


class SharedBiasStack(nn.Module):
    """T5's shape under transformers' reentrant checkpoint: the first block's position bias
    reaches the later blocks as a checkpoint's output (full storage: the tensor the first
    block made and used), and a constant bias bound by keyword is marked as requiring grad
    only when checkpointing is on."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.blocks = nn.ModuleList(SharedBiasBlock(width, i == 0) for i in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        steps = torch.arange(tokens.shape[1], dtype=h.dtype)[:, None]
        bias = torch.cos(steps / 3.0).expand(-1, h.shape[-1]).clone()
        if self.training and any(b.gradient_checkpointing for b in self.blocks):
            bias.requires_grad_(True)  # T5: position_bias.requires_grad = True
        position = None
        for block in self.blocks:
            h, position = block(h, position, bias=bias)
        return self.head(h.mean(1))


def shared_bias_stack(seed: int) -> UserModel:
    return _token_classifier(seed, SharedBiasStack, [SharedBiasBlock],  # reentrant: no
                             regimes=("fp32", "bf16-autocast"))  # torch.autograd.grad


def shared_bias_checkpointing(model: nn.Module, **reentrant_kwargs: Any) -> None:
    """The toggle of ``SharedBiasStack``: every block checkpointed, as transformers does."""
    for block in model.modules():
        if isinstance(block, SharedBiasBlock):
            block.gradient_checkpointing = True
            block.reentrant_kwargs = reentrant_kwargs


shared_bias_checkpointing.gradequiv_unsupported = ("autograd-grad",)  # type: ignore[attr-defined]


def shared_bias_checkpointing_without_rng(model: nn.Module) -> None:
    """A faulty toggle: the re-run draws other dropout masks (no RNG state restored)."""
    shared_bias_checkpointing(model, preserve_rng_state=False)


shared_bias_checkpointing_without_rng.gradequiv_unsupported = (  # type: ignore[attr-defined]
    "autograd-grad",)


def grad_checkpointing(model: nn.Module) -> None:
    """The README's kind of toggle: the model's own switch, on the user's model itself."""
    model.set_grad_checkpointing(True)


grad_checkpointing.gradequiv_unsupported = ("autograd-grad",)  # type: ignore[attr-defined]


class SpectralMix(Residual):
    """A block that mixes its features in the frequency domain: ``torch.fft.rfft`` refuses
    bfloat16, so the model cannot run as a bf16 model (a time-series model's FFT)."""

    def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
        mixed = torch.fft.irfft(torch.fft.rfft(x, dim=-1), n=x.shape[-1], dim=-1)
        return super().forward(mixed, scale=scale)


def spectral(seed: int) -> UserModel:
    return _blocks_model(seed, [SpectralMix(16, 0.1) for _ in range(2)])


def spectral_declared(seed: int) -> UserModel:
    """The same model, its factory declaring the regimes it runs."""
    built = spectral(seed)
    built.regimes = ("fp32", "bf16-autocast", "fp16-autocast")
    return built


def apply_activation_checkpointing(model: nn.Module) -> None:
    """torch's ``apply_activation_checkpointing`` (what torchtune's
    ``set_activation_checkpointing`` calls): every Residual is replaced by a wrapper, so the
    parameter names gain ``_checkpoint_wrapped_module``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as apply,
    )

    apply(model, check_fn=lambda m: isinstance(m, Residual))


# -- outputs that are no tensor ---------------------------------------------------------------

@dataclass
class StackOutput:
    """A library's output structure: a dataclass with fields left None."""

    logits: Tensor
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


class BlockOutput(NamedTuple):
    hidden: Tensor
    aux: Tensor | None


class StructuredBlock(Residual):
    """A block returning a named tuple, one field None."""

    def forward(self, x: Tensor, *, scale: float = 1.0) -> BlockOutput:  # type: ignore[override]
        return BlockOutput(super().forward(x, scale=scale), None)


class DictBlock(Residual):
    """A block returning a dict, as diffusers' and transformers' blocks may."""

    def forward(self, x: Tensor, *, scale: float = 1.0) -> dict[str, Any]:  # type: ignore[override]
        return {"hidden": super().forward(x, scale=scale), "cache": None}


class StructuredStack(Blocks):
    """Returns a dataclass (``StackOutput``) or, with ``as_dict``, an ordered dict with None
    fields, as transformers' ``ModelOutput`` is."""

    def __init__(self, blocks: list[nn.Module], as_dict: bool = False) -> None:
        super().__init__(blocks)
        self.as_dict = as_dict

    def forward(self, x: Tensor) -> Any:  # type: ignore[override]
        hidden = []
        for block in self.blocks:
            out = block(x, scale=0.5)
            x = out["hidden"] if isinstance(out, dict) else out.hidden
            hidden.append(x)
        logits = self.head(x)
        if self.as_dict:
            return OrderedDict(logits=logits, past_key_values=None, hidden_states=tuple(hidden))
        return StackOutput(logits, tuple(hidden))


def _structured_loss(outputs: Any, targets: Tensor) -> Tensor:
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    return F.cross_entropy(logits, targets)


def dataclass_outputs(seed: int) -> UserModel:
    built = _blocks_model(seed, [StructuredBlock(16, 0.1) for _ in range(2)])
    built.model = StructuredStack(list(built.model.blocks))
    built.loss_fn = _structured_loss
    return built


def dict_outputs(seed: int) -> UserModel:
    built = _blocks_model(seed, [DictBlock(16, 0.1) for _ in range(2)])
    built.model = StructuredStack(list(built.model.blocks), as_dict=True)
    built.loss_fn = _structured_loss
    return built


# -- keyword inputs, segments by class: an encoder-decoder shaped like T5 ----------------------

class EncoderDecoder(nn.Module):
    """``forward(input_ids=None, attention_mask=None, decoder_input_ids=None)``, as T5's:
    called by keyword, with None between the inputs it is given."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.encoder = nn.ModuleList(Residual(width, 0.1) for _ in range(2))
        self.decoder = nn.ModuleList(BiasBlock(width, 0.1) for _ in range(2))
        self.head = nn.Linear(width, 10)

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                inputs_embeds: Tensor | None = None,
                decoder_input_ids: Tensor | None = None) -> Tensor:
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        for layer in self.encoder:
            h = layer(h)
        assert decoder_input_ids is not None
        context = h.mean(1, keepdim=True)  # (B, 1, W)
        d = self.embed(decoder_input_ids)
        for layer in self.decoder:
            d = layer(d, context)
        return self.head(d)


def encoder_decoder(seed: int) -> UserModel:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = EncoderDecoder()
    tokens = torch.randint(0, 10, (2, 5), generator=gen)
    decoder = torch.randint(0, 10, (2, 4), generator=gen)
    targets = torch.randint(0, 10, (2, 4), generator=gen)
    return UserModel(model, {"input_ids": tokens, "attention_mask": torch.ones(2, 5),
                             "decoder_input_ids": decoder}, targets,
                     lambda out, t: F.cross_entropy(out.reshape(-1, 10), t.reshape(-1)),
                     segments=[Residual, BiasBlock])


def misnamed_layers(seed: int) -> UserModel:
    """Names a layer list as a library release before renamed it (``encoders`` for ``encoder``)."""
    built = encoder_decoder(seed)
    built.segments = ["encoders.0"]
    return built


# -- timm-shaped: a ViT whose blocks checkpoint through its own switch ---------------------------

class ViTBlock(nn.Module):
    """Pre-norm attention and MLP, with dropout, as timm's ``Block``."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, dropout=0.1, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(2 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """timm's ``VisionTransformer`` in small: patches, a block list, ``set_grad_checkpointing``,
    and in forward ``checkpoint_seq``-style recompute of every block when it is on."""

    def __init__(self, width: int = 16, depth: int = 2, patch: int = 4) -> None:
        super().__init__()
        self.patch = patch
        self.patch_embed = nn.Linear(3 * patch * patch, width)
        self.blocks = nn.Sequential(*(ViTBlock(width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 5)
        self.grad_checkpointing = False

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def forward(self, images: Tensor) -> Tensor:
        b, c, _, _ = images.shape
        patches = images.unfold(2, self.patch, self.patch).unfold(3, self.patch, self.patch)
        x = self.patch_embed(patches.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * self.patch ** 2))
        for block in self.blocks:
            if self.grad_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.norm(x).mean(1))


def tiny_vit(seed: int) -> UserModel:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TinyViT()
    images = torch.randn(2, 3, 8, 8, generator=gen)
    targets = torch.randint(0, 5, (2,), generator=gen)
    return UserModel(model, (images,), targets, F.cross_entropy, segments=[ViTBlock])


def vit_grad_checkpointing(model: nn.Module) -> None:
    """timm's toggle, as its users call it; it checkpoints every block, whatever is selected."""
    model.set_grad_checkpointing(True)


# -- an implementation whose import fails inside it ---------------------------------------------

def toggle_needing_a_library(model: nn.Module) -> None:
    """A toggle that imports its library when called, and the library is not installed."""
    from torchtune_is_not_installed.training import set_activation_checkpointing  # type: ignore[import-not-found]

    set_activation_checkpointing(model)



class PostNormBlock(nn.Module):
    """BERT's layer shape: the query, key and value projections read the layer's input, a
    float32 LayerNorm output, and the layer ends in a LayerNorm of the residual sum. Under
    autocast a reentrant checkpoint's re-run input is a detached leaf that requires grad,
    which autocast's cast cache casts to bfloat16 once for all three projections."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width, bias=False)  # softmax ignores a key bias
        self.value = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        scores = torch.softmax(self.query(x) @ self.key(x).transpose(-2, -1), dim=-1)
        return self.norm(x + scores @ self.value(x))


class PostNormEncoder(nn.Module):
    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.embed_norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(PostNormBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed_norm(self.embed(tokens))  # float32 under autocast: a LayerNorm output
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


def post_norm_encoder(seed: int) -> UserModel:
    return _token_classifier(seed, PostNormEncoder, [PostNormBlock], vocabulary=16)

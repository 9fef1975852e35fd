"""ParameterUses: recompute seen by the ops that read a segment's parameters.

Each test runs a tiny two-block model through one forward and one backward
under :class:`ParameterUses`, switching the phase around ``backward()`` as the
runner does, and checks what it attributed to each block.
"""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from gradequiv.harness.engine.attribution import ParameterUses

aten = torch.ops.aten
WIDTH = 8


class TinyBlock(nn.Module):
    """A layer's parameter kinds: a norm, a linear, and a 1-element gate (as Block's x0_gate)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.gate * torch.tanh(self.fc(self.norm(x)))


class TwoBlocks(nn.Module):
    def __init__(self, call: Callable[[nn.Module, Tensor], Tensor] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([TinyBlock(), TinyBlock()])
        self.call = call

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x) if self.call is None else self.call(block, x)
        return x


class _Phase:
    index = 0


def _step(model: TwoBlocks, *, requires_grad: bool = False
          ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """One forward and backward: (parameter uses, forward pre-hook calls) per block."""
    phase = _Phase()
    blocks = {f"blocks.{i}": b for i, b in enumerate(model.blocks)}
    hooks: dict[str, list[int]] = {name: [0, 0] for name in blocks}
    for name, block in blocks.items():
        def hook(_m: nn.Module, _a: Any, counter: list[int] = hooks[name]) -> None:
            counter[phase.index] += 1
        block.register_forward_pre_hook(hook)
    x = torch.randn(2, 3, WIDTH, generator=torch.Generator().manual_seed(1),
                    requires_grad=requires_grad)
    with ParameterUses(blocks, lambda: phase.index) as uses:
        loss = model(x).square().sum()
        phase.index = 1
        loss.backward()
        phase.index = 0
    return uses.uses, hooks


def test_instance_patched_forward_is_seen_where_hooks_see_nothing() -> None:
    model = TwoBlocks()
    for block in model.blocks:  # the idiom: recompute re-runs the bound forward, not __call__
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    uses, hooks = _step(model)
    for name in uses:
        assert hooks[name] == [1, 0], name  # the hooks' false "ran 0 time(s) in backward"
        assert uses[name][1] > 0, (name, uses)


def test_full_storage_has_no_backward_uses() -> None:
    uses, hooks = _step(TwoBlocks())
    for name in uses:
        # backward kernels read the gate and the norm's weight, under grad mode off
        assert uses[name][0] > 0 and uses[name][1] == 0, (name, uses)
        assert hooks[name] == [1, 0]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_module_call(reentrant: bool) -> None:
    def call(block: nn.Module, x: Tensor) -> Tensor:
        out: Tensor = checkpoint(block, x, use_reentrant=reentrant)
        return out

    uses, hooks = _step(TwoBlocks(call), requires_grad=True)  # reentrant needs an input grad
    for name in uses:
        assert 0 < uses[name][1] <= uses[name][0], (name, uses)
        assert hooks[name] == [1, 1]


class _TwiceRecompute(torch.autograd.Function):
    """A wrapper that recomputes its segment twice in backward."""

    @staticmethod
    def forward(ctx: Any, block: nn.Module, x: Tensor, *params: Tensor) -> Tensor:
        ctx.block = block
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            out: Tensor = block.forward(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, *params = ctx.saved_tensors
        grads: tuple[Tensor | None, ...] = ()
        with torch.enable_grad():
            for _ in range(2):
                detached = x.detach().requires_grad_(x.requires_grad)
                out = ctx.block.forward(detached)
                wrt = [t for t in (detached, *params) if t.requires_grad]
                grads = torch.autograd.grad(out, wrt, grad)
        if not x.requires_grad:
            grads = (None, *grads)
        return (None, *grads)


def test_recomputing_twice_gives_more_backward_than_forward_uses() -> None:
    def call(block: nn.Module, x: Tensor) -> Tensor:
        out: Tensor = _TwiceRecompute.apply(  # type: ignore[no-untyped-call]
            block, x, *block.parameters())
        return out

    uses, _ = _step(TwoBlocks(call))
    for name in uses:
        assert uses[name][1] > uses[name][0] > 0, (name, uses)


def test_selective_checkpoint_still_shows_recompute() -> None:
    context = functools.partial(create_selective_checkpoint_contexts,
                                [aten.mm.default, aten.addmm.default])

    def call(block: nn.Module, x: Tensor) -> Tensor:
        out: Tensor = checkpoint(block, x, use_reentrant=False, context_fn=context)
        return out

    uses, _ = _step(TwoBlocks(call))
    for name in uses:
        # the saved addmm comes out of SAC's cache, unseen: fewer than forward's
        assert 0 < uses[name][1] < uses[name][0], (name, uses)


def test_numbers_unchanged() -> None:
    def grads(watch: bool) -> list[Tensor]:
        model = TwoBlocks()
        x = torch.randn(2, 3, WIDTH, generator=torch.Generator().manual_seed(1))
        uses = ParameterUses(dict(model.blocks.named_children()), lambda: 0)
        with uses if watch else torch.enable_grad():
            model(x).square().sum().backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    watched, plain = grads(True), grads(False)
    assert len(watched) == len(plain) == 10
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))


def test_no_activation_kept_alive() -> None:
    model = TwoBlocks()
    x = torch.randn(2, 3, WIDTH)
    with ParameterUses(dict(model.blocks.named_children()), lambda: 0):
        hidden = model.blocks[0](x)  # the graph saves no reference to it (its last op: add)
        seen = weakref.ref(hidden)
        first = model.blocks[1](hidden.tanh()).sum()  # tanh saves its output, not hidden
        last = hidden.sum()  # the last op before the check takes it as an argument
        del hidden
        gc.collect()
        assert seen() is None  # dead inside the mode: the mode holds no op's tensors
        (first + last).backward()


def test_parameters_not_held_and_entering_twice_refused() -> None:
    block = TinyBlock()
    uses = ParameterUses({"b": block}, lambda: 0)
    with uses:
        with pytest.raises(RuntimeError, match="already active"):
            uses.__enter__()
        assert all(ref() is not None for ref, _ in uses._owners.values())
        block(torch.zeros(1, WIDTH))
        assert uses.uses["b"][0] == 4  # native_layer_norm, t, addmm (bias), mul (gate)
        torch.cat([block.gate, block.gate, torch.ones(1)])  # a Tensor[] argument: one use
        torch.ones(1) + 1  # no parameter: none
        assert uses.uses["b"][0] == 5
    assert uses._owners == {}  # nothing of the model held between uses
    uses.reset()
    assert uses.uses == {"b": [0, 0]}

"""The activation count against byte counts derived by hand.

Tiny model: two segments ``relu(z @ Wa) @ Wb`` chained, fp32, the input and
all weights require grad. Per segment, autograd keeps: for ``mm(z, Wa)`` its
inputs z and Wa (not new); relu's *result* r (B x HID), which relu's backward
and the second mm both save; the first mm's output is saved by nobody and is
freed. The second mm's output is the segment output: seg1's (B x MID) is seg2's
input, saved there; seg2's is y, which the caller holds.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from gradequiv.harness.engine.memory import ActivationCounter, tensor_storage_bytes

F32 = 4
B, IN, HID, MID, OUT = 4, 8, 16, 6, 2
R = B * HID * F32  # 256: relu's result, one per segment
H = B * MID * F32  # 96: seg1's output = seg2's input, the checkpoint boundary
Y = B * OUT * F32  # 32: the model output
LOSS = F32  # a 0-dim fp32 sum
FULL = R + H + R  # 608 with y and the loss ignored
BOUNDARY = H  # per-segment checkpoint: only seg2's input survives (x is excluded)

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]

Call = Callable[..., Tensor]


class HandCheckpoint(torch.autograd.Function):
    """A checkpoint written by hand: no_grad forward, inputs saved, recompute in backward."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor | None]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            out = ctx.fn(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


def plain(fn: Call, x: Tensor) -> Tensor:
    return fn(x)


def noop_checkpoint(fn: Call, x: Tensor) -> Tensor:
    """Has a checkpoint's calling convention and recomputes nothing."""
    return fn(x)


def torch_checkpoint(fn: Call, x: Tensor) -> Tensor:
    out: Tensor = checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False)
    return out


def torch_reentrant(fn: Call, x: Tensor) -> Tensor:
    out: Tensor = checkpoint(fn, x, use_reentrant=True, preserve_rng_state=False)
    return out


def hand_checkpoint(fn: Call, x: Tensor) -> Tensor:
    out: Tensor = HandCheckpoint.apply(fn, x)
    return out


def _policy(save: Any) -> Callable[[], Any]:
    def policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op is save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def selective(save: Any) -> Call:
    """Non-reentrant checkpoint with its selective mode saving ``save``'s outputs."""
    context_fn = _policy(save)

    def call(fn: Call, x: Tensor) -> Tensor:
        out: Tensor = checkpoint(
            fn, x, use_reentrant=False, preserve_rng_state=False, context_fn=context_fn
        )
        return out

    return call


CHECKPOINTS = [torch_checkpoint, torch_reentrant, hand_checkpoint]


@dataclass
class Tiny:
    x: Tensor
    weights: list[Tensor]

    def segment(self, k: int) -> Call:
        wa, wb = self.weights[2 * k], self.weights[2 * k + 1]
        return lambda z: torch.relu(z @ wa) @ wb

    def forward(self, call: Call) -> tuple[Tensor, Tensor]:
        h = call(self.segment(0), self.x)
        y = call(self.segment(1), h)
        return y, y.sum()

    def counted(self, call: Call) -> tuple[ActivationCounter, Tensor, Tensor]:
        with ActivationCounter(exclude=[self.x, *self.weights]) as counter:
            y, loss = self.forward(call)
        return counter, y, loss

    def grads(self) -> list[Tensor]:
        out = [t.grad for t in (self.x, *self.weights)]
        assert all(g is not None for g in out)
        return out  # type: ignore[return-value]


def make_tiny(device: str = "cpu") -> Tiny:
    gen = torch.Generator().manual_seed(0)
    shapes = [(IN, HID), (HID, MID), (MID, HID), (HID, OUT)]
    weights = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]
    x = torch.randn(B, IN, generator=gen).to(device).requires_grad_()
    return Tiny(x, weights)


@pytest.mark.parametrize("device", DEVICES)
def test_full_storage_is_the_hand_count(device: str) -> None:
    tiny = make_tiny(device)
    counter, y, loss = tiny.counted(plain)
    assert counter.held_bytes(ignore=[y, loss]) == FULL
    assert counter.held_storages(ignore=[y, loss]) == 3  # r1, h, r2
    assert counter.held_bytes() == FULL + Y + LOSS  # what the caller holds counts unless ignored
    del y, loss
    assert counter.held_bytes() == 0  # dropping the loss frees the whole graph


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("call", CHECKPOINTS)
def test_per_segment_checkpoint_holds_the_boundary(device: str, call: Call) -> None:
    tiny = make_tiny(device)
    counter, y, loss = tiny.counted(call)
    assert counter.held_bytes(ignore=[y, loss]) == BOUNDARY
    assert counter.held_storages(ignore=[y, loss]) == 1
    loss.backward()  # counting left the recompute able to run
    reference = make_tiny(device)
    reference.forward(plain)[1].backward()
    for got, want in zip(tiny.grads(), reference.grads(), strict=True):
        torch.testing.assert_close(got, want)


def test_autocast_casts_count() -> None:
    """bf16 autocast: the casts mm saves are new storages (x, Wa, Wb copies), fp32 x is not.

    seg1 only: x cast (B x IN) + Wa cast (IN x HID) + relu result (B x HID) +
    Wb cast (HID x MID), 2 bytes each; relu's result is already bf16, so the
    second mm casts only the weight.
    """
    tiny = make_tiny()
    never = [tiny.x, *tiny.weights]
    with ActivationCounter(exclude=never) as counter, torch.autocast("cpu", dtype=torch.bfloat16):
        h = tiny.segment(0)(tiny.x)
    assert counter.held_bytes(ignore=[h]) == 2 * (B * IN + IN * HID + B * HID + HID * MID)


def test_parameters_and_their_views_never_count() -> None:
    weight = torch.randn(IN, HID, requires_grad=True)
    before = torch.randn(B, IN)
    with ActivationCounter() as counter:
        views = [weight.t(), weight[1:3], weight.detach(), weight.view(-1), before.t()]
        before.add_(1.0)  # in place on a tensor from before the block: not new either
        fresh = weight * 2.0
    assert counter.held_bytes(ignore=[fresh]) == 0
    assert counter.held_bytes() == IN * HID * F32
    assert len(views) == 5

    # _unsafe_view declares no alias, so the weight's own storage is recorded:
    # only ``exclude`` keeps it out.
    with ActivationCounter() as counter:
        flat = torch.ops.aten._unsafe_view(weight, (-1,))
    assert counter.held_bytes() == IN * HID * F32
    with ActivationCounter(exclude=[weight]) as counter:
        flat = torch.ops.aten._unsafe_view(weight, (-1,))
    assert counter.held_bytes() == 0
    assert flat.untyped_storage()._cdata == weight.untyped_storage()._cdata


def test_ignore_leaves_out_only_the_named_storages() -> None:
    counter, y, loss = make_tiny().counted(plain)
    assert counter.held_bytes(ignore=[loss]) == FULL + Y
    assert counter.held_bytes(ignore=[y[0]]) == FULL + LOSS  # a view names its whole storage


# A multi-block model: residual MLP blocks through nn.Linear (whose transposed
# weight addmm saves) and LayerNorm.
N_BLOCKS, BATCH, TOKENS, D = 8, 2, 8, 16
ROWS = BATCH * TOKENS
ACT = ROWS * D * F32  # one block's output
# Per block under full storage: LayerNorm's output, mean and rstd, relu's result
# (ROWS x 4D) and the block output (saved by the next LayerNorm). The last output
# is the caller's.
PER_BLOCK = ACT + 2 * ROWS * F32 + ROWS * 4 * D * F32 + ACT
MODEL_FULL = N_BLOCKS * PER_BLOCK - ACT
MODEL_CHECKPOINTED = (N_BLOCKS - 1) * ACT  # the inputs of blocks 2..8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


@pytest.fixture(scope="module")
def blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block() for _ in range(N_BLOCKS))


def model_held(blocks: nn.ModuleList, call: Call, exclude_params: bool = True) -> int:
    x = torch.randn(BATCH, TOKENS, D, requires_grad=True)
    never = [*blocks.parameters(), x] if exclude_params else [x]
    with ActivationCounter(exclude=never) as counter:
        h = x
        for block in blocks:
            h = call(block, h)
        loss = h.square().mean()
    held = counter.held_bytes(ignore=[h, loss])
    loss.backward()
    blocks.zero_grad(set_to_none=True)
    return held


def test_noop_checkpoint_holds_what_full_storage_holds(blocks: nn.ModuleList) -> None:
    full = model_held(blocks, plain)
    assert full == MODEL_FULL
    assert model_held(blocks, noop_checkpoint) == full
    # addmm saves weight.t(), a view of the parameter: excluding parameters changes nothing
    assert model_held(blocks, plain, exclude_params=False) == full


@pytest.mark.parametrize("call", CHECKPOINTS)
def test_real_checkpoint_holds_strictly_less(blocks: nn.ModuleList, call: Call) -> None:
    held = model_held(blocks, call)
    assert held < MODEL_FULL
    assert held == MODEL_CHECKPOINTED


class _Passthrough(TorchDispatchMode):
    """Another mode in the forward, to check that modes nest."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("save", "expected"),
    [
        # mm outputs saved: per segment the first mm's (B x HID) and the second's,
        # which is seg1's output (the boundary) and y (ignored).
        (torch.ops.aten.mm.default, R + H + R),
        (None, BOUNDARY),  # save nothing: a plain non-reentrant checkpoint
    ],
)
def test_selective_checkpoint_and_other_modes_nest(save: Any, expected: int) -> None:
    tiny = make_tiny()
    outer, inner = _Passthrough(), _Passthrough()
    with outer, ActivationCounter(exclude=[tiny.x, *tiny.weights]) as counter, inner:
        y, loss = tiny.forward(selective(save))
    assert counter.held_bytes(ignore=[y, loss]) == expected
    assert inner.ops > 0 and outer.ops >= inner.ops
    loss.backward()


def test_no_reference_cycle_holds_a_counted_storage() -> None:
    """Why the counter runs no gc: with the collector off for the whole forward,
    every cycle a checkpoint leaves is still there, and a full collection
    afterwards frees none of the counted storages."""
    runs: list[tuple[ActivationCounter, Tensor, Tensor, int]] = []
    cases = [(call, BOUNDARY) for call in CHECKPOINTS] + [
        (selective(torch.ops.aten.mm.default), R + H + R),
        (plain, FULL),
    ]
    gc.disable()
    try:
        for call, expected in cases:
            counter, y, loss = make_tiny().counted(call)
            runs.append((counter, y, loss, expected))
        before = [counter.held_bytes(ignore=[y, loss]) for counter, y, loss, _ in runs]
        gc.collect()
    finally:
        gc.enable()
    after = [counter.held_bytes(ignore=[y, loss]) for counter, y, loss, _ in runs]
    assert before == after == [expected for *_, expected in runs]


def test_user_cycles_are_over_counted_until_collected() -> None:
    """The documented limit: a forward that ties a tensor into a cycle keeps it alive."""

    class Node:
        def __init__(self, t: Tensor) -> None:
            self.t, self.me = t, self

    gc.disable()
    try:
        with ActivationCounter() as counter:
            Node(torch.ones(10))
        assert counter.held_bytes() == 10 * F32
        gc.collect()
    finally:
        gc.enable()
    assert counter.held_bytes() == 0


def test_tensor_storage_bytes() -> None:
    base = torch.zeros(10, 4)
    assert tensor_storage_bytes(base[2:4]) == 10 * 4 * F32  # a view holds all of its storage
    assert tensor_storage_bytes(torch.zeros(3, dtype=torch.float16)) == 6
    assert tensor_storage_bytes(torch.zeros(3, 3).to_sparse()) == 0


def test_counters_see_only_their_own_block() -> None:
    with ActivationCounter() as first:
        a = torch.ones(4)
    with ActivationCounter() as second:
        b = torch.ones(8)
    assert (first.held_bytes(), second.held_bytes()) == (4 * F32, 8 * F32)
    assert (first.held_storages(), second.held_storages()) == (1, 1)
    del a
    assert (first.held_bytes(), second.held_bytes()) == (0, 8 * F32)
    assert b.numel() == 8


def _residual_blocks(n: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 16)) for _ in range(n)]


@pytest.mark.parametrize("variant", ["none", "reentrant", "non-reentrant"])
def test_the_backward_peak_adds_one_recomputed_block_to_the_boundaries(variant: str) -> None:
    """4 residual blocks 16->64->16, batch 8, fp32: a boundary is 8*16*4 = 512 bytes; a
    block's recomputed internals are its two 8x64 activations, 2 * 2048 bytes."""
    from gradequiv.harness.engine.memory import BackwardPeak

    blocks = _residual_blocks(4)
    params = [p for b in blocks for p in b.parameters()]
    x = torch.randn(8, 16, requires_grad=True)
    with ActivationCounter(exclude=[*params, x]) as counter:
        h = x
        for block in blocks:
            if variant == "none":
                h = h + block(h)
            else:
                h = h + checkpoint(block, h, use_reentrant=variant == "reentrant")
        loss = h.pow(2).sum()
    seed = torch.ones_like(loss)
    held = counter.held_bytes(ignore=[loss])
    with BackwardPeak(counter, ignore=[loss]) as peak:
        loss.backward(seed)
    if variant == "none":
        assert peak.peak_bytes == held  # nothing recomputed: backward only frees
    else:
        assert held == 4 * 512
        assert peak.peak_bytes == held + 2 * 8 * 64 * 4


def _held_to_the_end(block: nn.Module, h: Tensor, keep: list[Tensor]) -> Tensor:
    """A non-reentrant checkpoint whose recompute also keeps what it saves in ``keep``."""
    def pack(t: Tensor) -> Tensor:
        keep.append(t)
        return t

    def rerun(*args: Tensor) -> Tensor:
        if torch.is_grad_enabled():  # the re-run: reentrant's forward runs under no_grad
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return block(*args)  # type: ignore[no-any-return]
        return block(*args)  # type: ignore[no-any-return]

    return checkpoint(rerun, h, use_reentrant=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("variant", ["reentrant", "non-reentrant", "kept"])
def test_the_carry_sees_earlier_reruns_kept_alive(variant: str) -> None:
    """4 residual blocks as above, a segment each. A correct recompute carries nothing of a
    block's re-run into the next block's; one that keeps every re-run's saved tensors until
    backward ends carries three blocks' worth into the last (each block saves its ReLU's
    8x64 output), and its peak grows with them."""
    from gradequiv.harness.engine.attribution import ParameterUses
    from gradequiv.harness.engine.memory import RecomputeCarry

    blocks = _residual_blocks(4)
    params = [p for b in blocks for p in b.parameters()]
    x = torch.randn(8, 16, requires_grad=True)
    keep: list[Tensor] = []
    with ActivationCounter(exclude=[*params, x]) as counter:
        h = x
        for block in blocks:
            if variant == "kept":
                h = h + _held_to_the_end(block, h, keep)
            else:
                h = h + checkpoint(block, h, use_reentrant=variant == "reentrant")
        loss = h.pow(2).sum()
    held = counter.alive_keys(ignore=[loss])
    uses = ParameterUses({f"blocks.{i}": b for i, b in enumerate(blocks)}, lambda: 1)
    with RecomputeCarry(held, uses.take_rerun_hits) as carry, uses:
        loss.backward(torch.ones_like(loss))
    block_bytes = 2 * 8 * 64 * 4 + 8 * 16 * 4  # its two 8x64 activations, its saved input
    if variant == "kept":
        assert carry.carried_at == ("blocks.0",)
        assert carry.carried_from == ("blocks.1", "blocks.2", "blocks.3")
        assert carry.carried_bytes == 3 * 8 * 64 * 4  # ReLU's output, saved for both
        assert carry.peak_bytes >= 4 * 8 * 64 * 4
    else:
        assert carry.carried_bytes * 2 < block_bytes
        assert carry.peak_bytes <= 4 * 512 + block_bytes

"""A model with a low-precision region and delayed scaling, as TransformerEngine's fp8 layers
keep them, and checkpoints of it: one right, three wrong the ways real ones were.

The region's state is process-level (class attributes of :class:`Fp8State`, as
TransformerEngine's ``FP8GlobalStateManager`` keeps it): the model's forward turns it on
around its blocks, and a checkpoint's re-run in backward runs after the region closed. Each
:class:`Fp8Linear` quantizes its input with a scale kept in a buffer and records the input's
absolute maximum into a history (another buffer) in every forward that is not a re-run; the
region's exit sets each scale from its history (delayed scaling). A checkpoint of this model
must re-enter the region for the re-run, mark it as a re-run (it records nothing) and give it
the scales its forward used: copies, taken before the region's exit changed them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gradequiv.models import UserModel

#: The largest value of float8 e4m3, and the headroom delayed scaling keeps below it.
FP8_MAX = 448.0
MARGIN = 2.0
#: How many forwards' absolute maxima a layer's history holds.
AMAX_HISTORY = 4


class Fp8State:
    """Whether the low-precision region is on, and whether the forward running is a
    checkpoint's re-run: read by every :class:`Fp8Linear`."""

    enabled = False
    recompute_phase = False


def _fake_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """``x`` rounded to float8 e4m3 at ``scale`` and back; its gradient passes straight
    through, as a quantized linear layer's does."""
    scaled = (x.detach() * scale).clamp(-FP8_MAX, FP8_MAX)
    rounded = scaled.to(torch.float8_e4m3fn).to(x.dtype) / scale
    return x + (rounded - x).detach()


class Fp8Linear(nn.Linear):
    """A linear layer that, inside the region, reads its input in float8 at a delayed scale."""

    amax_history: Tensor
    scale: Tensor

    def __init__(self, width: int) -> None:
        super().__init__(width, width)
        self.register_buffer("amax_history", torch.zeros(AMAX_HISTORY))
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        if not Fp8State.enabled:
            return super().forward(x)
        if not Fp8State.recompute_phase:  # a re-run repeats a forward: it records nothing
            with torch.no_grad():
                self.amax_history.copy_(self.amax_history.roll(1))
                self.amax_history[0] = x.detach().abs().amax()
        return F.linear(_fake_fp8(x, self.scale), self.weight, self.bias)

    def update_scale(self) -> None:
        """Delayed scaling: the next forward's scale from the history recorded so far."""
        with torch.no_grad():
            amax = self.amax_history.amax()
            if amax > 0:
                self.scale.copy_(FP8_MAX / MARGIN / amax)


@contextlib.contextmanager
def fp8_autocast(model: nn.Module) -> Iterator[None]:
    """The region: on inside, and each layer's scale set from its history at the exit of a
    training forward."""
    was = Fp8State.enabled
    Fp8State.enabled = True
    try:
        yield
    finally:
        Fp8State.enabled = was
        if model.training and torch.is_grad_enabled():
            for module in model.modules():
                if isinstance(module, Fp8Linear):
                    module.update_scale()


class Fp8Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = Fp8Linear(width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.dropout(F.gelu(self.fc(self.norm(x))))


class Fp8Stack(nn.Module):
    """Blocks run inside the region; the head outside it, as a model keeps its output
    projection in higher precision."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Fp8Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        with fp8_autocast(self):
            for block in self.blocks:
                x = block(x)
        return self.head(x)


def fp8_delayed_scaling(seed: int) -> UserModel:
    gen = torch.Generator().manual_seed(seed)
    model = Fp8Stack(width=16, depth=2)
    inputs = (torch.randn(8, 16, generator=gen).requires_grad_(),)
    targets = torch.randint(0, 3, (8,), generator=gen)
    return UserModel(model, inputs, targets, F.cross_entropy,
                     segments=[f"blocks.{i}" for i in range(2)])


def _layers(function: Callable[..., Any]) -> list[Fp8Linear]:
    owner = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
    return [m for m in owner.modules() if isinstance(m, Fp8Linear)] \
        if isinstance(owner, nn.Module) else []


class _AsInForward:
    """The re-run under the region state ``enabled`` and ``phase``, each layer at the scale
    in ``scales``; everything put back after it. A class, not a generator: torch enters a
    checkpoint's recompute context once per backward pass over it."""

    def __init__(self, enabled: bool, phase: bool, layers: list[Fp8Linear],
                 scales: list[Tensor]) -> None:
        self.state, self.layers, self.scales = (enabled, phase), layers, scales
        self.saved: list[tuple[tuple[bool, bool], list[Tensor]]] = []

    def __enter__(self) -> None:
        self.saved.append(((Fp8State.enabled, Fp8State.recompute_phase),
                           [layer.scale.clone() for layer in self.layers]))
        Fp8State.enabled, Fp8State.recompute_phase = self.state
        self._scale(self.scales)

    def __exit__(self, *exc: object) -> None:
        (Fp8State.enabled, Fp8State.recompute_phase), current = self.saved.pop()
        self._scale(current)

    def _scale(self, scales: list[Tensor]) -> None:
        with torch.no_grad():
            for layer, scale in zip(self.layers, scales):
                layer.scale.copy_(scale)


def _fp8_checkpoint(function: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any], *, region: bool = True, phase: bool = True,
                    copies: bool = True) -> Any:
    layers = _layers(function)
    scales = [layer.scale.clone() if copies else layer.scale for layer in layers]
    enabled = Fp8State.enabled if region else False
    rerun = _AsInForward(enabled, phase, layers, scales)
    return checkpoint(function, *args, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), rerun), **kwargs)


def fp8_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Right: the re-run re-enters the region as the forward found it, marked as a re-run,
    at copies of the forward's scales (TransformerEngine's checkpoint)."""
    return _fp8_checkpoint(function, args, kwargs)


def fp8_region_not_reentered(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Wrong: the re-run runs outside the region, in full precision, where the forward ran
    in float8 (NVIDIA/Megatron-LM#7538: the checkpoint restored the RNG state only;
    NVIDIA/TransformerEngine#24)."""
    return _fp8_checkpoint(function, args, kwargs, region=False)


def fp8_scales_by_reference(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Wrong: the forward's scales kept by reference, so the re-run reads the scales the
    region's exit set since (NVIDIA/TransformerEngine#1723)."""
    return _fp8_checkpoint(function, args, kwargs, copies=False)


def fp8_amax_recorded_twice(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Wrong: the re-run is not marked as one, so it records its input's maximum into the
    history again, and the next step scales by it (NVIDIA/TransformerEngine#415)."""
    return _fp8_checkpoint(function, args, kwargs, phase=False)


#: How many experts a routed block has.
EXPERTS = 4
#: When a routed block counts the tokens each expert took: in every forward (torchtitan's
#: MoE, whose comment says a checkpoint's re-run counts them again), where grad mode is on
#: (Megatron's router: right beside its reentrant checkpoint, whose forward runs without
#: grad, and counting again in a non-reentrant re-run), or in every forward but a re-run
#: inside backward.
GUARDS = ("always", "grad", "not-in-backward")


class RoutedBlock(nn.Module):
    """x + the one expert its router picks for each token, weighted by the router's
    probability; the tokens each expert took counted in ``tokens_per_expert`` (a load
    statistic, read by whatever balances the experts between steps)."""

    tokens_per_expert: Tensor

    def __init__(self, width: int, guard: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.gate = nn.Linear(width, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(EXPERTS))
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS))
        self.guard = guard

    def _counts(self) -> bool:
        if self.guard == "grad":
            return torch.is_grad_enabled()
        return self.guard == "always" or torch._C._current_graph_task_id() == -1

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        weight, chosen = self.gate(h).softmax(dim=-1).max(dim=-1)
        if self.training and self._counts():
            with torch.no_grad():
                self.tokens_per_expert.add_(torch.bincount(chosen, minlength=EXPERTS))
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(chosen == e, as_tuple=True)[0]
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]) * weight[rows, None])
        return x + out


class RoutedStack(nn.Module):
    def __init__(self, width: int, depth: int, guard: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(RoutedBlock(width, guard) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _routed(seed: int, guard: str) -> UserModel:
    gen = torch.Generator().manual_seed(seed)
    model = RoutedStack(width=16, depth=2, guard=guard)
    inputs = (torch.randn(8, 16, generator=gen).requires_grad_(),)
    targets = torch.randint(0, 3, (8,), generator=gen)
    return UserModel(model, inputs, targets, F.cross_entropy,
                     segments=[f"blocks.{i}" for i in range(2)])


def expert_load_counted(seed: int) -> UserModel:
    """Unsafe under every checkpoint: the re-run counts its tokens again."""
    return _routed(seed, "always")


def expert_load_grad_guarded(seed: int) -> UserModel:
    """Safe under a reentrant checkpoint only: a non-reentrant one re-runs with grad on."""
    return _routed(seed, "grad")


def expert_load_guarded(seed: int) -> UserModel:
    """Safe: no re-run inside backward counts."""
    return _routed(seed, "not-in-backward")

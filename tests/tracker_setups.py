"""Megatron-shaped RNG-state tracking on the CPU (``--model tracker_setups:tracker_stack``,
``--impl tracker_setups:NAME``).

Megatron keeps named random generators in a tracker
(``megatron.core.tensor_parallel.random.CudaRNGStatesTracker``): ``add(name, seed)`` makes
a state, ``fork(name)`` swaps it into the device generator for a block (dropout inside a
tensor-parallel region), saves the advanced state back and puts the previous one back. Its
checkpoint (``CheckpointFunction``) saves the default generator's state and every tracker
state at the forward, and sets them back for the re-run. Here the device generator is the
CPU's default one; the shapes are Megatron's.

``tracker_checkpoint`` restores both, as Megatron's does (correct);
``default_only_checkpoint`` restores the default generator only, as torch's checkpoint
does, so the forked dropout's re-run draws from the tracker's advanced state (wrong).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from user_models import residual_stack

from gradequiv.harness.implementations.torch_builtins import tensors_positional
from gradequiv.models import UserModel

#: The tracker's name for the tensor-parallel region's generator (Megatron's
#: ``_MODEL_PARALLEL_RNG_TRACKER_NAME``).
MODEL_PARALLEL_RNG = "model-parallel-rng"


class RNGStatesTracker:
    """Named generator states (``CudaRNGStatesTracker``, with the CPU's default generator
    as the device one)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, Tensor]:
        """A copy of the dict: the states themselves, not a view of the tracker's."""
        return dict(self.states_)

    def set_states(self, states: dict[str, Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} or seed {seed} already exists")
        self.seeds_.add(seed)
        original = torch.get_rng_state()
        torch.default_generator.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from the state ``name`` inside the block, then put the caller's back."""
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


#: The tracker (Megatron's ``_CUDA_RNG_STATE_TRACKER``).
TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return TRACKER


def model_parallel_manual_seed(seed: int) -> None:
    """The tracker seeded afresh (Megatron's ``model_parallel_cuda_manual_seed``)."""
    TRACKER.reset()
    TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718)


# -- the model ---------------------------------------------------------------------------------

class ParallelBlock(nn.Module):
    """x + dropout(proj(parallel_dropout(gelu(fc(norm(x)))))): the inner dropout runs in
    the tensor-parallel region, under the tracker's fork; the outer one draws from the
    default generator."""

    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.parallel_dropout = nn.Dropout(p)
        self.proj = nn.Linear(2 * width, width)
        self.dropout = nn.Dropout(p)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc(self.norm(x)))  # (B, 2W)
        with get_rng_tracker().fork():
            h = self.parallel_dropout(h)
        return x + self.dropout(self.proj(h))


class ParallelStack(nn.Module):
    """The blocks, a final norm and a head of three classes."""

    def __init__(self, width: int, depth: int, p: float) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(ParallelBlock(width, p) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(x)))  # (B, 3)


def tracker_stack(seed: int) -> UserModel:
    """Three blocks that fork into the tracker, the tracker seeded from ``seed``; the batch,
    loss and segments are the residual stack's (``user_models``)."""
    model_parallel_manual_seed(seed)
    built = residual_stack(seed)
    built.model = ParallelStack(width=16, depth=3, p=0.3)
    return built


# -- checkpoints in Megatron's shape -----------------------------------------------------------

def _get_all_rng_states() -> tuple[Tensor, dict[str, Tensor]]:
    """The default generator's state and a copy of each tracker state (as Megatron's
    graph-safe tracker clones its generators' states)."""
    states = get_rng_tracker().get_states()
    return torch.get_rng_state(), {name: state.clone() for name, state in states.items()}


def _set_all_rng_states(cpu_state: Tensor, tracker_states: dict[str, Tensor]) -> None:
    """The states set back; the tracker gets a copy of the dict, which its forks write into
    (Megatron hands over the saved dict itself, so a second backward pass over the same
    forward, ``retain_graph=True``, would find the states the first pass advanced)."""
    torch.set_rng_state(cpu_state)
    get_rng_tracker().set_states(dict(tracker_states))


def _get_default_rng_state() -> tuple[Tensor, None]:
    return torch.get_rng_state(), None


def _set_default_rng_state(cpu_state: Tensor, tracker_states: None) -> None:
    del tracker_states
    torch.set_rng_state(cpu_state)


@contextlib.contextmanager
def _fork_rng(get: Any, put: Any) -> Iterator[None]:
    """The states ``get`` takes now, put back by ``put`` when the block ends."""
    current = get()
    try:
        yield
    finally:
        put(*current)


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in ("cpu", "cuda")]


class CheckpointFunction(torch.autograd.Function):
    """Megatron's ``CheckpointFunction``: the RNG states (``get``/``put``) saved at the
    forward and set back for the re-run, the current ones restored after it. It also
    carries the forward's autocast state into the re-run, as torch's reentrant checkpoint
    does (Megatron's re-runs without it)."""

    @staticmethod
    def forward(ctx: Any, run_function: Any, rng: tuple[Any, Any], *args: Any) -> Any:
        ctx.run_function, (get, ctx.put) = run_function, rng
        ctx.get = get
        ctx.rng_states = get()
        ctx.autocast = _autocast_state()
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad(), please use "
                               ".backward() if possible")
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with _fork_rng(ctx.get, ctx.put), contextlib.ExitStack() as stack:
            ctx.put(*ctx.rng_states)
            for kind, enabled, dtype in ctx.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        if isinstance(outputs, Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(t.grad if t.requires_grad else None for t in inputs))


def _checkpoint(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                rng: tuple[Any, Any]) -> Any:
    call, inputs = tensors_positional(function, args, kwargs)
    return CheckpointFunction.apply(call, rng, *inputs)


def tracker_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Saves and restores the default generator and every tracker state (Megatron's)."""
    return _checkpoint(function, args, kwargs, (_get_all_rng_states, _set_all_rng_states))


def default_only_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Saves and restores the default generator only: the forked dropout's re-run draws
    from the tracker's state as the forward left it."""
    return _checkpoint(function, args, kwargs, (_get_default_rng_state, _set_default_rng_state))


#: A reentrant checkpoint: torch.autograd.grad cannot run it (torch documents the same).
tracker_checkpoint.gradequiv_unsupported = ("autograd-grad",)  # type: ignore[attr-defined]
default_only_checkpoint.gradequiv_unsupported = ("autograd-grad",)  # type: ignore[attr-defined]


#: How many segment calls the counting checkpoint made, a tensor (a step counter).
_calls = torch.zeros((), dtype=torch.int64)


def counting_tracker_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``tracker_checkpoint`` that counts its calls in a tensor: the last count outlives
    each step, the same 8 bytes whatever the model (a hold, no leak)."""
    global _calls
    _calls = _calls + 1
    return tracker_checkpoint(function, *args, **kwargs)


counting_tracker_checkpoint.gradequiv_unsupported = ("autograd-grad",)  # type: ignore[attr-defined]

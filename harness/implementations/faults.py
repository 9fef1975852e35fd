"""Deliberately broken recompute implementations: one correct checkpoint, one switch per fault.

``reference_checkpoint`` is a plain, correct recompute (an autograd.Function:
forward under no_grad keeping only the inputs, backward re-running the
segment with the RNG state, autocast state and keyword arguments of the
first run, buffers put back). Each mutant flips one :class:`Faults` switch;
each switch is a failure seen in real recompute code. A harness that lets
any of them pass is broken.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Faults:
    """One switch per fault; all off is the correct checkpoint."""

    no_rng_restore: bool = False  # the recompute draws fresh dropout masks
    rng_lost_on_first_call: bool = False  # state captured lazily: the first recompute misses it
    rng_captured_late: bool = False  # RNG state saved after the forward ran, not before
    reseeded: bool = False  # recompute seeds a fixed value instead of restoring the state
    caller_stream_moved: bool = False  # restores for the recompute, never gives the caller's back
    caller_stream_moved_once: bool = False  # the same, on each segment's first recompute only
    cuda_rng_not_restored: bool = False  # CPU state restored, the CUDA generator's not
    dropout_off: bool = False  # recompute runs the segment in eval mode
    autocast_lost: bool = False  # recompute runs outside the caller's autocast
    kwargs_dropped: bool = False  # keyword arguments reach the first run only
    input_grads_dropped: bool = False  # only the first input gets its gradient
    inputs_detached: bool = False  # segment run on detached inputs: no gradient reaches them
    stale_recompute: bool = False  # later steps recompute from the first step's inputs
    no_op: bool = False  # keeps every activation: nothing recomputed, nothing saved
    padding_zeroed: bool = False  # forward writes zeros at padded positions (an unpadding path)
    gradient_skew: bool = False  # gradients through the segment off by a relative 1e-4
    buffers_updated_twice: bool = False  # recompute updates running statistics again
    crash_in_backward: bool = False  # backward raises


@dataclass(frozen=True)
class Mutant:
    name: str
    faults: Faults
    models: str  # the real failure it stands for
    cuda_only: bool = False

    @property
    def impl(self) -> Callable[..., Any]:
        fn = functools.update_wrapper(
            functools.partial(checkpoint_with_faults, faults=self.faults), checkpoint_with_faults
        )
        fn.__name__ = fn.__qualname__ = self.name.replace("-", "_")
        fn.__doc__ = self.models
        return fn


def _mutant(switch: str, models: str, cuda_only: bool = False) -> Mutant:
    return Mutant(switch.replace("_", "-"), Faults(**{switch: True}), models, cuda_only)


MUTANTS: tuple[Mutant, ...] = (
    _mutant("no_rng_restore", "checkpoint with preserve_rng_state=False around dropout"),
    _mutant("rng_lost_on_first_call", "RNG state saved lazily on first use, so each "
                                      "segment's first recompute draws fresh masks"),
    _mutant("rng_captured_late", "RNG state captured after the segment ran, as in code that "
                                 "saves state lazily on first backward"),
    _mutant("reseeded", "recompute calls manual_seed(fixed) instead of restoring the state"),
    _mutant("caller_stream_moved", "set_rng_state for the recompute without fork_rng: the "
                                   "caller's stream is left where the recompute put it"),
    _mutant("caller_stream_moved_once", "the caller's stream moved by a segment's first "
                                        "recompute only (a warm-up path without fork_rng)"),
    _mutant("cuda_rng_not_restored", "only torch.get_rng_state() saved; CUDA dropout differs",
            cuda_only=True),
    _mutant("dropout_off", "recompute under model.eval() or with dropout disabled"),
    _mutant("autocast_lost", "recompute outside the forward's autocast region"),
    _mutant("kwargs_dropped", "keyword arguments not forwarded to the recompute"),
    _mutant("input_grads_dropped", "backward returns None for all inputs but the first"),
    _mutant("inputs_detached", "inputs detached before the segment: no gradient flows back"),
    _mutant("stale_recompute", "recompute reuses the boundary saved on the first step"),
    _mutant("no_op", "a 'checkpoint' that just calls the function: no memory saved"),
    _mutant("padding_zeroed", "an unpadding fast path that returns zeros at padded positions: "
                              "outputs differ only where the loss does not look"),
    _mutant("gradient_skew", "a small systematic error in the recomputed gradient"),
    _mutant("buffers_updated_twice", "BatchNorm running statistics updated by the recompute"),
    _mutant("crash_in_backward", "backward raises (freed buffer, shape bug)"),
)


def reference_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The correct base: every fault switched off."""
    return checkpoint_with_faults(function, *args, faults=Faults(), **kwargs)


#: Segments recomputed at least once, for the first-call faults; dies with the model.
_RECOMPUTED: weakref.WeakSet[Any] = weakref.WeakSet()

#: The first step's saved inputs per segment, for the stale-recompute fault; dies with the model.
_STALE: weakref.WeakKeyDictionary[Any, tuple[Tensor, ...]] = weakref.WeakKeyDictionary()


def checkpoint_with_faults(
    function: Callable[..., Any], *args: Any, faults: Faults, **kwargs: Any
) -> Any:
    """Recompute ``function`` in backward, with the given ``faults``."""
    if faults.no_op:
        return function(*args, **kwargs)
    if faults.inputs_detached:
        args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
    run = _Run(function, args, kwargs, faults)
    tensors = [a for a in args if isinstance(a, Tensor)]
    out = _Recompute.apply(run, *tensors)  # type: ignore[no-untyped-call]  # untyped in torch
    if faults.padding_zeroed:
        mask = next((a for a in args if isinstance(a, Tensor) and a.dtype == torch.bool
                     and a.dim() == 2), None)
        if mask is not None and isinstance(out, Tensor) and out.shape[:2] == mask.shape:
            out = out * mask[..., None].to(out.dtype)
    return out


@dataclass
class _Run:
    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    faults: Faults
    cpu_rng: Tensor | None = None
    cuda_rng: list[Tensor] | None = None
    autocast: tuple[str, bool, torch.dtype] | None = None

    def capture(self) -> None:
        self.cpu_rng = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            self.cuda_rng = [torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())]
        for device_type in ("cuda", "cpu"):
            if torch.is_autocast_enabled(device_type):
                self.autocast = (device_type, True, torch.get_autocast_dtype(device_type))
                break

    def call(self, tensors: tuple[Tensor, ...]) -> Any:
        it = iter(tensors)
        args = tuple(next(it) if isinstance(a, Tensor) else a for a in self.args)
        kwargs = {} if self.faults.kwargs_dropped and torch.is_grad_enabled() else self.kwargs
        return self.function(*args, **kwargs)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _Run, *tensors: Tensor) -> Any:
        ctx.run = run
        if not run.faults.rng_captured_late:
            run.capture()
        with torch.no_grad():
            out = run.call(tensors)
        if run.faults.rng_captured_late:
            run.capture()
        ctx.save_for_backward(*tensors)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        run: _Run = ctx.run
        faults = run.faults
        if faults.crash_in_backward:
            raise RuntimeError("recompute buffer was freed before backward")
        saved = ctx.saved_tensors
        if faults.stale_recompute:
            saved = _STALE.setdefault(
                run.function, tuple(t.detach().requires_grad_(t.requires_grad) for t in saved))
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in saved)
        module = run.function if isinstance(run.function, nn.Module) else None
        buffers = [b.clone() for b in module.buffers()] if module is not None else []
        first = run.function not in _RECOMPUTED
        _RECOMPUTED.add(run.function)
        with _recompute_state(run, module, first), torch.enable_grad():
            out = run.call(inputs)
        outs = out if isinstance(out, tuple) else (out,)
        if faults.gradient_skew:
            grads = tuple(g * (1 + 1e-4) for g in grads)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if module is not None and not faults.buffers_updated_twice:
            # Only now: BatchNorm's backward reads the running statistics it saved.
            with torch.no_grad():
                for buffer, value in zip(module.buffers(), buffers):
                    buffer.copy_(value)
        input_grads = [t.grad if t.requires_grad else None for t in inputs]
        if faults.input_grads_dropped:
            input_grads = input_grads[:1] + [None] * (len(input_grads) - 1)
        return (None, *input_grads)


@contextlib.contextmanager
def _recompute_state(run: _Run, module: nn.Module | None, first: bool) -> Iterator[None]:
    """RNG, autocast and train mode as the first run had them (unless a fault says)."""
    faults = run.faults
    moved = faults.caller_stream_moved or (faults.caller_stream_moved_once and first)
    fork = contextlib.nullcontext() if moved else torch.random.fork_rng(
        devices=list(range(torch.cuda.device_count())) if run.cuda_rng else [])
    with fork:
        if faults.reseeded:
            torch.manual_seed(0)
        elif not (faults.no_rng_restore or (faults.rng_lost_on_first_call and first)):
            assert run.cpu_rng is not None
            torch.set_rng_state(run.cpu_rng)
            if run.cuda_rng and not faults.cuda_rng_not_restored:
                for device, state in enumerate(run.cuda_rng):
                    torch.cuda.set_rng_state(state, device)
        autocast: Any = contextlib.nullcontext()
        if run.autocast is not None and not faults.autocast_lost:
            device_type, enabled, dtype = run.autocast
            autocast = torch.autocast(device_type, dtype=dtype, enabled=enabled)
        was_training = module.training if module is not None else None
        if module is not None and faults.dropout_off:
            module.eval()
        try:
            with autocast:
                yield
        finally:
            if module is not None and was_training is not None:
                module.train(was_training)


def switches() -> list[str]:
    """Every fault switch, for listings and checks that the registry covers them."""
    return [f.name for f in fields(Faults)]


# Each mutant as a module attribute, so a SPEC can name it:
# ``gradequiv check --impl gradequiv.harness.implementations.faults:no_rng_restore``.
for _mutant_entry in MUTANTS:
    globals()[_mutant_entry.name.replace("-", "_")] = _mutant_entry.impl
del _mutant_entry

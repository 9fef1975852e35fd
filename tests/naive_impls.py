"""A checkpoint written the way a new user first writes one, and its fixes.

``naive`` is a ``torch.autograd.Function`` whose forward runs the segment under no_grad and
keeps its inputs, whose backward runs it again under enable_grad and calls
``torch.autograd.backward``. It has three faults at once: the RNG state is not restored for
the re-run, the keyword arguments are bound by a closure instead of passed as inputs (a
keyword tensor that requires grad, such as the reference model's ``x0``, is then reached
through the caller's graph, which the inner backward frees), and the inner backward writes
into ``.grad`` (so ``torch.autograd.grad`` cannot be served). Each ``only_*`` variant has one
of them alone; ``fixed`` has none. The fix of the third is the declaration the diagnosis
offers (``gradequiv_unsupported = ("autograd-grad",)``, as torch's reentrant checkpoint
declares): a backward that runs backward cannot hand ``torch.autograd.grad`` the gradients
of parameters it was not given, so every variant without that fault declares it. Referenced by SPEC
(``naive_impls:naive``); pytest puts this folder on sys.path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradequiv.harness.implementations.torch_builtins import tensors_positional


class _Checkpoint(torch.autograd.Function):
    """Forward under no_grad keeping the inputs; backward re-runs the segment and calls
    ``torch.autograd.backward`` on it; ``restore_rng``: the forward's RNG state is put back
    first."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], restore_rng: bool,
                *args: Any) -> Any:
        ctx.run, ctx.restore_rng = run, restore_rng
        ctx.rng = torch.get_rng_state()
        ctx.autocast = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        ctx.inputs = args
        with torch.no_grad():
            return run(*args)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        inputs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, Tensor) else a
                  for a in ctx.inputs]
        enabled, dtype = ctx.autocast
        with torch.random.fork_rng(devices=[], enabled=ctx.restore_rng):
            if ctx.restore_rng:
                torch.set_rng_state(ctx.rng)
            with torch.enable_grad(), torch.autocast("cpu", dtype=dtype, enabled=enabled):
                outputs = ctx.run(*inputs)
        if isinstance(outputs, Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, Tensor) and o.requires_grad and g is not None]
        # the whole graph the re-run reaches: parameters' .grad, and through a tensor the
        # closure kept, the caller's graph too
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(i.grad if isinstance(i, Tensor) else None for i in inputs))


def _checkpoint(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                *, restore_rng: bool, pass_kwargs: bool) -> Any:
    """``function(*args, **kwargs)`` through :class:`_Checkpoint`, its outputs flattened."""
    if pass_kwargs:  # every tensor, keyword or nested, an input of the Function
        call, inputs = tensors_positional(function, args, kwargs)
    else:  # the first draft's closure: keyword tensors reached through it, not passed
        def call(*positional: Any) -> Any:
            return function(*positional, **kwargs)
        inputs = args
    structure: list[Any] = []

    def flat(*positional: Any) -> tuple[Any, ...]:
        leaves, spec = tree_flatten(call(*positional))
        structure[:] = [spec]
        return tuple(leaves)

    out = _Checkpoint.apply(flat, restore_rng, *inputs)
    return tree_unflatten(list(out), structure[0])


def naive(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The first draft: no RNG restore, keyword tensors in a closure, backward inside
    backward."""
    return _checkpoint(function, args, kwargs, restore_rng=False, pass_kwargs=False)


def only_rng(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The RNG state alone not restored (the inner backward declared)."""
    return _checkpoint(function, args, kwargs, restore_rng=False, pass_kwargs=True)


def only_closure(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The keyword tensors alone captured by the closure (the inner backward declared)."""
    return _checkpoint(function, args, kwargs, restore_rng=True, pass_kwargs=False)


def only_inner_backward(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Backward inside backward alone (it writes into .grad under torch.autograd.grad)."""
    return _checkpoint(function, args, kwargs, restore_rng=True, pass_kwargs=True)


def fixed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The three faults fixed: the RNG restored, every tensor passed as an input, and the
    inner backward declared."""
    return _checkpoint(function, args, kwargs, restore_rng=True, pass_kwargs=True)


for _declared in (only_rng, only_closure, fixed):
    _declared.gradequiv_unsupported = ("autograd-grad",)  # type: ignore[attr-defined]

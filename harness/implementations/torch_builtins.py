"""torch's own ways to save activation memory, as built-in implementations.

Plain checkpoint (non-reentrant and reentrant), selective checkpoint (SAC)
with a policy, ``checkpoint_wrapper``, and offload (``save_on_cpu``,
``offload_wrapper``). Each imports what it uses inside the call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from gradequiv.harness.errors import InvalidArgument

#: ``gradequiv_strategy`` of a target that keeps activations in host memory instead of
#: recomputing them (torch's offloads below; users mark their own the same way).
OFFLOAD = "offload"
#: ``gradequiv_strategy`` of a target that saves some ops' outputs by policy and recomputes
#: the rest (selective checkpoint): where its policy keeps an output full storage would not
#: (a matmul's, whose backward needs only its input), it may hold more bytes than full
#: storage and still recompute (users mark their own the same way).
SELECTIVE = "selective"


def _double_backward(target: Callable[..., Any]) -> Callable[..., Any]:
    """Claim the opt-in grad mode ``create-graph`` for ``target``: its recompute (or offload)
    hands backward the forward's own graph, so gradients taken with ``create_graph=True``
    can be differentiated again (checked bitwise on CPU for each one marked)."""
    target.gradequiv_supports = ("create-graph",)  # type: ignore[attr-defined]
    return target


# -- torch: plain checkpoint ------------------------------------------------------------------

@_double_backward
def torch_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """torch.utils.checkpoint, non-reentrant (the variant torch recommends)."""
    from torch.utils.checkpoint import checkpoint

    kwargs.setdefault("use_reentrant", False)
    return checkpoint(function, *args, **kwargs)


_REENTRANT_OPTIONS = ("preserve_rng_state", "determinism_check", "debug", "context_fn")


def torch_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """torch.utils.checkpoint with ``use_reentrant=True``.

    The reentrant variant refuses keyword arguments for the function; see
    :func:`tensors_positional` for how they reach it, as careful users pass them. Nor does it
    follow tensors in a structure it returns: see :func:`flat_outputs`.
    """
    from torch.utils.checkpoint import checkpoint

    options = {k: kwargs.pop(k) for k in _REENTRANT_OPTIONS if k in kwargs}
    call, inputs = tensors_positional(function, args, kwargs)
    flat, rebuild = flat_outputs(call)
    return rebuild(checkpoint(flat, *inputs, use_reentrant=True, **options))


def flat_outputs(function: Callable[..., Any]
                 ) -> tuple[Callable[..., tuple[Any, ...]], Callable[[Any], Any]]:
    """For a checkpoint whose autograd.Function hands back tensors and tuples only: a call
    returning what ``function`` returns as the flat tuple of its leaves (tensors and
    ``None`` alike), and what rebuilds the structure around that tuple, ``None`` fields
    included.

    torch documents that the reentrant variant does not consider tensors in nested
    structures (dicts, custom objects) as taking part in autograd: a segment returning a
    dict or a dataclass gets no gradient through them, silently, and a named tuple comes
    back a plain tuple. Flattened, every tensor is an output of the Function.
    """
    structure: list[Any] = []

    def call(*args: Any) -> tuple[Any, ...]:
        leaves, spec = tree_flatten(function(*args))
        structure[:] = [spec]
        return tuple(leaves)

    def rebuild(flat: Any) -> Any:
        return tree_unflatten(list(flat), structure[0])

    return call, rebuild


def tensors_positional(function: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """For a checkpoint that takes positional inputs only: a call taking every tensor of the
    arguments positionally (top-level positional tensors where they were, then the tensors
    of keyword arguments and those nested in lists, tuples and dicts), and those inputs; the
    rest is bound.

    A tensor bound by a closure (``functools.partial``) or nested in a container is
    invisible to a reentrant checkpoint's autograd.Function: its gradient goes through the
    checkpoint's inner backward into the caller's graph, which the outer backward then walks
    a second time, or is lost (Megatron-LM PR 4765, DeepSpeed PR 8182, pytorch #124725).
    Passed positionally, it is an input.
    """
    nested = any(not isinstance(a, torch.Tensor) and any(
        isinstance(leaf, torch.Tensor) for leaf in tree_leaves(a)) for a in args)
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    nested = nested or any(not isinstance(v, torch.Tensor) and any(
        isinstance(leaf, torch.Tensor) for leaf in tree_leaves(v)) for v in kwargs.values())
    if nested:
        return _pytree_positional(function, args, kwargs)
    if not names:
        return (functools.partial(function, **kwargs) if kwargs else function), args
    bound = {k: v for k, v in kwargs.items() if k not in names}
    count = len(args)

    def call(*inputs: Any) -> Any:
        return function(*inputs[:count], **bound, **dict(zip(names, inputs[count:])))

    return call, (*args, *(kwargs[n] for n in names))


def _pytree_positional(function: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Every tensor leaf of ``(args, kwargs)`` as a positional input; the call rebuilds the
    containers around them."""
    leaves, spec = tree_flatten((args, kwargs))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def call(*inputs: Any) -> Any:
        filled = list(leaves)
        for i, tensor in zip(slots, inputs):
            filled[i] = tensor
        call_args, call_kwargs = tree_unflatten(filled, spec)
        return function(*call_args, **call_kwargs)

    return call, tuple(leaves[i] for i in slots)


#: torch documents that the reentrant variant does not support ``torch.autograd.grad`` (it
#: raises "incompatible with .grad()"): a declared limit, so those cases are not drawn. Nor
#: does it claim ``create-graph``, whose first backward is ``torch.autograd.grad``.
torch_reentrant_checkpoint.gradequiv_unsupported = ("autograd-grad",)  # type: ignore[attr-defined]


# -- torch: selective activation checkpoint (SAC) ------------------------------------------

def _matmul_ops() -> frozenset[Any]:
    """The matmul-like aten ops a 'matmuls' policy saves: the expensive ones to recompute.

    ``aten.matmul`` and ``linear`` decompose before dispatch, so what a policy
    sees are mm/addmm/bmm and the fused attention kernels of each backend.
    """
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


SAC_POLICIES = ("matmuls", "none", "all")


def sac_policy(name: str) -> Callable[..., Any]:
    from torch.utils.checkpoint import CheckpointPolicy

    if name not in SAC_POLICIES:
        raise InvalidArgument(
            f"--impl-kwarg policy={name!r} is not one of {', '.join(SAC_POLICIES)} (matmuls: "
            f"save mm/bmm/attention outputs; none: save nothing; all: save every op); "
            f"write e.g. --impl-kwarg policy=matmuls"
        )
    saved = _matmul_ops() if name == "matmuls" else frozenset()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if name == "all" or op in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def torch_sac(function: Callable[..., Any], *args: Any, policy: str = "matmuls",
              **kwargs: Any) -> Any:
    """torch.utils.checkpoint (non-reentrant) with a selective-checkpoint policy.

    It claims no ``create-graph`` and declares ``retain-graph`` unsupported: a second
    backward over a selectively checkpointed region raises ("You are only allowed to
    backward once on any region computed under selective activation checkpoint"), and a
    gradient penalty, or a loss backpropagated in parts, backpropagates twice.

    ``policy`` (``--impl-kwarg policy=...``): ``matmuls`` saves the outputs of
    matmul-like ops and recomputes the rest (the usual SAC set-up), ``none``
    recomputes everything (plain checkpoint), ``all`` saves every op (no
    memory saved). Marked ``selective``: what it holds is its policy's choice, so
    the ``recompute`` property reports its bytes against full storage's instead of
    failing on them.
    """
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    chosen = sac_policy(policy)
    kwargs.setdefault("use_reentrant", False)
    context_fn = functools.partial(create_selective_checkpoint_contexts, chosen)
    return checkpoint(function, *args, context_fn=context_fn, **kwargs)


torch_sac.gradequiv_strategy = SELECTIVE  # type: ignore[attr-defined]
# A loss backpropagated in parts (retain_graph=True) runs a second backward over each region:
# torch raises "Trying to backward an extra time. You are only allowed to backward once on
# any region computed under selective activation checkpoint", loudly, by design.
torch_sac.gradequiv_unsupported = ("retain-graph",)  # type: ignore[attr-defined]
# No declaration of in-place ops: torch's SAC refuses an in-place op on an output its policy
# saved ("Tensor cached during selective activation checkpoint has been mutated") only where
# the write moves that output's version counter (a Linear with a bias, a 2-D input: verify()
# names the refusal and holds nothing against it). A bias-free Linear on a 3-D input (mm,
# then _unsafe_view) or a bmm, whose output is then changed in place (mul_, an in-place
# dropout), writes through an alias with a counter of its own: the re-run reads the changed
# output and the gradients are silently wrong (pytorch/pytorch#113737, #119590), which the
# checks must see.


# -- torch: checkpoint_wrapper ------------------------------------------------------------

@_double_backward
def torch_wrapper(module: nn.Module, *, reentrant: bool = False, **kwargs: Any) -> nn.Module:
    """torch.distributed.algorithms' ``checkpoint_wrapper`` (NO_REENTRANT unless ``reentrant``).

    Other keyword arguments (``preserve_rng_state``, ...) go to torch's
    checkpoint, as ``checkpoint_wrapper`` forwards them.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    if not isinstance(reentrant, bool):
        raise InvalidArgument(
            f"--impl-kwarg reentrant={reentrant!r} must be true or false"
        )
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    return checkpoint_wrapper(module, checkpoint_impl=impl, **kwargs)


# -- torch: checkpoint patched into the instance ------------------------------------------

@_double_backward
def torch_patched(module: nn.Module, **kwargs: Any) -> nn.Module:
    """torch's checkpoint patched into the module itself, the idiom many codebases use::

        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)

    The recompute calls the bound ``forward`` directly, never ``Module.__call__``, so no
    forward hook sees it; the harness sees it by the ops that read the segment's
    parameters. Keyword arguments go to torch's checkpoint.
    """
    from torch.utils.checkpoint import checkpoint

    kwargs.setdefault("use_reentrant", False)
    module.forward = functools.partial(checkpoint, module.forward, **kwargs)
    return module


# -- torch: activation offload ---------------------------------------------------------------

def _offloads(target: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``target`` as keeping activations in host memory instead of recomputing them;
    users mark their own the same way (``gradequiv_strategy = "offload"``)."""
    target.gradequiv_strategy = OFFLOAD  # type: ignore[attr-defined]
    return target


@_double_backward
@_offloads
def torch_offload(function: Callable[..., Any], *args: Any, pin_memory: bool | None = None,
                  **kwargs: Any) -> Any:
    """The segment under ``torch.autograd.graph.save_on_cpu``: what autograd saves for
    backward is copied to host memory and brought back in backward; nothing is recomputed.

    ``pin_memory`` (``--impl-kwarg pin_memory=...``) defaults to whether the segment's
    inputs are on CUDA (pinned host memory makes the copies asynchronous).
    """
    if pin_memory is None:
        pin_memory = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    if not isinstance(pin_memory, bool):
        raise InvalidArgument(f"--impl-kwarg pin_memory={pin_memory!r} must be true or false")
    with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
        return function(*args, **kwargs)


@_double_backward
@_offloads
def torch_offload_wrapper(module: nn.Module) -> nn.Module:
    """torch.distributed.algorithms' ``offload_wrapper``: save_on_cpu around the module."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper

    return offload_wrapper(module)


# -- the options each built-in takes ------------------------------------------------------------

#: Options torch.utils.checkpoint takes for itself; it hands any other keyword to the segment.
_CHECKPOINT_OPTIONS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug")
#: SPEC -> the ``--impl-kwarg`` names it accepts (``context_fn`` is not given on a command line)
OPTIONS: dict[str, tuple[str, ...]] = {
    "torch": _CHECKPOINT_OPTIONS,
    "torch-reentrant": ("preserve_rng_state", "determinism_check", "debug"),
    "torch-sac": ("policy", "preserve_rng_state", "determinism_check", "debug"),
    "torch-wrapper": ("reentrant", "preserve_rng_state", "determinism_check", "debug"),
    "torch-patched": _CHECKPOINT_OPTIONS,
    "torch-offload": ("pin_memory",),
    "torch-offload-wrapper": (),
}
_BOOLEANS = ("use_reentrant", "preserve_rng_state", "debug", "reentrant", "pin_memory")


def check_options(spec: str, kwargs: dict[str, Any]) -> None:
    """Refuse an option built-in SPEC does not take, or a true/false option given another
    value: torch would hand an unknown keyword to the segment and fail every case."""
    allowed = OPTIONS[spec]
    for name, value in kwargs.items():
        if name not in allowed:
            takes = f"its options are {', '.join(allowed)}" if allowed else "it takes none"
            raise InvalidArgument(f"--impl-kwarg {name}={value!r}: --impl={spec!r} has no "
                                  f"option {name!r}; {takes}")
        if name in _BOOLEANS and not isinstance(value, bool):
            raise InvalidArgument(f"--impl-kwarg {name}={value!r} is not true or false; write "
                                  f"--impl-kwarg {name}=true or {name}=false")
    if spec == "torch-sac":
        sac_policy(kwargs.get("policy", "matmuls"))

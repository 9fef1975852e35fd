"""Built-in adapters for the recompute implementations users train with.

Each adapter imports its library inside the call, so gradequiv installs and
imports without any of them; a missing library is a caller's mistake
(``InvalidArgument``, exit 2 where resolution checks it) naming the pip extra
that brings it. The adapters pass the library's own code the segment as it
is: no fix-ups, so a verdict is the library's, not the adapter's.

Libraries warn at import (torch.jit deprecations, missing Transformer Engine);
those warnings say nothing about recompute and are silenced for the import
only, so a ``-W error`` test run still sees every warning raised by the run.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from gradequiv.models import InvalidArgument

#: SPEC -> (pip extra, distribution the extra installs)
EXTRAS = {
    "fairscale": ("fairscale", "fairscale"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "deepspeed-nonreentrant": ("deepspeed", "deepspeed"),
    "megatron": ("megatron", "megatron-core"),
    "hf": ("hf", "transformers"),
}


def _library(spec: str, module: str) -> ModuleType:
    """Import ``module`` for SPEC, or say which extra installs it."""
    extra, dist = EXTRAS[spec]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ImportError as exc:
        raise InvalidArgument(
            f"--impl={spec!r} needs {dist} ({module} could not be imported: {exc}); "
            f"install it with: pip install 'gradequiv[{extra}]'"
        ) from exc


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


def _sac_policy(name: str) -> Callable[..., Any]:
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

    ``policy`` (``--impl-kwarg policy=...``): ``matmuls`` saves the outputs of
    matmul-like ops and recomputes the rest (the usual SAC set-up), ``none``
    recomputes everything (plain checkpoint), ``all`` saves every op (no
    memory saved: the ``recompute`` property should fail).
    """
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    chosen = _sac_policy(policy)
    kwargs.setdefault("use_reentrant", False)
    context_fn = functools.partial(create_selective_checkpoint_contexts, chosen)
    return checkpoint(function, *args, context_fn=context_fn, **kwargs)


# -- torch: checkpoint_wrapper ------------------------------------------------------------

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


# -- torch: activation offload ---------------------------------------------------------------

OFFLOAD = "offload"


def _offloads(target: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``target`` as keeping activations in host memory instead of recomputing them;
    users mark their own the same way (``gradequiv_strategy = "offload"``)."""
    target.gradequiv_strategy = OFFLOAD  # type: ignore[attr-defined]
    return target


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


@_offloads
def torch_offload_wrapper(module: nn.Module) -> nn.Module:
    """torch.distributed.algorithms' ``offload_wrapper``: save_on_cpu around the module."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper

    return offload_wrapper(module)


# -- fairscale ------------------------------------------------------------------------------

class _Call(nn.Module):
    """A module whose forward calls ``inner`` through ``__call__``.

    fairscale's checkpoint_wrapper replaces ``module.forward`` on the instance
    and recomputes through the class's unbound ``forward``, past the module's
    hooks. Wrapping this shell instead leaves the segment itself untouched, so
    the harness still sees its arguments and counts its recompute by forward
    pre-hooks; what fairscale checkpoints (the same parameters, buffers and
    BatchNorms, now one level down) is unchanged.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def fairscale_wrapper(module: nn.Module, **kwargs: Any) -> nn.Module:
    """fairscale.nn.checkpoint.checkpoint_wrapper; ``offload_to_cpu`` passes through."""
    library = _library("fairscale", "fairscale.nn.checkpoint")
    wrapped: nn.Module = library.checkpoint_wrapper(_Call(module), **kwargs)
    return wrapped


# -- DeepSpeed ------------------------------------------------------------------------------

def _deepspeed_checkpointing(spec: str) -> ModuleType:
    """deepspeed.checkpointing; it runs on CPU unconfigured.

    Without ``deepspeed.checkpointing.configure`` the module's defaults are
    in force (no partitioning, no CPU offload, no contiguous buffers), and
    its RNG tracker is empty; on the CPU accelerator the "device" RNG state
    it saves and restores is the CPU generator, restored in the right order.
    """
    return _library(spec, "deepspeed.runtime.activation_checkpointing.checkpointing")


def deepspeed_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """deepspeed.checkpointing.checkpoint: reentrant (an autograd.Function); kwargs supported."""
    return _deepspeed_checkpointing("deepspeed").checkpoint(function, *args, **kwargs)


def deepspeed_nonreentrant(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """deepspeed.checkpointing.non_reentrant_checkpoint (saved-tensor hooks).

    It takes positional arguments only, so keyword arguments are bound with
    functools.partial, as its callers do.
    """
    library = _deepspeed_checkpointing("deepspeed-nonreentrant")
    bound = functools.partial(function, **kwargs) if kwargs else function
    return library.non_reentrant_checkpoint(bound, *args)


# -- Megatron-core --------------------------------------------------------------------------

def _megatron() -> ModuleType:
    library = _library("megatron", "megatron.core.tensor_parallel")
    if not torch.cuda.is_available():
        raise InvalidArgument(
            "--impl='megatron' needs CUDA: megatron.core.tensor_parallel.checkpoint saves and "
            "restores the CUDA RNG state unconditionally (random.py: _get_all_rng_states -> "
            "_get_cuda_rng_state -> torch.cuda.random.get_rng_state), which raises 'Torch not "
            "compiled with CUDA enabled' without a GPU; run with --device cuda on a GPU machine"
        )
    return library


def megatron_checkpoint(function: Callable[..., Any], *args: Any,
                        distribute_saved_activations: bool = False, **kwargs: Any) -> Any:
    """megatron.core.tensor_parallel.checkpoint (reentrant); kwargs bound with partial.

    Needs CUDA: its CheckpointFunction.forward saves the RNG states through
    ``_get_all_rng_states``, which calls ``_get_cuda_rng_state`` ->
    ``torch.cuda.random.get_rng_state`` unconditionally (megatron/core/
    tensor_parallel/random.py), and backward restores it the same way. On a
    machine without CUDA that raises "Torch not compiled with CUDA enabled"
    in the first forward; it is refused here with that reason instead.
    """
    library = _megatron()
    bound = functools.partial(function, **kwargs) if kwargs else function
    return library.checkpoint(bound, distribute_saved_activations, *args)


def require(spec: str, kwargs: dict[str, Any] | None = None) -> None:
    """Raise InvalidArgument now if SPEC cannot run here (missing library, bad option, no CUDA).

    For resolution time, so such a mistake exits 2 before any case runs
    instead of failing every case.
    """
    kwargs = kwargs or {}
    if spec == "torch-sac":
        _sac_policy(kwargs.get("policy", "matmuls"))
    elif spec == "fairscale":
        _library(spec, "fairscale.nn.checkpoint")
    elif spec in ("deepspeed", "deepspeed-nonreentrant"):
        _deepspeed_checkpointing(spec)
    elif spec == "megatron":
        _megatron()
    elif spec == "hf":
        _library(spec, "transformers.modeling_layers")


# -- transformers: the model's own gradient checkpointing (a toggle) ---------------------

HF_NEEDS_MODEL = (
    "--impl='hf' toggles a transformers model's own checkpointing: add --model "
    "gradequiv.models.hf:llama (or :gpt2, or a factory of your own PreTrainedModel)")


def hf_gradient_checkpointing(model: nn.Module, **checkpoint_kwargs: Any) -> None:
    """``model.gradient_checkpointing_enable()`` of a transformers model, as users call it;
    ``--impl-kwarg`` options become its ``gradient_checkpointing_kwargs`` (non-reentrant
    unless ``use_reentrant=true``).

    transformers turns recompute on for every decoder layer; the layers the
    harness did not select are turned back off, so ``every:2`` means every
    second layer here too. The model comes from ``--model`` (a factory of a
    ``PreTrainedModel``, e.g. ``gradequiv.models.hf:llama``).
    """
    layers = _library("hf", "transformers.modeling_layers")
    inner = getattr(model, "inner", model)
    enable = getattr(inner, "gradient_checkpointing_enable", None)
    if enable is None or not hasattr(inner, "config"):
        raise InvalidArgument(HF_NEEDS_MODEL)
    enable(gradient_checkpointing_kwargs={"use_reentrant": False, **checkpoint_kwargs})
    selected = getattr(model, "selected", None)
    chosen = {id(m) for m in selected()} if selected is not None else None
    for module in inner.modules():
        if isinstance(module, layers.GradientCheckpointingLayer) and chosen is not None \
                and id(module) not in chosen:
            module.gradient_checkpointing = False

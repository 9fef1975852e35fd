"""Built-in adapters for the recompute implementations of the libraries users train with.

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

import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.implementations.torch_builtins import tensors_positional

#: SPEC -> (pip extra, distribution the extra installs)
EXTRAS = {
    "fairscale": ("fairscale", "fairscale"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "deepspeed-nonreentrant": ("deepspeed", "deepspeed"),
    "deepspeed-partitioned": ("deepspeed", "deepspeed"),
    "deepspeed-partitioned-cpu": ("deepspeed", "deepspeed"),
    "megatron": ("megatron", "megatron-core"),
    "hf": ("hf", "transformers"),
    "diffusers": ("diffusers", "diffusers"),
    "timm": ("timm", "timm"),
}


def _import(module: str) -> ModuleType:
    """The one place a library is imported (tests stand in a missing one here)."""
    return importlib.import_module(module)


def _library(spec: str, module: str) -> ModuleType:
    """Import ``module`` for SPEC, or say which extra installs it."""
    extra, dist = EXTRAS[spec]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _import(module)
    except ImportError as exc:
        raise InvalidArgument(
            f"--impl={spec!r} needs {dist} ({module} could not be imported: {exc}); "
            f"install it with: pip install 'gradequiv[{extra}]'"
        ) from exc


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

    It takes positional arguments only: tensor keyword arguments are passed after them,
    the others bound (``tensors_positional``).
    """
    library = _deepspeed_checkpointing("deepspeed-nonreentrant")
    call, inputs = tensors_positional(function, args, kwargs)
    return library.non_reentrant_checkpoint(call, *inputs)


def deepspeed_partitioned(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """deepspeed.checkpointing.checkpoint with ``partition_activations``: each rank of the
    model-parallel group keeps its part of every checkpointed input and all-gathers them in
    backward. Configured as Megatron-DeepSpeed configures it, with an ``mpu`` whose
    model-parallel group is every rank of the run: ranks that share their rows
    (``gradequiv distributed --model-parallel``, or tensor parallelism). It needs the
    ranks' process group, so it runs under ``gradequiv distributed`` only."""
    library = _deepspeed_checkpointing("deepspeed-partitioned")
    _partitioning(library, "deepspeed-partitioned", in_cpu=False)
    return library.checkpoint(function, *args, **kwargs)


def deepspeed_partitioned_cpu(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``deepspeed-partitioned`` with ``cpu_checkpointing``: each rank's part of a saved
    input is moved to host memory in forward and brought back before the gather."""
    library = _deepspeed_checkpointing("deepspeed-partitioned-cpu")
    _partitioning(library, "deepspeed-partitioned-cpu", in_cpu=True)
    return library.checkpoint(function, *args, **kwargs)


deepspeed_partitioned.gradequiv_needs_ranks = True  # type: ignore[attr-defined]
deepspeed_partitioned_cpu.gradequiv_needs_ranks = True  # type: ignore[attr-defined]


class _WholeWorld:
    """DeepSpeed's ``mpu`` over every rank: the model-parallel group is the world."""

    def get_model_parallel_rank(self) -> int:
        return int(torch.distributed.get_rank())

    def get_model_parallel_world_size(self) -> int:
        return int(torch.distributed.get_world_size())

    def get_model_parallel_group(self) -> Any:
        return torch.distributed.group.WORLD

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return 0


#: How DeepSpeed's checkpointing is configured in this process: (library, in_cpu), once
#: a rank has configured it; configured again only where another setting is asked for.
_CONFIGURED: list[tuple[ModuleType, bool]] = []


def _partitioning(library: ModuleType, spec: str, *, in_cpu: bool) -> None:
    """DeepSpeed's checkpointing configured to partition over every rank (its saved parts
    on the host where ``in_cpu``), once a process and setting: ``configure`` resets the
    module's state, so it is not called per segment."""
    if _CONFIGURED and _CONFIGURED[-1] == (library, in_cpu):
        return
    if not torch.distributed.is_initialized():
        raise InvalidArgument(
            f"--impl={spec!r} partitions activations across the ranks of a "
            "model-parallel group: run it with gradequiv distributed --model-parallel (or "
            "--wrapper tp), not in one process")
    deepspeed = _library(spec, "deepspeed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not _CONFIGURED:
            deepspeed.init_distributed(torch.distributed.get_backend(), auto_mpi_discovery=False)
        library.configure(_WholeWorld(), partition_activations=True, checkpoint_in_cpu=in_cpu)
    _CONFIGURED[:] = [(library, in_cpu)]


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
    """megatron.core.tensor_parallel.checkpoint (reentrant); tensor kwargs passed after the
    positional inputs, the others bound (``tensors_positional``).

    Needs CUDA: its CheckpointFunction.forward saves the RNG states through
    ``_get_all_rng_states``, which calls ``_get_cuda_rng_state`` ->
    ``torch.cuda.random.get_rng_state`` unconditionally (megatron/core/
    tensor_parallel/random.py), and backward restores it the same way. On a
    machine without CUDA that raises "Torch not compiled with CUDA enabled"
    in the first forward; it is refused here with that reason instead.
    """
    library = _megatron()
    call, inputs = tensors_positional(function, args, kwargs)
    return library.checkpoint(call, distribute_saved_activations, *inputs)


# Checkpoints that raise under torch.autograd.grad ("Checkpointing is not compatible with
# .grad()"): the reentrant autograd.Functions, which call backward inside backward as torch's
# reentrant checkpoint does, and DeepSpeed's non-reentrant one, which checks the same. A
# declared limit, loud where it is met: those cases are not drawn.
_NO_AUTOGRAD_GRAD: tuple[Any, ...] = (fairscale_wrapper, deepspeed_checkpoint,
                                      deepspeed_nonreentrant, megatron_checkpoint)
for _target in _NO_AUTOGRAD_GRAD:
    _target.gradequiv_unsupported = ("autograd-grad",)
del _target


def require(spec: str) -> None:
    """Raise InvalidArgument now if SPEC cannot run here (missing library, no CUDA).

    For resolution time, so such a mistake exits 2 before any case runs
    instead of failing every case.
    """
    if spec == "fairscale":
        _library(spec, "fairscale.nn.checkpoint")
    elif spec in ("deepspeed", "deepspeed-nonreentrant", "deepspeed-partitioned",
                  "deepspeed-partitioned-cpu"):
        _deepspeed_checkpointing(spec)
    elif spec == "megatron":
        _megatron()
    elif spec == "hf":
        _library(spec, "transformers.modeling_layers")
    elif spec == "diffusers":
        _library(spec, "diffusers")
    elif spec == "timm":
        _library(spec, "timm.layers")


# -- transformers: the model's own gradient checkpointing (a toggle) ---------------------

HF_NEEDS_MODEL = (
    "--impl='hf' toggles a transformers model's own checkpointing: add --model "
    "gradequiv.models.hf:llama (or :gpt2, or a factory of your own PreTrainedModel)")


#: options of transformers' own toggle (5.25 on), not of torch's checkpoint:
#: ``every_n_layers`` checkpoints every n-th of its layers, ``offload`` keeps what the
#: re-run starts from in host memory
HF_TOGGLE_OPTIONS = ("every_n_layers", "offload")


def hf_gradient_checkpointing(model: nn.Module, *, segments: list[str] | None = None,
                              **checkpoint_kwargs: Any) -> list[str] | None:
    """The model's own toggle, as users call it: ``activation_checkpointing_enable()``
    (transformers 5.25 on; ``gradient_checkpointing_enable()``, deprecated there, before);
    ``--impl-kwarg`` options become the checkpoint's keyword arguments (non-reentrant unless
    ``use_reentrant=true``), ``every_n_layers`` and ``offload`` the toggle's own.

    transformers turns recompute on for every checkpointing layer (every n-th with
    ``every_n_layers``, counted over the model's ``GradientCheckpointingLayer``s); those not
    among ``segments`` (the selected segments' dotted names) are turned back off, so
    ``every:2`` means every second layer here too. Both at once, a layer recomputes where
    both select it. With ``every_n_layers`` it returns the dotted names of the layers left
    recomputing, so the harness checks that exactly those re-run and the others do not.
    The model comes from ``--model`` (a factory of a ``PreTrainedModel`` or a PEFT model of
    one, e.g. ``gradequiv.models.hf:llama``).
    """
    layers = _library("hf", "transformers.modeling_layers")
    if not hasattr(model, "config"):
        raise InvalidArgument(HF_NEEDS_MODEL)
    toggle = {k: checkpoint_kwargs.pop(k) for k in HF_TOGGLE_OPTIONS if k in checkpoint_kwargs}
    every = toggle.get("every_n_layers", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise InvalidArgument(
            f"--impl-kwarg every_n_layers={every!r}: transformers checkpoints every n-th "
            f"layer, so it must be a whole number >= 1; write e.g. every_n_layers=2")
    kwargs = {"use_reentrant": False, **checkpoint_kwargs}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs, **toggle)
    else:
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise InvalidArgument(HF_NEEDS_MODEL)
        if toggle:
            raise InvalidArgument(
                f"--impl-kwarg {', '.join(f'{k}={v}' for k, v in toggle.items())}: an option "
                f"of transformers' activation_checkpointing_enable (5.25 and later); this "
                f"transformers has only gradient_checkpointing_enable: upgrade it (pip "
                f"install -c ci/constraints.txt 'gradequiv[hf]') or leave the option out")
        enable(gradient_checkpointing_kwargs=kwargs)
    chosen = None if segments is None else {id(model.get_submodule(name)) for name in segments}
    on = []
    for name, module in model.named_modules():
        if isinstance(module, layers.GradientCheckpointingLayer) and module.gradient_checkpointing:
            if chosen is not None and id(module) not in chosen:
                module.gradient_checkpointing = False
            else:
                on.append(name)
    return on if every > 1 else None


# -- diffusers: the model's own gradient checkpointing (a toggle) -------------------------

DIFFUSERS_NEEDS_MODEL = (
    "--impl='diffusers' toggles a diffusers model's own checkpointing: add --model "
    "diffusers:UNet2DModel (or another diffusers:NAME, or a factory of your own ModelMixin)")


def diffusers_gradient_checkpointing(model: nn.Module, *, segments: list[str] | None = None,
                                     **checkpoint_kwargs: Any) -> None:
    """``model.enable_gradient_checkpointing()`` of a diffusers model, as users call it.

    Without options it is the library's own default function (torch's non-reentrant
    checkpoint of each module it hands over); ``--impl-kwarg`` options go to torch's
    checkpoint instead (``use_reentrant=true``). diffusers checkpoints every module its
    blocks hand to the function; those not among ``segments`` (the selected segments'
    dotted names) are called plainly, so ``every:2`` means every second one here too.
    """
    _library("diffusers", "diffusers")
    enable = getattr(model, "enable_gradient_checkpointing", None)
    if enable is None or not hasattr(model, "config"):
        raise InvalidArgument(DIFFUSERS_NEEDS_MODEL)
    if segments is None and not checkpoint_kwargs:
        enable()
        return
    chosen = None if segments is None else {id(model.get_submodule(n)) for n in segments}
    options = {"use_reentrant": False, **checkpoint_kwargs}

    def checkpointing(module: Any, *args: Any) -> Any:
        owner = getattr(module, "__self__", module)
        if chosen is not None and id(owner) not in chosen:
            return module(*args)
        return torch.utils.checkpoint.checkpoint(module.__call__, *args, **options)

    enable(gradient_checkpointing_func=checkpointing)


# -- timm: the model's own gradient checkpointing (a toggle) ------------------------------

TIMM_NEEDS_MODEL = (
    "--impl='timm' toggles a timm model's own checkpointing: add --model "
    "timm:vit_tiny_patch16_224 (or another timm:NAME, or a factory of your own timm model)")


def timm_gradient_checkpointing(model: nn.Module, *, use_reentrant: bool = False) -> None:
    """``model.set_grad_checkpointing(True)`` of a timm model, as users call it.

    timm checkpoints every block of the runs it hands to torch's checkpoint (a ViT's
    blocks, a ConvNeXt stage's, a ResNet's), so it picks the segments itself (the cases'
    granularity is "the toggle's"). ``use_reentrant`` is timm's own process-wide switch
    (``timm.layers.set_reentrant_ckpt``), set on every install, so one path's choice never
    carries into the next.
    """
    layers = _library("timm", "timm.layers")
    enable = getattr(model, "set_grad_checkpointing", None)
    if enable is None:
        raise InvalidArgument(TIMM_NEEDS_MODEL)
    layers.set_reentrant_ckpt(bool(use_reentrant))
    enable(True)


#: The library toggles that need a model of that library (``--model``), and what to add.
TOGGLES_NEEDING_MODEL = {"hf": HF_NEEDS_MODEL, "diffusers": DIFFUSERS_NEEDS_MODEL,
                         "timm": TIMM_NEEDS_MODEL}

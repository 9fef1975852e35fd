"""Recompute written for ranks: deliberately wrong ones, each right in one process, and their
correct peers (``distributed_impls:NAME``; the ranks import it, so the tests put this folder
on PYTHONPATH).

Each is one hand-written checkpoint (non-reentrant, as torch's: the forward's saved tensors
dropped, the segment re-run from its kept inputs when backward first needs one) with one
choice made per name: what the forward keeps of its inputs and how
the backward gets them back, which generator the re-run draws from, which parameters it
computes with. A wrong one differs from its peer in that one choice, made the way a real
issue or pull request made it.

The model-parallel group is Megatron's and DeepSpeed's ``mpu``: the ranks that hold the same
activations. Under tensor parallelism that is the mesh the segment's parameters are sharded
over; under data parallelism (DDP, FSDP) each rank is alone in it, since each has its own rows.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.utils.stateless import _reparametrize_module

from gradequiv.harness.implementations.torch_builtins import tensors_positional

# -- the checkpoint and the choices it is made of ----------------------------------------------


class Recompute:
    """A checkpoint's choices, each overridden by one wrong one: the correct peer as is."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.group = model_parallel_group(module)

    def save_rng(self) -> Tensor:
        """What the forward keeps of the generator: this rank's own state."""
        return torch.get_rng_state()

    def restore_rng(self, state: Tensor) -> None:
        torch.set_rng_state(state)

    def keep(self, t: Tensor) -> Any:
        """What the forward keeps of input ``t`` for the re-run."""
        return t.detach()

    def restore(self, kept: Any) -> Tensor:
        """The input again, from what :meth:`keep` kept (in backward)."""
        return kept  # type: ignore[no-any-return]

    def forward(self, run: Callable[..., Any], inputs: tuple[Any, ...]) -> Any:
        """The segment's forward, its saved tensors dropped."""
        return run(*inputs)

    def rerun(self, run: Callable[..., Any], inputs: list[Tensor]) -> Any:
        """The segment again, in backward, for what it saves."""
        return run(*inputs)


def model_parallel_group(module: nn.Module) -> Any:
    """The ranks that hold the same activations as this one for ``module`` (``mpu``'s model
    parallel group): the mesh of its tensor-parallel parameters, None where it has none (data
    parallelism: FSDP's sharded parameters are no tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    if _fully_sharded(module):
        return None
    for p in module.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh.get_group()
    return None


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in ("cpu", "cuda")]


class _Frame:
    """One checkpointed call, non-reentrant as torch's: the forward keeps an index for each
    tensor autograd saves; the first one backward asks for re-runs the segment from the kept
    inputs, under the forward's generator and autocast state (the caller's generator put
    back after), and hands over what the re-run saved in its place. The gradients flow
    through the forward's own graph, summed in its order."""

    def __init__(self, run: Callable[..., Any], choices: Recompute, args: tuple[Any, ...]) -> None:
        self.run, self.choices = run, choices
        self.rng = choices.save_rng()
        self.autocast = _autocast_state()
        self.tensors = [isinstance(a, Tensor) for a in args]
        self.grads = [isinstance(a, Tensor) and a.requires_grad for a in args]
        self.kept = [choices.keep(a) if t else a for a, t in zip(args, self.tensors)]
        self.count = 0
        self.saved: list[Tensor] | None = None
        self.unpacked = 0

    def pack(self, t: Tensor) -> int:
        self.count += 1
        return self.count - 1

    def unpack(self, index: int) -> Tensor:
        if self.saved is None:
            self.saved = self.recompute()
        saved = self.saved[index]
        self.unpacked += 1
        if self.unpacked == self.count:  # all handed over: a second backward re-runs again
            self.saved, self.unpacked = None, 0
        return saved

    def recompute(self) -> list[Tensor]:
        choices = self.choices
        inputs = [choices.restore(k).detach().requires_grad_(g) if t else k
                  for k, t, g in zip(self.kept, self.tensors, self.grads)]
        saved: list[Tensor] = []

        def collect(t: Tensor) -> None:
            saved.append(t.detach())  # not its graph: that would hold this list

        with torch.random.fork_rng(devices=[]), contextlib.ExitStack() as stack:
            choices.restore_rng(self.rng)
            for kind, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(collect, _never):
                choices.rerun(self.run, inputs)
        if len(saved) != self.count:
            raise RuntimeError(f"the re-run saved {len(saved)} tensors, the forward "
                               f"{self.count}")
        return saved


def _never(packed: Any) -> Tensor:
    raise AssertionError("nothing unpacks what a re-run saved")


def _checkpoint(choices: type[Recompute], function: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
    call, inputs = tensors_positional(function, args, kwargs)
    frame = _Frame(call, choices(function), inputs)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return frame.choices.forward(call, inputs)


# -- partitioned activations: each rank of the model-parallel group keeps 1/N -------------------


def _partition(t: Tensor, group: Any) -> tuple[Tensor, torch.Size, int]:
    """This rank's 1/N of ``t`` flattened (padded to a multiple of N), DeepSpeed's
    ``partition_activations``: ``get_partition_start`` and ``get_partition_size``."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = t.detach().reshape(-1)
    part = -(-flat.numel() // size)
    flat = torch.nn.functional.pad(flat, (0, part * size - flat.numel()))
    return flat.narrow(0, rank * part, part).clone(), t.shape, t.numel()


def _gathered(parts: list[Tensor], shape: torch.Size, numel: int) -> Tensor:
    return torch.cat(parts)[:numel].view(shape)


class Partitioned(Recompute):
    """Each input kept as this rank's 1/N of it, all-gathered over the group in backward,
    the parts in rank order (DeepSpeed's ``gather_partitioned_activations``)."""

    def keep(self, t: Tensor) -> Any:
        if self.group is None:
            return t.detach()
        return _partition(t, self.group)

    def restore(self, kept: Any) -> Tensor:
        if isinstance(kept, Tensor):
            return kept
        part, shape, numel = kept
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, part, group=self.group)
        return _gathered(self.order(parts), shape, numel)

    def order(self, parts: list[Tensor]) -> list[Tensor]:
        return parts


# -- the correct peers -----------------------------------------------------------------------


def own_rng_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Each rank saves its own generator's state at the forward and sets it back for the
    re-run (torch's ``preserve_rng_state``, by hand): every rank's re-run draws the masks its
    own forward drew, under every engine. The peer of :func:`rng_from_rank_zero`."""
    return _checkpoint(Recompute, function, args, kwargs)


def partitioned_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's activation checkpointing with ``partition_activations``, by hand: each
    rank of the model-parallel group keeps its 1/N of every input, all-gathered in rank
    order for the re-run (nothing to split where a rank is alone in its group). The peer of
    the three partitioned wrong ones."""
    return _checkpoint(Partitioned, function, args, kwargs)


# -- the wrong ones --------------------------------------------------------------------------


class _RankZeroRng(Recompute):
    def restore_rng(self, state: Tensor) -> None:
        state = state.clone()
        if dist.is_initialized():  # one process: its own state is rank 0's
            dist.broadcast(state, src=0)
        torch.set_rng_state(state)


def rng_from_rank_zero(function: Any, *args: Any, **kwargs: Any) -> Any:
    """The re-run draws from rank 0's saved generator state, broadcast so that the ranks
    agree, as DTensor's first RNG tracker synchronised every rank with rank 0's seed
    (pytorch/pytorch#98198): right where every rank draws alike (tensor parallelism's
    replicated regions, one process), wrong under data parallelism, where each rank's
    forward drew its own masks and rank 1's re-run draws rank 0's (the masks made alike
    across data-parallel ranks of huggingface/accelerate#114). The reduced gradients carry
    rank 1's error to every rank."""
    return _checkpoint(_RankZeroRng, function, args, kwargs)


class _Reversed(Partitioned):
    def order(self, parts: list[Tensor]) -> list[Tensor]:
        return parts[::-1]


def partitioned_gathered_reversed(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Partitioned activations put together in another order than the one they were split
    in (``all_gather`` returns the parts in rank order, not in the order of the data:
    NVIDIA/Model-Optimizer#1804's zigzag layout): alone in its group (one process, data
    parallelism) a rank gets its input back whole; under tensor parallelism every re-run
    starts from an input with its halves swapped."""
    return _checkpoint(_Reversed, function, args, kwargs)


class _OverEveryRank(Partitioned):
    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.group = dist.group.WORLD if dist.is_initialized() else None


def partitioned_over_every_rank(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Activations partitioned over every rank, not over the model-parallel group that
    holds the same activations (``--partition-activations`` that works with tensor or
    pipeline parallelism but not both: bigscience-workshop/Megatron-DeepSpeed#184,
    deepspeedai/DeepSpeed#1538): right under tensor parallelism, where the world is the
    group; under data parallelism the re-run's input is rank 0's half of its own rows and
    rank 1's half of its."""
    return _checkpoint(_OverEveryRank, function, args, kwargs)


class _OwnPartFirst(Partitioned):
    def restore(self, kept: Any) -> Tensor:
        if isinstance(kept, Tensor):
            return kept
        part, shape, numel = kept
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        parts = [torch.empty_like(part) for _ in range(size)]
        for step in range(size):  # each owner broadcasts its part: this rank's own first
            owner = (rank + step) % size
            parts[owner] = part.clone() if owner == rank else parts[owner]
            dist.broadcast(parts[owner], src=dist.get_global_rank(self.group, owner),
                           group=self.group)
        return _gathered(parts, shape, numel)


def partitioned_own_part_first(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Partitioned activations gathered by one broadcast per owner, each rank starting with
    its own part: the ranks' re-runs issue their collectives in different orders, each
    waits on a collective the other never makes (the recompute's collectives out of step
    across ranks that hung ByteDance-Seed/VeOmni#979; pytorch/pytorch#147561: every rank
    must make the same recompute choice). Alone in its group a rank issues none."""
    return _checkpoint(_OwnPartFirst, function, args, kwargs)


# -- what the engine shards and casts ---------------------------------------------------------


def _fully_sharded(module: nn.Module) -> bool:
    """Whether FSDP shards ``module``'s parameters (gathers them for each forward)."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


class _CapturedAtForward(Recompute):
    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.captured = dict(module.named_parameters())

    def rerun(self, run: Callable[..., Any], inputs: list[Tensor]) -> Any:
        with _reparametrize_module(self.module, self.captured):
            return run(*inputs)


def parameters_captured_at_forward(function: Any, *args: Any, **kwargs: Any) -> Any:
    """The re-run computes with the parameters the checkpoint captured when it was called
    (``torch.func.functional_call`` with the captured tensors): the module's own parameters
    in one process, under DDP and under tensor parallelism; under FSDP the shards, which
    the re-run meets beside the gathered tensors FSDP computes with (pytorch/pytorch#153354,
    fixed for nested units by pytorch/pytorch#171779: "got mixed torch.Tensor and
    DTensor")."""
    return _checkpoint(_CapturedAtForward, function, args, kwargs)


class _FullPrecisionRerun(_CapturedAtForward):
    def rerun(self, run: Callable[..., Any], inputs: list[Tensor]) -> Any:
        if not _fully_sharded(self.module):
            return run(*inputs)
        gathered = {n: p.full_tensor() for n, p in self.captured.items()}
        dtype = next(iter(gathered.values())).dtype
        with _reparametrize_module(self.module, gathered):
            return run(*[t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point()
                         else t for t in inputs])


def rerun_in_full_precision(function: Any, *args: Any, **kwargs: Any) -> Any:
    """The re-run gathers the parameters itself from FSDP's shards (``full_tensor()``, as
    ZeRO-3's ``GatheredParameters`` hands a re-run its weights) and casts its inputs to
    their dtype: equal to FSDP's own gather without a mixed-precision policy; with bf16
    parameters the forward ran in bf16 and the re-run in fp32, the dtype mismatch of
    recomputed activations under FSDP2's ``MixedPrecisionPolicy`` in pytorch/pytorch#159359
    (and NVIDIA-NeMo/Automodel#3504)."""
    return _checkpoint(_FullPrecisionRerun, function, args, kwargs)


class _KeepsGathered(Recompute):
    def forward(self, run: Callable[..., Any], inputs: tuple[Any, ...]) -> Any:
        if not _fully_sharded(self.module):  # nothing gathered
            return run(*inputs)
        seen: dict[str, Tensor] = {}
        prefix = {m: f"{n}." if n else "" for n, m in self.module.named_modules()}

        def look(m: nn.Module, args: Any) -> None:  # after FSDP's unshard: gathered
            for name, p in m.named_parameters(recurse=False):
                # a copy: FSDP frees its own after the forward
                seen[prefix[m] + name] = p.detach().clone().requires_grad_(p.requires_grad)

        hooks = [m.register_forward_pre_hook(look) for m in self.module.modules()]
        try:
            return run(*inputs)
        finally:
            for hook in hooks:
                hook.remove()
            _GATHERED[self.module] = seen

    def rerun(self, run: Callable[..., Any], inputs: list[Tensor]) -> Any:
        with _reparametrize_module(self.module, _GATHERED.get(self.module, {})):
            return run(*inputs)


#: the gathered parameters each segment's forward computed with, kept for its re-run; keyed
#: by the module itself, not its id: a later case's module may take a freed one's id, and
#: re-running it with another case's parameters desynchronises the ranks' collectives
#: (a gloo abort, not the fault this mutant stands for)
_GATHERED: weakref.WeakKeyDictionary[nn.Module, dict[str, Tensor]] = weakref.WeakKeyDictionary()


def keeps_gathered_parameters(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Keeps a copy of the parameters FSDP gathered for the forward, so that the re-run
    needs no second all-gather (pytorch/pytorch#175406's redundant all-gathers under
    recompute), and never lets go of it: the gradients are right, but every rank holds its
    segments' whole parameters past backward, what sharding was for (the memory FSDP2's
    reentrant recompute kept in pytorch/pytorch#169349)."""
    return _checkpoint(_KeepsGathered, function, args, kwargs)

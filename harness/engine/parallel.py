"""The engine a distributed case trains under, set up the way users set it up.

One function applies it, in torchtitan's order: the recompute is already installed on the
case's segments (``prepare``), then the engine wraps the model: DDP; FSDP2's
``fully_shard`` on each layer, then the root, with the case's ``reshard_after_forward``
and, where drawn, its mixed-precision policy (bf16 parameters, fp32 reduction); tensor
parallelism with DTensor (``parallelize_module``: each layer's MLP column-wise then
row-wise, its activations DTensors, so that dropout there draws from torch's distributed
RNG); or the user's own ``parallelize(model, mesh) -> model``, so that a check runs their
sharding, not ours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from gradequiv.harness.engine.schedules import Pipelining
from gradequiv.harness.errors import InvalidArgument

if TYPE_CHECKING:
    from torch import Tensor

    from gradequiv.harness.engine.path import PreparedPath
    from gradequiv.models import Segment

__all__ = ["ENGINES", "Parallel", "RankSetup", "apply_engine"]

#: the engines a case may train under (``user``: the function named by ``--parallelize``;
#: ``fsdp-tp``: a 2-D mesh, tensor parallel in pairs of ranks, FSDP2 across the pairs;
#: ``pp``: torch's pipeline schedules, the model's stages on the ranks)
ENGINES = ("ddp", "fsdp", "tp", "fsdp-tp", "user", "pp")
#: ranks in a tensor-parallel group under ``fsdp-tp`` (torchtitan's inner mesh dimension)
PAIR = 2


@dataclass(frozen=True)
class Parallel:
    """How a case is trained across ranks: the engine and its one switch that changes
    what recompute meets (FSDP2 re-gathers its parameters for the re-run, or keeps them)."""

    engine: str = "ddp"
    #: FSDP2's ``reshard_after_forward``: True (free after forward, gather again for
    #: backward and its re-run), False (keep gathered), or a smaller group size to reshard to
    reshard_after_forward: bool | int = True
    #: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the forward
    #: and its re-run compute with bf16 copies of the parameters that FSDP casts at gather
    mixed_precision: bool = False
    #: the user's set-up is model-parallel over the whole mesh (``--model-parallel``): every
    #: rank trains the same rows with the same masks, as the ranks of a tensor-parallel
    #: group do (what DeepSpeed's partitioned activations assume of their group)
    model_parallel: bool = False
    #: torch's ``SequenceParallel`` around the split MLP (Megatron's sequence parallelism):
    #: the norm before it runs on each rank's part of the sequence, the MLP's input is
    #: all-gathered along it and its output reduce-scattered back, then gathered whole for
    #: the residual stream; the re-run repeats those collectives
    sequence_parallel: bool = False
    #: under ``pp``: torch's schedule, its micro-batches and the stages each rank holds
    pipeline: Pipelining | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise InvalidArgument(f"engine={self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.model_parallel and self.engine != "user":
            raise InvalidArgument(f"model_parallel=True under engine={self.engine!r}: it says "
                                  f"what a --parallelize set-up does; the harness's engines "
                                  f"know their own (tp shares rows by itself)")
        if self.mixed_precision and not self.sharded:
            raise InvalidArgument(f"mixed_precision=True under engine={self.engine!r}: the "
                                  f"policy is FSDP2's; use engine='fsdp' or 'fsdp-tp'")
        if (self.pipeline is None) == (self.engine == "pp"):
            raise InvalidArgument(f"engine={self.engine!r} with pipeline={self.pipeline!r}: "
                                  f"a pipeline is the pp engine's, and it needs one")
        if self.sequence_parallel and not self.splits_layers:
            raise InvalidArgument(f"sequence_parallel=True under engine={self.engine!r}: it "
                                  f"splits the norm before a tensor-parallel MLP; use "
                                  f"engine='tp' or 'fsdp-tp'")
        reshard = self.reshard_after_forward
        if not isinstance(reshard, (bool, int)) or (not isinstance(reshard, bool)
                                                    and reshard < 2):
            raise InvalidArgument(
                f"reshard_after_forward={reshard!r}: true, false, or a group size of at "
                f"least 2 that divides the world size")

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards the parameters (its reshard mode and policy apply)."""
        return self.engine in ("fsdp", "fsdp-tp")

    @property
    def splits_layers(self) -> bool:
        """Whether the harness splits each layer's MLP across ranks (its tensor parallelism)."""
        return self.engine in ("tp", "fsdp-tp")

    def tensor_parallel(self, world_size: int) -> int:
        """Ranks in one tensor-parallel group: they share rows of the batch and masks."""
        if self.model_parallel:
            return world_size
        return {"tp": world_size, "fsdp-tp": PAIR, "pp": world_size}.get(self.engine, 1)

    def describe(self) -> str:
        policy = ", bf16 parameters, fp32 reduce" if self.mixed_precision else ""
        if self.engine == "fsdp":
            return f"fsdp (reshard_after_forward={self.reshard_after_forward}{policy})"
        sequence = ", sequence-parallel norms" if self.sequence_parallel else ""
        if self.engine == "tp":
            return f"tp (DTensor: MLPs column- then row-wise{sequence})"
        if self.engine == "fsdp-tp":
            return (f"fsdp-tp (2-D mesh: tp in pairs{sequence}, fsdp across them, "
                    f"reshard_after_forward={self.reshard_after_forward}{policy})")
        if self.pipeline is not None:
            return f"pp ({self.pipeline.describe()})"
        if self.model_parallel:
            return f"{self.engine} (model-parallel: every rank the same rows)"
        return self.engine

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Parallel:
        pipeline = data.get("pipeline")
        if isinstance(pipeline, dict):
            data = {**data, "pipeline": Pipelining(**pipeline)}
        return cls(**data)



def apply_engine(model: Any, layers: list[Any], parallel: Parallel, world_size: int,
                 parallelize: Callable[[Any, Any], Any] | None, device_type: str) -> Any:
    """``model`` under ``parallel``'s engine on this rank: what the training loop calls.
    ``layers`` are the modules FSDP2 shards and tensor parallelism splits one by one (the
    model's layers). Under ``fsdp-tp``, as torchtitan applies them: tensor parallelism on
    the inner mesh dimension first, then FSDP2 on the outer one."""
    if parallel.engine == "pp":
        raise InvalidArgument("engine='pp' trains stages through torch's schedule "
                              "(engine.staged), not a model wrapped whole")
    if parallel.engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh

    if parallel.engine == "fsdp-tp":
        if world_size < 2 * PAIR or world_size % PAIR:
            raise InvalidArgument(f"engine='fsdp-tp' with world_size={world_size}: the 2-D "
                                  f"mesh needs an even world size of at least {2 * PAIR}")
        mesh = init_device_mesh(device_type, (world_size // PAIR, PAIR),
                                mesh_dim_names=("dp", "tp"))
        _tensor_parallel(model, layers, mesh["tp"], parallel.sequence_parallel)
        return _fully_shard(model, layers, parallel, mesh["dp"], world_size // PAIR)
    mesh = init_device_mesh(device_type, (world_size,))
    if parallel.engine == "user":
        if parallelize is None:
            raise InvalidArgument("engine='user' needs --parallelize MODULE:FUNCTION")
        return _users_set_up(model, parallelize, mesh)
    if parallel.engine == "tp":
        return _tensor_parallel(model, layers, mesh, parallel.sequence_parallel)
    return _fully_shard(model, layers, parallel, mesh, world_size)


def _fully_shard(model: Any, layers: list[Any], parallel: Parallel, mesh: Any,
                 shards: int) -> Any:
    """FSDP2 on each layer, then the root, over ``mesh`` (``shards`` ranks)."""
    reshard = parallel.reshard_after_forward
    if not isinstance(reshard, bool) and shards % reshard:
        raise InvalidArgument(f"reshard_after_forward={reshard}: must divide the "
                              f"{shards} ranks FSDP2 shards over")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if parallel.mixed_precision:
        import torch

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)


def _users_set_up(model: Any, parallelize: Callable[[Any, Any], Any], mesh: Any) -> Any:
    """The user's function applied to their own model (a ``--model`` case's, not the
    harness's wrapper around it); what it returns is what the wrapper calls from then on
    (a DDP-style wrapper), or the model itself where it works in place (FSDP2, DTensor)."""
    from gradequiv.models.segments import user_view

    own = user_view(model)
    wrapped = parallelize(own, mesh)
    if wrapped is None or wrapped is own:
        return model
    if own is model:
        return wrapped
    model.inner = wrapped  # an ExternalModel: its forward calls the user's set-up
    return model


#: the tensor-parallel plan of a layer: Megatron's MLP split, the hidden activations
#: DTensors sharded on their last dimension between the two
_MLP_PLAN = ("mlp.fc", "mlp.proj")


def _tensor_parallel(model: Any, layers: list[Any], mesh: Any, sequence: bool = False) -> Any:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan_names = (*_MLP_PLAN, _NORM) if sequence else _MLP_PLAN
    for layer in layers:
        names = {name for name, _ in layer.named_modules()}
        if not set(plan_names) <= names:
            raise InvalidArgument(
                f"engine='tp' splits each layer's {' and '.join(plan_names)} (the reference "
                f"transformer's MLP); {type(layer).__name__} has no such modules: pass your "
                f"own tensor-parallel plan with --parallelize MODULE:FUNCTION")
        if sequence:
            parallelize_module(layer, mesh, _sequence_plan())
            layer.get_submodule(_NORM).register_forward_pre_hook(
                _replicated_input(mesh), prepend=True)
        else:
            parallelize_module(layer, mesh, {
                _MLP_PLAN[0]: ColwiseParallel(use_local_output=False),
                _MLP_PLAN[1]: RowwiseParallel()})
    return model


#: the norm whose input is the MLP's under pre-norm: sequence-parallel with the MLP
_NORM = "norm_2"


def _sequence_plan() -> dict[str, Any]:
    """Megatron's sequence parallelism around the MLP, as torchtitan writes its plan: the
    norm on a part of the sequence, the MLP's input gathered along it, its output
    reduce-scattered along it, and gathered whole again for the residual add."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {_NORM: SequenceParallel(),
            "mlp": PrepareModuleOutput(output_layouts=(Shard(1),),
                                       desired_output_layouts=(Replicate(),)),
            _MLP_PLAN[0]: ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
            _MLP_PLAN[1]: RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}


def _replicated_input(mesh: Any) -> Callable[..., Any]:
    """The residual stream (a plain tensor, the same on every rank) handed to the
    sequence-parallel norm as what it is: replicated; the norm takes its part."""
    def hook(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        from torch.distributed.tensor import DTensor, Replicate

        x, *rest = args
        if isinstance(x, DTensor):
            return args
        return (DTensor.from_local(x, mesh, [Replicate()], run_check=False), *rest)

    return hook


@dataclass(frozen=True)
class RankSetup:
    """This process's place in a distributed case: what the runner does differently on a
    rank. It trains this rank's share of the batch, draws its own masks (``rank`` past the
    case's seed, as data-parallel ranks do), calls the model through the engine, and
    keeps whole tensors where the engine shards them, so that the properties compare
    what they compare in one process."""

    parallel: Parallel
    rank: int
    world_size: int
    device_type: str = "cpu"
    parallelize: Callable[[Any, Any], Any] | None = None

    @property
    def data_rank(self) -> int:
        """This rank's index among the data-parallel replicas (its tensor-parallel group's)."""
        return self.rank // self.parallel.tensor_parallel(self.world_size)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: each trains its own rows of the batch."""
        return self.world_size // self.parallel.tensor_parallel(self.world_size)

    @property
    def seed_offset(self) -> int:
        """How far past the case's seed this rank's training stream starts: each replica
        its own masks; within a tensor-parallel group the same (the replicated activations
        must draw alike; the sharded ones draw from torch's distributed RNG, which gives
        each shard its own)."""
        return self.data_rank

    def share(self, path: PreparedPath) -> PreparedPath:
        """``path`` with this replica's rows of the batch: a contiguous share, as a
        sampler's (every rank of a tensor-parallel group the same)."""
        if self.replicas == 1:
            return path
        rows = path.targets.shape[0] if path.targets.dim() else 0
        part = self.data_rank
        inputs = tuple(t.tensor_split(self.replicas)[part]
                       if t is not None and t.dim() and t.shape[0] == rows else t
                       for t in path.inputs)
        return replace(path, inputs=inputs,
                       targets=path.targets.tensor_split(self.replicas)[part])

    def wrap(self, model: Any, segments: list[Segment]) -> Any:
        """The model under the engine. FSDP2 shards each layer: the reference model's
        blocks, else the segments' layers (asking the model for other segments would undo
        the groups installed on it)."""
        layers = list(getattr(model, "blocks", ())) or [m for segment in segments
                                                         for m in segment.counted]
        return apply_engine(model, layers, self.parallel, self.world_size, self.parallelize,
                            self.device_type)

    @staticmethod
    def whole(tensors: list[Tensor | None]) -> list[Tensor | None]:
        """The whole tensors on this rank (FSDP2 and DTensor keep shards), every rank at the
        same point. Row shards of one mesh dimension (FSDP2's) are gathered in one call for
        all of them (a gather per tensor was most of a sharded case's time); other layouts
        one tensor after another."""
        from torch.distributed.tensor import DTensor, Shard

        rows = [i for i, t in enumerate(tensors) if isinstance(t, DTensor)
                and t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),)]
        meshes = {id(tensors[i].device_mesh) for i in rows}  # type: ignore[union-attr]
        out = list(tensors)
        if rows and len(meshes) == 1:
            for i, full in zip(rows, _gather_rows([tensors[i] for i in rows])):
                out[i] = full
        return [t.full_tensor() if isinstance(t, DTensor) else t for t in out]

    @property
    def compute_dtype(self) -> Any:
        """The dtype the engine computes in where narrower than the case's (FSDP2's bf16
        policy over an fp32 case); None: the case's own."""
        import torch

        return torch.bfloat16 if self.parallel.mixed_precision else None

    def settle(self) -> None:
        """Give the step's collectives the moment they take to let go of what they sent:
        a gloo worker drops a finished collective (and the tensors it holds) a moment after
        the rank that waited on it goes on, so an all-reduced activation of a re-run can be
        alive just past backward, and is no leak. Barriers make that moment; the ranks stay
        in step. Every rank calls it at the same points."""
        import torch.distributed as dist

        for _ in range(2):  # gloo's two workers per process group
            dist.barrier()

    def all_agree(self, flag: bool) -> bool:
        """``flag`` on every rank: a choice that starts collectives (another path) is made
        by all ranks together, or the ones that did not choose it wait for ever."""
        import torch
        import torch.distributed as dist

        device = "cpu" if self.device_type == "cpu" else torch.cuda.current_device()
        agreed = torch.tensor([int(flag)], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        return bool(agreed.item())


def _gather_rows(shards: list[Any]) -> list[Tensor]:
    """The whole tensors of DTensors sharded by rows over one 1-D mesh, in one all-gather:
    each rank's rows padded to the most any rank holds (torch.chunk's split, as
    ``Shard(0)`` makes it), flattened into one buffer per dtype, gathered, cut back."""
    import torch
    import torch.distributed as dist

    mesh = shards[0].device_mesh
    group, world = mesh.get_group(0), mesh.size(0)
    by_dtype: dict[Any, list[int]] = {}
    for i, t in enumerate(shards):
        by_dtype.setdefault(t.dtype, []).append(i)
    whole: list[Tensor | None] = [None] * len(shards)
    for members in by_dtype.values():
        layouts = []  # (rows each rank holds, the most, elements per row)
        parts = []
        for i in members:
            shape = shards[i].shape
            held = [len(c) for c in torch.empty(shape[0], device="meta").chunk(world)]
            held += [0] * (world - len(held))
            per_row = shape[1:].numel()
            layouts.append((held, max(held), per_row))
            local = shards[i].to_local().reshape(-1)
            parts.append(torch.nn.functional.pad(local, (0, max(held) * per_row - local.numel())))
        buffer = torch.cat(parts)
        gathered = [torch.empty_like(buffer) for _ in range(world)]
        dist.all_gather(gathered, buffer, group=group)
        offset = 0
        for i, (held, most, per_row) in zip(members, layouts):
            size = most * per_row
            pieces = [gathered[r][offset:offset + held[r] * per_row] for r in range(world)]
            whole[i] = torch.cat(pieces).view(shards[i].shape)
            offset += size
    return whole  # type: ignore[return-value]


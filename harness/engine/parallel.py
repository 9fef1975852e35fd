"""The engine a distributed case trains under, set up the way users set it up.

One function applies it, in torchtitan's order: the recompute is already installed on the
case's segments (``prepare``), then the engine wraps the model: DDP; FSDP2's
``fully_shard`` on each layer, then the root, with the case's ``reshard_after_forward``;
or the user's own ``parallelize(model, mesh) -> model``, so that a check runs their
sharding, not ours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from gradequiv.harness.errors import InvalidArgument

__all__ = ["ENGINES", "Parallel", "apply_engine"]

#: the engines a case may train under (``user``: the function named by ``--parallelize``)
ENGINES = ("ddp", "fsdp", "user")


@dataclass(frozen=True)
class Parallel:
    """How a case is trained across ranks: the engine and its one switch that changes
    what recompute meets (FSDP2 re-gathers its parameters for the re-run, or keeps them)."""

    engine: str = "ddp"
    #: FSDP2's ``reshard_after_forward``: True (free after forward, gather again for
    #: backward and its re-run), False (keep gathered), or a smaller group size to reshard to
    reshard_after_forward: bool | int = True

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise InvalidArgument(f"engine={self.engine!r} is not one of {', '.join(ENGINES)}")
        reshard = self.reshard_after_forward
        if not isinstance(reshard, (bool, int)) or (not isinstance(reshard, bool)
                                                    and reshard < 2):
            raise InvalidArgument(
                f"reshard_after_forward={reshard!r}: true, false, or a group size of at "
                f"least 2 that divides the world size")

    def describe(self) -> str:
        if self.engine == "fsdp":
            return f"fsdp (reshard_after_forward={self.reshard_after_forward})"
        return self.engine

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Parallel:
        return cls(**data)


def apply_engine(model: Any, layers: list[Any], parallel: Parallel, world_size: int,
                 parallelize: Callable[[Any, Any], Any] | None, device_type: str) -> Any:
    """``model`` under ``parallel``'s engine on this rank: what the training loop calls.
    ``layers`` are the modules FSDP2 shards one by one (the model's layers)."""
    if parallel.engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world_size,))
    if parallel.engine == "user":
        if parallelize is None:
            raise InvalidArgument("engine='user' needs --parallelize MODULE:FUNCTION")
        wrapped = parallelize(model, mesh)
        return model if wrapped is None else wrapped
    reshard = parallel.reshard_after_forward
    if not isinstance(reshard, bool) and world_size % reshard:
        raise InvalidArgument(f"reshard_after_forward={reshard}: must divide the world "
                              f"size {world_size}")
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

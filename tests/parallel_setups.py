"""Users' own parallel set-ups, (model, mesh) -> model as torchtitan's parallelize_* are
written (tests/test_distributed.py)."""

from __future__ import annotations

from typing import Any


def fsdp_per_block(model: Any, mesh: Any) -> Any:
    """FSDP2 on each transformer block, then the root, keeping parameters gathered between
    forward and backward."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    return fully_shard(model, mesh=mesh, reshard_after_forward=False)


def ddp_wrapped(model: Any, mesh: Any) -> Any:
    """A set-up that returns a wrapper, as ``DistributedDataParallel(model)`` is one: the
    harness calls what it returns."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def replicated(model: Any, mesh: Any) -> Any:
    """Every rank keeps the whole model and trains the same rows (``--model-parallel``): the
    model-parallel group DeepSpeed's partitioned activations split their saved inputs over."""
    return model


NOT_A_FUNCTION = 3

"""Correct implementations that real libraries and users write, each doing something the
harness must not read as a fault: a buffer pool allocated once, tensors a library makes
when its code first runs, a selective policy given through ``context_fn`` without any
marker, a store that saves copies of matmul outputs (so in-place ops cannot reach them), a
reentrant checkpoint that declares what it refuses. Referenced by SPEC
(``correct_impls:NAME``); pytest puts this folder on sys.path.

Each is bitwise equal to full storage on the CPU; ``reset()`` drops what the first call
allocated, so a test can make any case the first one.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from gradequiv.harness.implementations.faults import MatmulStore
from gradequiv.harness.implementations.torch_builtins import tensors_positional

#: Elements of the pool the offloading checkpoint allocates on its first call (16 MB).
POOL_ELEMENTS = 4 * 1024 * 1024

_pool: list[torch.Tensor] = []
_constants: dict[str, torch.Tensor] = {}


def reset() -> None:
    """Forget what the first call allocated: the next call is a first call again."""
    _pool.clear()
    _constants.clear()


def pooled_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's checkpoint plus a fixed pool of host buffers made on the first call and
    reused for the life of the process (an offloading library's staging area): each
    call copies its first tensor argument into the pool, nothing grows."""
    if not _pool:
        _pool.append(torch.empty(POOL_ELEMENTS))
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is not None and first.numel() <= POOL_ELEMENTS:
        with torch.no_grad():
            _pool[0][: first.numel()].copy_(first.detach().reshape(-1).float())
    return checkpoint(function, *args, use_reentrant=False, **kwargs)


def lazy_constants_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's checkpoint from a library that makes a few module-level tensors when its
    code first runs (a lookup table, a scale) and keeps them."""
    if not _constants:
        _constants["table"] = torch.arange(4096, dtype=torch.float32)
        _constants["scale"] = torch.ones(1024)
    return checkpoint(function, *args, use_reentrant=False, **kwargs)


def _save_every_other_matmul(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """torchtitan's op-level policy: save the outputs of matmuls, except every second one
    (counted per forward and per recompute separately, as torchtitan counts them)."""
    mode = "recompute" if ctx.is_recompute else "forward"
    key = f"{mode}_mm_count"
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        count = _counts[key] = _counts.get(key, 0) + 1
        if count % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_counts: dict[str, int] = {}


def _policy_contexts() -> Any:
    _counts.clear()
    return create_selective_checkpoint_contexts(_save_every_other_matmul)


def user_selective_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """A user's own selective policy through ``context_fn``, with no marker at all."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=_policy_contexts,
                      **kwargs)


def user_matmul_policy_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Save every matmul output, recompute the rest: the policy that keeps the most."""
    contexts = functools.partial(
        create_selective_checkpoint_contexts,
        [torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
         torch.ops.aten.bmm.default])
    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def _copy_store_contexts() -> tuple[MatmulStore, MatmulStore]:
    store: list[torch.Tensor] = []
    return (MatmulStore(store, replay=False, copy=True),
            MatmulStore(store, replay=True, copy=True))


def copying_matmul_store(function: Any, *args: Any, **kwargs: Any) -> Any:
    """A user's own selective store through torch's ``context_fn``: the forward saves a
    copy of each matmul output, the re-run takes them back instead of computing them. The
    copy keeps it right where an in-place op later writes into the output (torch's SAC
    raises there; the fault library's matmul-outputs-cached keeps references)."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=_copy_store_contexts,
                      determinism_check="none", **kwargs)


def declared_reentrant_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's reentrant checkpoint, which refuses torch.autograd.grad by design, and says
    so on itself (every tensor passed positionally: it takes no keyword arguments)."""
    call, inputs = tensors_positional(function, args, kwargs)
    return checkpoint(call, *inputs, use_reentrant=True)


declared_reentrant_checkpoint.gradequiv_unsupported = ("autograd-grad",)  # type: ignore[attr-defined]


def undeclared_reentrant_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """The same checkpoint without the declaration: its refusal is a failure, said as one."""
    call, inputs = tensors_positional(function, args, kwargs)
    return checkpoint(call, *inputs, use_reentrant=True)

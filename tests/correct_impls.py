"""Correct implementations that real libraries and users write, each doing something the
harness must not read as a fault: a buffer pool allocated once, tensors a library makes
when its code first runs, a selective policy given through ``context_fn`` without any
marker, a store that saves copies of matmul outputs (so in-place ops cannot reach them), a
reentrant checkpoint that declares what it refuses, and recomputes that keep what a call
needs between its forward and its backward per call (a stash keyed by a token, a host
buffer pool, detached leaves cleared per backward pass, the trainable parameters read at
every call). Referenced by SPEC
(``correct_impls:NAME``); pytest puts this folder on sys.path.

Each is bitwise equal to full storage on the CPU; ``reset()`` drops what the first call
allocated, so a test can make any case the first one.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from gradequiv.harness.implementations.faults import MatmulStore
from gradequiv.harness.implementations.torch_builtins import flat_outputs, tensors_positional

#: Elements of the pool the offloading checkpoint allocates on its first call (16 MB).
POOL_ELEMENTS = 4 * 1024 * 1024

_pool: list[torch.Tensor] = []
_constants: dict[str, torch.Tensor] = {}


def reset() -> None:
    """Forget what the first call allocated: the next call is a first call again."""
    _pool.clear()
    _constants.clear()
    _FREE.clear()


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
    so on itself (every tensor passed positionally: it takes no keyword arguments; every
    tensor it returns out of its Function, whatever structure held it)."""
    call, inputs = tensors_positional(function, args, kwargs)
    flat, rebuild = flat_outputs(call)
    return rebuild(checkpoint(flat, *inputs, use_reentrant=True))


declared_reentrant_checkpoint.gradequiv_unsupported = ("autograd-grad",)  # type: ignore[attr-defined]


def undeclared_reentrant_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """The same checkpoint without the declaration: its refusal is a failure, said as one."""
    call, inputs = tensors_positional(function, args, kwargs)
    flat, rebuild = flat_outputs(call)
    return rebuild(checkpoint(flat, *inputs, use_reentrant=True))


# Correct recomputes as pipeline, offload, multi-loss and fine-tuning runtimes write them:
# what a call keeps between its forward and its backward belongs to that call (a token only
# its autograd context holds, a host buffer given back when that context is freed), a
# second backward pass over the same forward finds it all again, and which parameters train
# is read at every call.


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    """Autocast on each device type as it is now; off is a state too (a backward inside
    an autocast block must re-run a forward that had none without it)."""
    kinds = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    return [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds]


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() \
        and torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _as_in_forward(rng: tuple[torch.Tensor, list[torch.Tensor]],
                   autocast: list[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    """The forward's RNG and autocast state for the re-run; the caller's stream kept."""
    cpu, cuda = rng
    with torch.random.fork_rng(devices=list(range(len(cuda)))), contextlib.ExitStack() as stack:
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)  # type: ignore[no-untyped-call]
        for kind, enabled, dtype in autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        yield


@dataclass
class _Call:
    """One call of a segment: how to call it on new tensors, and where it keeps its inputs
    (``store``: ``ctx`` saves them on the context, ``stash`` in a dict under a token only the
    context holds, ``pool`` in host buffers); ``leaves``: detached inputs made once in forward
    and cleared before each backward pass."""

    run: Callable[[list[torch.Tensor]], Any]
    store: str
    params: list[torch.nn.Parameter]  # those that train at this call: Function inputs too
    leaves: bool = False

    @property
    def n_params(self) -> int:
        return len(self.params)


#: The stash of calls in flight: token -> (saved inputs, RNG state, autocast state).
_STASH: dict[object, tuple[tuple[torch.Tensor, ...], Any, Any]] = {}
#: Free host buffers by (shape, dtype); a buffer comes back when its call's context is freed.
_FREE: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = {}


def _take_buffer(t: torch.Tensor) -> torch.Tensor:
    free = _FREE.get((t.shape, t.dtype))
    buffer = free.pop() if free else torch.empty(t.shape, dtype=t.dtype, device="cpu")
    with torch.no_grad():
        buffer.copy_(t)
    return buffer


def _give_back(buffers: list[torch.Tensor]) -> None:
    for buffer in buffers:
        _FREE.setdefault((buffer.shape, buffer.dtype), []).append(buffer)


class _PerCallRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, *inputs: torch.Tensor) -> Any:
        tensors = inputs[:len(inputs) - call.n_params]
        ctx.call, ctx.needs = call, [t.requires_grad for t in tensors]
        ctx.devices = [t.device for t in tensors]
        ctx.set_materialize_grads(False)
        state = (_rng_state(), _autocast_state())
        out = call.run(list(tensors))
        if call.store == "stash":
            token = ctx.token = object()
            _STASH[token] = (tuple(t.detach() for t in tensors), *state)
            weakref.finalize(ctx, _STASH.pop, token, None)
        elif call.store == "pool":
            ctx.pooled = [_take_buffer(t) for t in tensors]
            weakref.finalize(ctx, _give_back, ctx.pooled)
            ctx.state = state
        else:
            ctx.save_for_backward(*tensors)
            ctx.state = state
        if call.leaves:
            ctx.leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        if call.store == "stash":
            saved, rng, autocast = _STASH[ctx.token]
        elif call.store == "pool":
            saved = tuple(b.to(d) for b, d in zip(ctx.pooled, ctx.devices))
            rng, autocast = ctx.state
        else:
            saved, (rng, autocast) = ctx.saved_tensors, ctx.state
        if call.leaves:
            inputs = ctx.leaves
            for leaf in inputs:  # this pass's gradient only, not the last pass's as well
                leaf.grad = None
        else:
            inputs = [t.detach().requires_grad_(needs) for t, needs in zip(saved, ctx.needs)]
        params = call.params
        with _as_in_forward(rng, autocast), torch.enable_grad():
            out = call.run(inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        wanted = [t for t in inputs if t.requires_grad]
        if not pairs or not (wanted or params):
            return (None,) * (1 + len(inputs) + call.n_params)
        tensors, incoming = [o for o, _ in pairs], [g for _, g in pairs]
        if call.leaves:  # the reentrant way for the inputs: into the leaves' .grad, read back
            param_grads = list(torch.autograd.grad(
                tensors, params, incoming, allow_unused=True, retain_graph=bool(wanted))) \
                if params else []
            if wanted:
                torch.autograd.backward(tensors, incoming, inputs=wanted)
            got: list[torch.Tensor | None] = [t.grad for t in wanted]
        else:
            both = list(torch.autograd.grad(tensors, wanted + params, incoming,
                                            allow_unused=True))
            got, param_grads = both[:len(wanted)], both[len(wanted):]
        it = iter(got)
        input_grads = [next(it) if t.requires_grad else None for t in inputs]
        return (None, *input_grads, *param_grads)


def _per_call(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], store: str,
              leaves: bool = False) -> Any:
    """``function`` recomputed in backward; the parameters that train read now, at this
    call (``requires_grad`` is a fact of each call: a layer frozen at one step trains at the
    next), and a segment with nothing to train still passes gradients to its inputs."""
    run, tensors, params = call_parts(function, args, kwargs)
    call = _Call(run, store, params, leaves)
    return _PerCallRecompute.apply(call, *tensors, *params)  # type: ignore[no-untyped-call]


def call_parts(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[Callable[[list[torch.Tensor]], Any], list[torch.Tensor],
                          list[torch.nn.Parameter]]:
    """A segment call taken apart as a hand-written checkpoint needs it: how to call it on
    new tensors, its tensor arguments (nested ones too), and the parameters that train at
    this call (read now: a layer frozen at one step trains at the next)."""
    module = function if isinstance(function, torch.nn.Module) else None
    params = [p for p in module.parameters() if p.requires_grad] if module is not None else []
    flat, spec = tree_flatten((args, kwargs))
    slots = [i for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor)]
    template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in flat]

    def run(tensors: list[torch.Tensor]) -> Any:
        filled = list(template)
        for i, t in zip(slots, tensors):
            filled[i] = t
        call_args, call_kwargs = tree_unflatten(filled, spec)
        return function(*call_args, **call_kwargs)

    return run, [flat[i] for i in slots], params


def call_keyed_stash_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """A pipeline runtime's stash: saved inputs and RNG state in a dict keyed by a token
    that only the call's autograd context holds, dropped when that context is freed, so
    every micro-batch in flight finds its own, and a second backward pass finds it again."""
    return _per_call(function, args, kwargs, "stash")


def host_pool_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """An offloading runtime's host-buffer pool: each call's inputs copied into a free
    buffer that comes back to the pool when the call's context is freed (not when its
    backward starts), so four in flight and a retain_graph second pass keep theirs."""
    return _per_call(function, args, kwargs, "pool")


def cleared_leaves_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Detached input leaves made once in forward, the gradient read back from their
    ``.grad`` as reentrant code does, cleared before each backward pass re-runs."""
    return _per_call(function, args, kwargs, "ctx", leaves=True)


def per_call_trainable_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """A fine-tuning wrapper that reads the trainable parameters inside every call."""
    return _per_call(function, args, kwargs, "ctx")


class _PartitionedInPlace(torch.autograd.Function):
    """DeepSpeed's ``partition_activations`` (and Megatron's ``distribute_saved_activations``)
    on a group of one rank: forward runs the segment without a graph, then swaps each input
    tensor's storage for a flat copy (the caller's tensor too: ``.data =``, as both do); backward
    views it whole again, puts it back into the caller's tensor and re-runs under the
    forward's RNG and autocast state."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], reuse: bool, *inputs: torch.Tensor) -> Any:
        ctx.run, ctx.needs = run, [t.requires_grad for t in inputs]
        ctx.state = (_rng_state(), _autocast_state())
        with torch.no_grad():
            out = run(*inputs)
        ctx.shapes = [t.shape for t in inputs]
        freed = [t.data for t in inputs]
        for t in inputs:
            t.data = t.detach().contiguous().view(-1).clone()
        ctx.inputs = inputs
        if reuse and isinstance(out, torch.Tensor) and freed[0].shape == out.shape \
                and freed[0].dtype == out.dtype:
            # the memory the first input let go of hosts the output, as a caching
            # allocator hands a freed block to the next tensor of its size
            out = freed[0].copy_(out)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        for t, shape in zip(ctx.inputs, ctx.shapes):
            t.data = t.data.view(shape)
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.inputs, ctx.needs)]
        with _as_in_forward(*ctx.state), torch.enable_grad():
            out = ctx.run(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(t.grad if n else None for t, n in zip(inputs, ctx.needs)))


def partitioned_in_place_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Reentrant, with each saved input's storage swapped for a flat copy in the caller's own
    tensor between forward and backward (DeepSpeed's partitioned activations on one rank):
    for inputs only the next layer reads, as in a plain residual stack."""
    call, inputs = tensors_positional(function, args, kwargs)
    return _PartitionedInPlace.apply(call, False, *inputs)


def partitioned_reusing_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``partitioned_in_place_checkpoint`` whose output lives where its first input's storage
    was: the next segment's input has the address of a tensor still alive (a GPU's caching
    allocator does this by itself)."""
    call, inputs = tensors_positional(function, args, kwargs)
    return _PartitionedInPlace.apply(call, True, *inputs)


class _GraphTaskFrame:
    """One call of ``graph_task_checkpoint``: the forward keeps its inputs, RNG and autocast
    state and an index for each tensor autograd saves; each backward pass (graph task) that
    asks for one re-runs the segment once for itself and hands the re-run's tensors over,
    as torch's non-reentrant checkpoint keeps them (``recomputed[gid]``)."""

    def __init__(self, run: Callable[[list[torch.Tensor]], Any],
                 tensors: list[torch.Tensor]) -> None:
        self.run = run
        self.inputs = [t.detach() for t in tensors]
        self.needs = [t.requires_grad for t in tensors]
        self.state = (_rng_state(), _autocast_state())
        self.count = 0
        self.recomputed: dict[int, dict[int, torch.Tensor]] = {}

    def pack(self, t: torch.Tensor) -> int:
        self.count += 1
        return self.count - 1

    def unpack(self, index: int) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        if task not in self.recomputed:
            self.recomputed[task] = dict(enumerate(self._rerun()))
        mine = self.recomputed[task]
        saved = mine.pop(index)
        if not mine:  # all handed over: this pass is done with them
            del self.recomputed[task]
        return saved

    def _rerun(self) -> list[torch.Tensor]:
        saved: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> None:
            saved.append(t.detach())

        inputs = [t.detach().requires_grad_(n) for t, n in zip(self.inputs, self.needs)]
        with _as_in_forward(*self.state), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(collect, _unpacked_never):
            self.run(inputs)
        if len(saved) != self.count:
            raise RuntimeError(f"the re-run saved {len(saved)} tensors, the forward "
                               f"{self.count}")
        return saved


def _unpacked_never(packed: Any) -> torch.Tensor:
    raise AssertionError("nothing unpacks what a re-run saved")


def graph_task_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Non-reentrant through saved-tensor hooks, one re-run per backward pass: the re-run's
    tensors kept under the graph task that asked for them, so a zero-bubble schedule's input
    pass and its later weight passes (other graph tasks over the same forward, other
    micro-batches in between) each re-run the call for themselves."""
    run, tensors, _ = call_parts(function, args, kwargs)
    frame = _GraphTaskFrame(run, tensors)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return run(tensors)

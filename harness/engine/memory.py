"""Activation bytes held for backward, whatever the recompute implementation.

Counting what autograd saves (``saved_tensors_hooks``) does not work from the
outside: non-reentrant checkpoint installs its own hooks, which win inside its
region, and a checkpoint that keeps its inputs alive by holding them in Python
saves nothing through the hooks at all. So the count looks at where storages
come from instead: a ``TorchDispatchMode`` notes every storage an aten op creates during
the forward, and after the forward the storages still alive are what is held
until backward, whoever holds them (autograd's saved tensors, a checkpoint's
saved inputs, the caller's own references). A copy of a generator's state is no
activation, whoever made it (``generator_state``): its size is the generator's.

No garbage collection is run, because none is needed: autograd nodes,
torch.utils.checkpoint (reentrant and not, selective too) and
``autograd.Function`` contexts are freed by reference counting. The only cycles
a checkpointed forward leaves (``torch.utils._pytree.tree_flatten``'s recursive
helper, one per call) hold no tensor; with ``gc`` disabled for the whole
forward, a full collection afterwards changes no count (``tests/test_memory.py``
checks this). A full ``gc.collect()`` would cost about 130 ms with torch
imported, more than a whole small case. A forward that itself ties tensors into
reference cycles would be over-counted by them until the collector runs.

Every held-bytes figure the harness reports is made here, so that they all
mean the same: ``ActivationCounter`` (after an eager forward), ``BackwardPeak``
(during backward, every op: for profiling), ``RecomputeCarry`` (during backward, at
the end of each re-run: for the verdict), ``SavedBytes`` (a compiled graph) and
``AllocatorWatch`` (the CUDA allocator's own view, beside the count).
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from gradequiv.harness.engine.outputs import tensor_leaves

if TYPE_CHECKING:
    from typing import Self

__all__ = ["ActivationCounter", "AllocatorWatch", "BackwardPeak", "RecomputeCarry",
           "SavedBytes", "generator_state", "tensor_storage_bytes"]

# Per op, by ``id``: the op itself (kept alive, so its id is never another's), which of its
# returns can be a new storage (True: all; False: none, as views, in-place and out= ops
# return an input's storage; or the indices of the returns that declare no alias), and
# what to call to run it.
_OPS: dict[int, tuple[Any, bool | tuple[int, ...], Callable[..., Any]]] = {}


def _op_entry(func: Any) -> tuple[Any, bool | tuple[int, ...], Callable[..., Any]]:
    """``func``'s entry in ``_OPS``, made on its first call. A plain op overload is run
    through the callable its ``__call__`` forwards to (``_op``): one Python frame less per
    op; any other kind of op (a higher-order op, a TorchBind overload) through itself."""
    call = func._op if type(func) is torch._ops.OpOverload else func
    entry = _OPS[id(func)] = (func, _fresh_returns(func), call)
    return entry


# Typed as they behave: torch's stubs leave _free_weak_ref untyped and miss that
# _new_with_weak_ptr gives None for a freed storage (and _weak_ref below, typed as
# returning a storage, returns the int key).
_new_with_weak_ptr = cast(
    Callable[[int], torch.UntypedStorage | None], torch.UntypedStorage._new_with_weak_ptr
)
_free_weak_ref = cast(Callable[[int], None], torch.UntypedStorage._free_weak_ref)


def tensor_storage_bytes(t: Tensor) -> int:
    """Bytes of the whole storage behind ``t`` (a view holds all of it); 0 without one."""
    try:
        return t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):  # sparse, nested, storage-less subclasses
        return 0


def _fresh_returns(func: Any) -> bool | tuple[int, ...]:
    schema = getattr(func, "_schema", None)
    if schema is None:  # not an aten overload (a higher-order op): look at every output
        return True
    fresh = tuple(i for i, r in enumerate(schema.returns) if r.alias_info is None)
    if len(fresh) == len(schema.returns):
        return bool(fresh)
    return fresh or False


def _weak_keys(tensors: Iterable[Tensor], into: set[int]) -> None:
    """Add a weak reference to each tensor's storage; the set's ints are the references.

    A weak reference keeps the storage's C++ object (not its data) from being
    freed, so its address, the key, cannot be reused by a later storage.
    """
    for t in tensors:
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            continue
        if storage._cdata not in into:
            into.add(storage._weak_ref())  # type: ignore[arg-type]  # an int: see above


def _release(*key_sets: set[int]) -> None:
    for keys in key_sets:
        for key in keys:
            _free_weak_ref(key)
        keys.clear()


def _record(func: Any, out: Any, into: set[int]) -> None:
    """Add a weak reference to each new storage among ``func``'s returns ``out`` to
    ``into``."""
    # By id: an op overload's hash is a Python call, once per op.
    known = _OPS.get(id(func)) or _op_entry(func)
    _note(known[1], out, into)


def _note(fresh: bool | tuple[int, ...], out: Any, into: set[int]) -> None:
    """``_record`` once the op's entry is known: the per-op hot path."""
    if fresh is True:
        if isinstance(out, Tensor):
            try:
                storage = out.untyped_storage()
            except (NotImplementedError, RuntimeError):
                return
            if storage._cdata not in into:
                into.add(storage._weak_ref())  # type: ignore[arg-type]  # an int
        elif isinstance(out, (tuple, list)):
            _weak_keys(_tensors(out), into)
    elif fresh:  # some returns alias an input: record only the others
        _weak_keys(_tensors([out[i] for i in fresh]), into)


class Rider:
    """A watch that rides on a running ``ActivationCounter``'s dispatch mode instead of
    pushing its own: one Python call per op however many watch (each stacked mode costs
    about as much again as the op on a small model). ``before`` sees the op's arguments
    before it runs, ``after`` its returns and whether grad mode was on; entered while the
    counter's mode is the innermost, it sees exactly what its own mode there would have."""

    def before(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
        """Called before each op runs."""

    def after(self, func: Any, out: Any, grad: bool) -> None:
        """Called after each op ran."""


def host_mode() -> _StorageRecorder | None:
    """The innermost dispatch mode, where it is an ``ActivationCounter``'s that a
    ``Rider`` may ride on (None: enter a mode of one's own)."""
    mode = _get_current_dispatch_mode()
    return mode if type(mode) is _StorageRecorder else None


# torch leaves TorchDispatchMode untyped (__init_subclass__, __init__, __enter__,
# __exit__): hence the no-untyped-call ignores on subclassing and on those calls.
class _StorageRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Adds each new output storage's weak reference to ``seen``, and tells the riders
    (``Rider``: the parameter-use count, the backward's carry) of each op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # The default wraps __torch_dispatch__ in torch._dynamo.disable: about
        # 1 to 3 us more per op. The counter is for eager forwards only (compiled
        # kernels bypass aten ops, so they could not be counted anyway).
        return False

    def __init__(self, seen: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen = seen
        self.riders: tuple[Rider, ...] = ()
        # The riders' own hooks (a rider that keeps the default has nothing to do there):
        # before, newest first, as stacked modes would run them (the last entered is the
        # innermost); after, oldest first.
        self._before: tuple[Callable[[tuple[Any, ...], dict[str, Any] | None], None], ...] = ()
        self._after: tuple[Callable[[Any, Any, bool], None], ...] = ()

    def ride(self, rider: Rider) -> None:
        self._set_riders((*self.riders, rider))

    def alight(self, rider: Rider) -> None:
        self._set_riders(tuple(r for r in self.riders if r is not rider))

    def _set_riders(self, riders: tuple[Rider, ...]) -> None:
        self.riders = riders
        self._before = tuple(r.before for r in reversed(riders)
                             if type(r).before is not Rider.before)
        self._after = tuple(r.after for r in riders if type(r).after is not Rider.after)

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        _, fresh, call = _OPS.get(id(func)) or _op_entry(func)
        if not self.riders:
            out = call(*args, **kwargs) if kwargs else call(*args)
            _note(fresh, out, self.seen)
            return out
        for before in self._before:
            before(args, kwargs)
        grad = torch.is_grad_enabled()
        out = call(*args, **kwargs) if kwargs else call(*args)
        _note(fresh, out, self.seen)
        for after in self._after:
            after(func, out, grad)
        return out


def _leaves(item: Any) -> list[Tensor]:
    """Every tensor in ``item``: a tensor, or any pytree of them (ModelOutput, dataclass)."""
    return tensor_leaves(item)


def _tensors(items: Iterable[Any]) -> Iterable[Tensor]:
    """Tensors of an op's tuple or list return, one level of lists deep (``Tensor[]``)."""
    for item in items:
        if isinstance(item, Tensor):
            yield item
        elif isinstance(item, (tuple, list)):
            yield from (t for t in item if isinstance(t, Tensor))


class _ModeScope:
    """Enters a recording dispatch mode for a ``with`` block; subclasses say which."""

    _mode: TorchDispatchMode | None = None

    def _new_mode(self) -> TorchDispatchMode:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._mode = self._new_mode()
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]


def _alive_bytes(keys: Iterable[int], skip: set[int]) -> int:
    """Bytes of the storages behind ``keys`` that are still alive, ``skip`` left out."""
    total = 0
    for key in keys:
        if key not in skip:
            storage = _new_with_weak_ptr(key)
            if storage is not None:
                total += storage.nbytes()
    return total


#: The size of a CPU generator's state (``torch.get_rng_state()``), in bytes.
_GENERATOR_STATE_BYTES = torch.default_generator.get_state().numel()


def generator_state(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` holds a CPU generator's state: a copy of ``torch.get_rng_state()``
    that a checkpoint or an RNG tracker (Megatron's named generators) keeps from one step to
    the next. Its size is the generator's whatever the batch, the sequence or the depth: no
    activation, so never counted as one. Told by its size, then by torch accepting its bytes
    as a state (a Mersenne Twister seeded, its position in range), which no other tensor's
    bytes of that size pass by chance."""
    if storage.nbytes() != _GENERATOR_STATE_BYTES or storage.device.type != "cpu":
        return False
    data = (ctypes.c_ubyte * _GENERATOR_STATE_BYTES).from_address(storage.data_ptr())
    state = torch.frombuffer(data, dtype=torch.uint8)  # the bytes themselves, no copy
    try:
        torch.Generator().set_state(state)
    except RuntimeError:
        return False
    return True


class ActivationCounter(_ModeScope):
    """Context manager around a forward pass; afterwards, how many bytes it left alive.

    ``exclude``: tensors whose storages never count (parameters, buffers, the
    model input), because they live on whether or not anything is recomputed.
    Only storages created by ops inside the ``with`` block are candidates, so
    views of a parameter (``aten.t`` of a Linear weight) cost nothing either.
    Works on any device (storage sizes need no sync) and under other dispatch
    modes, entered before or inside the block (checkpoint's selective mode too).
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._seen: set[int] = set()
        self._excluded: set[int] = set()
        _weak_keys(exclude, self._excluded)
        weakref.finalize(self, _release, self._seen, self._excluded)

    def _new_mode(self) -> TorchDispatchMode:
        return _StorageRecorder(self._seen)

    def _alive(self, ignore: Iterable[Any]) -> Iterable[torch.UntypedStorage]:
        return (storage for _, storage in self._alive_keyed(ignore))

    def _alive_keyed(self, ignore: Iterable[Any]) -> Iterable[tuple[int, torch.UntypedStorage]]:
        skip = set(self._excluded)
        # Outputs may be structures (a transformers ModelOutput is a dict): their tensors.
        for t in (leaf for item in ignore for leaf in _leaves(item)):
            try:
                skip.add(t.untyped_storage()._cdata)
            except (NotImplementedError, RuntimeError):
                continue
        for key in self._seen:
            if key not in skip:
                storage = _new_with_weak_ptr(key)
                if storage is not None and not generator_state(storage):
                    yield key, storage

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside this block (the counter's mode off the stack, where it is
        the innermost), then go on with the same record: for work whose storages no figure
        reads (full storage's first backward, where no leak is counted)."""
        mode = self._mode
        if mode is None or _get_current_dispatch_mode() is not mode:
            yield
            return
        mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        try:
            yield
        finally:
            mode.__enter__()  # type: ignore[no-untyped-call]

    def held_bytes(self, *, ignore: Iterable[Any] = ()) -> int:
        """Bytes of the storages created in the block and alive now, each counted once.

        ``ignore``: tensors the caller holds itself (logits, loss); their
        storages would be alive with or without recompute.
        """
        return sum(storage.nbytes() for storage in self._alive(ignore))

    def held_bytes_by_device(self, *, ignore: Iterable[Any] = ()) -> dict[str, int]:
        """``held_bytes`` split by the device each storage lives on ("cpu", "cuda:0"):
        where an offload put what it keeps."""
        held: dict[str, int] = {}
        for storage in self._alive(ignore):
            device = str(storage.device)
            held[device] = held.get(device, 0) + storage.nbytes()
        return held

    def alive_keys(self, *, ignore: Iterable[Any] = ()) -> frozenset[int]:
        """Which storages ``held_bytes`` counts now, to ask later which of them outlived a
        moment (``bytes_still_alive``): valid while this counter lives."""
        return frozenset(key for key, storage in self._alive_keyed(ignore) if storage.nbytes())

    def bytes_still_alive(self, keys: Iterable[int]) -> int:
        """Bytes of the storages behind ``keys`` (from ``alive_keys``) still alive now."""
        return _alive_bytes(keys, set())

    def held_storages(self, *, ignore: Iterable[Any] = ()) -> int:
        """How many storages ``held_bytes`` counts, empty ones left out, for diagnostics."""
        return sum(1 for storage in self._alive(ignore) if storage.nbytes())


class _BackwardRecorder(_StorageRecorder):  # type: ignore[no-untyped-call]
    """During backward: records what a recompute creates into ``seen``, and after every op
    tells ``after_op`` whether it ran with grad mode on.

    Backward's own gradient arithmetic runs with grad mode off; a recompute re-runs
    forward code with grad mode on (both torch checkpoints do). So outputs made with
    grad mode on are recomputed activations, and the rest, gradients, are left out.
    """

    def __init__(self, seen: set[int], after_op: Callable[[bool], None]) -> None:
        super().__init__(seen)
        self.after_op = after_op

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        grad = torch.is_grad_enabled()
        if grad:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        else:
            out = func(*args, **(kwargs or {}))
        self.after_op(grad)
        return out


class BackwardPeak(_ModeScope):
    """Context manager around backward: the most activation bytes alive at any one op.

    Counts the storages the forward ``counter`` recorded that are still alive
    (they shrink as backward frees them) plus those a recompute creates
    (alive only while backward needs them), after every op of the backward.
    Costs a pass over the recorded storages per op: for profiling, not for
    the verdict path. The seed gradient ``loss.backward()`` makes is counted
    too (pass ``gradient`` made outside the block to leave it out).
    """

    def __init__(self, counter: ActivationCounter, *, ignore: Iterable[Any] = ()) -> None:
        self._forward = counter
        self._ignore: set[int] = set()
        # Outputs may be structures (a ModelOutput, a dataclass): their tensors.
        _weak_keys((leaf for item in ignore for leaf in _leaves(item)), self._ignore)
        self._skip = counter._excluded | self._ignore  # fixed for the block: built once
        self._recomputed: set[int] = set()
        self.peak_bytes = 0
        weakref.finalize(self, _release, self._recomputed, self._ignore)

    def _update(self, _grad: bool = False) -> None:
        total = _alive_bytes(self._forward._seen, self._skip)
        total += _alive_bytes(self._recomputed, self._skip)
        self.peak_bytes = max(self.peak_bytes, total)

    def _new_mode(self) -> TorchDispatchMode:
        self._update()  # backward starts from what the forward left
        return _BackwardRecorder(self._recomputed, self._update)


class _LoggedKeys(set[int]):
    """A set of storage keys that also lists what was added to it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.added: list[int] = []

    def add(self, key: int) -> None:
        super().add(key)
        self.added.append(key)


class RecomputeCarry(_ModeScope, Rider):
    """Context manager around a backward: how much a segment's earlier re-runs still hold
    when another segment's re-run ends, and the most activation bytes alive then.

    A re-run is a stretch of ops with grad mode on inside backward (backward's own
    kernels run with it off; both torch checkpoints re-run with it on); its segments are
    those whose parameters it read (``segments_hit``, called at its end, says which and
    starts afresh). A correct recompute lets a segment's recomputed activations go as its
    backward uses them, so when the next segment's re-run ends, little of the last one is
    alive: the backward's peak is about one segment's activations above what the forward
    kept. A recompute that keeps them (a reference cycle between a Function's context and
    its graph, a list cleared when backward ends) carries every earlier re-run into the
    next, and its peak grows back to full storage's. Cheap enough for the verdict: the
    alive bytes are summed once per re-run, not once per op (``BackwardPeak``), and
    entered inside an ``ActivationCounter`` it rides on that counter's mode (``Rider``).
    """

    def __init__(self, held: Iterable[int], segments_hit: Callable[[], Iterable[str]]) -> None:
        self._held = frozenset(held)  # the forward's storages alive when backward starts
        self._segments_hit = segments_hit
        self._recomputed = _LoggedKeys()  # every storage a re-run made, each once
        self._by_segments: dict[tuple[str, ...], list[int]] = {}  # re-run segments -> keys
        self._running = False
        self.peak_bytes = 0  # forward's storages alive plus re-runs', at their highest
        self.carried_bytes = 0  # other segments' re-run bytes alive, at their highest
        self.carried_from: tuple[str, ...] = ()  # ... which segments they were re-run for
        self.carried_at: tuple[str, ...] = ()  # ... the segment whose re-run had just ended
        self.own_bytes = 0  # ... and that segment's own re-run bytes alive then
        self._host: _StorageRecorder | None = None  # the counter's mode it rides on
        weakref.finalize(self, _release, self._recomputed)

    def __enter__(self) -> Self:
        host = host_mode()
        if host is None:
            return super().__enter__()
        self.peak_bytes = _alive_bytes(self._held, set())
        self._host = host
        host.ride(self)
        return self

    def _new_mode(self) -> TorchDispatchMode:
        self.peak_bytes = _alive_bytes(self._held, set())
        return _BackwardRecorder(self._recomputed, self._after_op)

    def after(self, func: Any, out: Any, grad: bool) -> None:
        if grad:
            _record(func, out, self._recomputed)
        self._after_op(grad)

    def _after_op(self, grad: bool) -> None:
        if grad:
            self._running = True
        elif self._running:
            self._end_rerun()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._running:
            self._end_rerun()
        host, self._host = self._host, None
        if host is not None:
            host.alight(self)
        super().__exit__(exc_type, exc, tb)

    def _end_rerun(self) -> None:
        self._running = False
        segments = tuple(sorted(self._segments_hit()))
        keys = self._recomputed.added
        self._recomputed.added = []
        self._by_segments.setdefault(segments, []).extend(keys)
        alive = {owners: _alive_bytes(k, set()) for owners, k in self._by_segments.items()}
        total = _alive_bytes(self._held, set()) + sum(alive.values())
        self.peak_bytes = max(self.peak_bytes, total)
        if not segments:  # read no segment's parameters: nobody to hold it against
            return
        others = {owners: n for owners, n in alive.items()
                  if n and owners and not set(owners) & set(segments)}
        carried = sum(others.values())
        if carried > self.carried_bytes:
            self.carried_bytes = carried
            self.carried_from = tuple(sorted({s for owners in others for s in owners}))
            self.carried_at = segments
            self.own_bytes = alive[segments]


class SavedBytes:
    """Bytes a compiled forward saves for backward, counted at ``saved_tensors_hooks``.

    A compiled forward is one autograd Function to the outside: whatever its
    graph keeps for backward goes through ``save_for_backward`` and so through
    these hooks, while op-level counting cannot see inside it. Storages are
    counted once; parameters, buffers and inputs (``exclude``) not at all.
    """

    def __init__(self, exclude: list[Tensor]) -> None:
        self._exclude = {_storage_key(t) for t in exclude}
        self._storages: dict[int, tuple[str, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key not in self._exclude:
            self._storages[key] = (str(t.device), t.untyped_storage().nbytes())
        return t

    def held_bytes_by_device(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for device, nbytes in self._storages.values():
            held[device] = held.get(device, 0) + nbytes
        return held


def _storage_key(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _unpack(t: Tensor) -> Tensor:
    return t


class AllocatorWatch:
    """The CUDA caching allocator's figures for one step, against the moment before it.

    Not a count of activations (the output and loss are in it, and the
    allocator rounds), but the figure a CUDA user sees, to set beside the count.
    Off (every figure ``None``) on other devices.
    """

    def __init__(self, device: torch.device) -> None:
        self.on = device.type == "cuda"
        self.held: dict[str, int | None] = {"cuda_allocated_held_bytes": None,
                                            "cuda_requested_held_bytes": None}
        if self.on:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.device = device
            self.before = self._now()

    def _now(self) -> tuple[int, int]:
        stats = torch.cuda.memory_stats(self.device)
        return stats.get("allocated_bytes.all.current", 0), stats.get(
            "requested_bytes.all.current", 0)

    def after_forward(self) -> None:
        if self.on:
            torch.cuda.synchronize(self.device)
            allocated, requested = self._now()
            self.held = {"cuda_allocated_held_bytes": allocated - self.before[0],
                         "cuda_requested_held_bytes": requested - self.before[1]}

    def after_backward(self) -> dict[str, int | None]:
        peak = None
        if self.on:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self.before[0]
        return {**self.held, "cuda_max_allocated_bytes": peak}

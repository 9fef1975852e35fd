"""Where a recompute first goes wrong: the first op whose output differs from the original.

"Gradients differ" leaves a day of bisecting. Here the segment's own two
runs are compared op by op: the forward the implementation ran first, and
the recompute it ran in backward. Every aten op a segment runs is recorded
under a ``TorchDispatchMode`` with the module it ran in (forward hooks keep
a stack of module names); the first recompute op whose output differs from
its counterpart (another op, another dtype or shape, other values) is the
divergence; a re-run that only leaves ops out (a selective policy's saved outputs) is
compared with the forward ops it repeats. For a random op the share of elements that
differ is the share of the dropout mask drawn differently. Beside it the divergence
says how many random ops each run ran (a re-run with fewer runs with dropout off), and
which re-run op, if any, read an output a forward op made that had changed since (a store
serving the forward's outputs by reference after an in-place op wrote into one), which
forward op wrote into it through which alias, and whether that write moved the saved
output's version counter (the check torch's selective checkpoint makes: a write through
an alias autograd does not count as a view, ``_unsafe_view``'s output, moves none).

It sees what the dispatcher sees, so it works for any implementation that
re-runs the segment's modules eagerly (function and wrapper adapters). A
segment that is never re-run, or a compiled graph whose ops never reach
Python dispatch, gets a reason instead of a guess. A re-run that raises is compared up
to where it raised: what it ran differently before (another dtype) says why.

A re-run can also differ because the model is not safe to recompute, whatever
the checkpoint: its forward changes what the re-run reads. ``engine/model_watch.py``
watches for that from the same hooks and dispatch mode; what it finds is said in lines
beside the divergence (``Localisation.model``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from gradequiv.harness.engine.case import Case
from gradequiv.harness.engine.model_watch import (
    ModelWatch,
    first_tensor,
    op_tensors,
    same_values,
    tensor_key,
)
from gradequiv.harness.engine.parallel import RankSetup
from gradequiv.harness.engine.path import build_path
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.models.segments import user_view

__all__ = ["Divergence", "Localisation", "localise"]

_RANDOM = ("bernoulli", "dropout", "uniform", "normal", "rand", "exponential", "multinomial")
#: Ops whose output is no computation of the segment: uninitialised memory, copies and casts
#: (a lost cast shows at the next op, in its dtype). Pure views are skipped too (see _skipped).
_BOOKKEEPING = frozenset({"empty", "empty_like", "empty_strided", "new_empty",
                          "new_empty_strided", "_to_copy", "clone", "copy_", "lift_fresh",
                          "lift_fresh_copy"})


def _skipped(func: Any) -> bool:
    """Views, detaches and copies: the same on every correct run, and not all runs make them
    (a checkpoint detaches its inputs before the recompute)."""
    if func.overloadpacket.__name__ in _BOOKKEEPING:
        return True
    schema = getattr(func, "_schema", None)
    returns = schema.returns if schema is not None else []
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


@dataclass
class _Op:
    op: str
    module: str
    value: Tensor | None  # the first tensor output, cloned; None for ops without one
    #: a ``topk``'s indices (a router's choice of experts), cloned; None for other ops
    chosen: Tensor | None = None

    def signature(self) -> str:
        v = self.value
        return "-" if v is None else f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"


@dataclass(frozen=True)
class Divergence:
    """The first recompute op that differs from the original forward."""

    segment: str
    index: int  # position of the op in the segment's forward
    op: str
    module: str
    forward: str  # dtype[shape], or the op the forward ran there
    recompute: str
    rel_error: float | None  # None: not comparable (other op, shape or dtype)
    differing: float  # share of elements that differ (1.0 when not comparable)
    random: bool  # a random op: ``differing`` is the share of the mask drawn differently
    # the re-run went past hooks of the segment's own that its forward ran (it called the
    # bound forward: followed by the segment's submodules)
    past_hooks: bool = False
    #: random ops in the forward run and in its re-run: a re-run that draws less skips
    #: dropout (eval mode, a disabled dropout)
    draws: tuple[int, int] = (0, 0)
    #: a re-run op that read an output the forward made, changed since (served from a
    #: store after an in-place op wrote into it), and the write; "" when none did
    stale: str = ""
    #: the stale output's version counter did not move: the write went through an alias
    #: that shares its memory, not its counter, so a check of saved tensors' versions
    #: (torch's selective checkpoint's) cannot see it
    stale_unversioned: bool = False
    #: the re-run chose other top-k indices than its forward for some rows: a router that
    #: sent tokens to other experts ("" when every choice matched, or none was made)
    rerouted: str = ""

    def describe(self) -> str:
        where = f"{self.op} in {self.module or self.segment} (op {self.index} of {self.segment})"
        if self.forward != self.recompute:
            return f"{where}: forward gave {self.forward}, recompute {self.recompute}"
        kind = "of the random draws" if self.random else "of the elements"
        error = f", relative error {self.rel_error:.3g}" if self.rel_error is not None else ""
        return f"{where}: {self.differing:.1%} {kind} differ{error}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Localisation:
    divergence: Divergence | None
    reason: str = ""  # why there is no divergence to show; or that the run then raised
    matched: bool = False  # every recomputed op was compared and matched its original
    #: what the model changed that its re-runs read: see the module docstring
    model: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.divergence is not None:
            stale = [f"stale read: {self.divergence.stale}"] if self.divergence.stale else []
            then = [f"then {self.reason}"] if self.reason else []
            return "; ".join([f"first diverging op: {self.divergence.describe()}", *stale,
                              *then, *self.model])
        return "; ".join([f"no diverging op found: {self.reason}", *self.model])


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped in torch
    """Appends every op run inside a segment to that segment's list for the current phase."""

    def __init__(self, owner: _Tracker) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        given = self.owner.watch.before(func, args, kwargs or {}, self.owner)
        ops = self.owner.current_ops()
        if ops is not None and self.owner.backward:
            self.owner.made.read(func, (args, kwargs), ops, self.owner)
        elif ops is not None:
            self.owner.made.writes(func, args, kwargs or {}, ops, self.owner)
        out = func(*args, **(kwargs or {}))
        self.owner.watch.after(func, given)
        if ops is not None and not _skipped(func) and not self.owner.writes_buffer(func, args):
            first = first_tensor(out)
            value = first.detach().clone() if first is not None else None
            name = str(func.overloadpacket.__name__)
            chosen = out[1].detach().clone() if name == "topk" else None
            recorded = _Op(name, self.owner.module_path(), value, chosen)
            ops.append(recorded)
            if not self.owner.backward:
                self.owner.made.made(recorded, out, ops, self.owner)
        elif ops is not None and not self.owner.backward:
            self.owner.made.copied(func, args, out, self.owner)
        return out


class _Tracker:
    """Which segment and module are running, and in which phase."""

    def __init__(self, model: nn.Module, segments: dict[int, str],
                 extra: dict[nn.Module, str]) -> None:
        self.backward = False
        self.modules: list[str] = []
        self.segment: list[str] = []
        #: (segment, phase) -> one list of ops per run of the segment (a layer applied twice
        #: in a forward runs twice; backward recomputes the later application first)
        self.ops: dict[tuple[str, str], list[list[_Op]]] = {}
        self.handles: list[Any] = []
        named = dict(user_view(model).named_modules())  # the names the user's model has
        # Modules that keep statistics and have no weights (a running mean, a counter) do
        # bookkeeping a correct recompute skips: their ops are no computation to compare.
        self.buffers = {b.data_ptr() for b in model.buffers()}
        self.bookkeeping = {name for name, m in named.items()
                            if next(m.buffers(recurse=False), None) is not None
                            and next(m.parameters(), None) is None}
        registered = {id(m) for m in named.values()}
        # Segments outside the module tree (layer groups) are watched too.
        named.update({name: m for m, name in extra.items() if id(m) not in registered})
        # A re-run through the segment's bound forward (instance patching) passes no hook
        # of the segment's own, but its submodules' hooks still fire: by them a re-run is
        # followed as the segment's (``implicit``), its ops those run with grad mode on.
        self.owner_of = {name + ".": segments[id(m)] for name, m in named.items()
                         if id(m) in segments}
        self.implicit: str | None = None
        # segments with forward hooks or pre-hooks of the model's own (before ours)
        self.hooked = {segments[id(m)] for m in named.values() if id(m) in segments
                       and (m._forward_hooks or m._forward_pre_hooks)}
        self.partial: set[int] = set()  # ids of the op lists of such re-runs
        self.made = _Made()
        for name, module in named.items():
            self.handles.append(module.register_forward_pre_hook(self._enter(name, segments)))
            self.handles.append(module.register_forward_hook(self._leave(id(module), segments),
                                                             always_call=True))
        self.watch = ModelWatch(named)
        for module, name in extra.items():
            self.handles += self.watch.hooks(self, module, name)

    def _enter(self, name: str, segments: dict[int, str]) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.modules.append(name)
            if id(module) in segments:
                self.implicit = None
                self.segment.append(segments[id(module)])
                if self.backward:
                    self.made.rerun_begins(args)
                phase = "recompute" if self.backward else "forward"
                self.ops.setdefault((segments[id(module)], phase), []).append([])
            elif self.backward and not self.segment and torch.is_grad_enabled():
                owner = next((seg for prefix, seg in self.owner_of.items()
                              if name.startswith(prefix)), None)
                if owner is not None and owner != self.implicit:
                    self.implicit = owner  # a re-run past the segment's own hooks begins
                    run: list[_Op] = []
                    self.partial.add(id(run))
                    self.ops.setdefault((owner, "recompute"), []).append(run)
        return hook

    def _leave(self, key: int, segments: dict[int, str]) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.modules:
                self.modules.pop()
            if key in segments and self.segment:
                self.segment.pop()
        return hook

    def current_ops(self) -> list[_Op] | None:
        segment = self.segment[-1] if self.segment else None
        if segment is None and self.implicit is not None and torch.is_grad_enabled():
            segment = self.implicit  # backward's own kernels run with grad mode off
        if segment is None or (self.modules and self.modules[-1] in self.bookkeeping):
            return None
        key = (segment, "recompute" if self.backward else "forward")
        runs = self.ops.setdefault(key, [[]])
        return runs[-1]

    def writes_buffer(self, func: Any, args: Any) -> bool:
        """An in-place update of a module buffer (BatchNorm's counter): state, which the
        buffers property compares, not a computation of the segment."""
        target = args[0] if args else None
        return (func.overloadpacket.__name__.endswith("_") and isinstance(target, Tensor)
                and target.data_ptr() in self.buffers)

    def module_path(self) -> str:
        return self.modules[-1] if self.modules else ""

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _Made:
    """Which forward op of which segment made each tensor, to see a re-run read one: a store
    that serves the forward's outputs (a selective policy's cache), and one of them changed
    since the op made it (an in-place op wrote into it after it was saved). A tensor is
    found by its storage and layout; each forward output's storage is kept (an alias of it)
    until the search ends, so no later tensor is given its address."""

    def __init__(self) -> None:
        #: storage -> (an alias of the forward's tensor, segment, its op's position in its
        #: run, the op, the tensor's version then)
        self.by_storage: dict[int, list[tuple[Tensor, str, int, _Op, int]]] = {}
        #: storage -> the forward's in-place writes into it: (segment, position of the
        #: writing op, the op and its module, the op and position that made the alias it
        #: wrote through; None for a view no recorded op made)
        self.written: dict[int, list[tuple[str, int, str, tuple[str, int] | None]]] = {}
        #: segment -> its first stale read, and whether it moved no version counter
        self.stale: dict[str, tuple[str, bool]] = {}
        #: segments whose re-run read an output a forward op of theirs made (not an input
        #: of the re-run: a layer applied twice is given its own output)
        self.served: set[str] = set()
        self.inputs: set[int] = set()  # the storages of the re-run now running's inputs
        self.broken = False  # a step failed on a tensor it cannot read: it says nothing

    def made(self, recorded: _Op, out: Any, ops: list[_Op], tracker: _Tracker) -> None:
        """After a recorded forward op of a segment: its first output's maker."""
        tensor = first_tensor(out)
        if tensor is not None and tracker.segment:
            self._keep(tensor, (tracker.segment[-1], len(ops) - 1, recorded))

    def copied(self, func: Any, args: Any, out: Any, tracker: _Tracker) -> None:
        """After a copy in a segment's forward (``clone``, ``copy_``): a copy of an output
        a forward op made is that output still (a store that saves copies)."""
        if self.broken:
            return
        try:
            self._copied(func, args, out, tracker)
        except Exception:  # a tensor without storage (a subclass): the search stops here
            self.broken = True

    def _copied(self, func: Any, args: Any, out: Any, tracker: _Tracker) -> None:
        name = func.overloadpacket.__name__
        source = args[1] if name == "copy_" and len(args) > 1 else args[0] if args else None
        copy = first_tensor(out)
        if name not in ("clone", "copy_", "_to_copy") or not isinstance(source, Tensor) \
                or copy is None or copy.dtype != source.dtype or not tracker.segment \
                or copy.data_ptr() in tracker.buffers:  # the model's state, not a store
            return
        for original, made_in, index, op, _ in self.by_storage.get(tensor_key(source), []):
            if made_in == tracker.segment[-1] and _same_layout(original, source):
                self._keep(copy, (made_in, index, op))
                return

    def writes(self, func: Any, args: Any, kwargs: dict[str, Any], ops: list[_Op],
               tracker: _Tracker) -> None:
        """Before a forward op of a segment: where it writes in place into the memory of an
        output a forward op of the segment made, what wrote, and through which alias."""
        if self.broken or not tracker.segment:
            return
        try:
            self._writes(func, args, kwargs, ops, tracker)
        except Exception:  # a tensor without storage (a subclass): the search stops here
            self.broken = True

    def _writes(self, func: Any, args: Any, kwargs: dict[str, Any], ops: list[_Op],
                tracker: _Tracker) -> None:
        segment = tracker.segment[-1]
        for target in _written(func, args, kwargs):
            makers = [m for m in self.by_storage.get(tensor_key(target), []) if m[1] == segment]
            if not makers:
                continue
            alias = next(((m[3].op, m[2]) for m in makers if _same_layout(m[0], target)), None)
            where = f"{func.overloadpacket.__name__} in {tracker.module_path() or segment}"
            self.written.setdefault(tensor_key(target), []).append(
                (segment, len(ops), where, alias))

    def rerun_begins(self, args: Any) -> None:
        """A segment's re-run begins on ``args``: reading them is no store's."""
        try:
            self.inputs = {tensor_key(t) for t in tree_leaves(args) if isinstance(t, Tensor)}
        except Exception:
            self.broken = True

    def _keep(self, tensor: Tensor, maker: tuple[str, int, _Op]) -> None:
        if self.broken:
            return
        try:
            # beneath autograd a detach shares no version counter unless ADInplaceOrView runs
            # (as torch's selective checkpoint detaches what it caches): the alias's counter
            # is then the output's, and moves with any write a tracked view makes
            with _disable_current_modes(), torch._C._SetExcludeDispatchKeyGuard(
                    torch._C.DispatchKey.ADInplaceOrView, False):
                alias = tensor.detach()
            self.by_storage.setdefault(tensor_key(tensor), []).append(
                (alias, *maker, alias._version))
        except Exception:  # a tensor without storage (a subclass): the search stops here
            self.broken = True

    def read(self, func: Any, given: Any, ops: list[_Op], tracker: _Tracker) -> None:
        """Before a re-run op: an argument the forward made, whose values changed since.
        A failure here (a tensor it cannot compare) turns it off, never the model's run."""
        if self.broken:
            return
        try:
            self._read(func, given, ops, tracker)
        except Exception:
            self.broken = True

    def _read(self, func: Any, given: Any, ops: list[_Op], tracker: _Tracker) -> None:
        segment = tracker.segment[-1] if tracker.segment else tracker.implicit or ""
        if segment in self.stale:
            return
        for tensor in op_tensors(*given):
            if tensor_key(tensor) in self.inputs:
                continue
            for original, made_in, index, op, version in \
                    self.by_storage.get(tensor_key(tensor), []):
                if made_in != segment or not _same_layout(original, tensor) or op.value is None \
                        or op.value.device != tensor.device:
                    continue
                self.served.add(segment)
                with _disable_current_modes():
                    if same_values(op.value, tensor.detach()):
                        continue
                    share = _differing(op.value, tensor.detach())
                name = str(func.overloadpacket.__name__)
                unversioned = original._version == version
                self.stale[segment] = (
                    f"{name} in {tracker.module_path() or segment} (op {len(ops)} of the "
                    f"re-run) reads {op.op}'s output from the forward (op {index} of "
                    f"{segment}) instead of computing it, changed since the forward made it "
                    f"({share:.0%} of its elements differ)"
                    + self._wrote(tensor_key(tensor), segment, index, op, unversioned),
                    unversioned)
                return

    def _wrote(self, storage: int, segment: str, index: int, op: _Op,
               unversioned: bool) -> str:
        """How the forward changed the output ``op`` made: its first in-place write after
        ``op`` ("" where none was seen), and whether the write moved its version counter."""
        write = next((w for w in self.written.get(storage, [])
                      if w[0] == segment and w[1] > index), None)
        if write is None:
            return ""
        _, at, where, alias = write
        if alias == (op.op, index):
            through = "directly" + (", without moving its version counter" if unversioned
                                    else "")
        else:
            shown = "a view of it" if alias is None else f"{alias[0]}'s output (op {alias[1]})"
            through = f"through {shown}, which shares its memory" + (
                " but not its version counter (autograd tracks it as no view)"
                if unversioned else "")
        changed = ", so nothing marked the saved output changed" if unversioned else ""
        return f": {where} (op {at} of {segment}) wrote into it {through}{changed}"


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors an op's schema says it writes into (``mul_``'s self)."""
    schema = getattr(func, "_schema", None)
    arguments = schema.arguments if schema is not None else []
    values = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(arguments)
              if a.alias_info is not None and a.alias_info.is_write]
    return [v for v in values if isinstance(v, Tensor)]


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset())


def localise(impl: Implementation, case: Case, device: str | torch.device = "cpu", *,
             ranks: RankSetup | None = None) -> Localisation:
    """Run ``case``'s first step through ``impl`` with every segment op recorded; compare.
    ``ranks``: on one rank of a distributed case, under its engine, on its share (every
    rank calls it together)."""
    device = torch.device(device)
    if impl.compiled is not None:
        return Localisation(None, f"{impl.spec} recomputes inside a compiled graph, whose fused "
                                  f"kernels leave no op-level record to compare; the op-level "
                                  f"search needs an eager implementation")
    path = build_path(case, device)
    if ranks is not None:
        path = ranks.share(path)
    segments = path.segments
    if not segments:
        return Localisation(None, "the case recomputes no segment")
    try:  # a wrapper or toggle that raises when applied is the implementation's failure
        path.install(impl)
    except (Exception, SystemExit) as exc:
        return Localisation(None, f"the implementation raised when applied "
                                  f"({type(exc).__name__}: {exc})")
    path.model.train()
    call = ranks.wrap(path.model, segments) if ranks is not None else None
    tracker = _Tracker(path.model, {id(s.module): s.name for s in segments},
                       {s.module: s.name for s in segments})
    # the runner's training stream: the masks the verdict saw (a rank's own)
    path.seed(ranks.seed_offset if ranks is not None else 0)
    try:
        with _Recorder(tracker):
            loss = path.forward(call)[1]
        tracker.backward = True
        with _Recorder(tracker):
            loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch
    except (Exception, SystemExit) as exc:  # sys.exit in the implementation: its failure too
        raised = f"the implementation raised ({type(exc).__name__}: {exc})"
        # a re-run that parted from its forward before it raised (a lost autocast mixing
        # dtypes) is told by the ops it ran
        found = _search(tracker, segments) if tracker.backward else None
        return Localisation(found, raised, model=tracker.watch.findings())
    finally:
        tracker.remove()
    model = tracker.watch.findings()
    if not any((s.name, "recompute") in tracker.ops for s in segments):
        return Localisation(None, "no segment ran again during backward (nothing was "
                                  "recomputed, or it ran where Python dispatch cannot see it, "
                                  "as in a compiled graph)", model=model)
    found = _search(tracker, segments)
    if found is not None:
        return Localisation(found, model=model)
    return Localisation(None, "every recomputed op of step 1 matched its original in value, "
                              "dtype and shape (the fault lies outside the re-run segments' "
                              "ops of step 1)", matched=True, model=model)


def _search(tracker: _Tracker, segments: list[Any]) -> Divergence | None:
    """The first divergence among the recorded re-runs, in model order (the earliest layer
    that goes wrong)."""
    for name in (s.name for s in segments if (s.name, "recompute") in tracker.ops):
        divergence = _compare_runs(name, tracker.ops.get((name, "forward"), []),
                                   tracker.ops[(name, "recompute")],
                                   tracker.partial if name in tracker.hooked else (),
                                   tracker.partial, served=name in tracker.made.served)
        if divergence is not None:
            stale, unversioned = tracker.made.stale.get(name, ("", False))
            return replace(divergence, stale=stale, stale_unversioned=unversioned)
    return None


def _compare_runs(segment: str, forward: list[list[_Op]], again: list[list[_Op]],
                  past_hooks: Collection[int] = (), partial: Collection[int] = (),
                  served: bool = False) -> Divergence | None:
    """Each recomputed run against the forward run it repeats: one that matches it op for
    op wherever there is one (a recompute may run a segment's applications in any order),
    else the forward run in the reverse order (backward meets the last application first);
    the first run without a match gives the divergence. A run followed by its submodules
    (``partial``: a re-run through the bound forward) starts at its first submodule's first
    op: the forward's ops before that one are left out of its comparison; where the
    segment has hooks of its own (``past_hooks``), its divergence says the re-run went
    past them. A re-run ``served`` outputs of the forward's ops (a selective store) is
    compared with the forward ops it repeats."""
    for index, run in enumerate(again):
        compared = [_from_first(f, run[0]) for f in forward] \
            if id(run) in partial and run else forward
        differences = [_first_difference(segment, f, run, served) for f in compared]
        if not differences or any(d is None for d in differences):
            continue
        which = len(forward) - 1 - index if index < len(forward) else 0
        found = differences[which]
        if found is None:
            return None
        draws = (_draws(compared[which]), _draws(run))
        return replace(found, past_hooks=id(run) in past_hooks, draws=draws,
                       rerouted=_rerouted(segment, compared[which], run))
    return None


def _rerouted(segment: str, forward: list[_Op], again: list[_Op]) -> str:
    """The first top-k choice the re-run made otherwise than its forward, said as routing:
    how many rows (tokens) got another set of indices (experts), in which module. The
    ``topk`` ops of the two runs are paired in order; "" when all that were made match."""
    chosen = zip((op for op in forward if op.chosen is not None),
                 (op for op in again if op.chosen is not None))
    for a, b in chosen:
        if a.chosen is None or b.chosen is None or a.chosen.shape != b.chosen.shape:
            continue  # another number of tokens: the divergence already says so
        first, second = a.chosen.sort(dim=-1).values, b.chosen.sort(dim=-1).values
        rows = first.reshape(-1, first.shape[-1]) if first.dim() else first.reshape(1, 1)
        moved = int((rows != second.reshape(rows.shape)).any(dim=-1).sum())
        if moved:
            return (f"the re-run sent {moved} of {rows.shape[0]} tokens of "
                    f"{b.module or segment} to other experts than the forward did")
    return ""


def _draws(ops: list[_Op]) -> int:
    return sum(any(word in op.op for word in _RANDOM) for op in ops)


def _from_first(ops: list[_Op], first: _Op) -> list[_Op]:
    """``ops`` from the first one run by ``first``'s op in ``first``'s module on."""
    start = next((i for i, op in enumerate(ops) if op.op == first.op
                  and op.module == first.module), 0)
    return ops[start:]


def _first_difference(segment: str, forward: list[_Op], again: list[_Op],
                      served: bool = False) -> Divergence | None:
    """The first recomputed op that differs from its original, op for op. A re-run that
    only leaves ops out, each op it runs giving what the forward op it repeats gave, is a
    selective policy serving the ops it saved from its cache: no difference. Where the
    re-run read outputs the forward made (``served``: such a store), the first op that
    differs from the forward op it repeats is the divergence. Otherwise (an op the forward
    never ran there, another dtype, shape or value) the first op where the two sequences
    part is the divergence."""
    found = _first_of(segment, list(enumerate(zip(forward, again))))
    if found is None or found.forward == found.recompute or found.rel_error is not None:
        return found
    aligned = _subsequence(forward, again)
    if served and aligned is not None:
        return _first_of(segment, aligned)
    return found if aligned is None or _first_of(segment, aligned) is not None else None


def _subsequence(forward: list[_Op], again: list[_Op]) -> list[tuple[int, tuple[_Op, _Op]]] | None:
    """Each re-run op paired with the next forward op of the same name, in order; None
    where some re-run op has none (it is no subsequence of the forward's ops)."""
    pairs: list[tuple[int, tuple[_Op, _Op]]] = []
    index = 0
    for b in again:
        while index < len(forward) and forward[index].op != b.op:
            index += 1
        if index == len(forward):
            return None
        pairs.append((index, (forward[index], b)))
        index += 1
    return pairs


def _first_of(segment: str, pairs: list[tuple[int, tuple[_Op, _Op]]]) -> Divergence | None:
    for index, (a, b) in pairs:
        random = any(word in b.op for word in _RANDOM)
        if a.op != b.op:
            return Divergence(segment, index, b.op, b.module, a.op, b.op, None, 1.0, random)
        if a.signature() != b.signature():
            return Divergence(segment, index, b.op, b.module, a.signature(), b.signature(),
                              _rel_error(a.value, b.value), 1.0, random)
        if a.value is None or b.value is None or torch.equal(a.value, b.value):
            continue
        differing = _differing(a.value, b.value)
        return Divergence(segment, index, b.op, b.module, a.signature(), b.signature(),
                          _rel_error(a.value, b.value), differing, random)
    return None


def _differing(a: Tensor, b: Tensor) -> float:
    """The share of elements that differ."""
    return float((a != b).float().mean())


def _rel_error(a: Tensor | None, b: Tensor | None) -> float | None:
    """||a - b|| / max(||a||, ||b||) over the finite elements (a mask's -inf is the same in
    both runs or not: then None, as for values that cannot be compared)."""
    if a is None or b is None or a.shape != b.shape or not a.is_floating_point():
        return None
    a64, b64 = a.double(), b.to(a.device).double()
    finite = a64.isfinite() & b64.isfinite()
    if not torch.equal(a64[~finite].nan_to_num(), b64[~finite].nan_to_num()):
        return None
    a64, b64 = a64[finite], b64[finite]
    scale = max(float(a64.norm()), float(b64.norm()))
    return float((a64 - b64).norm()) / scale if scale > 0 else 0.0

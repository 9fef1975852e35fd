"""Attribute the ops that run to segments, by the parameters they read.

Forward pre-hooks (the runner's call counter) see a segment re-run in backward
only if the recompute goes through ``Module.__call__``. A wrapper that re-runs
the bound ``forward`` directly, such as the instance-patching idiom::

    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)

never does, so the hooks report a correct recompute as "ran 0 time(s) in
backward". What every recompute cannot avoid is to run the segment's ops
again, on the segment's own parameters. :class:`ParameterUses` watches that,
under a ``TorchDispatchMode`` (the way torchtitan's tests count ops): every op
dispatched whose tensor arguments include one of a counted module's
parameters counts as one use of that module, per phase.

Parameters arrive in ``__torch_dispatch__`` as the very ``nn.Parameter``
objects the module holds (checked on aten.t, aten.addmm, native_layer_norm,
and mul with a 1-element gate), so an ``id`` lookup is enough; comparing
storages would also count the views of a weight (``t(weight)`` into addmm) and
cost a call per tensor argument. Each hit is confirmed through a weak
reference to the parameter, so an ``id`` reused by an unrelated object after
the model died is never taken for a parameter, and nothing is kept alive.

In the backward phase only ops dispatched while grad mode is on count:
torch's checkpoints (reentrant and not) and hand-written recomputes re-run the
forward under ``enable_grad``, while the engine runs ordinary backward kernels
with grad mode off (unless ``create_graph``). The forward phase counts every
op, as a reentrant checkpoint runs the first forward under ``no_grad``.

Limits. The first three make backward counts smaller than a full re-run's;
``create_graph`` makes them larger:

- torch's non-reentrant checkpoint stops a recompute early, once it has
  rebuilt the last tensor backward needs: ops after that are not re-run (on
  the reference Block, 10 of its 11 parameter reads; reentrant re-runs 11).
- selective activation checkpoint serves the ops its policy saves from a cache
  during recompute (its mode, pushed above this one, never passes them on):
  with addmm/mm saved, 7 of 11.
- a compiled graph runs its ops out of Python's sight; a higher-order op
  (torch.cond, flex_attention) called eagerly under the mode raises, as
  torch's modes do by default.
- ``create_graph=True`` runs backward kernels under grad mode, so the weight
  reads of ordinary backward formulas count as backward uses, even with no
  recompute at all: backward uses prove nothing there.
- only what runs inside the ``with`` block is seen: keep the optimizer step
  (which reads every parameter, under ``no_grad``) out of it, or it counts as
  forward uses.
- the parameters are looked up when the block is entered; a wrapper that swaps
  parameter objects during forward (FSDP2's unsharded parameters) is missed.

:class:`ParameterUses` holds the counted modules (so their parameters live as
long as it does, as they would with the model); the mode holds no tensor of
any op, and between ``with`` blocks not even the parameters' weak references.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradequiv.harness.engine.memory import Rider, host_mode

#: A parameter's ``id`` -> (a weak reference to it, the counted modules that own it).
_Owners = dict[int, tuple["weakref.ref[nn.Parameter]", tuple[str, ...]]]


class ParameterUses(Rider):
    """Count, per counted module, the ops that read its parameters, per phase.

    ``uses[name]`` is ``[forward-phase ops, backward-phase grad-enabled ops]``;
    ``phase()`` says which (0 forward, 1 backward: the runner's ``_Phase.index``).
    A parameter shared by several counted modules counts for each; an op that
    reads several parameters of one module counts once for it. Entered inside an
    ``ActivationCounter`` it rides on that counter's mode (``memory.Rider``) rather than
    pushing its own.
    """

    def __init__(self, modules: Mapping[str, nn.Module], phase: Callable[[], int]) -> None:
        self._modules = dict(modules)
        self._phase = phase
        self.uses: dict[str, list[int]] = {name: [0, 0] for name in self._modules}
        self._owners: _Owners = {}
        self._mode: _UseMode | None = None
        self._host: Any = None  # the counter's mode it rides on, while entered
        self._rerun_hits: set[str] = set()  # modules read in backward with grad on, lately

    def reset(self) -> None:
        """Zero every count (between steps), keeping the names."""
        for counter in self.uses.values():
            counter[0] = counter[1] = 0
        self._rerun_hits = set()

    def __enter__(self) -> ParameterUses:
        if self._mode is not None or self._host is not None:
            raise RuntimeError("ParameterUses is already active; enter it once at a time")
        self._owners = _owners(self._modules)
        host = host_mode()
        if host is not None:
            self._host = host
            host.ride(self)
            return self
        self._mode = _UseMode(self)
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        mode, self._mode = self._mode, None
        host, self._host = self._host, None
        self._owners = {}
        if host is not None:
            host.alight(self)
        if mode is not None:
            mode.__exit__(kind, error, trace)  # type: ignore[no-untyped-call]

    def _count(self, hit: set[str], phase: int) -> None:
        """Count one op that read the parameters of the modules ``hit``."""
        uses = self.uses
        for name in hit:
            uses[name][phase] += 1
        if phase:
            self._rerun_hits |= hit

    def before(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
        # The hot path, once per op. An ordinary backward kernel (grad mode off in the
        # backward phase) is no recompute: nothing to look at.
        phase = self._phase()
        if phase and not torch.is_grad_enabled():
            return
        # Look each argument up by id, flat or one list/tuple deep (aten's Tensor[] and
        # Tensor?[]; deeper nesting does not occur, so no pytree).
        owners = self._owners
        hit: set[str] | None = None
        for arg in (*args, *kwargs.values()) if kwargs else args:
            if type(arg) is list or type(arg) is tuple:
                for item in arg:
                    entry = owners.get(id(item))
                    if entry is not None and entry[0]() is item:
                        hit = set(entry[1]) if hit is None else hit.union(entry[1])
            else:
                entry = owners.get(id(arg))
                if entry is not None and entry[0]() is arg:
                    hit = set(entry[1]) if hit is None else hit.union(entry[1])
        if hit is not None:
            self._count(hit, phase)

    def take_rerun_hits(self) -> set[str]:
        """The modules whose parameters backward's grad-enabled ops read since the last
        call (a re-run's segments, for ``memory.RecomputeCarry``), and start afresh."""
        hits, self._rerun_hits = self._rerun_hits, set()
        return hits


# torch leaves TorchDispatchMode untyped (__init_subclass__, __init__, __enter__,
# __exit__): hence the no-untyped-call ignores on subclassing and on those calls.
class _UseMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The dispatch mode behind :class:`ParameterUses`: look, then run the op unchanged."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # The default wraps __torch_dispatch__ in torch._dynamo.disable, about 1 to 3 us
        # more per op; this mode watches eager runs only (compiled kernels bypass aten).
        return False

    def __init__(self, uses: ParameterUses) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._uses = uses

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        self._uses.before(args, kwargs)
        if kwargs:
            return func(*args, **kwargs)
        return func(*args)


def _owners(modules: Mapping[str, nn.Module]) -> _Owners:
    """Each parameter the counted modules hold now (recursively), by ``id``."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, module in modules.items():
        for param in module.parameters():
            params[id(param)] = param
            names.setdefault(id(param), []).append(name)
    return {key: (weakref.ref(params[key]), tuple(dict.fromkeys(owners)))
            for key, owners in names.items()}

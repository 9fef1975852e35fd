"""What a segment's forward changes that its re-run reads: the model's side of a re-run
that differs, whatever the checkpoint.

A re-run can differ because the model is not safe to recompute: its forward changes what
the re-run reads. :class:`ModelWatch` watches each segment's own state at the start and end
of each forward and at the start of each re-run (its buffers and plain attributes, Python's
and NumPy's global generators and generators it holds), the arguments it is given (a tensor
changed in place, a list or dict emptied), and random ops that draw from a
``torch.Generator`` of the model's own, which no checkpoint restores. Beside them, named
generator states held outside the default generator (an RNG-state tracker's, as Megatron
keeps for dropout in tensor-parallel regions: :class:`NamedStates`), at each forward's start
and each re-run's. What it finds is said in lines (:meth:`ModelWatch.findings`), each
beginning ``model state:``, ``model input:``, ``model random:``, ``model generator:`` or
``named rng state:``, the words ``reports/diagnosis.py`` reads them by.
The localisation (``engine/localise.py``) drives it from its hooks and dispatch mode.
"""

from __future__ import annotations

import random
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves

from gradequiv.harness.engine.rng_story import draws_between

__all__ = ["ModelWatch", "NamedStates", "Phase", "first_tensor", "op_tensors", "same_values",
           "tensor_key"]


class Phase(Protocol):
    """Where the model's run stands: the localisation's tracker."""

    backward: bool  # re-runs (in backward), not the forward

    def module_path(self) -> str: ...


class ModelWatch:
    """What a segment's forward changes that its re-run reads (see the module docstring)."""

    def __init__(self, named: dict[str, nn.Module]) -> None:
        self.names = {id(m): name for name, m in named.items()}
        #: segment -> its state at the start of each forward run, at the end of each, and
        #: at the start of each re-run
        self.starts: dict[str, list[dict[str, tuple[str, Any]]]] = {}
        self.ends: dict[str, list[dict[str, tuple[str, Any]]]] = {}
        self.reruns: dict[str, list[dict[str, tuple[str, Any]]]] = {}
        self.running: list[str] = []  # the segments running now, innermost last
        self.watched: dict[int, str] = {}  # data_ptr -> a buffer's or an input's name
        self.writers: dict[str, list[str]] = {}  # that name -> the ops that wrote it
        self.read: set[int] = set()  # data_ptrs of buffers a re-run read
        self.rerun_wrote: set[str] = set()  # names of buffers a re-run wrote into
        self.generators: dict[str, str] = {}  # a line per op drawing from a user's generator
        self.inputs: dict[str, str] = {}  # a line per input a forward changed
        #: per forward run now running: how many leaves its arguments had, and the version
        #: of each tensor among them
        self.arguments: list[tuple[int, list[tuple[Tensor, int]]]] = []
        self.broken = False  # a step of the watch failed: it says nothing
        self.named = NamedStates()
        # the per-op steps, made soft once (not on every op)
        self._soft_before = self._soft(self._before)
        self._soft_after = self._soft(self._after)

    def _soft(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step``, made to turn the watch off where it fails (on a kind of state it does
        not know) instead of failing the model's forward, whose failure it is not."""
        def run(*args: Any) -> Any:
            if self.broken:
                return None
            try:
                return step(*args)
            except Exception:
                self.broken = True
                return None
        return run

    def hooks(self, tracker: Phase, module: nn.Module, segment: str) -> list[Any]:
        """Hooks that see the segment's state before its own pre-hooks and after its hooks."""
        prefix = self.names.get(id(module), segment)

        self.named.watch(module, prefix)

        def start(module: nn.Module, args: Any, kwargs: Any) -> None:
            state = {**_state(module, prefix, self.names), **self.named.snapshot()}
            (self.reruns if tracker.backward else self.starts).setdefault(segment, []).append(
                state)
            self.running.append(segment)
            if tracker.backward:
                return
            self.watched.update({value[0]: key for key, (kind, value) in state.items()
                                 if kind == "buffer"})
            leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
            self.watched.update({tensor_key(t): f"input {i} of {segment}"
                                 for i, t in enumerate(leaves)})
            self.arguments.append((tree_flatten((args, kwargs))[1].num_leaves,
                                   [(t, t._version) for t in leaves]))

        def end(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self.running:
                self.running.pop()
            if tracker.backward or not self.arguments:
                return
            self.ends.setdefault(segment, []).append(
                {**_state(module, prefix, self.names), **self.named.snapshot()})
            count, versions = self.arguments.pop()
            for i, (tensor, version) in enumerate(versions):
                if tensor._version != version:
                    label = f"input {i} of {segment}"
                    ops = ", ".join(self.writers.get(label, [])) or "in place"
                    self.inputs.setdefault(label, (
                        f"model input: {label} was changed by {segment}'s forward ({ops}), "
                        f"and its re-run read the changed input"))
            now = tree_flatten((args, kwargs))[1].num_leaves
            if now != count:
                self.inputs.setdefault(segment, (
                    f"model input: {segment}'s forward changed a list or dict it was given "
                    f"(its arguments held {count} values before it, {now} after), and its "
                    f"re-run was given what was left"))

        return [module.register_forward_pre_hook(self._soft(start), prepend=True,
                                                 with_kwargs=True),
                module.register_forward_hook(self._soft(end), with_kwargs=True,
                                             always_call=True)]

    def before(self, func: Any, args: Any, kwargs: dict[str, Any],
               tracker: Phase) -> list[tuple[str, Tensor, Tensor | None]]:
        given: list[tuple[str, Tensor, Tensor | None]] | None = self._soft_before(
            func, args, kwargs, tracker)
        return given or []

    def after(self, func: Any, given: list[tuple[str, Tensor, Tensor | None]]) -> None:
        self._soft_after(func, given)

    def _before(self, func: Any, args: Any, kwargs: dict[str, Any],
                tracker: Phase) -> list[tuple[str, Tensor, Tensor | None]]:
        """Before an op: note what a re-run reads and a user's generator drawn from; return
        each watched tensor the op is given, with a copy, to see in :meth:`after` whether
        it wrote it (batch norm's schema does not say that it updates its statistics)."""
        if not self.running:
            return []
        leaves = [t for t in op_tensors(args, kwargs) if tensor_key(t) in self.watched]
        if tracker.backward:
            self.read.update(tensor_key(t) for t in leaves)
            if leaves:
                self.rerun_wrote.update(self.watched[tensor_key(t)]
                                        for t in _written(func, args, kwargs)
                                        if tensor_key(t) in self.watched)
            return []
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and not _default(generator):
            self._drawn(func, generator, tracker)
        if not leaves:
            return []
        declared = {tensor_key(t) for t in _written(func, args, kwargs)}
        with _disable_current_modes():
            return [(self.watched[tensor_key(t)], t, None if tensor_key(t) in declared else
                     t.detach().clone()) for t in leaves]

    def _after(self, func: Any, given: list[tuple[str, Tensor, Tensor | None]]) -> None:
        """After an op: each watched tensor it wrote (its schema says so, or its values
        changed) has the op among its writers."""
        if not given:
            return
        name = str(func.overloadpacket.__name__)
        with _disable_current_modes():
            for label, tensor, copy in given:
                wrote = copy is None or not same_values(tensor, copy)
                if wrote and name not in self.writers.setdefault(label, []):
                    self.writers[label].append(name)

    def _drawn(self, func: Any, generator: torch.Generator, tracker: Phase) -> None:
        module = tracker.module_path() or self.running[-1]
        held = next((key for key, (kind, value) in self.starts[self.running[-1]][-1].items()
                     if kind == "generator" and _same_generator(value, generator)), "")
        named = f" ({held})" if held else ""
        name = str(func.overloadpacket.__name__)
        self.generators.setdefault(f"{module} {name}", (
            f"model generator: {module} draws {name} from a torch.Generator of the model's "
            f"own{named}, not torch's default one, which no checkpoint restores"))

    def findings(self) -> tuple[str, ...]:
        """A line for each thing a re-run started from other than its forward did."""
        found: tuple[str, ...] | None = self._soft(self._findings)()
        return found or ()

    def _findings(self) -> tuple[str, ...]:
        lines = [*self.generators.values(), *self.inputs.values()]
        unseen = []  # said last: what a re-run seen started from tells more
        named: dict[str, int] = {}  # a named state -> its line (the first segment's)
        also: dict[str, list[str]] = {}  # ... and the other segments whose re-runs did so
        for segment, starts in self.starts.items():  # model order
            reruns, ends = self.reruns.get(segment, []), self.ends.get(segment, [])
            if not reruns and ends:  # a re-run past the hooks (a patched forward), if any
                unseen += self._unseen(segment, starts[0], ends[-1])
            if not reruns:
                continue
            rerun = reruns[0]
            for key, (kind, value) in rerun.items():
                if kind == "default rng":  # said beside a named state, never alone
                    continue
                before = [s[key] for s in starts if key in s]
                changed = any(key in e and not _same(s[key], e[key])
                              for s, e in zip(starts, ends) if key in s)
                if kind == "buffer" and key in self.rerun_wrote and not changed:
                    lines.append(f"model state: {key} (a buffer) was recorded into by "
                                 f"the re-run of {segment} and not by {segment}'s forward")
                    continue
                if not before or any(_same(b, (kind, value)) for b in before):
                    continue
                if kind in _SAID_ONCE and key in named:  # one line per state
                    also[key].append(segment)
                    continue
                if kind == "named rng":
                    line = _named_finding(segment, key, [b[1] for b in before], value,
                                          changed, rerun, starts)
                else:
                    line = _finding(segment, key, kind, before[-1][1], value, changed,
                                    self.writers.get(key, []), self.read,
                                    key in self.rerun_wrote)
                if line and kind in _SAID_ONCE:
                    named[key], also[key] = len(lines), []
                if line:
                    lines.append(line)
        for key, segments in also.items():
            if segments:
                lines[named[key]] += f" (so did the re-runs of {', '.join(segments)})"
        said = list(dict.fromkeys(lines + unseen))
        if len(said) > _MODEL_LINES:  # the same change in every layer says no more
            said[_MODEL_LINES:] = [f"and {len(said) - _MODEL_LINES} more such changes"]
        return tuple(said)

    def _unseen(self, segment: str, start: dict[str, tuple[str, Any]],
                end: dict[str, tuple[str, Any]]) -> list[str]:
        """Lines for what ``segment``'s forward changed where no re-run of it was seen: a
        re-run starts from where the forward left things, or later."""
        lines = []
        for key, (kind, value) in end.items():
            if key not in start or kind in ("named rng", "default rng") \
                    or _same(start[key], (kind, value)):
                continue
            if kind == "global random":
                lines.append(f"model random: {segment}'s forward drew from {key} (its state "
                             f"moved), and a re-run draws from where the forward left it")
                continue
            if kind == "process":
                lines.append(f"model state: {key} (process-level state: {start[key][1]!r} "
                             f"before it, {value!r} after) was changed by {segment}'s "
                             f"forward, which a re-run starts from (the re-run itself was "
                             f"not seen)")
                continue
            if kind == "random":
                lines.append(f"model random: {key} (a generator of the model's) moved during "
                             f"{segment}'s forward, and a re-run draws from where the forward "
                             f"left it")
                continue
            ops = ", ".join(self.writers.get(key, []))
            detail = {"buffer": f"a buffer, written by {ops}" if ops else "a buffer",
                      "tensor": "a tensor attribute",
                      "attribute": f"an attribute: {start[key][1]!r} before it, {value!r} after"
                      }.get(kind, f"a {kind}: length {start[key][1]} before it, {value} after")
            lines.append(f"model state: {key} ({detail}) was changed by {segment}'s forward, "
                         f"which a re-run starts from (the re-run itself was not seen)")
        return lines


#: Kinds of state shared by segments, said once with the other segments named after it.
_SAID_ONCE = ("named rng", "process")

#: The most lines on the model's side a localisation says.
_MODEL_LINES = 4

#: The attributes every module has: its machinery, not the model's state.
_MODULE_KEYS = frozenset(vars(nn.Module()))


def _state(module: nn.Module, prefix: str, names: dict[int, str]) -> dict[str, tuple[str, Any]]:
    """What a segment carries from one call to the next, name -> (kind, value): each buffer
    and plain attribute of its modules, generators it holds, and the host's global ones."""
    state: dict[str, tuple[str, Any]] = {}
    # the copies are the search's, no op of the model's: no mode may see them
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        for path, sub in module.named_modules(prefix=prefix):
            path = names.get(id(sub), path)
            for key, buffer in sub._buffers.items():
                if buffer is not None:
                    state[f"{path}.{key}"] = ("buffer", (tensor_key(buffer),
                                                         buffer.detach().clone()))
            for key, value in vars(sub).items():
                kept = None if key in _MODULE_KEYS else _kept(value)
                if kept is not None:
                    state[f"{path}.{key}"] = kept
    state["Python's random"] = ("global random", random.getstate())
    numpy = sys.modules.get("numpy")  # only a model that imported NumPy draws from it
    if numpy is not None:
        state["NumPy's random"] = ("global random", _plain(numpy.random.get_state()))
    return state


def _kept(value: Any) -> tuple[str, Any] | None:
    """(kind, what to compare) of an attribute worth watching; None for the rest."""
    if isinstance(value, bool | int | float | str):
        return "attribute", value
    if isinstance(value, list | tuple | dict | set):
        return type(value).__name__, len(value)
    if isinstance(value, Tensor):
        return "tensor", (0, value.detach().clone())
    if isinstance(value, torch.Generator):
        return "generator", value  # its draws are seen by op (an identity, not a state)
    if isinstance(value, random.Random) and not isinstance(value, random.SystemRandom):
        return "random", value.getstate()  # the system's has no state to take
    if type(value).__module__.startswith("numpy.random"):
        state = getattr(getattr(value, "bit_generator", None), "state", None)
        if state is None and hasattr(value, "get_state"):
            state = value.get_state()
        return ("random", _plain(state)) if state is not None else None
    return None


def _plain(value: Any) -> Any:
    """A generator's state, comparable with ``==`` (arrays as bytes)."""
    if isinstance(value, dict):
        return tuple((k, _plain(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return tuple(_plain(v) for v in value)
    return value.tobytes() if hasattr(value, "tobytes") else value


def _same(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] in ("buffer", "tensor"):
        return same_values(a[1][1], b[1][1])
    if a[0] in ("named rng", "default rng"):
        return bool(torch.equal(a[1], b[1]))
    if a[0] == "generator":
        return True
    return bool(a[1] == b[1])


#: What :class:`NamedStates` snapshots torch's default generators as.
_DEFAULT = "torch's default generator"


def _named_finding(segment: str, key: str, before: list[Tensor], after: Tensor,
                   changed: bool, rerun: dict[str, tuple[str, Any]],
                   starts: list[dict[str, tuple[str, Any]]]) -> str:
    """The line for a named generator state (``key``) the segment's forward moved and its
    re-run started from other than the forward did: how far past the forward's it was, and
    whether the default generator was put back for the re-run (a checkpoint that restores
    that one only, as torch's does)."""
    if not changed:
        return ""
    ahead = [n for n in (draws_between(b, after) for b in before if _cpu_state(b))
             if n is not None]
    how = f"advanced {min(ahead)} draws past the forward's" if ahead else \
        "other than the forward's"
    default = rerun.get(_DEFAULT)
    put_back = default is not None and any(
        _DEFAULT in s and _same(s[_DEFAULT], default) for s in starts)
    default_said = ("while torch's default generator was put back as the forward found it"
                    if put_back else "and torch's default generator was not put back either")
    return (f"named rng state: the re-run of {segment} started from {key} {how} (the "
            f"forward moved it, and nothing set it back), {default_said}")


def _cpu_state(state: Tensor) -> bool:
    return state.numel() == _GENERATOR_STATE_BYTES


#: The size of a CPU generator's state, in bytes; a CUDA generator's (seed and offset) is 16.
_GENERATOR_STATE_BYTES = torch.default_generator.get_state().numel()
_STATE_SIZES = (_GENERATOR_STATE_BYTES, 16)
#: The most entries of a dict looked into for generator states.
_DICT_ENTRIES = 64
#: Modules whose state is torch's or the harness's: never a user's named generators.
_NOT_USERS = ("torch", "gradequiv", "numpy", "typing", "builtins")


@dataclass(frozen=True)
class _Holder:
    """Where a generator state lives: ``root``'s attributes ``path`` (a dict of states by
    name where ``keyed``), said as ``label``."""

    label: str
    root: Any
    path: tuple[str, ...]
    keyed: bool

    def states(self) -> Iterator[tuple[str, Any]]:
        value = self.root
        for name in self.path:
            value = getattr(value, name, None)
        if not self.keyed:
            if _rng_leaf(value):
                yield self.label, value
            return
        if type(value) is dict:
            for name, state in list(value.items())[:_DICT_ENTRIES]:
                if _rng_leaf(state):
                    yield f"{self.label}[{name!r}]", state


class NamedStates:
    """Generator states a segment's code keeps outside torch's default generator, by
    qualified name (``module.object.attribute['key']``): torch.Generator objects and CPU or
    CUDA generator states (byte tensors) held in the segment's module attributes, in the
    module-level objects of the Python modules its classes are written in (and of the
    modules those import functions or classes from: Megatron's model code imports
    ``get_cuda_rng_tracker``), and in the attributes and dicts of such objects, two levels
    deep. Found once, at the first snapshot; read again at each (a tracker's
    ``set_states`` puts in another dict).

    Beside them, the process-level state the same code reads: plain values (a flag, a
    count, a name) held by those Python modules at module level, by the classes written in
    them (class attributes: TransformerEngine keeps its fp8 region's state so) and by the
    plain objects they hold. A region a caller enters around the forward and no checkpoint
    enters around the re-run shows there."""

    def __init__(self) -> None:
        self.roots: list[tuple[str, Any]] = []
        self.holders: list[_Holder] | None = None
        self.flags: list[tuple[str, Any, str]] = []  # (qualified name, owner, attribute)

    def watch(self, module: nn.Module, prefix: str) -> None:
        """Look for states where ``module`` (a segment) and its code keep them."""
        for path, sub in module.named_modules(prefix=prefix):
            self.roots.append((path, sub))
            for cls in type(sub).__mro__:
                code = sys.modules.get(cls.__module__)
                if code is not None and _users(code.__name__):
                    self.roots.append((code.__name__, code))
        self.holders = None

    def snapshot(self) -> dict[str, tuple[str, Any]]:
        """Each named state now (a copy), and the default generator's beside them; nothing
        where no named state was found."""
        if self.holders is None:
            try:
                self.holders = _holders(self.roots)
            except Exception:  # an object that will not be read: no named states, the rest
                self.holders = []  # of the watch goes on
            try:
                self.flags = _flags(_code_modules(self.roots))
            except Exception:
                self.flags = []
        flags = {label: ("process", getattr(owner, name, None))
                 for label, owner, name in self.flags}
        if not self.holders:
            return flags
        found: dict[str, tuple[str, Any]] = dict(flags)
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            for holder in self.holders:
                for label, state in holder.states():
                    found[label] = ("named rng", state.get_state()
                                    if isinstance(state, torch.Generator)
                                    else state.detach().clone())
            if len(found) > len(flags):  # the CPU's and, where in use, each CUDA device's
                initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
                cuda = torch.cuda.default_generators if initialized else ()
                found[_DEFAULT] = ("default rng", torch.cat(
                    [torch.default_generator.get_state(), *(g.get_state() for g in cuda)]))
        return found


def _users(name: str) -> bool:
    """Whether the Python module ``name`` is a user's: not torch's, the harness's, nor the
    standard library's."""
    top = name.partition(".")[0]
    return top not in _NOT_USERS and top not in sys.stdlib_module_names


def _holders(roots: list[tuple[str, Any]]) -> list[_Holder]:
    """Where generator states live, looked for from each root (a segment's module, a Python
    module its code is written in, and one step on: the modules that one imports from)."""
    seen: set[int] = set()
    modules = _code_modules(roots)
    holders: list[_Holder] = []
    for label, root in [*roots, *((m.__name__, m) for m in modules)]:
        if id(root) in seen:
            continue
        seen.add(id(root))
        for name, value in _members(root):
            # a module's own generators and tensors are watched as its state (``_state``)
            if not isinstance(root, nn.Module) or type(value) is dict:
                holders += _held(f"{label}.{name}", root, (name,), value)
            if _plain_object(value):
                for attr, inner in list(vars(value).items())[:_DICT_ENTRIES]:
                    holders += _held(f"{label}.{name}.{attr}", root, (name, attr), inner)
    return holders


def _code_modules(roots: list[tuple[str, Any]]) -> list[types.ModuleType]:
    """The Python modules among ``roots``, and the user modules they import functions or
    classes from."""
    modules = list({id(root): root for _, root in roots
                    if isinstance(root, types.ModuleType)}.values())
    for code in list(modules):
        for value in list(vars(code).values()):
            origin = getattr(value, "__module__", None) \
                if isinstance(value, type | types.FunctionType) else None
            if isinstance(origin, str) and origin != code.__name__ and _users(origin) \
                    and origin in sys.modules and sys.modules[origin] not in modules:
                modules.append(sys.modules[origin])
    return modules


def _flags(modules: list[types.ModuleType]) -> list[tuple[str, Any, str]]:
    """The process-level plain values of ``modules``: (qualified name, owner, attribute)
    for each module-level one, each class attribute of a class written there and each
    attribute of a plain object held there."""
    flags: list[tuple[str, Any, str]] = []
    for code in modules:
        for name, value in _members(code):
            if _flag_value(value):
                flags.append((f"{code.__name__}.{name}", code, name))
            elif isinstance(value, type) and value.__module__ == code.__name__:
                flags += [(f"{code.__name__}.{value.__qualname__}.{attr}", value, attr)
                          for attr, inner in list(vars(value).items())[:_DICT_ENTRIES]
                          if not attr.startswith("__") and _flag_value(inner)]
            elif _plain_object(value):
                flags += [(f"{code.__name__}.{name}.{attr}", value, attr)
                          for attr, inner in list(vars(value).items())[:_DICT_ENTRIES]
                          if _flag_value(inner)]
    return flags


def _flag_value(value: Any) -> bool:
    """A plain value a flag or a count is kept as."""
    return value is None or isinstance(value, bool | int | float | str)


def _members(root: Any) -> list[tuple[str, Any]]:
    """A Python module's globals or a module's own attributes (not its machinery)."""
    if isinstance(root, nn.Module):
        return [(k, v) for k, v in vars(root).items() if k not in _MODULE_KEYS]
    return [(k, v) for k, v in vars(root).items() if not k.startswith("__")]


def _held(label: str, root: Any, path: tuple[str, ...], value: Any) -> list[_Holder]:
    if _rng_leaf(value):
        return [_Holder(label, root, path, False)]
    if type(value) is dict and any(  # a plain one: a mapping of its own may run code
            _rng_leaf(v) for v in list(value.values())[:_DICT_ENTRIES]):
        return [_Holder(label, root, path, True)]
    return []


def _plain_object(value: Any) -> bool:
    """An object of the user's whose attributes may hold states (a tracker): no module,
    class, function, tensor or container."""
    return _users(type(value).__module__) and not isinstance(value, (
        type, types.ModuleType, types.FunctionType, types.MethodType, nn.Module, Tensor,
        torch.Generator)) and hasattr(value, "__dict__")


def _rng_leaf(value: Any) -> bool:
    """A generator of the user's or a generator's state (a byte tensor of a CPU or CUDA
    generator state's size)."""
    if isinstance(value, torch.Generator):
        return not _default(value)
    return isinstance(value, Tensor) and value.dtype == torch.uint8 and value.dim() == 1 \
        and value.numel() in _STATE_SIZES


def _finding(segment: str, key: str, kind: str, before: Any, after: Any, changed: bool,
             writers: list[str], read: set[int], rerun_wrote: bool = False) -> str:
    """The line for state ``key`` that a re-run of ``segment`` started from changed."""
    by = f"by {segment}'s forward" if changed else f"after {segment}'s forward"
    if kind == "process":
        if changed:
            return (f"model state: {key} (process-level state: {before!r} at the forward, "
                    f"{after!r} at the re-run) was advanced by {segment}'s forward, and its "
                    f"re-run ran under the advanced value")
        return (f"model state: {key} (process-level state: {before!r} during {segment}'s "
                f"forward, {after!r} at its re-run) was set around the forward and not "
                f"around its re-run")
    if kind == "global random":
        if not changed:  # the segment does not draw from it
            return ""
        return (f"model random: {segment}'s forward drew from {key} (its state moved), and "
                f"its re-run drew from where the forward left it")
    if kind == "random":
        if not changed:
            return ""
        return (f"model random: {key} (a generator of the model's) moved during {segment}'s "
                f"forward, and its re-run drew from where the forward left it")
    if kind == "buffer":
        if before[0] not in read and after[0] not in read:  # a re-run that skips it (a guard)
            return ""
        ops = f", written by {', '.join(writers)}" if writers else ""
        if changed and rerun_wrote:
            return (f"model state: {key} (a buffer{ops}) was recorded into by {segment}'s "
                    f"forward and again by its re-run")
        return (f"model state: {key} (a buffer{ops}) was changed {by}, and its re-run read "
                f"the changed value")
    if kind == "tensor":
        return (f"model state: {key} (a tensor attribute) was changed {by}, and its re-run "
                f"started from the changed value")
    if kind == "attribute":
        return (f"model state: {key} (an attribute: {before!r} at the forward, {after!r} at "
                f"the re-run) was changed {by}")
    return (f"model state: {key} (a {kind}: length {before} at the forward, {after} at the "
            f"re-run) was changed {by}")


def same_values(a: Tensor, b: Tensor) -> bool:
    """Bitwise equal, NaN where NaN was (an op that writes nothing leaves a NaN a NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a.isnan(), b.isnan())
                    and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))
    return bool(torch.equal(a, b))


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors an op's schema says it writes into (``add_``'s self)."""
    schema = getattr(func, "_schema", None)
    written = []
    for i, argument in enumerate(schema.arguments if schema is not None else []):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            if isinstance(value, Tensor):
                written.append(value)
    return written


def _default(generator: torch.Generator) -> bool:
    """Whether ``generator`` is one of torch's default ones, which checkpoints restore."""
    defaults = [torch.default_generator]
    if generator.device.type == "cuda" and torch.cuda.is_available():
        defaults += list(torch.cuda.default_generators)
    return any(_same_generator(generator, d) for d in defaults)


def _same_generator(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether two generator objects are one generator. A generator handed to an op is a new
    Python object each time, so where device and state agree, ``a`` is reseeded for a moment
    (and put back) to see whether ``b`` moves with it."""
    if a is b:
        return True
    state = a.get_state()
    if a.device != b.device or not torch.equal(state, b.get_state()):
        return False
    a.manual_seed((a.initial_seed() + 1) % 2**63)
    moved = not torch.equal(b.get_state(), state)
    a.set_state(state)
    return moved


def op_tensors(args: Any, kwargs: dict[str, Any] | None = None) -> list[Tensor]:
    """The tensors an aten op is given (``args`` and ``kwargs``) or returns (``args``
    alone): flat, or one list or tuple deep (``Tensor[]``, ``Tensor?[]``, a tuple of
    returns); aten nests no deeper. In order, as a pytree walk gives them, at a fraction of
    its cost, paid on every op of a watched run."""
    items = args if isinstance(args, (tuple, list)) else (args,)
    if kwargs:
        items = (*items, *kwargs.values())
    found: list[Tensor] = []
    for item in items:
        if isinstance(item, Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            found.extend(t for t in item if isinstance(t, Tensor))
    return found


def first_tensor(out: Any) -> Tensor | None:
    """An op's first tensor return (``op_tensors``'s order); None if it returns none."""
    if isinstance(out, Tensor):
        return out
    found = op_tensors(out) if isinstance(out, (tuple, list)) else []
    return found[0] if found else None


def tensor_key(tensor: Tensor) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage (a subclass, a sparse tensor)
        return -id(tensor)

"""The training regime a user states: what their training runs, so that the check draws
within it and the report says what it left out.

A checkpoint can be right for the regime a user trains in and wrong elsewhere (a loss
backpropagated in parts, the backward inside autocast, fp16): undeclared, everything is
drawn; stated, only the stated values are, and the verdict holds for that regime only.

Stated in the nearest ``pyproject.toml`` upward from the working directory that has a
``[tool.gradequiv]`` table (found as pytest, ruff and mypy find theirs), on the command line
(``--regime KEY=VALUE``, each replacing that key) or in the Python API (``regime={...}``).
Pure Python: the option parser and the plugin read it before torch is imported.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gradequiv.harness.errors import InvalidArgument
from gradequiv.models.kinds import DTYPES, GRAD_MODES, SCHEDULES
from gradequiv.models.kinds import PIPELINE_SCHEDULE_NAMES as PIPELINE_SCHEDULES

__all__ = ["BACKWARDS", "EVERYTHING", "KEYS", "MAX_LOSS_PARTS", "Regime", "describe",
           "find_pyproject", "stated_regime"]

#: Where the backward runs: after the autocast block (as torch's AMP recipe writes it), or
#: inside it.
BACKWARDS = ("outside-autocast", "inside-autocast")
#: The most parts a drawn loss is split in (``Case.backward_passes``).
MAX_LOSS_PARTS = 3
#: Grad modes whose step is one forward and one backward, the only ones a micro-batch
#: schedule drives (``training_loops``).
_SCHEDULED_MODES = ("backward", "autograd-grad")

#: key -> (its field, what it takes), as written in ``[tool.gradequiv]`` and ``--regime``
KEYS: dict[str, tuple[str, str]] = {
    "dtypes": ("dtypes", f"a list of {', '.join(DTYPES)}"),
    "backward": ("backward", f"{' or '.join(BACKWARDS)}, or a list of both"),
    "grad-modes": ("grad_modes", f"a list of {', '.join(GRAD_MODES)}"),
    "loss-parts": ("loss_parts", f"the most parts a loss is backpropagated in, 1 to "
                                 f"{MAX_LOSS_PARTS} (1: one backward per step)"),
    "schedules": ("schedules", f"a list of {', '.join(SCHEDULES)} (micro-batches in one "
                               f"process; one: the whole batch per step)"),
    "pipeline-schedules": ("pipeline_schedules",
                           f"a list of {', '.join(PIPELINE_SCHEDULES)} (gradequiv "
                           f"distributed --wrapper pp)"),
    "micro-batches": ("micro_batches", "the micro-batches per step of a pipeline schedule"),
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "dtypes": DTYPES, "backward": BACKWARDS, "grad-modes": GRAD_MODES, "schedules": SCHEDULES,
    "pipeline-schedules": tuple(PIPELINE_SCHEDULES)}


@dataclass(frozen=True)
class Regime:
    """What the user's training runs; every field at its default is "everything drawn".

    Frozen and hashable: the strategies that draw within it are built once per regime.
    """

    dtypes: tuple[str, ...] = DTYPES
    backward: tuple[str, ...] = BACKWARDS
    grad_modes: tuple[str, ...] = GRAD_MODES
    loss_parts: int = MAX_LOSS_PARTS
    schedules: tuple[str, ...] = SCHEDULES
    pipeline_schedules: tuple[str, ...] = tuple(PIPELINE_SCHEDULES)
    micro_batches: int | None = None
    #: where it was stated ("" where nothing was: everything is drawn)
    source: str = ""

    @property
    def stated(self) -> bool:
        return bool(self.source)

    def backward_autocast(self) -> tuple[bool, ...]:
        """The ``Case.backward_autocast`` values within the regime, the plain one first."""
        return tuple(b for b, name in ((False, BACKWARDS[0]), (True, BACKWARDS[1]))
                     if name in self.backward)

    def outside(self, case: Any) -> str:
        """What of ``case`` lies outside the regime ("" where nothing does)."""
        why = []
        if case.dtype not in self.dtypes:
            why.append(f"its precision {case.dtype} is not among dtypes")
        if case.backward_autocast and BACKWARDS[1] not in self.backward:
            why.append("its backward runs inside autocast")
        if (not case.backward_autocast and case.dtype.endswith("-autocast")
                and BACKWARDS[0] not in self.backward):
            why.append("its backward runs outside autocast")
        if case.grad_mode not in self.grad_modes:
            why.append(f"it asks for gradients by {case.grad_mode}")
        if case.backward_passes > self.loss_parts:
            why.append(f"its loss is backpropagated in {case.backward_passes} parts")
        if case.schedule not in self.schedules and (case.schedule != "one"
                                                    or case.grad_mode in _SCHEDULED_MODES):
            why.append(f"its micro-batch schedule is {case.schedule}")
        return "; ".join(why)

    def modes_within(self, modes: tuple[str, ...]) -> tuple[str, ...]:
        """The grad modes of ``modes`` (an implementation's) that the regime runs; raises
        :class:`InvalidArgument` where none is left to draw."""
        kept = tuple(m for m in modes if m in self.grad_modes)
        if not kept:
            raise InvalidArgument(
                f"the training regime ({self.source}) states grad-modes "
                f"{', '.join(self.grad_modes)}, and the implementation does "
                f"{', '.join(modes)}: none in common, so nothing could be drawn")
        return kept

    def dtypes_within(self, declared: Any, model: str) -> tuple[str, ...]:
        """The precisions a user's model declares (``UserModel.regimes``; None: every one)
        that the regime runs; raises :class:`InvalidArgument` where none is left."""
        kept = tuple(d for d in self.dtypes if declared is None or d in declared)
        if not kept:
            raise InvalidArgument(
                f"{model} declares regimes={tuple(declared)!r} and the training regime "
                f"({self.source}) states dtypes {', '.join(self.dtypes)}: none in common, so "
                f"nothing could be drawn; state a precision the model runs")
        return kept

    def left_out(self) -> list[str]:
        """What the check does not draw under this regime, one phrase per key."""
        out = []
        if missing := [d for d in DTYPES if d not in self.dtypes]:
            out.append(f"precisions {', '.join(missing)}")
        out += [f"the backward {b.replace('-', ' ')}" for b in BACKWARDS if b not in self.backward]
        if missing := [m for m in GRAD_MODES if m not in self.grad_modes]:
            out.append(f"gradients by {', '.join(missing)}")
        if self.loss_parts < MAX_LOSS_PARTS:
            parts = range(self.loss_parts + 1, MAX_LOSS_PARTS + 1)
            out.append(f"losses backpropagated in {' or '.join(map(str, parts))} parts")
        if missing := [s for s in SCHEDULES if s not in self.schedules]:
            out.append(f"micro-batch schedules {', '.join(missing)}")
        if missing := [s for s in PIPELINE_SCHEDULES if s not in self.pipeline_schedules]:
            out.append(f"pipeline schedules {', '.join(missing)}")
        return out

    def describe(self) -> str:
        """One line: where the regime was stated and what it keeps out."""
        return describe(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """The stated keys, as written in ``[tool.gradequiv]`` (only those that differ from
        drawing everything), and the source."""
        data: dict[str, Any] = {}
        default = EVERYTHING
        for key, (name, _) in KEYS.items():
            value = getattr(self, name)
            if value != getattr(default, name):
                data[key] = list(value) if isinstance(value, tuple) else value
        return {"source": self.source, "stated": data, "left_out": self.left_out()}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> Regime:
        """A regime from its fields as ``dataclasses.asdict`` wrote them (options as JSON)."""
        values: dict[str, Any] = {f.name: tuple(data[f.name]) if isinstance(data[f.name], list)
                                  else data[f.name] for f in fields(cls) if f.name in data}
        return cls(**values)

    def entries(self) -> list[str]:
        """The stated keys as ``--regime`` arguments (``KEY=V1,V2``)."""
        stated = self.to_dict()["stated"]
        return [f"{key}={','.join(map(str, v)) if isinstance(v, list) else v}"
                for key, v in stated.items()]


def describe(stated: Mapping[str, Any]) -> str:
    """The sentence every view says of a stated regime (``Regime.to_dict``, or report.json's
    ``regime``): where it was stated, what it left out, what the verdict holds for."""
    left = "; ".join(stated["left_out"]) or "nothing"
    return (f"training regime stated in {stated['source']}: not drawn: {left}; the verdict "
            f"holds for this regime only")


#: No regime stated: every value of every key drawn.
EVERYTHING = Regime()


def find_pyproject(start: Path) -> Path | None:
    """The nearest ``pyproject.toml`` at or above ``start`` that has ``[tool.gradequiv]``."""
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file() and "gradequiv" in _read_toml(candidate).get("tool", {}):
            return candidate
    return None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: cannot be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{path}: is not valid TOML ({exc}); fix the file") from None


def _entries(given: Iterable[str], flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` items (values comma-separated) as a mapping."""
    out: dict[str, Any] = {}
    for item in given:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise InvalidArgument(
                f"{flag} {item!r}: write KEY=VALUE, e.g. {flag} dtypes=bf16-autocast; keys: "
                f"{', '.join(KEYS)}")
        values = [v.strip() for v in value.split(",") if v.strip()]
        out[key.strip()] = values if len(values) != 1 else values[0]
    return out


def _names(key: str, value: Any, where: str) -> tuple[str, ...]:
    choices = _CHOICES[key]
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or \
            not all(isinstance(v, str) for v in items):
        raise InvalidArgument(f"{where}: {key} = {value!r}: write {KEYS[key][1]}")
    unknown = [v for v in items if v not in choices]
    if unknown:
        raise InvalidArgument(f"{where}: {key} = {value!r}: {', '.join(map(repr, unknown))} "
                              f"is not one of {', '.join(choices)}")
    return tuple(c for c in choices if c in items)


def _count(key: str, value: Any, where: str, high: int | None) -> int:
    try:
        number = int(value) if not isinstance(value, bool) and str(value).strip().isdigit() \
            else None
    except ValueError:
        number = None
    if number is None or number < 1 or (high is not None and number > high):
        raise InvalidArgument(f"{where}: {key} = {value!r}: write {KEYS[key][1]}")
    return number


def _regime(table: Mapping[str, Any], where: str, base: Regime, source: str) -> Regime:
    """``base`` with the keys of ``table`` replaced, each checked against its rule."""
    changes: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = str(raw_key).replace("_", "-")
        if key not in KEYS:
            raise InvalidArgument(f"{where}: {raw_key!r} is not a key of the training regime; "
                                  f"keys: {', '.join(KEYS)}")
        name = KEYS[key][0]
        if key in _CHOICES:
            changes[name] = _names(key, value, where)
        else:
            changes[name] = _count(key, value, where, MAX_LOSS_PARTS if key == "loss-parts"
                                   else None)
    if not changes:
        return base
    sources = [s for s in (base.source, source) if s]
    return Regime(**{**{f.name: getattr(base, f.name) for f in fields(Regime)}, **changes,
                     "source": " and ".join(dict.fromkeys(sources))})


def stated_regime(given: Any = None, *, start: Path | None = None, flag: str = "--regime",
                  read_pyproject: bool = True) -> Regime:
    """The regime of a run: ``[tool.gradequiv]`` of the nearest pyproject.toml (from
    ``start``, default the working directory), then ``given`` on top of it key by key.

    ``given``: None, a :class:`Regime` (taken whole), a mapping (the Python API, or a report's
    ``stated``), or ``KEY=VALUE`` strings (the command line). Raises :class:`InvalidArgument`.
    """
    if isinstance(given, Regime):
        return given
    if isinstance(given, Mapping) and "source" in given:  # the options' JSON: already resolved
        return Regime.from_fields(given)
    regime = Regime()
    if read_pyproject:
        path = find_pyproject(start or Path.cwd())
        if path is not None:
            table = _read_toml(path)["tool"]["gradequiv"]
            where = f"{path} [tool.gradequiv]"
            if not isinstance(table, dict):
                raise InvalidArgument(f"{where}: must be a table of keys: {', '.join(KEYS)}")
            regime = _regime(table, where, regime, where)
    if given is None or given == [] or given == ():
        return regime
    if isinstance(given, Mapping):
        return _regime(given, "regime=", regime, "regime= (Python)")
    if isinstance(given, str):
        given = [given]
    return _regime(_entries(given, flag), flag, regime, flag)

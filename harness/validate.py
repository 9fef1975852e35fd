"""The validators of caller input: each takes the option's name and its raw value, returns
the typed value or raises :class:`InvalidArgument` (name=value, the rule, a fix).

Pure Python (no torch): the command line, the pytest plugin and the side commands
all validate through these, so a rule and its message exist once.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from gradequiv.harness.errors import InvalidArgument

__all__ = [
    "as_argparse_type",
    "bound",
    "boolean",
    "byte_count",
    "choice",
    "impl_kwargs",
    "seed",
    "shard",
    "threads",
    "threads_given",
    "whole_number",
]

T = TypeVar("T")

#: The largest seed: torch's generators take 64 bits, Hypothesis any int; keep one rule.
MAX_SEED = 2**32 - 1


def whole_number(name: str, value: Any, *, low: int = 1, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{name}={value!r} is not a whole number")
    try:
        number = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise InvalidArgument(f"{name}={value!r} is not a whole number; write e.g. "
                              f"{name} {max(low, 1)}") from None
    if number < low:
        raise InvalidArgument(f"{name}={number}: must be at least {low}")
    if high is not None and number > high:
        raise InvalidArgument(f"{name}={number}: must be at most {high}")
    return number


def seed(name: str, value: Any) -> int:
    """A seed: a whole number from 0 to :data:`MAX_SEED`."""
    return whole_number(name, value, low=0, high=MAX_SEED)


def bound(name: str, value: Any) -> float:
    """``value`` as a finite float >= 0 (tolerances, probabilities, seconds)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{name}={value!r} is not a number; write e.g. {name} 1e-5") \
            from None
    if not (number >= 0 and math.isfinite(number)):
        raise InvalidArgument(f"{name}={number}: must be a finite number >= 0")
    return number


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_count(name: str, value: Any) -> int:
    """A positive number of bytes: ``1500000``, ``512MiB``, ``1.5GB`` (powers of 1024 for
    KiB/MiB/GiB/TiB, of 1000 for kB/MB/GB/TB)."""
    text = str(value).strip().replace("_", "")
    digits = text.rstrip("".join({*"kmgtibKMGTIB"}))
    unit = text[len(digits):].strip().lower()
    try:
        number = float(digits) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise InvalidArgument(f"{name}={value!r} is not a byte count (a number, optionally "
                              f"with kB, MB, GB, KiB, MiB or GiB); write e.g. {name} 512MiB") \
            from None
    if not (math.isfinite(number) and number >= 1):
        raise InvalidArgument(f"{name}={value!r}: must be at least 1 byte; write e.g. "
                              f"{name} 512MiB")
    return int(number)


def shard(name: str, value: Any) -> tuple[int, int]:
    """``"I/N"`` as ``(I, N)`` with ``1 <= I <= N``."""
    index, sep, count = str(value).partition("/")
    try:
        parsed = (int(index), int(count))
    except ValueError:
        parsed = (0, 0)
    if not sep or not 1 <= parsed[0] <= parsed[1]:
        raise InvalidArgument(f"{name}={value!r} is not I/N with 1 <= I <= N; "
                              f"write e.g. {name} 2/4")
    return parsed


#: The most intra-op threads a run may ask for: more is a typo, not a machine.
MAX_THREADS = 1024


def threads(name: str, value: Any) -> int | None:
    """torch's intra-op thread count: a whole number from 1 to :data:`MAX_THREADS`, or
    ``auto`` (None: torch's own default, which follows OMP_NUM_THREADS)."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    example = f"{name}=1" if name.isupper() else f"{name} 1"  # an environment variable's
    if isinstance(value, bool) or not str(value).strip().isdigit():
        raise InvalidArgument(f"{name}={value!r} is not a thread count: a whole number from 1 "
                              f"to {MAX_THREADS}, or auto for torch's default; write e.g. "
                              f"{example}")
    count = int(str(value).strip())
    if not 1 <= count <= MAX_THREADS:
        raise InvalidArgument(f"{name}={count}: must be from 1 to {MAX_THREADS}, or auto for "
                              f"torch's default; write e.g. {example}")
    return count


def threads_given(given: str | None) -> Any:
    """--threads, else GRADEQUIV_THREADS (a CI job's setting), else 1: the value for
    :func:`threads`, for every command that runs torch."""
    if given is not None:
        return given
    return threads("GRADEQUIV_THREADS", os.environ.get("GRADEQUIV_THREADS", "1"))


def choice(name: str, value: Any, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices``."""
    allowed = tuple(choices)
    if value not in allowed:
        raise InvalidArgument(f"{name}={value!r} is not one of {', '.join(allowed)}")
    return str(value)


_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def boolean(name: str, value: Any) -> bool:
    """True/false, strictly: ``maybe`` is a mistake, not False."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word not in _WORDS:
        raise InvalidArgument(f"{name}={value!r} is not true or false; write {name} true "
                              f"or {name} false")
    return _WORDS[word]


def impl_kwargs(items: Iterable[str], *, name: str = "--impl-kwarg") -> dict[str, Any]:
    """Parse repeated ``KEY=VALUE``; values read as Python literals, true/false/none too."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, raw = str(item).partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise InvalidArgument(
                f"{name}={item!r} is not KEY=VALUE with KEY a Python identifier; "
                f"write e.g. {name} preserve_rng_state=false"
            )
        parsed[key] = _literal(raw.strip())
    return parsed


def _literal(raw: str) -> Any:
    words = {"true": True, "false": False, "none": None, "null": None}
    if raw.lower() in words:
        return words[raw.lower()]
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def as_argparse_type(check: Callable[[str, Any], T], name: str) -> Callable[[str], T]:
    """A validator as an argparse ``type=``: argparse shows an ArgumentTypeError's message,
    but replaces a ValueError's (InvalidArgument is one) with a bare 'invalid value'."""

    def convert(text: str) -> T:
        try:
            return check(name, text)
        except InvalidArgument as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = check.__name__
    return convert

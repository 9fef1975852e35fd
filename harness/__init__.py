"""The engine: run full storage and recompute on one fixed batch and compare.

``check(impl, model=...)`` is ``gradequiv check`` for a user's own test suite (in
a child process by default) and returns a :class:`Report`; ``assert_equivalent``
fails a test with its diagnosis.
``verify(impl, case)`` returns a :class:`Verdict` with every metric; no
Hypothesis in here (the property layer only chooses cases).

The names below load on first use: ``gradequiv.models`` imports
``gradequiv.harness.errors``, and the pytest plugin imports
``gradequiv.harness.options`` in every pytest run, so importing this package
must not import torch or the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradequiv.harness.api import Failure, Report, assert_equivalent, check
    from gradequiv.harness.engine.case import DTYPES, Case
    from gradequiv.harness.engine.compare import PairMetrics, Tolerance, measure_pairs
    from gradequiv.harness.engine.spread import default_cases, extra_cases, find_case
    from gradequiv.harness.engine.verify import (
        PROPERTIES,
        PropertyResult,
        TensorCheck,
        Verdict,
        verify,
    )
    from gradequiv.harness.errors import InvalidArgument
    from gradequiv.harness.implementations.adapters import Implementation, parse_impl_kwargs
    from gradequiv.harness.implementations.resolve import resolve

#: public name -> the module that defines it
_WHERE = {
    "check": "api", "assert_equivalent": "api", "Report": "api", "Failure": "api",
    "DTYPES": "engine.case", "Case": "engine.case",
    "PairMetrics": "engine.compare", "Tolerance": "engine.compare",
    "measure_pairs": "engine.compare",
    "default_cases": "engine.spread", "extra_cases": "engine.spread",
    "find_case": "engine.spread",
    "PROPERTIES": "engine.verify", "PropertyResult": "engine.verify",
    "TensorCheck": "engine.verify", "Verdict": "engine.verify", "verify": "engine.verify",
    "InvalidArgument": "errors",
    "Implementation": "implementations.adapters",
    "parse_impl_kwargs": "implementations.adapters",
    "resolve": "implementations.resolve",
}

__all__ = [
    "DTYPES",
    "PROPERTIES",
    "Case",
    "Failure",
    "Implementation",
    "InvalidArgument",
    "PairMetrics",
    "PropertyResult",
    "Report",
    "TensorCheck",
    "Tolerance",
    "Verdict",
    "assert_equivalent",
    "check",
    "default_cases",
    "extra_cases",
    "find_case",
    "measure_pairs",
    "parse_impl_kwargs",
    "resolve",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))

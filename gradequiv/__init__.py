"""gradequiv: prove an activation-recompute implementation gives full storage's gradients.

For a user's own test suite::

    import gradequiv

    report = gradequiv.check(my_checkpoint)          # a child process, as ``gradequiv check``
    assert report.passed, report                      # str(report): the diagnosis
    gradequiv.assert_equivalent(my_checkpoint, model=my_factory)

The names load on first use (from ``gradequiv.harness.api``): the pytest plugin imports
this package in every pytest run, so importing it must not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradequiv.harness.api import Failure, Report, assert_equivalent, check
    from gradequiv.harness.errors import InvalidArgument

#: public name -> the module that defines it
_WHERE = {"check": "api", "assert_equivalent": "api", "Report": "api", "Failure": "api",
          "InvalidArgument": "errors"}

__all__ = ["Failure", "InvalidArgument", "Report", "assert_equivalent", "check"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"gradequiv.harness.{_WHERE[name]}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

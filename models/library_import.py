"""A library a route builds its models from, imported quietly (libraries warn on import),
its absence a usage error that names the option and the extra that installs it."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from gradequiv.harness.errors import InvalidArgument

__all__ = ["import_library"]


def import_library(module: str, needed_by: str, extra: str) -> Any:
    """``module``, imported with its warnings silenced, for ``needed_by`` (an option as
    written: ``--model hf:...``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ImportError as exc:
        raise InvalidArgument(
            f"{needed_by} needs {module} ({exc}); install it with: "
            f"pip install 'gradequiv[{extra}]'") from exc

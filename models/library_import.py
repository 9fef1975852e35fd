"""A library a route builds its models from, imported quietly (libraries warn on import),
its absence a usage error that names the route and the extra that installs it."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from gradequiv.harness.errors import InvalidArgument

__all__ = ["import_library"]


def import_library(module: str, route: str, extra: str) -> Any:
    """``module``, imported with its warnings silenced, for ``--model route``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ImportError as exc:
        raise InvalidArgument(
            f"--model {route} needs {module} ({exc}); install it with: "
            f"pip install 'gradequiv[{extra}]'") from exc

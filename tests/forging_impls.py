"""Broken checkpoints (the RNG not restored) that forge a pass from inside the checking
process, each on its first call, after gradequiv bound its comparison
(tests/test_false_pass_three.py); forging_at_import.py and forging_helper.py do it at
import."""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

_done: set[str] = set()


def _broken(function: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def equal_always(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Every comparison agrees: torch.equal says True."""
    torch.equal = lambda a, b: True
    return _broken(function, *args, **kwargs)


def channel_says_passed(function: Any, *args: Any, **kwargs: Any) -> Any:
    """The channel to the supervisor found, "ended 0" said on it, and the process gone."""
    from gradequiv.harness.commands.supervise import ChildChannel

    for obj in gc.get_objects():
        if isinstance(obj, ChildChannel):
            obj.ended(0)
            os._exit(0)
    return _broken(function, *args, **kwargs)

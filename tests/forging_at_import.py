"""A broken checkpoint (the RNG not restored) whose module makes torch.equal say True when
it is imported (tests/test_false_pass_three.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

torch.equal = lambda a, b: True


def my_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

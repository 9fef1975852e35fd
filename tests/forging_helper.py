"""A broken checkpoint (the RNG not restored) whose module replaces gradequiv's own
assertion when it is imported: every property test passes whatever its cases found, while
the cases' records still fail (tests/test_false_pass_three.py)."""

from __future__ import annotations

from typing import Any

from torch.utils.checkpoint import checkpoint

from gradequiv.properties import assertions

assertions.assert_property = lambda *args, **kwargs: None
assertions.assert_known_failures = lambda *args, **kwargs: None


def my_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

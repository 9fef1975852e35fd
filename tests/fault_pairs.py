"""Checkpoints with two faults that show in different cases (each alone in its cases): a run
must name both, as hand-written helpers copied between repositories often carry two."""

from __future__ import annotations

from typing import Any

from gradequiv.harness.implementations.faults import Faults, checkpoint_with_faults


def _pair(**switches: bool) -> Any:
    faults = Faults(**switches)

    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        return checkpoint_with_faults(function, *args, faults=faults, **kwargs)

    return checkpoint


#: fresh dropout masks in the re-run (dropout cases), and autocast lost (autocast cases)
rng_and_autocast = _pair(no_rng_restore=True, caller_stream_moved=True, autocast_lost=True)
#: autocast lost, and no gradient for tensors passed nested in lists and dicts
autocast_and_nested = _pair(autocast_lost=True, nested_tensors_no_grad=True)
#: fresh dropout masks, and keyword arguments that reach the first run only
rng_and_kwargs = _pair(no_rng_restore=True, caller_stream_moved=True, kwargs_dropped=True)

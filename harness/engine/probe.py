"""Before any case: can the implementation import what it needs?

A toggle or wrapper may import its library only when it is applied (a toggle that
imports torchtune's ``set_activation_checkpointing`` inside its body). Such a failure is
no verdict on recompute: it is the caller's set-up, exit 2, as an implementation whose
module cannot be imported is at resolution, whatever the adapter. Applying it once to the
run's model finds it before the suite starts; anything else it raises is left to the
cases, which report it as theirs. A function is not called here: the call is the case's
(a checkpoint that keeps state between calls must meet the cases as it was given).
"""

from __future__ import annotations

import torch

from gradequiv.harness.engine import global_state
from gradequiv.harness.engine.case import Case
from gradequiv.harness.engine.path import build_path
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.implementations.adapters import Implementation

__all__ = ["import_problem"]


def import_problem(impl: Implementation, case: Case, device: torch.device | str = "cpu"
                   ) -> str | None:
    """What ``impl`` could not import when applied to ``case``'s model (None: nothing).
    torch's global switches and the caller's random streams are as they were after it."""
    device = torch.device(device)
    clean = global_state.snapshot()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            build_path(case, device).install(impl)
    except InvalidArgument:
        raise
    except ImportError as exc:
        missing = f"{exc.name!r}" if exc.name else "a module it needs"
        return (f"--impl={impl.spec!r} could not import {missing} when it was applied "
                f"({type(exc).__name__}: {exc}); install the library the implementation "
                f"needs, or check its import")
    except Exception:  # noqa: BLE001  # the cases report it, with its traceback
        return None
    finally:
        global_state.restore(clean)
    return None

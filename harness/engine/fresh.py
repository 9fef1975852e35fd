"""Verify a case as a new training process would: in a process that has run no case before.

An implementation may keep state at module level that its first call sets (a cache of
whether layers have trainable parameters, a lazily captured generator, a workspace sized
once): in one long process, whichever case runs first sets it for every later one, so a
fault that a fresh training process meets on its first step can pass every case after the
first (modelscope/ms-swift#10142: one requires_grad cache shared by every layer, set by the
first, frozen one). Here each case runs in a child of a fork server that has imported
torch and gradequiv's engine but no implementation and has run nothing: the child imports
the implementation afresh, as a training script would, verifies the one case and hands its
verdict back. A fork costs tens of milliseconds, not a Python start and a torch import.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from gradequiv.harness.engine.case import Case
from gradequiv.harness.implementations.adapters import Implementation

__all__ = ["FreshProcessEnded", "FreshProcesses", "portable", "resolvable", "shared"]

#: What the fork server imports once for every child: torch and the engine, no implementation.
_PRELOAD = ["torch", "gradequiv.harness.engine.verify"]


#: Where the Python API keeps objects handed to it that no other process can import.
_THIS_PROCESS_ONLY = "gradequiv.harness.api:given."


def resolvable(impl: Implementation) -> bool:
    """Whether a fresh process can build ``impl`` from its spec alone (an implementation
    made in this process from a Python object has no spec another process can import)."""
    from gradequiv.harness.implementations.resolve import BUILTINS

    spec = impl.spec
    return isinstance(spec, str) and not spec.startswith(_THIS_PROCESS_ONLY) and (
        spec in BUILTINS or ":" in spec)


def portable(impl: Implementation, case: Case) -> bool:
    """Whether a fresh process can run ``case`` through ``impl``: both built from names it
    can import (a user's model handed to the Python API as an object has none)."""
    factory = getattr(case.model, "factory", "")
    return resolvable(impl) and not str(factory).startswith(_THIS_PROCESS_ONLY)


class FreshProcessEnded(Exception):
    """The fresh process ended before it handed its result back (an exit, a signal)."""


class FreshProcesses:
    """A fork server whose every task runs in a process of its own, one at a time."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    def verify(self, impl: Implementation, case: Case, device: Any, **options: Any) -> Any:
        """``verify(impl, case, device, **options)`` in a process that ran no case before:
        the verdict it returned."""
        return self._call("verify", impl, case, device, options)

    def localise(self, impl: Implementation, case: Case, device: Any) -> Any:
        """``localise(impl, case, device)`` in a process that ran no case before."""
        return self._call("localise", impl, case, device, {})

    def _call(self, what: str, impl: Implementation, case: Case, device: Any,
              options: dict[str, Any]) -> Any:
        import torch

        if self._pool is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(_PRELOAD)
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=context,
                                             max_tasks_per_child=1)
        switches = {"threads": torch.get_num_threads(),
                    "deterministic": torch.are_deterministic_algorithms_enabled(),
                    "path": list(__import__("sys").path), "cwd": os.getcwd()}
        task = self._pool.submit(_run_fresh, what, (impl.spec, impl.adapter, impl.kwargs),
                                 case.to_json(), str(device), switches, options)
        try:
            return task.result()
        except BrokenProcessPool as exc:  # the pool cannot be used again: a new one next time
            self._pool.shutdown(wait=True)
            self._pool = None
            raise FreshProcessEnded(str(exc)) from None

    def close(self) -> None:
        """End the pool, the fork server and the resource tracker it started: a run leaves
        no process behind (a supervisor would count them as the implementation's)."""
        if self._pool is None:
            return
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None
        from multiprocessing import forkserver, resource_tracker

        for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
            stop = getattr(helper, "_stop", None)  # private, in every Python this supports
            if stop is not None:
                stop()


_SHARED: FreshProcesses | None = None


def shared() -> FreshProcesses:
    """The process's fresh processes: one fork server for every suite this process runs
    (``gradequiv mutants`` runs dozens; each server start imports torch), stopped when
    the process exits."""
    global _SHARED
    if _SHARED is None:
        _SHARED = FreshProcesses()
        atexit.register(_SHARED.close)
    return _SHARED


def _run_fresh(what: str, spec: tuple[str, str | None, dict[str, Any]], case_json: str,
               device: str, switches: dict[str, Any], options: dict[str, Any]) -> Any:
    """In the child: the run's switches as the parent has them, the implementation imported
    afresh, the case verified (``what``: or its first diverging op searched)."""
    import sys

    import torch

    from gradequiv.harness.engine.global_state import pin_regime
    from gradequiv.harness.engine.localise import localise
    from gradequiv.harness.engine.verify import verify
    from gradequiv.harness.implementations.resolve import resolve

    sys.path[:] = switches["path"]
    os.chdir(switches["cwd"])
    torch.set_num_threads(switches["threads"])
    torch.use_deterministic_algorithms(switches["deterministic"])
    impl = resolve(spec[0], adapter=spec[1], kwargs=spec[2])
    pin_regime()  # the implementation's import may have set one, as in the parent
    case = Case.from_json(case_json)
    if what == "localise":
        return localise(impl, case, device)
    return verify(impl, case, device=device, **options)

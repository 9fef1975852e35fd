"""Verify a case as a new training process would: in a process that has run no case before.

An implementation may keep state at module level that its first call sets (a cache of
whether layers have trainable parameters, a lazily captured generator, a workspace sized
once): in one long process, whichever case runs first sets it for every later one, so a
fault that a fresh training process meets on its first step can pass every case after the
first (modelscope/ms-swift#10142: one requires_grad cache shared by every layer, set by the
first, frozen one). Here each case runs in a child of a fork server that has imported
torch and gradequiv's engine (warmed by one case of torch's own checkpoint) but no
implementation of the user's: the child imports the implementation afresh, as a training
script would, verifies the one case and hands its verdict back. A fork costs tens of
milliseconds, not a Python start and a torch import. Where the platform has no fork server
(Windows), named cases run in the suite's process, as before.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import threading
import traceback
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from gradequiv.harness.engine.case import Case
from gradequiv.harness.implementations.adapters import Implementation

__all__ = ["Ahead", "FreshProcessEnded", "FreshProcesses", "Pending", "helper_pids",
           "portable", "resolvable", "shared"]

#: What the fork server imports once for every child: torch and the engine, warmed up by
#: one case through torch's own checkpoint, and no implementation of the user's.
_PRELOAD = ["torch", "gradequiv.harness.engine.fresh_server"]


#: Where the Python API keeps objects handed to it that no other process can import.
_THIS_PROCESS_ONLY = "gradequiv.harness.api:given."


def resolvable(impl: Implementation) -> bool:
    """Whether a fresh process can build ``impl`` from its spec alone (an implementation
    made in this process from a Python object has no spec another process can import)."""
    from gradequiv.harness.implementations.resolve import BUILTINS

    spec = impl.spec
    return "forkserver" in multiprocessing.get_all_start_methods() and isinstance(spec, str) \
        and not spec.startswith(_THIS_PROCESS_ONLY) and (spec in BUILTINS or ":" in spec)


def portable(impl: Implementation, case: Case) -> bool:
    """Whether a fresh process can run ``case`` through ``impl``: both built from names it
    can import (a user's model handed to the Python API as an object has none)."""
    factory = getattr(case.model, "factory", "")
    return resolvable(impl) and not str(factory).startswith(_THIS_PROCESS_ONLY)


class FreshProcessEnded(Exception):
    """The fresh process ended before it handed its result back (an exit, a signal)."""


@dataclass
class Pending:
    """A task started in a child of its own, its result not yet read
    (:meth:`FreshProcesses.result`)."""

    child: Any  # multiprocessing's Process
    receive: Any  # the pipe's end the result comes through


class FreshProcesses:
    """A fork server whose every task runs in a child process of its own.

    The child hands its result back through a pipe and ends at once (``os._exit``): a thread
    the implementation left running (a forgotten prefetcher) must not keep it alive. Tasks
    may be started ahead (:meth:`start`) and their results read later (:meth:`result`):
    each child is still the first case of its process, whatever runs beside it."""

    def __init__(self) -> None:
        self.started = False  # whether its fork server was ever asked for

    def warm(self) -> None:
        """Start the fork server now, without waiting for it: it imports torch and runs its
        warm-up case on another core while the suite's drawn cases run here."""
        if self.started:
            return
        multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
        from multiprocessing import forkserver

        forkserver.ensure_running()
        self.started = True

    def verify(self, impl: Implementation, case: Case, device: Any, **options: Any) -> Any:
        """``verify(impl, case, device, **options)`` in a process that ran no case before:
        the verdict it returned."""
        return self.result(self.start(impl, case, device, **options))

    def localise(self, impl: Implementation, case: Case, device: Any) -> Any:
        """``localise(impl, case, device)`` in a process that ran no case before."""
        return self.result(self._start("localise", impl, case, device, {}))

    def start(self, impl: Implementation, case: Case, device: Any, **options: Any) -> Pending:
        """:meth:`verify`, started now in its own child; its verdict read by :meth:`result`."""
        return self._start("verify", impl, case, device, options)

    def _start(self, what: str, impl: Implementation, case: Case, device: Any,
               options: dict[str, Any]) -> Pending:
        import torch

        self.warm()
        context = multiprocessing.get_context("forkserver")
        switches = {"threads": torch.get_num_threads(),
                    "deterministic": torch.are_deterministic_algorithms_enabled(),
                    "path": list(sys.path), "cwd": os.getcwd()}
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_child, daemon=True, args=(
            send, what, (impl.spec, impl.adapter, impl.kwargs), case.to_json(), str(device),
            switches, options))
        child.start()
        send.close()
        return Pending(child, receive)

    def result(self, pending: Pending) -> Any:
        """What the task of ``pending`` returned, once its child sent it (raises
        :class:`FreshProcessEnded` where the child ended without a word)."""
        child, receive = pending.child, pending.receive
        try:
            result = receive.recv()
        except EOFError:  # it ended without a word: an exit or a signal
            child.join(5.0)
            raise FreshProcessEnded(f"exit code {child.exitcode}") from None
        finally:
            receive.close()
        child.join(5.0)
        if child.is_alive():
            child.kill()
            child.join()
        if isinstance(result, _Raised):
            raise RuntimeError(f"in a fresh process:\n{result.text}")
        return result

    @staticmethod
    def cancel(pending: Pending) -> None:
        """End the child of a task whose result is wanted no more."""
        pending.receive.close()
        if pending.child.is_alive():
            pending.child.kill()
        pending.child.join()

    def close(self) -> None:
        """End the fork server and the resource tracker it started: a run leaves no process
        behind (a supervisor would count them as the implementation's)."""
        if not self.started:
            return
        self.started = False
        from multiprocessing import forkserver, resource_tracker

        for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
            stop = getattr(helper, "_stop", None)  # private, in every Python this supports
            if stop is not None:
                stop()


@dataclass
class _Raised:
    """What the child raised outside the case (the case's own errors are in its verdict)."""

    text: str


class Ahead:
    """Cases verified in fresh processes ahead of being asked for, one child at a time, on
    a thread of this process that only waits: the suite's own cases go on meanwhile, and
    each child still runs its case as the first of its process.

    ``tasks``: (key, implementation, case, device, verify's options), in the order they
    will be asked for. :meth:`take` hands a key's verdict over (waiting for it where its
    child still runs); :meth:`stop` ends the child running and starts no other."""

    def __init__(self, processes: FreshProcesses,
                 tasks: list[tuple[Hashable, Implementation, Case, Any, dict[str, Any]]]) -> None:
        self.processes = processes
        self.queued = {task[0] for task in tasks}
        self.done: dict[Hashable, tuple[bool, Any]] = {}  # key -> (ended, verdict or why)
        self.changed = threading.Condition()
        self.running: Pending | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._work, args=(tasks,), daemon=True,
                                       name="gradequiv-fresh-ahead")
        self.thread.start()

    def _work(self, tasks: list[tuple[Hashable, Implementation, Case, Any,
                                      dict[str, Any]]]) -> None:
        for key, impl, case, device, options in tasks:
            with self.changed:
                if self.stopped:
                    return
            try:
                pending = self.processes.start(impl, case, device, **options)
                with self.changed:
                    self.running = pending
                    if self.stopped:  # stopped while it started: this thread ends it
                        self.processes.cancel(pending)
                        return
                found: tuple[bool, Any] = (False, self.processes.result(pending))
            except FreshProcessEnded as ended:
                found = (True, ended)
            except Exception as error:  # told where the verdict is asked for
                found = (True, error)
            with self.changed:
                self.running = None
                self.done[key] = found
                self.changed.notify_all()

    def take(self, key: Hashable) -> Any:
        """The verdict of ``key``'s case (raising what its child's end raised); None where
        it was not queued, or the work was stopped before it."""
        with self.changed:
            if key not in self.queued:
                return None
            self.queued.discard(key)
            while key not in self.done and self.thread.is_alive():
                self.changed.wait(0.5)
            if key not in self.done:
                return None
            ended, found = self.done.pop(key)
        if ended:
            raise found
        return found

    def stop(self) -> None:
        """End the child running and start no other; wait for the thread. The child is
        killed, never its pipe closed here: the thread reading it closes its own end (two
        threads closing one descriptor close whatever took its number in between)."""
        with self.changed:
            self.stopped = True
            running = self.running
            if running is not None and running.child.is_alive():
                running.child.kill()  # the thread's read ends at once, without a word
        self.thread.join(10.0)


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


def helper_pids() -> set[int]:
    """The fork server's and its resource tracker's process ids where this process started
    them for fresh processes: the harness's, not the implementation's."""
    if _SHARED is None or not _SHARED.started:
        return set()
    from multiprocessing import forkserver, resource_tracker

    pids = (getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None))
    return {pid for pid in pids if isinstance(pid, int)}


def _child(send: Any, what: str, spec: tuple[str, str | None, dict[str, Any]],
           case_json: str, device: str, switches: dict[str, Any],
           options: dict[str, Any]) -> None:
    """The child's whole life: the task, its result sent back, the end."""
    try:
        result: Any = _run_fresh(what, spec, case_json, device, switches, options)
    except BaseException:  # a SystemExit in the implementation is the case's, in its verdict
        result = _Raised(traceback.format_exc())
    try:
        send.send(result)
        send.close()
    finally:
        os._exit(0)


def _run_fresh(what: str, spec: tuple[str, str | None, dict[str, Any]], case_json: str,
               device: str, switches: dict[str, Any], options: dict[str, Any]) -> Any:
    """In the child: the run's switches as the parent has them, the implementation imported
    afresh, the case verified (``what``: or its first diverging op searched)."""
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

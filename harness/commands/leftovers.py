"""Threads and processes the implementation started and left running when the run ended.

:func:`watch` is called once before the implementation is first called (by
``gradequiv check`` in the process that runs it). It notes the threads and child
processes alive then, and from then on who starts each new one: the first
frame outside Python's standard library on the stack of the ``threading.Thread.start``
or ``subprocess.Popen`` call (seen with an audit hook). At the end, :func:`left_running`
keeps only what the implementation started: not what was there before, nor what
torch, the harness, Hypothesis or pytest started (torch's compile workers and
prefetch threads are its own). A thread whose starter was not seen is judged by
where its target lives.

Child processes are read from ``/proc`` (Linux); elsewhere none are reported.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import types
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Leftovers", "left_running", "stop", "watch"]

#: Top-level packages whose threads and processes are never the implementation's.
NOT_THE_IMPLEMENTATION = frozenset({
    "gradequiv", "torch", "torchgen", "functorch", "triton", "hypothesis",
    "_hypothesis_pytestplugin", "_hypothesis_ftz_detector", "_pytest", "pytest", "pluggy",
    "numpy",
})
_STDLIB = frozenset(sys.stdlib_module_names) | {"__main__"}
#: Helpers whose threads are their caller's: a starter is looked for past their frames
#: (tqdm's monitor thread, started for torch's compiler progress bars, is torch's).
_HELPERS = frozenset({"tqdm"})


@dataclass
class _Watch:
    threads: set[threading.Thread]  # alive when the watch began
    processes: set[int]  # child pids alive when it began
    thread_starters: weakref.WeakKeyDictionary[threading.Thread, str] = field(
        default_factory=weakref.WeakKeyDictionary)
    process_starters: list[tuple[tuple[str, ...], str]] = field(default_factory=list)


@dataclass(frozen=True)
class Leftovers:
    """What the implementation left running: threads (name, where started) and processes
    (pid, command line)."""

    threads: tuple[tuple[str, str], ...] = ()
    processes: tuple[tuple[int, str], ...] = ()

    def warnings(self) -> list[str]:
        said = []
        if self.threads:
            named = ", ".join(f"{name} (started at {where})" for name, where in self.threads)
            said.append(f"the implementation left {len(self.threads)} thread(s) running: "
                        f"{named}")
        if self.processes:
            named = ", ".join(f"pid {pid} ({command})" for pid, command in self.processes)
            said.append(f"the implementation left {len(self.processes)} process(es) running: "
                        f"{named}; stopped with SIGTERM")
        return said


#: the audit events (and the one this module raises itself) that start a thread or process
_EVENTS = frozenset({"_thread.start_new_thread", "_thread.start_joinable_thread",
                     "subprocess.Popen", "os.system"})
_WATCH: _Watch | None = None
_HOOKED = False


def watch() -> None:
    """Begin watching (again): what runs now is not the implementation's."""
    global _WATCH, _HOOKED
    _WATCH = _Watch(set(threading.enumerate()), set(_children()))
    if not _HOOKED:  # an audit hook cannot be removed: one per process
        sys.addaudithook(_audit)
        start = getattr(threading, "_start_new_thread", None)
        if start is not None:  # Python < 3.13 audits no thread start: see it where it starts
            def start_new_thread(function: Any, *args: Any, **kwargs: Any) -> Any:
                _audit("_thread.start_new_thread", (function, *args))
                return start(function, *args, **kwargs)

            threading._start_new_thread = start_new_thread  # type: ignore[attr-defined]
        _HOOKED = True


def left_running() -> Leftovers:
    """The implementation's threads and processes alive now (nothing before :func:`watch`)."""
    if _WATCH is None:
        return Leftovers()
    seen = _WATCH
    threads = []
    for thread in threading.enumerate():
        if thread in seen.threads or not thread.is_alive():
            continue
        where = seen.thread_starters.get(thread) or _target_site(thread)
        if where is not None and _owner(where) not in NOT_THE_IMPLEMENTATION:
            threads.append((thread.name, where))
    processes = []
    from gradequiv.harness.engine.fresh import helper_pids

    ours = helper_pids()  # the fork server of the named cases' fresh processes
    for pid in _children():
        if pid in seen.processes or pid in ours:
            continue
        command = _command_line(pid)
        starter = next((s for argv, s in reversed(seen.process_starters)
                        if " ".join(argv) == command), None)
        if starter is None or _owner(starter) not in NOT_THE_IMPLEMENTATION:
            processes.append((pid, command))
    return Leftovers(tuple(threads), tuple(processes))


def stop(processes: tuple[tuple[int, str], ...]) -> None:
    """SIGTERM to each process (one left running would hold the run's output open)."""
    for pid, _ in processes:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event not in _EVENTS:
        return
    try:
        seen = _WATCH
        if seen is None:
            return
        where = _starter(sys._getframe(1))
        if event.startswith("_thread."):
            thread = getattr(args[0], "__self__", None)  # Thread._bootstrap, bound
            if isinstance(thread, threading.Thread) and where is not None:
                seen.thread_starters[thread] = where
        elif where is not None:
            if event == "os.system":
                argv: tuple[str, ...] = ("/bin/sh", "-c", os.fsdecode(args[0]))
            else:
                executable, given = args[0], args[1]
                items = [given] if isinstance(given, str | bytes | os.PathLike) else list(given)
                argv = tuple(os.fsdecode(a) for a in items)
                del executable
            seen.process_starters.append((argv, where))
    except Exception:  # noqa: S110  # a watch must never break the call it watches
        pass


def _starter(frame: types.FrameType | None) -> str | None:
    """The first frame outside the standard library and the helpers that start threads for
    their caller: ``package/file.py:line in function``, the package first, as
    :func:`_owner` reads it."""
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.partition(".")[0] not in _STDLIB | _HELPERS and module != __name__:
            return f"{module}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _target_site(thread: threading.Thread) -> str | None:
    """Where a thread's code lives: its target, or its class's ``run``."""
    target = getattr(thread, "_target", None)
    if target is None and type(thread).run is not threading.Thread.run:
        target = type(thread).run
    module = getattr(target, "__module__", None)
    if not module or module.partition(".")[0] in _STDLIB | _HELPERS:
        return None  # a stdlib or helper worker whose starter was not seen
    return f"{module}:{getattr(target, '__qualname__', '?')}"


def _owner(where: str) -> str:
    return where.partition(":")[0].partition(".")[0]


def _children() -> list[int]:
    """Pids of this process's running child processes (Linux /proc; elsewhere none)."""
    me = os.getpid()
    pids = []
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # after the command, which may hold spaces
        if len(fields) > 1 and fields[0] != "Z" and fields[1] == str(me):
            pids.append(int(entry.name))
    return pids


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(os.fsdecode(a) for a in raw.split(b"\0") if a)

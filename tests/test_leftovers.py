"""Threads and processes left running at the end of a run: the implementation's are named,
torch's and the harness's never are, and what ran before the watch began is nobody's."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator

import pytest

from gradequiv.harness.commands import leftovers


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    """Ends the threads a test starts."""
    event = threading.Event()
    yield event
    event.set()


def _started_from(module: str, stop: threading.Event, name: str) -> threading.Thread:
    """A thread started by code whose module is ``module`` (as torch's code would start it)."""
    source = ("def start(stop, name):\n"
              "    t = threading.Thread(target=stop.wait, name=name)\n"
              "    t.start()\n"
              "    return t\n")
    space: dict[str, object] = {"__name__": module, "threading": threading}
    exec(compile(source, f"<{module}>", "exec"), space)  # noqa: S102
    start = space["start"]
    assert isinstance(start, types.FunctionType)
    thread = start(stop, name)
    assert isinstance(thread, threading.Thread)
    return thread


def test_only_the_threads_the_implementation_started_are_named(stop: threading.Event) -> None:
    threading.Thread(target=stop.wait, name="there-before").start()
    leftovers.watch()
    _started_from("torch.utils._functools", stop, "torch-prefetch")
    _started_from("hypothesis.database", stop, "hypothesis-writer")
    _started_from("my_recompute.prefetch", stop, "user-prefetch")
    left = leftovers.left_running()
    assert [name for name, _ in left.threads] == ["user-prefetch"]
    assert left.threads[0][1].startswith("my_recompute.prefetch:")
    assert left.processes == ()
    assert left.warnings() == [
        f"the implementation left 1 thread(s) running: user-prefetch (started at "
        f"{left.threads[0][1]})"]


def test_a_stdlib_executor_is_judged_by_who_submitted_to_it(stop: threading.Event) -> None:
    """An executor's worker runs stdlib code; whoever submitted the first task started it."""
    from concurrent.futures import ThreadPoolExecutor

    leftovers.watch()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mine")
    pool.submit(stop.wait)
    try:
        (name, where), = leftovers.left_running().threads
        assert name.startswith("mine") and where.startswith(f"{__name__}:")
    finally:
        stop.set()
        pool.shutdown()


def test_a_thread_that_ended_is_not_left_running() -> None:
    leftovers.watch()
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    assert leftovers.left_running().threads == ()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child processes from /proc")
def test_a_process_left_running_is_named_by_pid_and_command_line() -> None:
    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        leftovers.watch()
        started = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(61)"])
        ended = subprocess.Popen([sys.executable, "-c", "pass"])
        ended.wait()
        left = leftovers.left_running()
        assert left.processes == (
            (started.pid, f"{sys.executable} -c import time; time.sleep(61)"),)
        assert f"pid {started.pid} ({sys.executable} -c import time" in left.warnings()[0]
        leftovers.stop(left.processes)
        assert started.wait(timeout=30) != 0
    finally:
        for process in (before, started):
            process.kill()
            process.wait()


def test_nothing_is_reported_without_a_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leftovers, "_WATCH", None)
    assert leftovers.left_running() == leftovers.Leftovers()
    assert leftovers.Leftovers().warnings() == []


def test_a_process_started_by_torch_is_not_the_implementation_s() -> None:
    """A Popen whose caller is torch's code (its compile workers) is torch's own."""
    leftovers.watch()
    space: dict[str, object] = {"__name__": "torch._inductor.compile_worker", "sys": sys,
                                "subprocess": subprocess}
    exec(compile("def start():\n    return subprocess.Popen("  # noqa: S102
                 "[sys.executable, '-c', 'import time; time.sleep(62)'])\n",
                 "<torch>", "exec"), space)
    start = space["start"]
    assert isinstance(start, types.FunctionType)
    process = start()
    try:
        time.sleep(0.1)
        assert leftovers.left_running().processes == ()
    finally:
        process.kill()
        process.wait()


def test_a_thread_a_helper_starts_is_its_caller_s() -> None:
    """tqdm's monitor thread, started for torch's compiler progress bars, is torch's; started
    for the implementation's own bar, it is the implementation's."""
    helper = types.ModuleType("tqdm._monitor_like")
    exec("import sys\ndef start(find):\n    return find(sys._getframe())", helper.__dict__)
    for package, blamed in (("torch", False), ("mypkg", True)):
        caller = types.ModuleType(f"{package}.progress")
        exec("def run(helper, find):\n    return helper.start(find)", caller.__dict__)
        where = caller.run(helper, leftovers._starter)
        assert where is not None and where.startswith(f"{package}.progress:")
        assert (leftovers._owner(where) not in leftovers.NOT_THE_IMPLEMENTATION) is blamed

"""``gradequiv check`` runs the suite in a child process and owns the verdict.

The implementation under test runs in the child, so whatever it does to its
process (``os._exit``, a signal, a hang, a thread left running) cannot end
the run with a false pass. The child tells this process, over a pipe, which
case it is about to run, each case it finished, the phase it is in (a
replay, a localisation) and, last, the exit code it chose. This process:

- passes the child's exit code on when the child said it was done (a child
  slow to exit after that is stopped with a note: the verdict stands, and
  nobody is blamed for a slow teardown; the child itself names the threads
  and processes the implementation left running, :mod:`.leftovers`);
- otherwise (the child exited without saying so, was killed, or sent
  nothing for ``--case-timeout`` seconds) stops it, says which case it was
  running and how it ended, writes report.json (and report.md) with every
  case that finished (incomplete, failing) and exits 1; a hung child is
  stopped with :data:`HANG_SIGNAL`, which ends it quietly;
- forwards SIGINT and SIGTERM to the child, which writes its report as an
  interrupted run does; a child that has not ended :data:`STOP_GRACE_S` seconds
  later (it ignores the signals, or its implementation works on) is killed
  with its process group, and the report keeps what finished with the
  interruption as its failure. Either way the run exits 130, never a pass.

report.json is written from the first moment, before the child starts
(incomplete, no case), so a run that ends at any point leaves one.

No torch here: the child imports it. ``--in-process`` runs without a child.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gradequiv.harness.errors import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_PASS, EXIT_USAGE
from gradequiv.harness.options import CheckOptions
from gradequiv.harness.reports.text import bounded, printable

#: environment of the child: the pipe's write end, and the run's identity (id, start,
#: command line, pid of this process), so that the report names the run the user started
CHANNEL_FD = "GRADEQUIV_SUPERVISOR_FD"
IDENTITY = "GRADEQUIV_RUN_IDENTITY"

#: seconds a child that said it is done may take to exit (torch's teardown on a loaded machine
#: can take seconds; threads left running do not keep it: it exits without waiting for them)
EXIT_GRACE_S = 30.0
#: seconds between SIGTERM and SIGKILL when the child must be stopped
STOP_GRACE_S = 5.0
#: the signal that stops a child that hung: it exits at once, quietly (SIGTERM would read as
#: an interruption: pytest's "KeyboardInterrupt", "interrupted")
HANG_SIGNAL = signal.SIGUSR1
#: seconds the supervisor waits on the child's pipe at most before it looks again (at a
#: stop request, a deadline)
POLL_S = 0.5
#: the least time the child's start-up (importing torch and the implementation, collecting
#: the suite) gets before its first case, whatever the case timeout: minutes on a busy machine
STARTUP_S = 120.0


def run(options: CheckOptions, argv: list[str], *, case_timeout: float) -> int:
    """Run ``gradequiv check ARGV --in-process`` as a child and decide its exit code."""
    from gradequiv.harness.reports.files import (
        REPORT_FILE,
        claim_report_dir,
        lock_report_dir,
        run_identity,
        write_json_atomic,
    )
    from gradequiv.harness.reports.report import starting_report

    identity = run_identity()
    starting = starting_report(options, identity)
    with contextlib.ExitStack() as stack:
        if options.report_dir is not None:
            stack.enter_context(lock_report_dir(options.report_dir, identity))
            # The earlier run's files are set aside, not removed, until the child has
            # validated the arguments: a usage error puts them back (_drop_untouched).
            claim_report_dir(options.report_dir, identity, set_aside=True)
            # From the first moment: a hang or a kill before the first case still leaves a
            # report, incomplete, that says what ended the run.
            write_json_atomic(options.report_dir / REPORT_FILE, starting)
        child = _Child([*argv, "--in-process"], identity)
        stack.enter_context(_forwarding_signals(child))
        ended = child.watch(case_timeout)
        if (ended is None and child.interrupted is None and child.code == EXIT_USAGE
                and options.report_dir is not None):
            _drop_untouched(options.report_dir, starting)  # under the lock, before its end
    if child.interrupted is not None:
        return _interrupted(options.report_dir, child, ended)
    if ended is None and child.code == EXIT_PASS:
        ended = _why_not_a_pass(options.report_dir, child, identity)
    if ended is None:
        return child.code
    # The child's progress dots may have left its line open: the verdict starts a new one.
    print(flush=True)
    print(f"gradequiv: FAIL: {printable(bounded(ended))}", file=sys.stderr)
    kept = _write_ended_report(options.report_dir, child, ended)
    print(f"gradequiv: {len(child.records)} case(s) finished before it; {kept}",
          file=sys.stderr)
    return EXIT_FAIL


def _interrupted(report_dir: Path | None, child: _Child, ended: str | None) -> int:
    """The run was asked to stop (SIGINT, SIGTERM): exit 130, never a pass. A child that
    stopped as asked wrote its own incomplete report; otherwise (it went on, ignored the
    signal, or was killed) the report keeps what finished with the interruption as its
    failure."""
    name = signal.Signals(child.interrupted or signal.SIGINT).name
    if ended is None and child.code == EXIT_INTERRUPTED and _report_says_incomplete(
            report_dir):
        return EXIT_INTERRUPTED
    print(flush=True)
    how = ended or f"it ended with exit code {child.code} after the signal"
    message = f"the run was interrupted ({name}) during {child.where}: {how}"
    print(f"gradequiv: interrupted: {printable(bounded(message))}", file=sys.stderr)
    kept = _write_ended_report(report_dir, child, message)
    print(f"gradequiv: {len(child.records)} case(s) finished before it; {kept}",
          file=sys.stderr)
    return EXIT_INTERRUPTED


def _why_not_a_pass(report_dir: Path | None, child: _Child,
                    identity: dict[str, Any]) -> str | None:
    """Why the checking process's "passed" is not taken (None: it is). That process ran the
    implementation, which can reach its exit code, its channel and its report; a pass is
    this process's decision, from the cases it heard of as they finished and the report
    the run wrote: every one of them passing and verified, and the same in both."""
    from gradequiv.harness.reports.files import REPORT_FILE
    from gradequiv.harness.reports.report import SHRINK_KEY, verdict_disagreement
    from gradequiv.harness.reports.verified import (
        case_unverified,
        why_not_what_was_sent,
        why_unverified,
    )

    claim = "the checking process said the run passed, but "
    sent = [r for r in child.records if not r.get(SHRINK_KEY)]
    if not sent:
        return claim + "it sent no verified case"
    failing = [r for r in sent if r.get("verdict") != "pass"]
    if failing:
        return (claim + f"{len(failing)} of the {len(sent)} case(s) it sent failed (the "
                f"first: {failing[0].get('description')})")
    for record in sent:
        why = case_unverified(record)
        if why is not None:
            return claim + f"a case it sent verified nothing ({why})"
    if report_dir is None:
        return None
    path = report_dir / REPORT_FILE
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return claim + f"{path} cannot be read ({type(exc).__name__})"
    if not isinstance(report, dict) or (report.get("run") or {}).get("id") != identity["id"]:
        return claim + f"{path} is not this run's report"
    if report.get("verdict") != "pass":
        return claim + f"{path} says verdict={report.get('verdict')!r}"
    why = (verdict_disagreement(report) or why_unverified(report)
           or why_not_what_was_sent(report, sent))
    return None if why is None else claim + f"{path}: {why}"


def _report_says_incomplete(report_dir: Path | None) -> bool:
    """Whether report.json (when there is a folder) is marked incomplete with a failure."""
    if report_dir is None:
        return True
    from gradequiv.harness.reports.files import REPORT_FILE

    try:
        report = json.loads((report_dir / REPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return report.get("complete") is False and report.get("failure") is not None


def _drop_untouched(report_dir: Path, starting: dict[str, Any]) -> None:
    """Remove the starting report.json a run that never began left (a usage error found
    in the child): no case ran, so no report speaks for it; and put back what the claim
    set aside, so the folder is as it was."""
    from gradequiv.harness.reports.files import REPORT_FILE, unclaim_report_dir

    path = report_dir / REPORT_FILE
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text(encoding="utf-8")) == starting:
            path.unlink()
            unclaim_report_dir(report_dir)


class _Child:
    """The child process and what it said over the pipe."""

    def __init__(self, argv: list[str], identity: dict[str, Any]) -> None:
        read, write = os.pipe()
        env = dict(os.environ)
        env[CHANNEL_FD] = str(write)
        env[IDENTITY] = json.dumps(identity)
        # The child must import what this process can: a user's module beside a test, or
        # on a path a script put on sys.path.
        path = [p for p in sys.path if p and Path(p).exists()]
        env["PYTHONPATH"] = os.pathsep.join(p for p in [*path, env.get("PYTHONPATH")] if p)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gradequiv.harness", *argv], env=env, pass_fds=(write,),
            process_group=0, preexec_fn=_die_with_parent)
        os.close(write)
        self.read = read
        self.records: list[dict[str, Any]] = []
        self.during: dict[str, Any] | None = None
        self.phase: str | None = None
        self.code: int = EXIT_FAIL
        #: the signal that asked the run to stop, and when (None: nobody asked)
        self.interrupted: int | None = None
        self._interrupted_at = 0.0
        self._said_done = False
        self._buffer = b""

    def interrupt(self, signum: int) -> None:
        """Pass a stop request on to the child; from the first, it has
        :data:`STOP_GRACE_S` seconds to end before it is killed."""
        if self.interrupted is None:
            self.interrupted, self._interrupted_at = signum, time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signum)

    def watch(self, case_timeout: float) -> str | None:
        """Follow the child to its end: None when it ended as it said it would, else how
        it ended without saying so (the failure's words)."""
        try:
            hung = self._follow(case_timeout)
        finally:
            os.close(self.read)
        if self.interrupted is not None:
            return self._end_interrupted()
        if hung:
            self._stop(HANG_SIGNAL)
            return (f"the implementation hung during {self.where}: nothing finished in "
                    f"{case_timeout:g} s (--case-timeout); the process was stopped")
        if self._said_done:
            try:
                self.process.wait(EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                # The verdict is in: a slow teardown (atexit handlers, freeing memory on a
                # loaded machine) is no fault of the implementation, whose threads the child
                # named itself and does not wait for.
                self._stop(signal.SIGTERM)
                print(f"gradequiv: note: the checking process was still shutting down "
                      f"{EXIT_GRACE_S:g} s after its verdict and was stopped; the verdict "
                      f"stands", file=sys.stderr)
            return None
        status = self.process.wait()
        how = (f"killed by {signal.Signals(-status).name}" if status < 0 else
               f"exit status {status}, without finishing the run (os._exit or a crash?)")
        return f"the implementation ended the process during {self.where}: {how}"

    def _end_interrupted(self) -> str | None:
        """After a stop request: the child's end within the grace, else its kill. None when
        it ended as it said it would."""
        left = STOP_GRACE_S - (time.monotonic() - self._interrupted_at)
        try:
            self.process.wait(max(0.0, left))
        except subprocess.TimeoutExpired:
            self._kill_group()
            return (f"the checking process did not stop within {STOP_GRACE_S:g} s of the "
                    f"signal and was killed")
        if self._said_done:
            return None
        status = self.process.returncode
        return (f"the checking process was killed by {signal.Signals(-status).name}"
                if status < 0 else
                f"the checking process ended with exit status {status} without its verdict")

    def _kill_group(self) -> None:
        """SIGKILL to the child and whatever it started in its process group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()

    def _follow(self, case_timeout: float) -> bool:
        """Read events until the pipe closes; True when nothing came for too long. A stop
        request ends the reading once the child has had its grace to stop."""
        deadline = time.monotonic() + max(case_timeout, STARTUP_S) if case_timeout else None
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self.interrupted is not None:
                left = STOP_GRACE_S - (time.monotonic() - self._interrupted_at)
                if left <= 0:
                    return False
                wait = left if wait is None else min(wait, left)
            # Woken often: a signal's handler runs between two waits, not inside one.
            wait = POLL_S if wait is None else min(wait, POLL_S)
            try:
                ready, _, _ = select.select([self.read], [], [], wait)
            except InterruptedError:  # a forwarded signal; go on reading
                continue
            if not ready:
                if deadline is not None and time.monotonic() >= deadline:
                    return True
                continue
            chunk = os.read(self.read, 1 << 16)
            if not chunk:
                return False
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                self._hear(json.loads(line))
            if deadline is not None:
                deadline = time.monotonic() + case_timeout

    def _hear(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "case":
            self.during, self.phase = event, None
        elif kind == "phase":
            self.phase = event["what"]
        elif kind == "record":
            self.records.append(event["record"])
        elif kind == "end":
            self.code, self._said_done = int(event["code"]), True

    @property
    def where(self) -> str:
        """What the child was doing: its phase, its case, or its start-up."""
        if self.phase is not None:
            return self.phase
        if self.during is not None:
            return str(self.during["description"])
        return "start-up, before the first case"

    def _stop(self, how: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(how)
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _write_ended_report(report_dir: Path | None, child: _Child, ended: str) -> str:
    """report.json after a child that ended early: its last report with every finished case
    and the end as the failure. Says where the cases went."""
    if report_dir is None:
        return "no --report-dir, so no report was written"
    from gradequiv.harness.reports.files import REPORT_FILE, write_json_atomic
    from gradequiv.harness.reports.report import process_ended_report

    path = report_dir / REPORT_FILE
    try:
        last = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"the run wrote no report before it ended, so {path} was not written"
    write_json_atomic(path, process_ended_report(last, child.records, message=ended,
                                                 during=child.during))
    from gradequiv.harness.commands.render import write_views

    write_views(report_dir)
    return f"they are kept in {path} and report.md, marked incomplete"


@contextlib.contextmanager
def _forwarding_signals(child: _Child) -> Iterator[None]:
    """SIGINT and SIGTERM go to the child (in its own process group, it hears them once,
    from here), which then writes its report as an interrupted run, or is killed after
    :data:`STOP_GRACE_S` seconds if it does not stop."""
    def forward(signum: int, frame: Any) -> None:
        child.interrupt(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def stop_quietly_on_hang() -> None:
    """In the child: the supervisor's :data:`HANG_SIGNAL` ends this process at once, with
    what it printed flushed and nothing more (the supervisor says which case hung)."""
    def end(signum: int, frame: Any) -> None:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.flush()
        os._exit(EXIT_FAIL)

    if threading.current_thread() is threading.main_thread():
        signal.signal(HANG_SIGNAL, end)


def keep_own_streams() -> None:
    """In the child: stdout and stderr on copies of file descriptors 1 and 2, which the
    implementation does not know of, with 1 and 2 pointing there too. An implementation
    that closes 1 and 2 (as a daemonising library does) then fails its case, and the run's
    own output, its verdict included, still reaches the user.

    What was 1 and 2 is put back on them before each case
    (:func:`restore_standard_fds`).
    """
    global _OWN_FDS
    if _OWN_FDS is not None:
        return
    _OWN_FDS = (os.dup(1), os.dup(2))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    sys.stdout = os.fdopen(_OWN_FDS[0], "w", buffering=1, encoding=sys.stdout.encoding,
                           errors="backslashreplace", closefd=False)
    sys.stderr = os.fdopen(_OWN_FDS[1], "w", buffering=1, encoding=sys.stderr.encoding,
                           errors="backslashreplace", closefd=False)


def restore_standard_fds() -> None:
    """File descriptors 1 and 2 back on the child's streams where an implementation closed
    them (nothing elsewhere, or when :func:`keep_own_streams` was not called)."""
    if _OWN_FDS is None:
        return
    for fd, own in ((1, _OWN_FDS[0]), (2, _OWN_FDS[1])):
        try:
            os.fstat(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.dup2(own, fd)


#: the child's copies of file descriptors 1 and 2 (None: not made)
_OWN_FDS: tuple[int, int] | None = None


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when this process dies, so that a child
    in its own process group is not left running by a killed parent."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ChildChannel:
    """The child's side: tells the supervisor what the run is doing (a ``RunObserver``)."""

    def __init__(self, fd: int) -> None:
        self._out = os.fdopen(fd, "w", encoding="utf-8", buffering=1)

    @classmethod
    def from_environment(cls) -> ChildChannel | None:
        """The channel this process was started with, if a supervisor started it."""
        fd = os.environ.pop(CHANNEL_FD, None)
        return cls(int(fd)) if fd is not None else None

    def _say(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, allow_nan=False) + "\n"  # a record that is not JSON: a bug
        try:
            self._out.write(line)
            self._out.flush()
        except (BrokenPipeError, ValueError):
            pass  # the supervisor is gone: the run goes on and writes its report alone

    def case_started(self, impl: Any, case: Any, device: Any) -> None:
        from gradequiv.harness.reports.report import reproduce_command

        restore_standard_fds()  # an implementation that closed them closed them for itself

        self._say({"event": "case", "description": case.describe(), "case": case.to_dict(),
                   "reproduce": reproduce_command(impl, case, device)})

    def case_finished(self, record: dict[str, Any]) -> None:
        self._say({"event": "record", "record": record})

    def phase(self, what: str) -> None:
        self._say({"event": "phase", "what": what})

    def ended(self, code: int) -> None:
        """The run chose its exit code: the last word."""
        self._say({"event": "end", "code": code})
        with contextlib.suppress(OSError, ValueError):
            self._out.close()

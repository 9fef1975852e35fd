"""The files of a report folder: their names, a run's claim on it and identity, atomic writes.

Pure Python (no torch): the command line reads the names for ``--help``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from gradequiv.harness.errors import InvalidArgument

__all__ = ["LOCK_FILE", "RENDERED", "REPORT_FILE", "claim_report_dir", "lock_report_dir",
           "run_identity", "write_json_atomic", "write_text_atomic"]

#: The files a check run owns in its report folder: report.json and the views rendered from
#: it (format -> file name; ``gradequiv report`` writes the views).
REPORT_FILE = "report.json"
RENDERED = {"md": "report.md", "html": "report.html", "junit": "junit.xml"}
#: The lock of the run writing into a folder (``lock_report_dir``); never a file a run owns,
#: so ``claim_report_dir`` leaves it.
LOCK_FILE = ".gradequiv.lock"
#: the folder (inside a report folder) of minimal failures' cases, for ``--case FILE``
CASES_DIR = "cases"


def claim_report_dir(folder: Path) -> None:
    """Make ``folder`` this run's: create it, prove it writable, and remove what an earlier
    run left there (report.json, its rendered views, its case files, temporary files of
    interrupted writes),
    so a stale report is never read as this run's. Other commands' files stay, and so does
    the lock (``LOCK_FILE``) of the run that called this."""
    owned = [REPORT_FILE, *RENDERED.values()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".gradequiv-probe-")
        probe.close()
        for name in owned:
            (folder / name).unlink(missing_ok=True)
        for name in owned:
            for stale in folder.glob(f".{name}.*"):
                stale.unlink(missing_ok=True)
        for stale in folder.glob(f"{CASES_DIR}/minimal-*.json"):
            stale.unlink()
    except OSError as exc:
        raise InvalidArgument(f"--report-dir={str(folder)!r} cannot be written "
                              f"({type(exc).__name__}: {exc}); pick a folder you can write "
                              f"to") from exc


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, whole."""
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=False, allow_nan=False) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; a report is for others to read
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def run_identity(run_id: str | None = None) -> dict[str, Any]:
    """Which run wrote a report: an id (``GRADEQUIV_RUN_ID`` when a gate sets one), when it
    started, its command line and process; in a supervised child, its supervisor's."""
    given = os.environ.get("GRADEQUIV_RUN_IDENTITY")
    if given and run_id is None:
        return dict(json.loads(given))
    return {"id": run_id or os.environ.get("GRADEQUIV_RUN_ID") or uuid.uuid4().hex,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(sys.argv), "pid": os.getpid()}


#: (folder, run id) of the locks this process holds: a lock naming this process's pid is
#: alive only if listed here (else a dead run's pid came back, as in a fresh container).
_HELD: set[tuple[str, str]] = set()


@contextlib.contextmanager
def lock_report_dir(folder: Path, identity: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Hold ``folder`` for one run: no second run may write into it until the block ends.

    Creates the folder, then ``folder/.gradequiv.lock`` holding the run's identity
    (``run_identity()``: id, started, command, pid), created atomically so that of two runs
    one wins. A lock whose process is alive refuses this run with an InvalidArgument (exit
    2); a lock of a dead process, or one that is not a lock at all, is stale and taken over,
    so a crashed run never blocks the folder. Leaving the block removes the lock if it is
    still this run's. Held again by the same run (same id and pid), it is a no-op."""
    ident = dict(run_identity() if identity is None else identity)
    record = {key: ident[key] for key in ("id", "started", "command", "pid")}
    lock = Path(folder) / LOCK_FILE
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        key = (str(lock.resolve()), str(record["id"]))
        held = _acquire(lock, record, key)
    except OSError as exc:
        raise InvalidArgument(f"--report-dir={str(folder)!r} cannot be written "
                              f"({type(exc).__name__}: {exc}); pick a folder you can write "
                              f"to") from exc
    if not held:  # this run holds it already (an outer block): that block releases it
        yield
        return
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)
        if _same_run(_read_lock(lock), record):  # another run's lock (it took ours) stays
            with contextlib.suppress(OSError):
                lock.unlink()


def _acquire(lock: Path, record: dict[str, Any], key: tuple[str, str]) -> bool:
    """Create the lock (True), find it this run's already (False), or refuse."""
    text = json.dumps(record) + "\n"
    for _ in range(8):  # each round ends a race lost to another run starting or ending
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            if _same_run(_read_lock(lock), record):  # not taken away while still empty
                return True
            continue
        try:
            seen = lock.read_bytes()
        except FileNotFoundError:
            continue  # it ended meanwhile: try again
        except IsADirectoryError:
            raise
        except OSError:
            seen = b""
        holder = _parse_lock(seen)
        if holder is not None and _same_run(holder, record):
            return False
        if holder is not None and _alive(holder, key[0]):
            command = " ".join(str(holder["command"]).split())
            raise InvalidArgument(
                f"--report-dir={str(lock.parent)!r} is in use by run {holder['id']} (pid "
                f"{holder['pid']}, started {holder['started']}: {command}); wait for it to "
                f"end, or give this run another --report-dir")
        _take_away(lock, seen)
    raise InvalidArgument(f"--report-dir={str(lock.parent)!r}: could not take its lock "
                          f"{str(lock)!r} after several tries (other runs keep starting "
                          f"there); give this run another --report-dir")


def _take_away(lock: Path, stale: bytes) -> None:
    """Remove the stale lock ``stale``, and only it: moved aside first (atomic), and put
    back if what was moved is a new run's lock, written since it was read."""
    aside = lock.with_name(f"{LOCK_FILE}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return
    try:
        try:
            moved = aside.read_bytes()
        except OSError:
            moved = b""  # as unreadable as the stale one was
        if moved != stale:
            with contextlib.suppress(FileExistsError):
                os.link(aside, lock)
    finally:
        with contextlib.suppress(OSError):
            aside.unlink()


def _read_lock(lock: Path) -> dict[str, Any] | None:
    try:
        return _parse_lock(lock.read_bytes())
    except OSError:
        return None


def _parse_lock(data: bytes) -> dict[str, Any] | None:
    """A lock's record, or None when it is no lock (empty, cut short, not JSON, wrong shape)."""
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:  # 0, -1: a group
        return None
    record.setdefault("started", "?")
    record.setdefault("command", "?")
    return record


def _same_run(holder: dict[str, Any] | None, record: Mapping[str, Any]) -> bool:
    return (holder is not None and holder["id"] == record["id"]
            and holder["pid"] == record["pid"])


def _alive(holder: dict[str, Any], lock: str) -> bool:
    """Whether the process that wrote ``holder`` still runs on this machine."""
    pid: int = holder["pid"]
    if pid == os.getpid():
        return (lock, holder["id"]) in _HELD
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    except (OverflowError, OSError):
        return False  # no such process can exist
    return True

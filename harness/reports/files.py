"""The files of a report folder: their names, a run's claim on it and identity, atomic writes.

A run removes or replaces only the files it can show it wrote: each write of a report file
is recorded (size and SHA-256) in the folder's manifest, ``.gradequiv/manifest.json``.

Pure Python (no torch): the command line reads the names for ``--help``.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import os
import re
import shlex
import stat
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from gradequiv.harness.errors import InvalidArgument

__all__ = ["LOCK_FILE", "MANIFEST", "RENDERED", "REPORT_FILE", "claim_report_dir",
           "discard_set_aside", "lock_report_dir", "not_written_by_us", "run_identity",
           "take_write_failure", "unclaim_report_dir", "write_json_atomic",
           "write_text_atomic", "write_text_through"]

#: The files a check run owns in its report folder: report.json and the views rendered from
#: it (format -> file name; ``gradequiv report`` writes the views).
REPORT_FILE = "report.json"
RENDERED = {"md": "report.md", "html": "report.html", "junit": "junit.xml"}
#: The lock of the run writing into a folder (``lock_report_dir``); never a file a run owns,
#: so ``claim_report_dir`` leaves it.
LOCK_FILE = ".gradequiv.lock"
#: the folder (inside a report folder) of minimal failures' cases, for ``--case FILE``
CASES_DIR = "cases"
#: What the tool wrote in a report folder (relative path -> size and SHA-256), and the run
#: that claimed it: in a hidden folder of its own, so a listing of the reports shows none.
MANIFEST = ".gradequiv/manifest.json"
#: Where ``claim_report_dir(set_aside=True)`` keeps the earlier run's files, the manifest
#: among them, under their paths in the report folder, until the run's arguments are valid.
_SET_ASIDE = ".gradequiv/set-aside"

_OWNED = (REPORT_FILE, *RENDERED.values())
_CASE_FILE = re.compile(r"minimal-[0-9]+\.json")


def claim_report_dir(folder: Path, identity: Mapping[str, Any] | None = None, *,
                     set_aside: bool = False) -> None:
    """Make ``folder`` this run's (``identity``'s): create it, prove it writable, and remove
    what an earlier run left there (report.json, its rendered views, its case files,
    temporary files of interrupted writes), so a stale report is never read as this run's.
    Other commands' files stay, and so does the lock (``LOCK_FILE``) of the run that called
    this.

    Only files the manifest shows the tool wrote, unchanged since, are removed; a folder
    with no manifest whose report.json is a gradequiv report is one an earlier version
    wrote, and its report files are taken as that version's. Any other file under a report
    file's name (the user's own junit.xml, a symlink, a report.md edited since) refuses the
    run (InvalidArgument, exit 2) before anything is touched. Refusing, not writing beside
    it: the run's report must be at ``--report-dir``/report.json, where a gate reads it, and
    a foreign file left there would be read as this run's; so the user moves it, or picks
    another folder.

    ``set_aside``: for a run whose arguments are not all validated yet (a supervisor's),
    the earlier run's files are moved into the manifest's folder instead, for
    :func:`unclaim_report_dir` to put back if the run ends in a usage error, and for
    :func:`discard_set_aside` to remove once its arguments are valid.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _probe(folder)
        cases = folder / CASES_DIR
        if cases.exists() or cases.is_symlink():
            if cases.is_symlink() or not cases.is_dir():
                raise InvalidArgument(
                    f"--report-dir={str(folder)!r} holds {CASES_DIR!r}, which is not a folder "
                    f"(the run writes its failures' cases there); move or remove it, or pick "
                    f"another --report-dir")
            _probe(cases, what=f"--report-dir={str(folder)!r}: its folder {str(cases)!r}")
        found = [folder / name for name in _OWNED if _exists(folder / name)]
        found += sorted(p for p in folder.glob(f"{CASES_DIR}/minimal-*.json")
                        if _CASE_FILE.fullmatch(p.name))
        foreign = not_written_by_us(folder, found)
        if foreign:
            raise InvalidArgument(_foreign_message(folder, foreign))
        discard_set_aside(folder)  # an earlier run's, never put back: superseded
        if set_aside:
            aside = folder / _SET_ASIDE
            aside.mkdir(parents=True, exist_ok=True)
            for path in [*found, *_leftovers(folder), folder / MANIFEST]:
                if _exists(path):
                    moved = aside / path.relative_to(folder)
                    moved.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(path, moved)
        else:
            for path in found + _leftovers(folder):
                path.unlink(missing_ok=True)
        _write_manifest(folder, {"run": None if identity is None else dict(identity),
                                 "files": {}})
    except OSError as exc:
        raise InvalidArgument(f"--report-dir={str(folder)!r} cannot be written "
                              f"({type(exc).__name__}: {exc}); pick a folder you can write "
                              f"to") from exc


def not_written_by_us(folder: Path, paths: list[Path]) -> list[Path]:
    """Those of ``paths`` (report files in ``folder``) that gradequiv cannot show it wrote:
    not in the folder's manifest as they are now (a folder with no manifest whose
    report.json is a gradequiv report: an earlier version wrote its report files)."""
    manifest = _read_manifest(folder)
    earlier = manifest is None and _is_gradequiv_report(folder / REPORT_FILE)
    recorded = (manifest or {}).get("files", {})
    return [p for p in paths if not (_regular(p) and (
        earlier or _unchanged(p, recorded.get(p.relative_to(folder).as_posix()))))]


def unclaim_report_dir(folder: Path) -> None:
    """Undo ``claim_report_dir(folder, set_aside=True)`` for a run that ended in a usage
    error, its own report removed already: the earlier run's files back where they were,
    and the manifest as it was (none, if there was none). A name taken since keeps what is
    there now. Nothing happens where nothing was set aside."""
    aside = folder / _SET_ASIDE
    if not aside.is_dir():
        return
    manifest = folder / MANIFEST
    if not _exists(aside / MANIFEST):
        manifest.unlink(missing_ok=True)
    for path in sorted(aside.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        back = folder / path.relative_to(aside)
        if path.is_dir():
            with contextlib.suppress(OSError):
                path.rmdir()
        elif not _exists(back) or back == manifest:
            back.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, back)
    discard_set_aside(folder)
    with contextlib.suppress(OSError):
        manifest.parent.rmdir()  # made by the claim, and left empty


def discard_set_aside(folder: Path) -> None:
    """Remove what ``claim_report_dir(set_aside=True)`` set aside: the run's arguments are
    valid, so the earlier run's report is not coming back. What cannot be removed stays,
    hidden, for the next claim."""
    aside = folder / _SET_ASIDE
    if aside.is_symlink() or not aside.is_dir():
        return
    for path in [*sorted(aside.rglob("*"), key=lambda p: len(p.parts), reverse=True), aside]:
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()


def _foreign_message(folder: Path, foreign: list[Path]) -> str:
    names = [p.relative_to(folder).as_posix() for p in foreign]
    listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    them = "it" if len(names) == 1 else "them"
    return (f"--report-dir={str(folder)!r} holds {listed}, which gradequiv did not write (or "
            f"which changed since it wrote {them}); a run replaces only the report files it "
            f"wrote: pick another --report-dir, or move or remove {listed} yourself")


def _probe(folder: Path, what: str | None = None) -> None:
    """Create and remove a file in ``folder``: writable, or an InvalidArgument naming it."""
    try:
        tempfile.NamedTemporaryFile(dir=folder, prefix=".gradequiv-probe-").close()
    except OSError as exc:
        if what is None:
            raise
        raise InvalidArgument(f"{what} cannot be written ({type(exc).__name__}: "
                              f"{exc.strerror or exc}); make it writable, or pick another "
                              f"--report-dir") from exc


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _regular(path: Path) -> bool:
    """A regular file itself (not a symlink, a folder, a FIFO or a device)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _leftovers(folder: Path) -> list[Path]:
    """The temporary files of writes an interrupted run left (``write_text_atomic``'s and
    the manifest's names: a dot, the file's name, a dot and mkstemp's letters)."""
    patterns = [f".{name}.*" for name in _OWNED]
    patterns += [f"{CASES_DIR}/.minimal-*.json.*", f"{Path(MANIFEST).parent}/.manifest.json.*"]
    return [p for pattern in patterns for p in folder.glob(pattern) if _regular(p)]


def _digest(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _unchanged(path: Path, entry: Any) -> bool:
    """Whether ``path`` is still what the manifest's ``entry`` says the tool wrote."""
    if not isinstance(entry, dict):
        return False
    try:
        if path.lstat().st_size != entry.get("size"):
            return False
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return False
    return digest.hexdigest() == entry.get("sha256")


def _is_gradequiv_report(path: Path) -> bool:
    """Whether ``path`` is a report.json that gradequiv wrote (it says so, and whose run)."""
    if not _regular(path):
        return False
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return (isinstance(report, dict) and report.get("tool") == "gradequiv"
            and report.get("command") in ("check", "distributed")
            and isinstance(report.get("run"), dict))


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest; None when it has none. One that is not a manifest (cut short,
    edited) records nothing: every report file is then the user's."""
    path = folder / MANIFEST
    if not _exists(path):
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return {}
    return manifest


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    path = folder / MANIFEST
    path.parent.mkdir(exist_ok=True)
    _replace(path, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))


def _report_folder(path: Path) -> tuple[Path, str] | None:
    """The report folder that ``path`` is a report file of, and its name there (None: no
    report file's name)."""
    if path.name in _OWNED:
        return path.parent, path.name
    if path.parent.name == CASES_DIR and _CASE_FILE.fullmatch(path.name):
        return path.parent.parent, f"{CASES_DIR}/{path.name}"
    return None


def _record(path: Path, data: bytes) -> None:
    """Note in the manifest of a claimed report folder that the tool wrote ``data`` at
    ``path`` (a report file's name): what a later run may replace. A folder with no manifest
    was never claimed and gets none."""
    where = _report_folder(path)
    if where is None or not (where[0] / MANIFEST).is_file():
        return
    folder, name = where
    try:
        with _manifest_locked(folder):
            manifest = _read_manifest(folder) or {"run": None, "files": {}}
            manifest["files"][name] = _digest(data)
            _write_manifest(folder, manifest)
    except OSError as exc:
        raise _unwritable(folder / MANIFEST, exc) from exc


@contextlib.contextmanager
def _manifest_locked(folder: Path) -> Iterator[None]:
    """The manifest held by this process for a read and a write: a run's supervisor, its
    child and ``gradequiv report`` may record at once. Where the lock cannot be had (no flock on
    the file system), without it."""
    try:
        import fcntl

        fd = os.open(folder / Path(MANIFEST).parent, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


#: the writes that failed since the last ``take_write_failure``, as the errors they raised
_FAILED_WRITES: list[InvalidArgument] = []


def take_write_failure() -> InvalidArgument | None:
    """The first write of a report file that failed since the last call (then forgotten):
    a full disk or an unwritable folder met where its error could not end the run itself
    (inside the suite's pytest session)."""
    failed = _FAILED_WRITES[0] if _FAILED_WRITES else None
    _FAILED_WRITES.clear()
    return failed


def _unwritable(path: Path, exc: OSError) -> InvalidArgument:
    """A write that failed: the caller's disk or folder, said as a usage error (exit 2)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space there, or write the report to another disk"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "make its folder writable, or write the report elsewhere"
    else:
        fix = "write the report elsewhere"
    failure = InvalidArgument(f"{str(path)!r} could not be written ({type(exc).__name__}: "
                              f"{exc.strerror or exc}); {fix}")
    _FAILED_WRITES.append(failure)
    return failure


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, whole."""
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=False, allow_nan=False) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half a file.

    A report file's write in a claimed folder is recorded in its manifest. A failed write
    (a full disk, a folder that is not writable) raises an InvalidArgument naming ``path``:
    the caller's to fix, never the tool's fault."""
    data = text.encode("utf-8")
    try:
        _replace(path, data)
    except OSError as exc:
        raise _unwritable(path, exc) from exc
    _record(path, data)


def _replace(path: Path, data: bytes) -> None:
    """``data`` at ``path`` through a temporary file beside it and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; a report is for others to read
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_through(path: Path, text: str, *, name: str) -> None:
    """Write ``text`` where ``path`` leads, as a shell's ``>`` would, and never replace what
    is there with something else: a regular file (or none) is written atomically; a symlink
    is followed, and its target written (so the link stays); a FIFO or a character device
    (``/dev/stdout``, a pipe a reader waits on) is opened and written, no rename. A folder,
    a block device or a socket is refused: ``name`` (``--output='x'``) names it."""
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG  # a new file (or a dangling link's target): created
    except OSError as exc:
        raise _unwritable(path, exc) from exc
    if stat.S_ISREG(mode):
        write_text_atomic(target, text)
    elif stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
        try:
            with open(target, "w", encoding="utf-8") as handle:
                handle.write(text)
        except OSError as exc:
            raise _unwritable(path, exc) from exc
    else:
        kind = ("a folder" if stat.S_ISDIR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a file")
        raise InvalidArgument(f"{name} is {kind}, which the report would replace; name a "
                              f"file (or a FIFO), or '-' for standard output")


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
    still this run's, and the folders it created if they are still empty (a run refused for
    a usage error leaves no trace). Held again by the same run (same id and pid), it is a
    no-op."""
    ident = dict(run_identity() if identity is None else identity)
    record = {key: ident[key] for key in ("id", "started", "command", "pid")}
    lock = Path(folder) / LOCK_FILE
    try:
        created = [p for p in (Path(folder), *Path(folder).parents) if not _exists(p)]
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
        for made in created:  # deepest first; a folder anything was written into stays
            with contextlib.suppress(OSError):
                made.rmdir()


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

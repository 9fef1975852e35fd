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
from pathlib import Path
from typing import Any

from gradequiv.harness.errors import InvalidArgument

__all__ = ["RENDERED", "REPORT_FILE", "claim_report_dir", "run_identity", "write_json_atomic",
           "write_text_atomic"]

#: The files a check run owns in its report folder: report.json and the views rendered from
#: it (format -> file name; ``gradequiv report`` writes the views).
REPORT_FILE = "report.json"
RENDERED = {"md": "report.md", "html": "report.html", "junit": "junit.xml"}


def claim_report_dir(folder: Path) -> None:
    """Make ``folder`` this run's: create it, prove it writable, and remove what an earlier
    run left there (report.json, its rendered views, temporary files of interrupted writes),
    so a stale report is never read as this run's. Other commands' files stay."""
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
    started, its command line and process."""
    return {"id": run_id or os.environ.get("GRADEQUIV_RUN_ID") or uuid.uuid4().hex,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(sys.argv), "pid": os.getpid()}

"""One run at a time in a report folder: ``lock_report_dir`` refuses a live holder, takes
over a dead or broken lock, and removes only its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.reports.files import (
    LOCK_FILE,
    REPORT_FILE,
    claim_report_dir,
    lock_report_dir,
    run_identity,
    write_json_atomic,
)


def identity(run_id: str, pid: int | None = None) -> dict[str, Any]:
    return {**run_identity(run_id), "pid": os.getpid() if pid is None else pid}


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def live_other() -> Any:
    """Another live process, and its pid."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child.pid
    child.kill()
    child.wait()


def test_the_lock_names_the_run_and_goes_when_the_block_ends(tmp_path: Path) -> None:
    folder = tmp_path / "new" / "reports"  # created on the way
    me = identity("run-a")
    with lock_report_dir(folder, me):
        written = json.loads((folder / LOCK_FILE).read_text())
        assert written == {key: me[key] for key in ("id", "started", "command", "pid")}
    assert not (folder / LOCK_FILE).exists()
    with pytest.raises(RuntimeError), lock_report_dir(folder, me):
        raise RuntimeError("the run failed")
    assert not (folder / LOCK_FILE).exists()  # a failing run lets go too


def test_a_live_holder_refuses_a_second_run_with_one_line(tmp_path: Path,
                                                          live_other: int) -> None:
    holder = identity("run-a", pid=live_other) | {"command": "gradequiv check\n--impl torch"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    with pytest.raises(InvalidArgument) as caught, lock_report_dir(tmp_path, identity("run-b")):
        pytest.fail("a second run got the folder")
    message = str(caught.value)
    assert message == (f"--report-dir={str(tmp_path)!r} is in use by run run-a (pid "
                       f"{live_other}, started {holder['started']}: gradequiv check --impl "
                       f"torch); wait for it to end, or give this run another --report-dir")
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == holder  # left as it was


def test_a_held_lock_in_this_process_refuses_another_run(tmp_path: Path) -> None:
    with lock_report_dir(tmp_path, identity("run-a")):
        with pytest.raises(InvalidArgument, match="is in use by run run-a"):
            with lock_report_dir(tmp_path, identity("run-b")):
                pytest.fail("a second run got the folder")
        assert json.loads((tmp_path / LOCK_FILE).read_text())["id"] == "run-a"
        with lock_report_dir(tmp_path, identity("run-a")):  # the same run: a no-op
            pass
        assert (tmp_path / LOCK_FILE).exists()  # ... that leaves the outer block's lock
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_dead_run_s_lock_is_taken_over(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_text(json.dumps(identity("crashed", pid=dead_pid())))
    with lock_report_dir(tmp_path, identity("run-b")):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["id"] == "run-b"
    assert sorted(os.listdir(tmp_path)) == []  # nothing left: no lock, no set-aside copy


def test_a_lock_naming_this_pid_but_no_block_of_ours_is_stale(tmp_path: Path) -> None:
    # A dead run whose pid came back as this process's (a fresh container's pid 7).
    (tmp_path / LOCK_FILE).write_text(json.dumps(identity("earlier-life")))
    with lock_report_dir(tmp_path, identity("run-b")):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["id"] == "run-b"


@pytest.mark.parametrize("garbage", [b"", b"{half", b"\xff\xfe", b"[1, 2]", b'{"id": "x"}',
                                     b'{"id": "x", "pid": 0}', b'{"id": "x", "pid": true}',
                                     b'{"id": 5, "pid": 1}'],
                         ids=["empty", "cut", "binary", "list", "no-pid", "pid-0", "pid-bool",
                              "id-int"])
def test_a_lock_that_is_no_lock_is_taken_over(tmp_path: Path, garbage: bytes) -> None:
    (tmp_path / LOCK_FILE).write_bytes(garbage)
    with lock_report_dir(tmp_path, identity("run-b")):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["id"] == "run-b"
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_another_run_put_in_place_of_ours_is_not_removed(tmp_path: Path,
                                                                 live_other: int) -> None:
    other = json.dumps(identity("run-c", pid=live_other))
    with lock_report_dir(tmp_path, identity("run-b")):
        (tmp_path / LOCK_FILE).write_text(other)  # e.g. it judged ours stale
    assert (tmp_path / LOCK_FILE).read_text() == other


def test_claiming_the_folder_keeps_the_lock(tmp_path: Path) -> None:
    """What an earlier run wrote goes (its report, a half-written temporary file); the lock
    stays, and so does the record of what the tool wrote (a user's own report.json is
    refused instead: tests/test_own_files.py)."""
    with lock_report_dir(tmp_path, identity("run-a")):
        claim_report_dir(tmp_path)
        write_json_atomic(tmp_path / REPORT_FILE, {})
        (tmp_path / f".{REPORT_FILE}.tmp123").write_text("half")
        claim_report_dir(tmp_path)
        assert sorted(os.listdir(tmp_path)) == [".gradequiv", LOCK_FILE]


def test_a_folder_that_cannot_hold_a_lock_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidArgument, match="cannot be written"):
        with lock_report_dir(tmp_path / "file", identity("run-a")):
            pytest.fail("locked a folder inside a file")

"""A run removes or replaces only the files it wrote; a report goes where ``--output`` leads
without replacing what is there; a case's fields are bounded, and a disk or folder that
cannot be written is the user's to fix (exit 2), never a fault of gradequiv."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness.cli import main
from gradequiv.harness.engine.case import CASE_BOUNDS, MAX_CASE_SEED, MAX_STEPS
from gradequiv.harness.engine.spread import MAX_CASE_FILE_BYTES, load_case
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.reports import files
from gradequiv.harness.reports.files import (
    MANIFEST,
    claim_report_dir,
    discard_set_aside,
    unclaim_report_dir,
    write_json_atomic,
    write_text_atomic,
)

TESTS = Path(__file__).resolve().parent
GRADEQUIV = Path(sys.executable).with_name("gradequiv")
ONE = ["--case", "1L-layer-dropout"]
#: what a user keeps in a folder they then hand to --report-dir
THEIRS = {"junit.xml": "<testsuite name='mine'/>\n", "report.md": "# my notes\n",
          "report.json": '{"mine": true}\n'}


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``, hidden ones too: a file's bytes, else what it is."""
    seen: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        mode = path.lstat().st_mode
        seen[path.relative_to(folder).as_posix()] = (
            path.read_bytes() if stat.S_ISREG(mode) else f"mode {stat.S_IFMT(mode):o}")
    return seen


def _theirs(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in THEIRS.items():
        (folder / name).write_text(text)


def _gradequiv(*args: str, pythonpath: Path = TESTS,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The console script, supervised, as a user runs it."""
    environ = dict(os.environ, PYTHONPATH=str(pythonpath), **(env or {}))
    return subprocess.run([str(GRADEQUIV), *args], capture_output=True, text=True, env=environ,
                          cwd=TESTS, timeout=600, check=False)


def _a_report(folder: Path, run_id: str = "an-earlier-run") -> None:
    """A valid, incomplete report.json of a gradequiv run, as ``check`` writes first."""
    from gradequiv.harness.options import check_options
    from gradequiv.harness.reports.report import starting_report

    options = check_options(impl="torch", profile="ci")
    write_json_atomic(folder / "report.json", starting_report(
        options, {"id": run_id, "started": "2026-01-01T00:00:00+00:00",
                  "command": "gradequiv check", "pid": 1}))


# A run deletes or replaces only files it wrote


@pytest.mark.parametrize("held", ["the user's files", "an earlier run's report", "nothing"])
def test_a_usage_error_found_in_the_child_leaves_the_folder_as_it_was(
        tmp_path: Path, held: str) -> None:
    """The typo in --impl is found in the child, after the supervisor took the folder: the
    report of an earlier run it set aside comes back (and stays the folder's last word), a
    folder that was not there is not left behind, and the user's own junit.xml, report.md
    and report.json refuse the run before anything is touched."""
    folder = tmp_path / "new" / "results"
    if held == "the user's files":
        _theirs(folder)
    elif held == "an earlier run's report":
        claim_report_dir(folder)
        _a_report(folder)
        write_text_atomic(folder / "report.md", "## gradequiv\n")
    before = _snapshot(tmp_path)
    done = _gradequiv("check", "--impl", "torch.utils:checkpointt", *ONE,
                      "--report-dir", str(folder))
    assert done.returncode == 2, done.stderr
    said = ("--report-dir" if held == "the user's files"  # refused before the child starts
            else "--impl='torch.utils:checkpointt'")
    assert done.stderr.startswith(f"gradequiv: error: {said}")
    assert _snapshot(tmp_path) == before


def test_a_run_refuses_a_folder_holding_files_it_did_not_write(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _theirs(tmp_path)
    before = _snapshot(tmp_path)
    code = main(["check", "--in-process", "--impl", "torch", *ONE,
                 "--report-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"gradequiv: error: --report-dir={str(tmp_path)!r} holds "
                          f"report.json, report.md, junit.xml, which gradequiv did not write")
    assert "pick another --report-dir, or move or remove" in err
    assert _snapshot(tmp_path) == before


def test_what_the_tool_wrote_is_replaced_and_what_changed_since_is_not(tmp_path: Path) -> None:
    claim_report_dir(tmp_path)
    _a_report(tmp_path)
    write_text_atomic(tmp_path / "report.md", "## gradequiv\n")
    write_text_atomic(tmp_path / "junit.xml", "<testsuite/>\n")
    write_json_atomic(tmp_path / "cases" / "minimal-1.json", {"seed": 1})
    (tmp_path / "notes.txt").write_text("mine")  # another name: never a report file
    recorded = json.loads((tmp_path / MANIFEST).read_text())["files"]
    assert sorted(recorded) == ["cases/minimal-1.json", "junit.xml", "report.json",
                                "report.md"]
    claim_report_dir(tmp_path)  # all the tool's, unchanged: removed
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")
                  if p.is_file() and ".gradequiv" not in p.parts) == ["notes.txt"]
    _a_report(tmp_path)
    write_text_atomic(tmp_path / "report.md", "## gradequiv\n")
    (tmp_path / "report.md").write_text("## gradequiv\nmy own remark\n")  # edited since
    before = _snapshot(tmp_path)
    with pytest.raises(InvalidArgument, match=r"holds report\.md, which gradequiv did not "
                                              r"write \(or which changed since it wrote it\)"):
        claim_report_dir(tmp_path)
    assert _snapshot(tmp_path) == before  # report.json, the tool's, stays with it


def test_a_symlink_at_a_report_name_is_neither_followed_nor_removed(tmp_path: Path) -> None:
    folder, mine = tmp_path / "r", tmp_path / "mine.md"
    mine.write_text("keep me\n")
    claim_report_dir(folder)
    (folder / "report.md").symlink_to(mine)
    with pytest.raises(InvalidArgument, match=r"holds report\.md, which gradequiv did not"):
        claim_report_dir(folder)
    assert (folder / "report.md").is_symlink() and mine.read_text() == "keep me\n"


def test_files_set_aside_go_back_on_a_usage_error_and_go_once_the_run_is_valid(
        tmp_path: Path) -> None:
    """What a supervisor's claim does before the child has validated the arguments, and
    the two ways it ends."""
    claim_report_dir(tmp_path)
    _a_report(tmp_path)
    write_json_atomic(tmp_path / "cases" / "minimal-1.json", {"seed": 1})
    (tmp_path / ".report.md.x1y2z3ab").write_text("half a view")  # an interrupted write
    before = _snapshot(tmp_path)
    claim_report_dir(tmp_path, set_aside=True)
    assert not (tmp_path / "report.json").exists()  # never read as the new run's
    assert not (tmp_path / "cases" / "minimal-1.json").exists()
    unclaim_report_dir(tmp_path)
    assert _snapshot(tmp_path) == before
    claim_report_dir(tmp_path, set_aside=True)
    discard_set_aside(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        ".gradequiv", ".gradequiv/manifest.json", "cases"]
    fresh = tmp_path / "fresh"
    claim_report_dir(fresh, set_aside=True)
    unclaim_report_dir(fresh)
    assert not list(fresh.iterdir())


def test_a_run_ending_in_its_start_up_leaves_its_own_report_not_the_earlier_one(
        tmp_path: Path) -> None:
    """The child dies while importing the implementation, before it has validated the
    arguments: the report is this run's, not the earlier one's rewritten."""
    (tmp_path / "dies_on_import.py").write_text("import os\nos._exit(0)\n")
    folder = tmp_path / "report"
    claim_report_dir(folder)
    _a_report(folder)
    done = _gradequiv("check", "--impl", "dies_on_import:checkpoint", *ONE,
                      "--report-dir", str(folder), pythonpath=tmp_path,
                      env={"GRADEQUIV_RUN_ID": "this-run"})
    assert done.returncode == 1, done.stderr
    assert "ended the process during start-up" in done.stderr
    report = json.loads((folder / "report.json").read_text())
    assert report["run"]["id"] == "this-run"
    assert report["complete"] is False and report["failure"]["property"] == "process"


def test_a_folder_whose_cases_folder_cannot_be_written_is_refused_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Report folder writable, its cases/ not (simulated: the tests run as root): exit 2
    naming cases/, before the run and before anything is removed."""
    claim_report_dir(tmp_path)
    _a_report(tmp_path)
    (tmp_path / "cases").mkdir()
    before = _snapshot(tmp_path)
    real = files.tempfile.NamedTemporaryFile

    def no_write_in_cases(*args: Any, **kwargs: Any) -> Any:
        if Path(kwargs.get("dir", ".")).name == "cases":
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(*args, **kwargs)

    monkeypatch.setattr(files.tempfile, "NamedTemporaryFile", no_write_in_cases)
    code = main(["check", "--in-process", "--impl", "torch", *ONE,
                 "--report-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.startswith(f"gradequiv: error: --report-dir={str(tmp_path)!r}: its folder "
                          f"{str(tmp_path / 'cases')!r} cannot be written (PermissionError")
    assert "gradequiv check:" not in out  # refused before the suite
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize(("impl", "failing", "error"), [
    ("torch", "report.json", OSError(errno.ENOSPC, "No space left on device")),
    ("wrong_impls:skewed_gradients", "cases/minimal-1.json",
     PermissionError(errno.EACCES, "Permission denied")),
], ids=["full-disk-once", "cases-not-writable"])
def test_a_write_failing_mid_run_is_exit_2_naming_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        impl: str, failing: str, error: OSError) -> None:
    """A write that fails inside the suite's pytest session (an error there is pytest's
    internal error, the run's last report.json written all the same): exit 2 naming the
    file, never a verdict, never a fault of gradequiv."""
    real, failed = files._replace, []

    def fails_once(path: Path, data: bytes) -> None:
        if path == tmp_path / failing and not failed:
            failed.append(path)
            raise error
        real(path, data)

    monkeypatch.setattr(files, "_replace", fails_once)
    monkeypatch.syspath_prepend(str(TESTS))
    code = main(["check", "--in-process", "--impl", impl, *ONE, "--no-shrink",
                 "--report-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert failed and code == 2, err
    fix = ("free space there, or write the report to another disk" if failing == "report.json"
           else "make its folder writable, or write the report elsewhere")
    assert err.strip().splitlines()[-1] == (
        f"gradequiv: error: {str(tmp_path / failing)!r} could not be written "
        f"({type(error).__name__}: {error.strerror}); {fix}")
    assert "fault of gradequiv" not in err


# report --output never replaces what is at PATH with a regular file


@pytest.fixture
def rendered(tmp_path: Path) -> Path:
    folder = tmp_path / "r"
    claim_report_dir(folder)
    _a_report(folder)
    return folder


def test_output_through_a_symlink_writes_its_target(rendered: Path, tmp_path: Path) -> None:
    target, link = tmp_path / "target.md", tmp_path / "link.md"
    target.write_text("old\n")
    link.symlink_to(target)
    assert main(["report", str(rendered), "--format", "md", "--output", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text().startswith("## gradequiv")


def test_output_into_a_fifo_writes_it_as_a_redirect_would(rendered: Path,
                                                           tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    assert main(["report", str(rendered), "--format", "md", "--output", str(fifo)]) == 0
    reader.join(timeout=60)
    assert not reader.is_alive() and got[0].startswith("## gradequiv")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def _a_null_device(folder: Path) -> Path:
    """A character device to write into: a null device made in ``folder`` where this may
    (root), else /dev/null where nothing could replace it (its folder not writable)."""
    made = folder / "null"
    try:
        os.mknod(made, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        made.write_text("")  # not on a nodev mount
        return made
    except OSError:
        null = Path("/dev/null")
        if os.access(null.parent, os.W_OK) or not os.access(null, os.W_OK):
            pytest.skip("no device node to write into that a regression could not replace")
        return null


def test_output_into_a_character_device_keeps_the_device(rendered: Path,
                                                         tmp_path: Path) -> None:
    device = _a_null_device(tmp_path)
    before = device.stat()
    assert main(["report", str(rendered), "--format", "junit", "--output", str(device)]) == 0
    after = device.lstat()
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino


def test_output_onto_a_folder_is_refused(rendered: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    assert main(["report", str(rendered), "--format", "md", "--output", str(folder)]) == 2
    assert capsys.readouterr().err == (
        f"gradequiv: error: --output={str(folder)!r} is a folder, which the report would "
        f"replace; name a file (or a FIFO), or '-' for standard output\n")
    assert folder.is_dir() and not list(folder.iterdir())


def test_a_full_disk_under_report_is_exit_2_and_keeps_the_old_file(
        rendered: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    files.write_text_atomic(rendered / "report.md", "the old view\n")  # gradequiv's own

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full_disk)
    assert main(["report", str(rendered), "--format", "md"]) == 2
    assert capsys.readouterr().err == (
        f"gradequiv: error: {str(rendered / 'report.md')!r} could not be written (OSError: "
        f"No space left on device); free space there, or write the report to another "
        f"disk\n")
    assert (rendered / "report.md").read_text() == "the old view\n"
    assert not list(rendered.glob(".report.md.*"))  # no temporary file left


# Guards: every field of a case read from JSON is bounded


@pytest.mark.parametrize(("case", "message"), [
    ({"steps": MAX_STEPS + 1}, f"steps={MAX_STEPS + 1}: a case may take at most {MAX_STEPS} "
                               f"optimizer steps; pick steps from 2 to {MAX_STEPS}"),
    ({"seed": MAX_CASE_SEED + 1}, f"seed={MAX_CASE_SEED + 1}: must be at most {MAX_CASE_SEED}"),
    ({"seed": True}, "seed=True: must be a whole number >= 0"),
    ({"backward_passes": True}, "backward_passes=True: must be 1, 2 or 3"),
    ({"name": "x" * 201}, "must be a string of at most 200 characters; shorten it"),
    ({"model": {"layer_repeats": 10**6}},
     f"model.layer_repeats=1000000: a case may have at most "
     f"{CASE_BOUNDS['model']['layer_repeats']}; pick a layer_repeats from 1 to"),
    ({"model": {"n_layer": 10**6, "n_embd": 2, "n_head": 1}},
     "model.n_layer=1000000: a case may have at most 64; pick a n_layer from 1 to 64"),
    ({"model": {"n_layer": True}}, "model.n_layer=True: must be a whole number"),
    ({"batch": {"batch_size": 0}}, "batch_size=0: must be a whole number >= 1"),
    ({"granularity": "group:1000"}, "granularity='group:1000': K may be at most 64"),
    ({"granularity": 3}, "granularity=3 is not a string"),
    ({"model_kind": "batchnorm", "model": {"momentum": "fast"},
      "batch": {"batch_size": 4, "seq_len": 1}},
     "model.momentum='fast': must be a number from 0 to 1"),
    ({"model_kind": "batchnorm", "model": {"n_classes": 10**7},
      "batch": {"batch_size": 4, "seq_len": 1}}, "model.n_classes=10000000: a case may have"),
], ids=["steps", "seed", "seed-bool", "passes-bool", "name", "repeats", "layers",
        "layers-bool", "batch", "group-k", "granularity-type", "momentum", "classes"])
def test_a_case_field_out_of_bounds_is_refused(case: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        load_case(json.dumps(case))
    assert message in str(caught.value)


def test_a_case_out_of_bounds_is_exit_2_before_the_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--in-process", "--impl", "torch", "--case",
                 json.dumps({"steps": 10**9})])
    out, err = capsys.readouterr()
    assert code == 2 and "gradequiv check:" not in out
    assert err == (f"gradequiv: error: steps=1000000000: a case may take at most {MAX_STEPS} "
                   f"optimizer steps; pick steps from 2 to {MAX_STEPS} (2 checks the "
                   f"trajectory)\n")


def test_a_case_file_that_is_no_case_file_is_refused_unread(tmp_path: Path) -> None:
    fifo = tmp_path / "case.json"
    os.mkfifo(fifo)  # read whole, it would wait for a writer forever
    with pytest.raises(InvalidArgument, match=r"case\.json' is not a file"):
        load_case(str(fifo))
    big = tmp_path / "big.json"
    big.write_text('{"name": "' + "x" * MAX_CASE_FILE_BYTES + '"}')
    with pytest.raises(InvalidArgument, match=f"holds more than {MAX_CASE_FILE_BYTES} bytes"):
        load_case(str(big))
    with pytest.raises(InvalidArgument, match="is not valid JSON"):
        load_case('{"seed": ' + "9" * 5000 + "}")  # past int()'s digits: a ValueError


def test_report_renders_over_its_own_views_but_not_over_a_users_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder a check claimed: rendering again replaces the views gradequiv wrote, and a
    junit.xml the user put there since is refused (exit 2) and left as it is."""
    folder = tmp_path / "r"
    assert main(["check", "--impl", "torch", "--case", "1L-layer-dropout", "--in-process",
                 "--report-dir", str(folder)]) == 0
    assert main(["report", str(folder), "--format", "all"]) == 0
    assert main(["report", str(folder), "--format", "all"]) == 0  # its own, again
    (folder / "junit.xml").write_text("<mine/>", encoding="utf-8")
    capsys.readouterr()
    assert main(["report", str(folder), "--format", "junit"]) == 2
    assert "holds junit.xml, which gradequiv did not write" in capsys.readouterr().err
    assert (folder / "junit.xml").read_text(encoding="utf-8") == "<mine/>"

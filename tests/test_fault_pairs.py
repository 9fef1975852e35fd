"""A checkpoint with two faults, each alone in cases of its own: the run names both in its
headline, each with a case that shows it, in report.json's ``faults`` and the terminal alike.
Whole check runs: marker slow."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from gradequiv.harness.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("spec", "causes"), [
    ("fault_pairs:rng_and_autocast", {"rng-not-restored", "autocast-lost"}),
    ("fault_pairs:autocast_and_nested", {"autocast-lost", "input-grads-dropped"}),
    ("fault_pairs:rng_and_kwargs", {"rng-not-restored", "inputs-lost"}),
])
def test_both_faults_of_a_checkpoint_are_in_the_headline(spec: str, causes: set[str],
                                                          tmp_path: Path) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["check", "--impl", spec, "--examples", "5", "--report-dir",
                     str(tmp_path), "--in-process"])
    assert code == 1
    report = json.loads((tmp_path / "report.json").read_text())
    found = [f["cause"] for f in report["faults"]]
    assert causes <= set(found), found
    summary = out.getvalue()[out.getvalue().index("= gradequiv ="):]
    assert f"likely causes ({len(found)} distinct faults):" in summary
    for fault in report["faults"]:
        assert fault["sentence"] in summary and fault["reproduce"]

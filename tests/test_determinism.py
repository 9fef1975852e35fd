"""Same seed, same result: a failing run too, whatever the machine's speed.

Hypothesis has two wall-clock limits that would make a failing run depend on
how fast the machine is: it goes on looking for other bugs for 10 s after the
first, and it stops shrinking after 300 s. The suite turns both off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis.internal.conjecture import engine

TESTS = Path(__file__).resolve().parent
GRADEQUIV = Path(sys.executable).with_name("gradequiv")
#: what may differ between two runs of the same seed: timings, who ran it, and the report
#: folder the short reproduce line names
VARYING = {"seconds", "run", "pid", "started", "reproduce_file"}


def _without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in VARYING}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _failing_run(folder: Path) -> dict[str, Any]:
    done = subprocess.run(
        [str(GRADEQUIV), "check", "--impl", "torch", "--impl-kwarg", "preserve_rng_state=false",
         "--model", "user_models:residual_stack", "--seed", "7", "--examples", "3",
         "--report-dir", str(folder)],
        capture_output=True, text=True, cwd=TESTS, timeout=600, check=False,
        env=dict(os.environ, PYTHONPATH=str(TESTS)))
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr
    return dict(json.loads((folder / "report.json").read_text()))


@pytest.mark.slow
def test_two_failing_runs_of_one_seed_give_one_report(tmp_path: Path) -> None:
    first, second = _failing_run(tmp_path / "a"), _failing_run(tmp_path / "b")
    assert first["minimal_failures"], "the run must fail, or it proves nothing"
    assert _without_timings(first) == _without_timings(second)


def test_no_wall_clock_limit_decides_what_a_run_tries(tmp_path: Path) -> None:
    """After the first bug the search stops (no 10 s of looking for more), and shrinking
    is bounded by a count of shrinks, not by Hypothesis's 300 s."""
    import importlib

    from gradequiv.harness.cli import main  # noqa: F401  # the plugin's options load with it
    from gradequiv.properties import runtime

    runtime.RUN = runtime.SuiteState()
    sys.modules.pop("gradequiv.properties.test_recompute", None)
    suite = importlib.import_module("gradequiv.properties.test_recompute")
    settings = suite.test_gradients._hypothesis_internal_use_settings
    assert settings.report_multiple_bugs is False
    assert engine.MAX_SHRINKING_SECONDS >= 10**6

"""A fresh process's view: named cases are verified as the first case of a new process, so an
implementation's process-wide state, set by whichever case ran first, cannot hide a fault a
training process meets on its first step (modelscope/ms-swift#10142's shared cache)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from gradequiv.harness import find_case, resolve, verify
from gradequiv.harness.engine.fresh import Ahead, FreshProcesses, resolvable
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.properties.assertions import FRESH_ONLY

MUTANT = "gradequiv.harness.implementations.faults:trainable_cached_per_process"
FROZEN = "3L-layer-frozen-layer-dropout"  # its first segment frozen: the first call is frozen


def test_a_process_wide_cache_passes_after_other_cases_and_fails_in_a_fresh_process() -> None:
    impl = resolve(MUTANT)
    assert verify(impl, find_case("1L-layer-dropout")).passed  # sets the process's cache
    assert verify(impl, find_case(FROZEN)).passed  # hidden here
    fresh = FreshProcesses()
    try:
        verdict = fresh.verify(impl, find_case(FROZEN), "cpu")
        assert not verdict.passed and verdict.error is None
        assert "gradients" in {p.name for p in verdict.properties if p.passed is False}
        assert fresh.verify(resolve("torch"), find_case(FROZEN), "cpu").passed
        assert fresh.localise(impl, find_case(FROZEN), "cpu").divergence is None
    finally:
        fresh.close()
    assert not multiprocessing.active_children()
    from multiprocessing import forkserver

    assert forkserver._forkserver._forkserver_pid is None  # no server left running


def test_cases_verified_ahead_are_handed_over_as_fresh_verdicts_and_stopped_cleanly() -> None:
    """The suite's named cases run in fresh children on a thread while its drawn cases run:
    each verdict is the fresh one (the cached mutant fails there), asked for in any order;
    a key never queued is not taken; stopping ends the child running."""
    impl = resolve(MUTANT)
    verify(impl, find_case("1L-layer-dropout"))  # this process's cache, set by a trained layer
    fresh = FreshProcesses()
    names = [FROZEN, "1L-layer-dropout", "2L-layer-nodropout", "2L-layer-manual-attn"]
    try:
        ahead = Ahead(fresh, [(name, impl, find_case(name), "cpu", {}) for name in names])
        assert ahead.take("1L-layer-dropout").passed
        assert not ahead.take(FROZEN).passed  # fresh: the first call is the frozen segment
        assert ahead.take("not queued") is None
        ahead.stop()
        assert not ahead.thread.is_alive()
        taken = ahead.take("2L-layer-manual-attn")  # stopped before it, or done before that
        assert taken is None or taken.passed
    finally:
        fresh.close()
    assert not multiprocessing.active_children()


def test_only_an_implementation_another_process_can_build_goes_there() -> None:
    assert resolvable(resolve("torch")) and resolvable(resolve(MUTANT))
    assert not resolvable(Implementation("made-here", lambda f, *a, **k: f(*a, **k)))


def test_the_suite_names_a_failure_only_a_fresh_process_meets(
        pytester: pytest.Pytester, tmp_path: Path) -> None:
    assert verify(resolve(MUTANT), find_case("1L-layer-dropout")).passed  # this process: set
    result = pytester.runpytest(
        "--pyargs", "gradequiv.properties", "-p", "no:cacheprovider", "-k",
        f"test_named_case and ({FROZEN} or 1L-layer-dropout)", f"--gradequiv-impl={MUTANT}",
        f"--gradequiv-report-dir={tmp_path}")
    result.assert_outcomes(passed=1, failed=1)
    failure = json.loads((tmp_path / "report.json").read_text())["failure"]
    assert failure["message"].startswith(f"{FRESH_ONLY}: ")
    assert failure["diagnosis"]["cause"] == "process-state"
    assert failure["diagnosis"]["sentence"].startswith(
        "the implementation keeps state across cases at process level, set by its first call")
    assert "flaky" not in failure["diagnosis"]["sentence"] and not failure["flaky"]


def test_an_object_only_this_process_has_stays_here() -> None:
    from dataclasses import replace

    from gradequiv.harness.engine.fresh import portable
    from gradequiv.models import ExternalConfig

    case = find_case(FROZEN)
    assert portable(resolve("torch"), case)
    here = replace(case, model=ExternalConfig("gradequiv.harness.api:given.model_1"))
    assert not portable(resolve("torch"), here)
    assert not resolvable(Implementation("gradequiv.harness.api:given.impl_1",
                                         lambda f, *a, **k: f(*a, **k)))

"""Assert one property of one case, the way a failure should read.

A failure message gives the property's first failure, the case as JSON and
a command that replays exactly that case. The minimal failure of a test is
replayed once outside the cache (``replay_passes``); one that does not come
back is called flaky: the implementation is nondeterministic, a failure of
its own kind.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import currently_in_test_context, event, target

from gradequiv.harness import Case, Implementation, Verdict, verify
from gradequiv.harness.reports.report import reproduce_command, verdict_record
from gradequiv.properties import runtime

CASE_KEY, FAILURE_KEY = runtime.CASE_KEY, runtime.FAILURE_KEY


def assert_property(name: str, impl: Implementation, case: Case, node: pytest.Item) -> None:
    """Fail the running test unless property ``name`` holds for ``case``."""
    __tracebackhide__ = True
    run = runtime.RUN
    run.used = impl
    device = run.device()
    verdict, fresh = run.cache.verify(impl, case, device)
    if fresh:
        record = verdict_record(impl, verdict, device)
        node.user_properties.append((CASE_KEY, record))
        run.record(record)
    if currently_in_test_context():
        _statistics(case, verdict)
    message = _failure(name, verdict)
    if not message:
        return
    command = reproduce_command(impl, case, device)
    failure = {"property": name, "message": message, "flaky": False,
               "case": case.to_dict(), "description": case.describe(), "reproduce": command}
    node.user_properties[:] = [p for p in node.user_properties if p[0] != FAILURE_KEY]
    node.user_properties.append((FAILURE_KEY, failure))
    pytest.fail(
        f"property {name!r} failed for {case.describe()}\n  {message}\n"
        f"  case: {case.to_json()}\n  reproduce: {command}",
        pytrace=False,
    )


def replay_passes(impl: Implementation, failure: dict[str, Any]) -> bool:
    """Run a failure's case again, outside the cache: does the property hold now?"""
    case = Case.from_dict(failure["case"])
    run = runtime.RUN
    verdict = verify(impl, case, device=run.device(), tolerance=run.tolerance(case))
    return _failure(failure["property"], verdict) == ""


def locate(impl: Implementation, failure: dict[str, Any]) -> None:
    """Add to a minimal failure the first recompute op that differs from the original
    forward (``localisation``, and ``first_diverging_op`` when one is found)."""
    from gradequiv.harness.engine.localise import localise

    case = Case.from_dict(failure["case"])
    key = (runtime.implementation_key(impl), case.to_json())
    located = runtime.RUN.cache.located  # the failing tests of a run often share their minimal case
    if key not in located:
        located[key] = localise(impl, case, runtime.RUN.device())
    found = located[key]
    failure["localisation"] = found.describe()
    failure["first_diverging_op"] = found.divergence.to_dict() if found.divergence else None


def _failure(name: str, verdict: Verdict) -> str:
    if verdict.error is not None:
        return verdict.first_failure + "\n" + verdict.error
    prop = next(p for p in verdict.properties if p.name == name)
    return prop.first_failure if prop.passed is False else ""


def _statistics(case: Case, verdict: Verdict) -> None:
    """Hypothesis statistics: regimes seen, and the worst error (a target to push up)."""
    event(f"dtype {case.dtype}")
    event(f"granularity {case.granularity.kind}")
    event("random ops on" if case.model.has_randomness else "random ops off")
    worst = max((c.rel_error / c.bound if c.bound else (c.rel_error > 0) * 1e9
                 for p in verdict.properties for c in p.checks), default=0.0)
    if 0 < worst < float("inf"):  # a zero score would only bias the search
        target(min(worst, 1e9), label="worst relative error / bound")

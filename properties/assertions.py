"""Assert one property of one case, the way a failure should read.

A failure message gives the property's first failure, the case as JSON and
a command that replays exactly that case. The minimal failure of a test is
replayed once outside the cache (``replay_passes``); one that does not come
back is called flaky: the implementation is nondeterministic, a failure of
its own kind.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import currently_in_test_context, event, reject, target

from gradequiv.harness import Case, Implementation, Verdict, verify
from gradequiv.harness.engine.verify import verify_without_autocast_cache
from gradequiv.harness.errors import user_frames
from gradequiv.harness.reports.diagnosis import MEMORY_FINDINGS, divergence_cause, state_name
from gradequiv.harness.reports.report import (
    SHRINK_KEY,
    pytest_reproduce_command,
    reproduce_command,
    verdict_record,
)
from gradequiv.properties import runtime

CASE_KEY, FAILURE_KEY = runtime.CASE_KEY, runtime.FAILURE_KEY
FURTHER_SEARCHES = runtime.FURTHER_SEARCHES


def assert_property(name: str, impl: Implementation, case: Case, node: pytest.Item, *,
                    found_by: str | None = None) -> None:
    """Fail the running test unless property ``name`` holds for ``case``.

    ``found_by`` names the earlier test whose minimal failure ``case`` is, when this test
    fails on it without a search of its own.
    """
    __tracebackhide__ = True
    run = runtime.RUN
    run.used = impl
    run.verify_named_fresh(impl)  # its fork server starts now, beside the drawn cases
    # one place for every route, a fixture's too
    declined = impl.declines(case.grad_mode, case.features())
    if declined:
        if currently_in_test_context() and run.options.case is None:
            reject()  # a drawn case: draw another
        pytest.skip(f"{case.describe()}: {declined}")
    device = run.device()
    # After a test's first failure (of this search), every new case it runs is Hypothesis
    # shrinking it: counted in the report, not kept (only the minimal one is).
    search = run.further.get(node.name, 0)
    shrinking = any(f.get("search", 0) == search for f in _failures(node))
    if shrinking and not run.cache.has(impl, case, device):
        smallest = run.shrinking[1] if run.shrinking else case
        # Not tried: a case costlier than the smallest failure so far (Hypothesis's order of
        # choices is not one of cost: a smaller first choice can mean a bigger model), and
        # any new case once the shrink budget is spent. Hypothesis reports the smallest.
        budget = f"{node.name}, search {search}" if search else node.name
        if case.cost() > smallest.cost() or not run.may_shrink(budget):
            reject()
    if search and not shrinking and not run.cache.has(impl, case, device) \
            and run.further_draws >= run.options.max_examples:
        reject()  # the further searches' new draws are spent: the cached ones stay free
    # A shrink try asks about its own property only: the cheapest verdict that tells it.
    verdict, fresh = run.cache.verify(impl, case, device,
                                      probe=name if shrinking else None)
    if verdict.not_applicable:  # torch's own code refused the case by design: no failure,
        # and no case record (a pass would claim what was not checked)
        if currently_in_test_context() and run.options.case is None:
            reject()
        pytest.skip(f"{case.describe()}{runtime.NOT_APPLICABLE_SKIP}{verdict.not_applicable}")
    message = _failure(name, verdict)
    fresh_only = _fresh_only(impl, case, device)
    if message and fresh_only:
        message = f"{FRESH_ONLY}: {message}"
    command = _reproduce(impl, case, device) if fresh or message else ""
    if fresh:
        record = verdict_record(impl, verdict, device, reproduce=command)
        if shrinking:
            record[SHRINK_KEY] = True
        node.user_properties.append((CASE_KEY, record))
        run.record(record)
    if currently_in_test_context():
        _statistics(case, verdict)
    if not message:
        return
    failure = {"property": name, "message": message, "flaky": False,
               "case": case.to_dict(), "description": case.describe(), "reproduce": command}
    if fresh_only:
        failure["fresh_process_only"] = True
    if search and found_by is None:
        if fresh and not shrinking:
            run.further_draws += 1
        if not _new_cause(impl, verdict, failure, device, shrinking=shrinking):
            return  # a fault already found: this search looks past it
        failure["search"] = search
    if found_by is not None:
        failure["found_by"] = found_by
    elif not shrinking and not search and currently_in_test_context():
        same = _same_cause_as(impl, verdict, failure, device)
        if same is not None:  # the fault has its minimal case: shrinking would find it again
            run.unshrunk[node.name] = same
            run.stop_shrinking(node.name)
    if node.name in run.unshrunk and not search:
        failure["same_cause_as"] = run.unshrunk[node.name]
    node.user_properties[:] = [p for p in node.user_properties if p[0] != FAILURE_KEY
                               or p[1].get("search", 0) != search]  # type: ignore[attr-defined]
    node.user_properties.append((FAILURE_KEY, failure))
    run.shrinking = (node.name, case)  # the smallest failure so far, for progress lines
    found = f" (the minimal failure of {found_by}; not searched again)" if found_by else ""
    frames = "".join(f"\n  in your code: {frame}" for frame in user_frames(verdict.error or ""))
    pytest.fail(
        f"property {name!r} failed for {case.describe()}{found}\n  {message}{frames}\n"
        f"  case: {case.to_json()}\n  reproduce: {command}",
        pytrace=False,
    )


def assert_known_failures(name: str, impl: Implementation, node: pytest.Item) -> None:
    """Fail at once on the first minimal failure an earlier test of this run shrank to
    where property ``name`` fails too (its verdict is cached: this costs nothing)."""
    __tracebackhide__ = True
    run = runtime.RUN
    for found_by, case in run.minimal_cases:
        verdict, _ = run.cache.verify(impl, case, run.device())
        if _failure(name, verdict):
            assert_property(name, impl, case, node, found_by=found_by)


def search_further(impl: Implementation, node: pytest.Item, search: Callable[[], None]) -> None:
    """After a test failed: search again, up to ``FURTHER_SEARCHES`` times, each time for a
    failure with a cause no failure of the run has shown yet (failures with known causes
    count as passes); stop at the first search that finds none. Each search draws the same
    cases from the same seed (those tried before come from the cache) and goes on past
    them, within the run's examples; its new failure is shrunk and kept beside the first."""
    run = runtime.RUN
    if run.options.case is not None:  # one case, whose every fault its diagnosis names
        return
    for number in range(1, FURTHER_SEARCHES + 1):
        learn_causes(impl, node)
        run.further[node.name] = number
        try:
            search()
        except pytest.fail.Exception:
            continue  # another cause: look for one more
        except Exception:  # noqa: BLE001  # nothing left to draw (all rejected): done
            break
        finally:
            run.further.pop(node.name, None)
        break


def learn_causes(impl: Implementation, node: pytest.Item) -> None:
    """Add the causes of ``node``'s failures so far to the run's known causes, and how they
    look before localisation to the known looks (a shrink, told by looks alone, must not
    walk back to a failure already found)."""
    run = runtime.RUN
    device = run.device()
    for failure in _failures(node):
        verdict = run.cache.get(impl, Case.from_dict(failure["case"]), device)
        if verdict is not None:
            run.known_causes |= _causes(impl, failure, verdict, device)
            run.known_looks.add(_looks(impl, verdict, failure, device))


def _failures(node: pytest.Item) -> list[dict[str, Any]]:
    """The failures ``node`` has recorded: its first search's, then its further ones'."""
    return [value for key, value in node.user_properties
            if key == FAILURE_KEY and isinstance(value, dict)]


def _new_cause(impl: Implementation, verdict: Verdict, failure: dict[str, Any],
               device: Any, *, shrinking: bool) -> bool:
    """Whether ``failure``, met by a further search, has a cause the run has not found yet.
    Told first by its looks (its causes before localisation: cheap), then, for looks not
    seen, by its localised causes; a shrink try only by its looks."""
    run = runtime.RUN
    looks = _looks(impl, verdict, failure, device)
    if looks <= run.known_causes or looks in run.known_looks:
        return False
    if shrinking:  # localising every try would cost more than the search
        return True
    if _causes(impl, failure, verdict, device) <= run.known_causes:
        run.known_looks.add(looks)
        return False
    return True


def _looks(impl: Implementation, verdict: Verdict, failure: dict[str, Any],
           device: Any) -> frozenset[str]:
    """The causes the diagnosis gives ``failure`` from its case's record alone, before any
    localisation (no verify: pure Python on the record)."""
    from gradequiv.harness.reports.diagnosis import diagnose, fault_key

    diagnosis = diagnose(failure, verdict_record(impl, verdict, device,
                                                 reproduce=failure["reproduce"]))
    return frozenset(fault_key(f["cause"], f["sentence"]) for f in diagnosis.faults)


def _same_cause_as(impl: Implementation, verdict: Verdict, failure: dict[str, Any],
                   device: Any) -> str | None:
    """The earlier test whose minimal failure has every cause ``failure`` (a new one of a
    drawn test) has; None if none, or if there is none yet. A later property test meeting a
    fault already shrunk goes on to report it unshrunk, and the search time goes to faults
    not yet found."""
    run = runtime.RUN
    if not run.minimal_cases:
        return None
    causes = _causes(impl, failure, verdict, device)
    for test, known in run.minimal_cases:
        first = run.cache.get(impl, known, device)
        if first is None:
            continue
        earlier = {"property": test.removeprefix("test_"), "message": _failure(
            test.removeprefix("test_"), first), "flaky": False, "case": known.to_dict(),
            "description": known.describe(), "reproduce": _reproduce(impl, known, device)}
        if causes <= _causes(impl, earlier, first, device):
            return test
    return None


def _causes(impl: Implementation, failure: dict[str, Any], verdict: Verdict,
            device: Any) -> set[str]:
    """Every cause the diagnosis gives ``failure`` (its localisation is kept for the
    report, which localises the same case)."""
    from gradequiv.harness.reports.diagnosis import diagnose, fault_key

    found = dict(failure)
    locate(impl, found)
    diagnosis = diagnose(found, verdict_record(impl, verdict, device,
                                               reproduce=failure["reproduce"]))
    return {fault_key(f["cause"], f["sentence"]) for f in diagnosis.faults}


def _reproduce(impl: Implementation, case: Case, device: Any) -> str:
    """The command that replays ``case``: ``gradequiv check`` for an implementation named by
    its SPEC, the run's own pytest command for one a conftest fixture provides."""
    run = runtime.RUN
    if run.pytest_args is not None and run.from_fixture(impl):
        return pytest_reproduce_command(run.pytest_args, case)
    return reproduce_command(impl, case, device)


#: What a named case's failure message begins with where it fails only as the first case of
#: a fresh process.
FRESH_ONLY = ("as the first case of a fresh process (it passes in this one, after other "
              "cases ran)")


def _fresh_only(impl: Implementation, case: Case, device: Any) -> bool:
    key = (runtime.implementation_key(impl), case.to_json(), str(device))
    return key in runtime.RUN.cache.fresh_only


def replay_passes(impl: Implementation, failure: dict[str, Any]) -> bool:
    """Run a failure's case again, outside the cache: does the property hold now?

    Where the first run left out the noise floor or the memory watch (a case tried while
    shrinking), the replay's record, whole, becomes the case's record in the report.
    """
    case = Case.from_dict(failure["case"])
    run = runtime.RUN
    key = (runtime.implementation_key(impl), case.to_json())
    if key not in run.cache.replayed:  # tests that share a minimal case share its replay
        device = run.device()
        replay = run.cache.fresh.verify if _fresh_only(impl, case, device) else verify
        replayed = replay(impl, case, device=device, tolerance=run.tolerance(case))
        run.cache.replayed[key] = replayed
        first = run.cache.get(impl, case, device)
        if first is not None and (not first.floor_measured or not first.memory_watched
                                  or first.first_step_only):
            run.record(verdict_record(impl, replayed, device, reproduce=failure["reproduce"]))
    return _failure(failure["property"], run.cache.replayed[key]) == ""


def locate(impl: Implementation, failure: dict[str, Any], *, named: bool = False) -> None:
    """Add to a minimal failure the first recompute op that differs from the original
    forward (``localisation``, and ``first_diverging_op`` when one is found), and what the
    experiments beside it found; once per case and property in a run (a further search
    asks of a failure's causes before the report does)."""
    memo = ("located fields", json.dumps([runtime.implementation_key(impl), failure["case"],
                                          failure["property"], named], sort_keys=True))
    located = runtime.RUN.cache.located
    if memo not in located:
        found = dict(failure)
        _locate(impl, found, named=named)
        located[memo] = {k: v for k, v in found.items() if k not in failure or failure[k] != v}
    failure.update(copy.deepcopy(located[memo]))


def _locate(impl: Implementation, failure: dict[str, Any], *, named: bool = False) -> None:
    """:func:`locate`'s work.

    ``named``: the failure is a named case's. One whose case differs from full storage in
    memory figures only is not searched: every value the op-level search compares already
    agrees (each property that compares values held), so the search and the pattern
    experiments (seconds apiece on the large named cases, a tenth of a leaking run for
    all of them) could only say so again; the drawn minimal failure of the same fault is
    searched, and says it."""
    from gradequiv.harness.engine.localise import localise

    case = Case.from_dict(failure["case"])
    if named and memory_only(runtime.RUN.cache.get(impl, case, runtime.RUN.device())):
        failure["localisation"] = MEMORY_ONLY
        failure["first_diverging_op"] = None
        return
    key = (runtime.implementation_key(impl), case.to_json())
    located = runtime.RUN.cache.located  # the failing tests of a run often share their minimal case
    if key not in located:
        device = runtime.RUN.device()
        search = runtime.RUN.cache.fresh.localise if _fresh_only(impl, case, device) \
            else localise
        located[key] = search(impl, case, device)
    found = located[key]
    failure["localisation"] = found.describe()
    failure["first_diverging_op"] = found.divergence.to_dict() if found.divergence else None
    beside = _beside_torch(impl, case, found.model)
    if beside is not None:
        failure["torch_checkpoint"] = beside
    captured = _captured(impl, case)
    if captured is not None:
        failure["captured"] = captured
    # The experiments below (each a verify or more) only where the op names no cause.
    if divergence_cause(failure["first_diverging_op"]) is None:
        failure["needs_pattern"] = _patterns_needed(impl, case, failure["property"])
    if found.divergence is None and _holds_without_autocast_cache(impl, case, failure["property"]):
        failure["needs_autocast_cache"] = True
    if found.divergence is None and found.matched and failure["property"] in NOT_IN_OPS:
        failure["localisation"] = "; ".join([
            f"every recomputed op of step 1 matched its original, and "
            f"{NOT_IN_OPS[failure['property']]}", *found.model])


#: The lines of a localisation that name state of the model's a re-run started from.
_STATE_LINES = ("model state: ", "model input: ")


def _beside_torch(impl: Implementation, case: Case,
                  model: tuple[str, ...]) -> dict[str, str] | None:
    """Whose a fault in the model's state is, by evidence: torch's own checkpoint run on the
    same case. ``passes``: the checkpoint's (a faithful re-run gets this state right);
    ``same``: torch's fails naming the same state (the model's, or needs a checkpoint that
    knows it); ``other``: torch's fails on other state (``state``: its first line). None
    where no state was named, the implementation is torch's own, or torch's cannot run
    the case."""
    from gradequiv.harness.engine.localise import localise
    from gradequiv.harness.implementations.resolve import BUILTINS, resolve

    named = [line for line in model if line.startswith(_STATE_LINES)]
    if not named or ((impl.spec in BUILTINS or impl.spec.startswith("torch."))
                     and not impl.kwargs):
        return None
    run = runtime.RUN
    key = ("torch beside", case.to_json())
    if key not in run.cache.located:
        try:
            torch_own = resolve("torch")
            verdict = verify(torch_own, case, device=run.device())
            run.cache.located[key] = (True, ()) if verdict.passed else (
                False, localise(torch_own, case, run.device()).model)
        except Exception:  # a case torch's checkpoint cannot run: no evidence
            run.cache.located[key] = None
    found = run.cache.located[key]
    if found is None:
        return None
    passed, there = found
    if passed:
        return {"verdict": "passes"}
    theirs = [line for line in there if line.startswith(_STATE_LINES)]
    if {state_name(line) for line in named} & {state_name(line) for line in theirs}:
        return {"verdict": "same"}
    return {"verdict": "other", "state": theirs[0] if theirs else ""}


#: A named case's localisation where only memory figures differ (``locate``).
MEMORY_ONLY = ("recomputed ops not searched: only memory figures differ from full storage's, "
               "and every property that compares values held")


def memory_only(verdict: Verdict | None) -> bool:
    """Whether ``verdict`` fails on memory figures alone: the recompute property only, each
    of its findings about bytes (nothing freed, a leak, re-runs held), none about values,
    counts or an error."""
    if verdict is None or verdict.error is not None:
        return False
    failing = [p for p in verdict.properties if p.passed is False]
    return [p.name for p in failing] == ["recompute"] and bool(failing[0].failures) and all(
        any(phrase in line for phrase in MEMORY_FINDINGS) for line in failing[0].failures)


def _patterns_needed(impl: Implementation, case: Case, prop: str) -> list[str]:
    """The case's training-loop patterns without which the property holds (each switched
    off alone, then all together): the op-level search drives one forward and one backward,
    so what only a schedule, a second pass, a backward under autocast or frozen parameters
    show is told by these."""
    patterns = case.loop_patterns()
    if not patterns:
        return []
    device = runtime.RUN.device()
    needed = [name for name, off in patterns.items()
              if _failure(prop, verify(impl, off, device=device)) == ""]
    if needed or len(patterns) == 1:
        return needed
    bare = case
    for name in patterns:
        bare = bare.loop_patterns()[name]
    return list(patterns) if _failure(prop, verify(impl, bare, device=device)) == "" else []


#: What torch says where a backward walks a graph an earlier backward freed.
FREED_GRAPH = "backward through the graph a second time"


def _symptom(verdict: Verdict) -> str:
    """What a captured argument does to a case: "freed" (a backward through a graph the
    re-run's inner backward freed), "lost" (a gradient full storage has and the recompute
    path not), or ""."""
    if verdict.error is not None:
        return "freed" if FREED_GRAPH in verdict.error else ""
    lost = any("absent on the recompute path" in text or "exists only on the full-storage" in text
               for p in verdict.properties for text in p.failures)
    return "lost" if lost else ""


def _captured(impl: Implementation, case: Case) -> dict[str, Any] | None:
    """The tensor arguments of the segments the implementation captured instead of passing
    (``engine/captured.py``), where the case raised a backward through a freed graph or lost
    a gradient: each one whose own tensors reached the segment with grad off and whose
    passing as an input takes that away (one verify apiece), and the line of the user's
    code that calls the segment. None where none was."""
    from gradequiv.harness.engine.captured import passing, watched

    run = runtime.RUN
    device = run.device()
    if impl.adapter != "function":
        return None
    verdict = run.cache.get(impl, case, device) or verify(impl, case, device=device)
    if not _symptom(verdict):
        return None
    watching, calls = watched(impl)
    verify(watching, case, device=device, tolerance=run.tolerance(case))
    names = [argument.name for argument in calls.arguments if argument.name in calls.seen
             and not _symptom(verify(passing(impl, argument), case, device=device,
                                     tolerance=run.tolerance(case)))]
    if not names:
        return None
    return {"arguments": names, "symptom": _symptom(verdict), "frame": calls.frame}


def _holds_without_autocast_cache(impl: Implementation, case: Case, prop: str) -> bool:
    """Whether the property holds with autocast's cast cache off on both paths: a re-run
    whose inputs are leaves that require grad (a reentrant checkpoint detaches them) gets
    one cached cast for all their uses, and so their gradients summed in the low precision,
    where full storage casts each use and sums in float32."""
    if not case.dtype.endswith("-autocast") or prop not in ("gradients", "trajectory"):
        return False
    return _failure(prop, verify_without_autocast_cache(
        impl, case, device=runtime.RUN.device())) == ""


#: What the evidence says where step 1's recomputed ops all match and a property still fails.
NOT_IN_OPS = {
    "rng": "the RNG stream after the step differs from full storage's (the generator is left "
           "moved: drawn from and not put back)",
    "trajectory": "the difference first shows at a later step (state carried between steps)",
    "buffers": "the difference is in module state (buffers changed outside the ops compared)",
    "inference": "the difference is in a forward without backward (eval or no_grad)",
}


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

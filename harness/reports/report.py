"""report.json of a check run: its one author, and the atomic writes every report uses.

The file is rewritten whole after each case (write to a temporary file, then
rename), so a run that is interrupted or killed leaves the cases that
finished, marked ``"complete": false``, and never a half-written file.
"""

from __future__ import annotations

import math
import os
import platform
import shlex
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from gradequiv.harness.errors import user_frames
from gradequiv.harness.options import CheckOptions
from gradequiv.harness.reports.diagnosis import Diagnosis, diagnose, distinct_faults
from gradequiv.harness.reports.text import bounded_texts

if TYPE_CHECKING:  # torch is imported on use: a supervisor writes reports without it
    import torch

    from gradequiv.harness.engine.case import Case
    from gradequiv.harness.engine.verify import Verdict
    from gradequiv.harness.implementations.adapters import Implementation

SCHEMA_VERSION = 1
#: marks a case record made while a failure was shrunk: counted in the report, not kept
SHRINK_KEY = "shrink_attempt"
#: The parts of a report whose texts are kept where the same text comes again (cut there):
#: the headline failure, its diagnosis first, then the minimal failures; in a case, its
#: traceback (a diagnosis reads the exception from it).
KEPT_FIRST = ("failure", "diagnosis", "error", "minimal_failures", "faults")


def bounded_report(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with its texts bounded (:func:`~.text.bounded_texts`): a long text (the
    same exception in every case and every failure) is kept once among the failures, the
    headline's first, and once among the cases, and cut wherever it comes again."""
    return bounded_texts(report, first=KEPT_FIRST, apart=("cases",))


def gradequiv_version() -> str:
    try:
        return version("gradequiv")
    except PackageNotFoundError:
        return "unknown"


def run_conditions(device: torch.device, seed: int) -> dict[str, Any]:
    """What a reader needs to compare these numbers with others."""
    import torch

    conditions: dict[str, Any] = {
        "gradequiv": gradequiv_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "seed": seed,
    }
    if device.type == "cuda":
        conditions["device_name"] = torch.cuda.get_device_name(device)
        conditions["cuda"] = torch.version.cuda
    return conditions


def reproduce_command(impl: Implementation, case: Case, device: torch.device) -> str:
    """One line that re-runs exactly this case."""
    args = ["gradequiv", "check", *impl.command_args(), "--device", device.type,
            "--case", case.to_json()]
    return " ".join(shlex.quote(a) for a in args)


#: Tensor checks a case record keeps per property: its worst failing ones, then the worst
#: of those that passed without being bitwise equal. The rest are counted (``compared``,
#: ``bitwise_equal``): a record of every tensor made a failing run's report 9 MB.
KEPT_FAILING, KEPT_PASSING = 6, 2


#: pytest options a replay of one case must not repeat: the case it replaced, the report
#: folder it would overwrite, and selections or workers that have nothing left to do
_REPLAY_DROPS = {"--gradequiv-case": 1, "--gradequiv-report-dir": 1, "--gradequiv-seed": 1,
                 "--gradequiv-examples": 1, "--gradequiv-shard": 1, "-k": 1, "-n": 1,
                 "--numprocesses": 1, "-x": 0, "--exitfirst": 0, "--lf": 0, "--ff": 0}


def pytest_reproduce_command(args: list[str], case: Case) -> str:
    """The pytest command that ran a suite, made to replay one case (for an implementation
    a conftest's ``recompute_impl`` fixture provides: only that run knows it)."""
    kept: list[str] = []
    skip = 0
    for arg in args:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _REPLAY_DROPS:
            skip = 0 if "=" in arg else _REPLAY_DROPS[name]
            continue
        kept.append(arg)
    line = ["python", "-m", "pytest", *kept, "--gradequiv-case", case.to_json()]
    return " ".join(shlex.quote(a) for a in line)


def with_case_file(command: str, path: str) -> str:
    """A reproduce command (its case last) with the case read from ``path`` instead: a line
    short enough to copy."""
    head, _, _ = command.rpartition(" ")
    return f"{head} {shlex.quote(path)}"


#: characters of each of the implementation's streams kept for a failing case (the last ones)
OUTPUT_CHARS = 4000


def bounded_output(stdout: str, stderr: str) -> dict[str, str]:
    """What the implementation printed during a case, each stream cut to its last
    :data:`OUTPUT_CHARS` characters (a cut says how much went)."""
    def tail(text: str) -> str:
        if len(text) <= OUTPUT_CHARS:
            return text
        return f"[... {len(text) - OUTPUT_CHARS} characters cut]\n" + text[-OUTPUT_CHARS:]

    return {"stdout": tail(stdout), "stderr": tail(stderr)}


def verdict_record(impl: Implementation, verdict: Verdict, device: torch.device, *,
                   reproduce: str | None = None) -> dict[str, Any]:
    """The record of one case in report.json; its texts (the implementation's exception,
    warnings, tensor names of a user's model) bounded here, where they come in."""
    properties = []
    for prop in verdict.properties:
        status = {True: "pass", False: "fail", None: "n/a"}[prop.passed]
        worst = prop.worst_first()
        kept = ([c for c in worst if not c.passed][:KEPT_FAILING]
                + [c for c in worst if c.passed and c.mismatched][:KEPT_PASSING])
        properties.append({
            "name": prop.name,
            "status": status,
            "summary": prop.summary,
            "failures": prop.failures,
            "compared": len(prop.checks),
            "bitwise_equal": sum(c.mismatched == 0 for c in prop.checks),
            "max_floor": _finite_number(max((c.floor for c in prop.checks), default=0.0)),
            "checks": [_finite(asdict(c)) for c in kept],
        })
    record: dict[str, Any] = {
        "name": verdict.case.name,
        "description": verdict.case.describe(),
        "case": verdict.case.to_dict(),
        "verdict": "pass" if verdict.passed else "fail",
        "first_failure": verdict.first_failure or None,
        "reproduce": reproduce or reproduce_command(impl, verdict.case, device),
        "error": verdict.error,
        "error_at": verdict.error_at or None,
        "warnings": verdict.warnings,
        "seconds": verdict.seconds,
        "held_bytes": verdict.held_bytes,
        "held_on": verdict.held_on,
        "properties": properties,
    }
    if verdict.error:  # the lines of the user's own files the exception went through
        record["user_frames"] = user_frames(verdict.error)
    if not verdict.floor_measured:  # it passed at a zero floor, or the floor cannot matter
        record["floor_measured"] = False
    if not verdict.passed:  # every gradient's error, for a heatmap of where the fault sits
        record["gradient_errors"] = {
            c.name: _finite_number(c.rel_error) for p in verdict.properties
            if p.name == "gradients" for c in p.checks}
    return bounded_texts(record, first=("error",))


def verdict_diagnosis(impl: Implementation, verdict: Verdict, device: torch.device,
                      **evidence: Any) -> Diagnosis:
    """The likely cause of a failed ``verdict``, read as a minimal failure of its first
    failing property would be; ``evidence``: what else was found (``localisation``,
    ``first_diverging_op``, ``needs_autocast_cache``)."""
    failing = [p.name for p in verdict.properties if p.passed is False]
    failure: dict[str, Any] = {"property": failing[0] if failing else "gradients",
                               "message": verdict.first_failure, "flaky": False, **evidence}
    return diagnose(failure, verdict_record(impl, verdict, device))


def ranks_record(impl: Implementation, verdicts: list[Verdict], *, case: Case, passed: bool,
                 first_failure: str, error: str | None, seconds: float,
                 engine: dict[str, Any], device: torch.device, reproduce: str
                 ) -> dict[str, Any]:
    """The record of one case trained on several ranks (``gradequiv distributed``): the
    properties of its first failing rank (rank 0's where all pass), each rank's verdict and
    memory beside them, and the engine. ``verdicts`` is empty where no rank gave one (a
    rank died or hung: ``error`` says so)."""
    shown = next((v for v in verdicts if not v.passed), verdicts[0] if verdicts else None)
    if shown is None:
        record: dict[str, Any] = {
            "name": case.name, "description": case.describe(), "case": case.to_dict(),
            "reproduce": reproduce, "error": error, "error_at": "the ranks", "warnings": [],
            "seconds": {}, "held_bytes": {}, "properties": []}
    else:
        record = verdict_record(impl, shown, device, reproduce=reproduce)
    record["verdict"] = "pass" if passed else "fail"
    record["first_failure"] = first_failure or None
    record["seconds"] = {**record["seconds"], "ranks": seconds}
    record["engine"] = engine
    record["ranks"] = [{"rank": rank, "verdict": "pass" if v.passed else "fail",
                        "first_failure": v.first_failure or None,
                        "held_bytes": v.held_bytes} for rank, v in enumerate(verdicts)]
    return bounded_texts(record, first=("error",))


def _finite_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no inf or NaN: write them as strings."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}


def assemble_check_report(
    *,
    options: CheckOptions,
    impl: Implementation | None,
    device: torch.device,
    records: list[dict[str, Any]],
    outcomes: dict[str, str],
    failures: list[dict[str, Any]],
    complete: bool,
    run: dict[str, Any] | None = None,
    command: str = "check",
    not_applicable: dict[str, str] | None = None,
) -> dict[str, Any]:
    """report.json of a check run, whole: the one place its verdict and failure are decided.
    ``command``: the command whose run it is (``distributed`` writes its own the same way).

    ``records`` are the distinct cases verified, ``outcomes`` each property
    test's outcome, ``failures`` the minimal failure of each failing test (the
    pytest plugin gathers all three and decides nothing).
    """
    records, attempts = distinct_cases(records, failures)
    failed = [r for r in records if r["verdict"] == "fail"]
    verdict_fails = _why_not_a_pass(records, failures, complete, outcomes) is not None
    conditions = run_conditions(device, options.seed) | {
        "profile": options.profile, "examples_per_property": options.max_examples,
        "shard": f"{options.shard[0]}/{options.shard[1]}"}
    implementation = ({"spec": impl.spec, "adapter": impl.adapter,
                       "kwargs": {k: repr(v) for k, v in impl.kwargs.items()}}
                      if impl is not None else
                      {"spec": options.impl or "unset", "adapter": options.adapter or "function",
                       "kwargs": {}})
    by_reproduce = {r["reproduce"]: r for r in records}
    return bounded_report({
        "schema_version": SCHEMA_VERSION,
        "tool": "gradequiv",
        "command": command,
        "verdict": "fail" if verdict_fails else "pass",
        "complete": complete,
        "run": run,
        "implementation": implementation,
        "conditions": conditions,
        "summary": {"run": len(records), "passed": len(records) - len(failed),
                    "failed": len(failed), "shrink_attempts": attempts},
        "cases": records,
        "failure": _headline_failure(failures, failed, by_reproduce),
        "faults": distinct_faults(failures),
        "tests": dict(sorted(outcomes.items())),
        "not_applicable": dict(sorted((not_applicable or {}).items())),
        "regime": options.regime.to_dict() if options.regime.stated else None,
        "minimal_failures": failures,
        "statistics": _statistics(records),
    })


#: A property test's outcome a pass allows: passed, or not applicable (torch's own
#: checkpoint refused the case loudly and by design: ``Verdict.not_applicable``).
NOT_APPLICABLE = "not applicable"
PASSING_OUTCOMES = ("passed", NOT_APPLICABLE)


def _why_not_a_pass(cases: list[dict[str, Any]], failures: list[dict[str, Any]],
                    complete: bool, outcomes: dict[str, str]) -> str | None:
    """The field of a report that makes it no pass (``cases[2].verdict='fail'``), or None.

    A pass needs every case to pass, every property test to have ended and passed,
    and no failure: a run that stopped early (interrupted, killed, or still going when
    this is written) has proved nothing whole, and one with no case nothing at all.
    """
    for index, case in enumerate(cases):
        if case.get("verdict") != "pass":
            return f"cases[{index}].verdict={case.get('verdict')!r}"
    if not cases:
        return "cases=[] (no case was verified)"
    if failures:
        return f"minimal_failures holds {len(failures)} failure(s)"
    if not complete:
        return "complete=False"
    if not outcomes:
        return "tests={} (no property test ended)"
    for name, outcome in sorted(outcomes.items()):
        if outcome not in PASSING_OUTCOMES:
            return f"tests[{name!r}]={outcome!r}"
    return None


def verdict_disagreement(report: dict[str, Any]) -> str | None:
    """Why a check report's stored ``verdict`` disagrees with what it holds (the verdict
    decided again from its cases, tests, failures and completeness), or None.

    A report.json edited to read "pass" over failing cases, or a failure with a passing
    verdict, is never rendered or gated on as a pass.
    """
    why = _why_not_a_pass(list(report.get("cases") or []),
                          list(report.get("minimal_failures") or []),
                          bool(report.get("complete")), dict(report.get("tests") or {}))
    if why is None and report.get("failure") is not None:
        why = "failure is set"
    stored = report.get("verdict")
    if stored == "pass" and why is not None:
        return f"verdict='pass' but {why}"
    if stored == "fail" and why is None:
        return ("verdict='fail' but every case and property test passed, complete and "
                "without a failure")
    return None


def starting_report(options: CheckOptions, run: dict[str, Any]) -> dict[str, Any]:
    """report.json at the first moment of a run, before the process that runs the
    implementation has started: no case, incomplete, failing. A run that hangs or is
    killed before its first case leaves this (with the line that ended it), never nothing.

    Written by a supervisor, which has no torch: the versions are the installed ones.
    """
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "unknown"
    conditions = {
        "gradequiv": gradequiv_version(), "torch": torch_version,
        "python": platform.python_version(), "platform": platform.platform(),
        "device": options.device, "threads": options.threads or os.cpu_count() or 1,
        "deterministic_algorithms": options.deterministic, "seed": options.seed,
        "profile": options.profile, "examples_per_property": options.max_examples,
        "shard": f"{options.shard[0]}/{options.shard[1]}"}
    return {
        "schema_version": SCHEMA_VERSION, "tool": "gradequiv", "command": "check",
        "verdict": "fail", "complete": False, "run": run,
        "implementation": {"spec": options.impl or "unset",
                           "adapter": options.adapter or "function", "kwargs": {}},
        "conditions": conditions,
        "summary": {"run": 0, "passed": 0, "failed": 0, "shrink_attempts": 0},
        "cases": [], "failure": None, "tests": {}, "minimal_failures": [],
        "statistics": _statistics([]),
    }


def kept_record(kept: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The record of a case to keep, of ``kept`` (the one so far) and ``new``: the first
    record of a case stays, unless it left out the noise floor and ``new`` (a replay)
    measured it; what the implementation printed in the first run stays with it."""
    if kept is None:
        return new
    if kept.get("floor_measured") is not False or new.get("floor_measured") is False:
        return kept
    if "output" in kept and "output" not in new:
        return {**new, "output": kept["output"]}
    return new


def distinct_cases(records: list[dict[str, Any]],
                   failures: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The cases a report keeps, and how many it only counts: the cases Hypothesis tried
    while shrinking a failure (marked ``shrink_attempt``) go, except the minimal ones."""
    minimal = {f["reproduce"] for f in failures}
    kept = [{k: v for k, v in r.items() if k != SHRINK_KEY} for r in records
            if not r.get(SHRINK_KEY) or r["reproduce"] in minimal]
    return kept, len(records) - len(kept)


def _headline_failure(failures: list[dict[str, Any]], failed: list[dict[str, Any]],
                      records: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The failure a reader sees first: the first minimal failure, else the first failing
    case (a run stopped before any test ended)."""
    if failures:
        first = failures[0]
        record = records.get(first["reproduce"])
        headline = {"case": first["description"], "property": first["property"],
                    "message": first["message"], "flaky": first["flaky"],
                    "minimal_case": first["case"], "reproduce": first["reproduce"],
                    "first_mismatch": first_mismatch(record) if record else None}
        for key in ("diagnosis", "reproduce_file", "output"):
            if key in first:
                headline[key] = first[key]
        return headline
    if failed:
        first = failed[0]
        headline = {"case": first["description"], "property": _failing_property(first),
                    "message": first["first_failure"], "flaky": False,
                    "minimal_case": first["case"], "reproduce": first["reproduce"],
                    "first_mismatch": first_mismatch(first)}
        headline["diagnosis"] = diagnose(headline, first).to_dict()
        if "output" in first:
            headline["output"] = first["output"]
        return headline
    return None


def _failing_property(record: dict[str, Any]) -> str:
    return next((p["name"] for p in record["properties"] if p["status"] == "fail"), "error")


def _statistics(records: list[dict[str, Any]]) -> dict[str, Any]:
    """How many cases of each regime ran, the worst relative error seen, and the noisiest
    floor (the two full-storage runs' own disagreement: zero where kernels are deterministic)."""
    regimes: dict[str, int] = {}
    worst = floor = 0.0
    measured = 0  # cases whose floor path ran (a verdict passing at a zero floor needs none)
    for record in records:
        case = record["case"]
        for key in (f"dtype {case['dtype']}", f"granularity {case['granularity']}"):
            regimes[key] = regimes.get(key, 0) + 1
        floored = record.get("floor_measured", True)
        measured += floored
        for prop in record["properties"]:
            if floored and isinstance(prop.get("max_floor"), float):  # every tensor's
                floor = max(floor, prop["max_floor"])
            for check in prop["checks"]:
                if isinstance(check["rel_error"], float):
                    worst = max(worst, check["rel_error"])
                if floored and isinstance(check["floor"], float):
                    floor = max(floor, check["floor"])
    return {"cases_per_regime": dict(sorted(regimes.items())), "worst_relative_error": worst,
            "max_noise_floor": floor, "noise_floor_cases": measured}


def first_mismatch(record: dict[str, Any]) -> dict[str, Any] | None:
    for prop in record["properties"]:
        for check in prop["checks"]:
            if not check["passed"]:
                return dict(check)
    return None


def process_ended_report(last: dict[str, Any], records: list[dict[str, Any]], *,
                         message: str, during: dict[str, Any] | None) -> dict[str, Any]:
    """report.json of a run whose process ended before the run did (the implementation
    exited, was killed or hung): the report the run last wrote, with every case it
    finished since, incomplete and failing, the end of the process as its failure.

    ``during`` is the case that was running (``description``, ``case``, ``reproduce``),
    or None when the process ended before its first case.
    """
    by_reproduce = {r["reproduce"]: r for r in last.get("cases", [])}
    for record in records:
        by_reproduce[record["reproduce"]] = kept_record(by_reproduce.get(record["reproduce"]),
                                                        record)
    cases, attempts = distinct_cases(list(by_reproduce.values()),
                                     last.get("minimal_failures", []))
    failed = sum(r["verdict"] == "fail" for r in cases)
    failure = {"case": during["description"] if during else "start-up, before the first case",
               "property": "process", "message": message, "flaky": False,
               "minimal_case": during["case"] if during else None,
               "reproduce": during["reproduce"] if during else (last.get("run") or {}).get(
                   "command", "gradequiv check"),
               "first_mismatch": None}
    failure["diagnosis"] = diagnose(failure, None).to_dict()
    return bounded_report(last | {
        "verdict": "fail", "complete": False,
        "summary": {"run": len(cases), "passed": len(cases) - failed, "failed": failed,
                    "shrink_attempts": attempts},
        "cases": cases, "failure": failure, "statistics": _statistics(cases)})

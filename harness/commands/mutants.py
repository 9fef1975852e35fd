"""``gradequiv mutants``: prove the property suite catches every mutant and flags no correct one.

Runs the suite (under pytest, without shrinking, stopping at the first
failure) against the correct implementations first, as a baseline: a broken
harness that fails everything cannot then report a perfect score. Then
against every mutant. The mutation score is killed / valid, where CUDA-only
mutants on a machine without CUDA are not valid (skipped, with the reason).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.implementations.faults import MUTANTS, Mutant
from gradequiv.harness.options import SuiteRun, check_options
from gradequiv.harness.reports.files import write_json_atomic, write_text_atomic
from gradequiv.harness.reports.markdown import mutants_markdown
from gradequiv.harness.reports.report import PASSING_OUTCOMES
from gradequiv.harness.reports.tables import mutants_summary
from gradequiv.models import DRAWN_MODELS
from gradequiv.models.kinds import TRANSFORMER

#: Correct implementations the suite must pass: torch's two, its checkpoint patched into
#: each segment (whose recompute no hook sees), and the mutants' base.
CORRECT = {
    "torch": (TRANSFORMER,),
    "torch-reentrant": (TRANSFORMER,),
    "torch-patched": (TRANSFORMER,),
    # torch's checkpoint updates BatchNorm statistics twice; the base restores them.
    "gradequiv.harness.implementations.faults:reference_checkpoint": DRAWN_MODELS,
}
MUTANT_MODELS = DRAWN_MODELS
MODULE = "gradequiv.harness.implementations.faults"


@dataclass
class Outcome:
    name: str
    spec: str
    role: str  # "correct" or "mutant"
    status: str  # correct: "passed" / "flagged"; mutant: "caught" / "survived" / "skipped"
    caught_by: str  # the first failing property test, or the skip reason
    examples: int  # cases verified up to and including the first failure
    seconds: float
    models: str
    source: str = ""  # a mutant's real-world report (issue or PR); "" for correct ones


def run_suite(spec: str, models: tuple[str, ...], *, seed: int, examples: int,
              device: str) -> tuple[int, dict[str, Any]]:
    """One suite run in this process, stopping at the first failure; its exit code and report."""
    from gradequiv.harness.commands.check import run_suite as run_property_suite

    with tempfile.TemporaryDirectory(prefix="gradequiv-mutants-") as folder:
        # every regime: the fault library measures the harness, not a user's training
        options = check_options(impl=spec, seed=seed, examples=examples, profile="ci",
                                shrink=False, models=models, device=device, report_dir=folder,
                                read_pyproject=False)
        code = run_property_suite(SuiteRun(options), ["-x", "-p", "no:terminal"])
        report_file = Path(folder) / "report.json"
        report = json.loads(report_file.read_text()) if report_file.exists() else {}
    return code, report


def _first_failure(report: dict[str, Any]) -> tuple[str, int]:
    failing = [name for name, outcome in report.get("tests", {}).items()
               if outcome not in PASSING_OUTCOMES]
    cases = report.get("cases", [])
    first = next((i for i, c in enumerate(cases, start=1) if c["verdict"] == "fail"), len(cases))
    return (failing[0] if failing else ""), first


def run_all(*, seed: int = 0, examples: int = 20, device: str = "cpu",
            progress: Any = print, after_each: Any = None,
            mutants: tuple[Mutant, ...] = MUTANTS) -> list[Outcome]:
    """Baseline first, then every mutant (or those given); one Outcome each.

    ``after_each(outcomes)`` runs after every outcome (the command writes the
    report there, so an interrupted run keeps what finished).
    """
    outcomes = []
    for spec, models in CORRECT.items():
        started = time.perf_counter()
        code, report = run_suite(spec, models, seed=seed, examples=examples, device=device)
        test, count = _first_failure(report)
        status = "passed" if code == 0 else "flagged"
        outcomes.append(Outcome(spec.rsplit(":", 1)[-1], spec, "correct", status, test,
                                len(report.get("cases", [])), time.perf_counter() - started,
                                ",".join(models)))
        _report(outcomes, progress, after_each)
    for mutant in mutants:
        spec = f"{MODULE}:{mutant.name.replace('-', '_')}"
        if mutant.cuda_only and device != "cuda":
            outcomes.append(Outcome(mutant.name, spec, "mutant", "skipped",
                                    "needs CUDA (the fault is in the CUDA generator)", 0, 0.0,
                                    ",".join(MUTANT_MODELS), mutant.source))
            _report(outcomes, progress, after_each)
            continue
        started = time.perf_counter()
        code, report = run_suite(spec, MUTANT_MODELS, seed=seed, examples=examples,
                                 device=device)
        test, count = _first_failure(report)
        status = "caught" if code == 1 else "survived"
        outcomes.append(Outcome(mutant.name, spec, "mutant", status, test, count,
                                time.perf_counter() - started, ",".join(MUTANT_MODELS),
                                mutant.source))
        _report(outcomes, progress, after_each)
    return outcomes


def _report(outcomes: list[Outcome], progress: Any, after_each: Any) -> None:
    progress(_line(outcomes[-1]))
    if after_each is not None:
        after_each(outcomes)


def _line(o: Outcome) -> str:
    detail = f" by {o.caught_by}" if o.caught_by else ""
    return f"{o.role:7s} {o.name:28s} {o.status}{detail} ({o.examples} cases, {o.seconds:.1f}s)"


def score(outcomes: list[Outcome]) -> dict[str, Any]:
    mutants = [o for o in outcomes if o.role == "mutant" and o.status != "skipped"]
    killed = sum(o.status == "caught" for o in mutants)
    correct_ok = all(o.status == "passed" for o in outcomes if o.role == "correct")
    return {"killed": killed, "valid": len(mutants),
            "mutation_score": killed / len(mutants) if mutants else 0.0,
            "correct_pass": correct_ok,
            "verdict": "pass" if correct_ok and killed == len(mutants) else "fail"}


def report(outcomes: list[Outcome], summary: dict[str, Any], conditions: dict[str, Any], *,
           complete: bool = True) -> dict[str, Any]:
    """What mutants.json holds; mutants.md is rendered from the same dict."""
    return {"schema_version": 1, "command": "mutants",
            "verdict": summary["verdict"], "complete": complete,
            "summary": summary, "conditions": conditions,
            "outcomes": [asdict(o) for o in outcomes]}


def write(folder: Path, outcomes: list[Outcome], summary: dict[str, Any],
          conditions: dict[str, Any], *, complete: bool = True) -> None:
    data = report(outcomes, summary, conditions, complete=complete)
    write_json_atomic(folder / "mutants.json", data)
    write_text_atomic(folder / "mutants.md", mutants_markdown(data))


def select(names: list[str] | None) -> tuple[Mutant, ...]:
    """The mutants ``--mutant`` names (every one without it); an unknown name is exit 2."""
    if not names:
        return MUTANTS
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InvalidArgument(f"--mutant={unknown[0]!r} is not a mutant; known: "
                              f"{', '.join(known)}")
    return tuple(known[n] for n in dict.fromkeys(names))


def run(args: Any) -> int:
    """The mutants command: exit 0 when every mutant is caught and every correct one passes."""
    from gradequiv.harness.engine.devices import resolve_device
    from gradequiv.harness.reports.report import run_conditions

    device = resolve_device(args.device)
    chosen = select(args.mutant)
    print(f"gradequiv mutants: {len(chosen)} mutants, {len(CORRECT)} correct "
          f"implementations first; {args.examples} examples per property, seed {args.seed}, "
          f"{device}", flush=True)
    conditions = run_conditions(device, args.seed)

    def write_partial(outcomes: list[Outcome]) -> None:
        if args.report_dir is not None:
            write(args.report_dir, outcomes, score(outcomes), conditions, complete=False)

    outcomes = run_all(seed=args.seed, examples=args.examples, device=device.type,
                       progress=lambda line: print(line, flush=True), after_each=write_partial,
                       mutants=chosen)
    summary = score(outcomes)
    print(mutants_summary(report(outcomes, summary, conditions)))
    if args.report_dir is not None:
        write(args.report_dir, outcomes, summary, conditions)
        print(f"report: {args.report_dir / 'mutants.json'}, {args.report_dir / 'mutants.md'}")
    return 0 if summary["verdict"] == "pass" else 1

"""Every mutant is caught by some property; the correct base passes everywhere."""

from __future__ import annotations

import pytest

from gradequiv.harness import Case, Implementation, default_cases, extra_cases, verify
from gradequiv.harness.implementations.faults import MUTANTS, Mutant, reference_checkpoint, switches

CASES = default_cases() + [c for c in extra_cases() if c.model_kind == "batchnorm"]


def test_every_fault_switch_has_a_mutant() -> None:
    flipped = [[n for n in switches() if getattr(m.faults, n)] for m in MUTANTS]
    assert all(len(names) == 1 for names in flipped)  # one fault each
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    covered = {name for m in MUTANTS for name in switches() if getattr(m.faults, name)}
    assert covered == set(switches()) and len(MUTANTS) >= 43


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_correct_base_passes(case: Case) -> None:
    """Every case of a grad mode it claims: not the gradient penalty (``create-graph``)."""
    impl = Implementation("reference", reference_checkpoint)
    if case.grad_mode not in impl.grad_modes:
        pytest.skip(f"the base does not claim {case.grad_mode}")
    verdict = verify(impl, case)
    assert verdict.passed, verdict.first_failure


@pytest.mark.slow  # every mutant over the named cases; -m mutants runs the whole command
@pytest.mark.parametrize("mutant", [m for m in MUTANTS if not m.cuda_only], ids=lambda m: m.name)
def test_every_mutant_is_caught(mutant: Mutant) -> None:
    """By a case of a grad mode it supports, as the suite draws them: the base itself is
    no bitwise match under a gradient penalty, which it does not claim."""
    from gradequiv.harness.implementations import faults

    impl = Implementation(mutant.name, mutant.impl)
    for case in CASES:
        if case.grad_mode not in impl.grad_modes:
            continue
        faults._PROCESS_TRAINABLE.clear()  # each named case as a fresh process sees it
        verdict = verify(impl, case)
        if not verdict.passed:
            return
    pytest.fail(f"{mutant.name} survived all {len(CASES)} cases")


def _mutants_command(folder: object, *args: str) -> dict:
    import json
    from pathlib import Path

    from gradequiv.harness.cli import main

    folder = Path(str(folder))
    assert main(["mutants", "--report-dir", str(folder), *args]) == 0
    report: dict = json.loads((folder / "mutants.json").read_text())
    assert report["summary"]["correct_pass"] is True and report["verdict"] == "pass"
    assert report["complete"] is True
    from gradequiv.harness.reports.markdown import mutants_markdown

    markdown = (folder / "mutants.md").read_text()
    assert markdown.startswith("**Mutation score") and markdown == mutants_markdown(report)
    return report


#: One mutant caught by a plain case, and two that only the new case kinds reach.
FEW = ("stale-recompute", "grad-via-backward", "state-queue-without-backward")


@pytest.mark.slow  # the correct implementations through the whole suite, then the chosen
def test_the_mutants_command_catches_the_chosen_and_passes_the_correct(
        tmp_path: object) -> None:
    report = _mutants_command(tmp_path, "--examples", "3",
                              *(a for name in FEW for a in ("--mutant", name)))
    roles = {o["name"]: o["status"] for o in report["outcomes"]}
    assert roles == {"torch": "passed", "torch-reentrant": "passed", "torch-patched": "passed",
                     "reference_checkpoint": "passed"} | dict.fromkeys(FEW, "caught")
    sources = {o["name"]: o["source"] for o in report["outcomes"]}
    assert sources["grad-via-backward"].startswith("https://github.com/")
    assert report["summary"]["killed"] == report["summary"]["valid"] == len(FEW)


def test_an_unknown_mutant_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from gradequiv.harness.cli import main

    assert main(["mutants", "--mutant", "no-such-fault"]) == 2
    assert "--mutant='no-such-fault' is not a mutant" in capsys.readouterr().err


@pytest.mark.mutants
def test_the_mutants_command_catches_all_and_passes_the_correct(tmp_path: object) -> None:
    report = _mutants_command(tmp_path, "--examples", "5")
    summary = report["summary"]
    assert summary["killed"] == summary["valid"] == len([m for m in MUTANTS if not m.cuda_only])
    assert summary["valid"] >= 42


@pytest.mark.slow
def test_an_interrupted_mutants_run_keeps_what_finished(tmp_path: object,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first outcome the run is interrupted: mutants.json holds it, incomplete."""
    import json
    from pathlib import Path

    from gradequiv.harness.cli import main
    from gradequiv.harness.commands import mutants as mutation
    from gradequiv.harness.reports.bundle import load_bundle

    seen: list[int] = []
    real_write = mutation.write

    def write_then_stop(folder: Path, outcomes: list, *args: object, **kwargs: object) -> None:
        real_write(folder, outcomes, *args, **kwargs)  # type: ignore[arg-type]
        seen.append(len(outcomes))
        raise KeyboardInterrupt

    monkeypatch.setattr(mutation, "write", write_then_stop)
    folder = Path(str(tmp_path))
    assert main(["mutants", "--examples", "2", "--report-dir", str(folder)]) == 130
    report = json.loads((folder / "mutants.json").read_text())
    assert seen == [1] and len(report["outcomes"]) == 1
    assert report["complete"] is False
    assert load_bundle(folder).verdict == "incomplete"  # torch passed, then the stop
    assert "(incomplete: the run stopped early)" in (folder / "mutants.md").read_text()

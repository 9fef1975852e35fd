"""Never a false pass, round three: a pass forged from inside the checking process, a case
that verifies nothing, a report that reads "pass" over nothing.

The implementation runs in the process that compares and decides. Its forgeries
(tests/forging_*.py, each a broken checkpoint: the RNG not restored) end with exit 1: the
supervisor decides from the cases it heard of and the report, and the checking process
fingerprints what its comparison calls before the implementation's code runs.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness.cli import main

TESTS = Path(__file__).resolve().parent
GRADEQUIV = Path(sys.executable).with_name("gradequiv")
ONE = ["--case", "1L-layer-dropout"]


def _check(impl: str, folder: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    return subprocess.run([str(GRADEQUIV), "check", "--impl", impl, *ONE, "--report-dir",
                           str(folder)], capture_output=True, text=True, env=env, cwd=TESTS,
                          timeout=600, check=False)


@pytest.mark.slow
@pytest.mark.parametrize(("impl", "said"), [
    ("forging_at_import:my_checkpoint", "the implementation's process replaced torch.equal"),
    ("forging_impls:equal_always", "the implementation's process replaced torch.equal"),
    ("forging_helper:my_checkpoint", "the checking process said the run passed, but it "
                                     "sent no verified case"),
    ("forging_impls:channel_says_passed", "the checking process said the run passed, but "
                                          "it sent no verified case"),
])
def test_a_pass_forged_inside_the_checking_process_fails(impl: str, said: str,
                                                         tmp_path: Path) -> None:
    done = _check(impl, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"gradequiv: FAIL: {said}" in done.stderr, done.stderr
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert report["verdict"] == "fail" and said in report["failure"]["message"]


class _Heard:
    """What a supervisor heard from its child: the records, its last word."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records


def _passing_run(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A real passing report of one case, and the identity of the run that wrote it."""
    folder = tmp_path / "real"
    assert main(["check", "--impl", "torch", *ONE, "--report-dir", str(folder),
                 "--in-process"]) == 0
    report = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    return report, report["run"]


def test_the_supervisor_decides_a_pass_from_what_it_heard_and_the_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gradequiv.harness.commands.supervise import _why_not_a_pass

    report, identity = _passing_run(tmp_path)
    capsys.readouterr()
    folder = tmp_path / "decided"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(report), encoding="utf-8")
    sent = copy.deepcopy(report["cases"])
    assert _why_not_a_pass(folder, _Heard(sent), identity) is None  # type: ignore[arg-type]
    failing = copy.deepcopy(sent)
    failing[0]["verdict"] = "fail"
    assert "1 of the 1 case(s) it sent failed" in str(
        _why_not_a_pass(folder, _Heard(failing), identity))  # type: ignore[arg-type]
    other = copy.deepcopy(sent)
    other[0]["reproduce"] += " --seed 9"
    assert "holds 1 case(s) where the checking process sent 1 (1 missing, 1 it never sent)" \
        in str(_why_not_a_pass(folder, _Heard(other), identity))  # type: ignore[arg-type]
    stranger = dict(identity, id="another-run")
    assert "is not this run's report" in str(
        _why_not_a_pass(folder, _Heard(sent), stranger))  # type: ignore[arg-type]
    assert _why_not_a_pass(None, _Heard(sent), identity) is None  # type: ignore[arg-type]


def test_a_replaced_primitive_is_named_and_a_real_run_replaces_none() -> None:
    import torch

    from gradequiv.harness import verify
    from gradequiv.harness.engine import bindings, compare
    from gradequiv.harness.engine.case import Case

    bound = bindings.fingerprint()
    verify("torch", Case())  # a whole verdict: checkpoint, optimizer, comparison
    assert bound.replaced() == []
    saved = torch.equal, torch.Tensor.abs, compare.measure_pairs
    try:
        torch.equal = lambda a, b: True
        torch.Tensor.abs = lambda self: self  # type: ignore[method-assign]
        compare.measure_pairs = None  # type: ignore[assignment]
        replaced = bound.replaced()
    finally:
        torch.equal, torch.Tensor.abs, compare.measure_pairs = saved  # type: ignore[method-assign]
    assert replaced == ["gradequiv.harness.engine.compare.measure_pairs",
                        "torch.Tensor.abs", "torch.equal"]
    assert bound.replaced() == []
    assert bindings.said(replaced).startswith(
        "the implementation's process replaced gradequiv.harness.engine.compare.measure_pairs,"
        " torch.Tensor.abs, torch.equal after gradequiv bound")


def test_a_case_whose_gradients_are_all_zero_verifies_nothing() -> None:
    """A vocabulary of one token: the loss is 0 whatever the parameters, every gradient is
    zero, and any recompute, broken or not, would match it."""
    from gradequiv.harness import verify
    from gradequiv.harness.engine.case import Case
    from gradequiv.models import TransformerConfig

    case = Case(model=TransformerConfig(n_layer=1, n_embd=16, vocab_size=1))
    with pytest.raises(RuntimeError, match="verifies nothing: every one of its [0-9]+ "
                                           "gradients is zero"):
        verify("torch", case)


@pytest.mark.parametrize(("edit", "named"), [
    (lambda r: [p.update(status="n/a", compared=0) for c in r["cases"]
                for p in c["properties"]], "cases[0].properties: gradients 'n/a'"),
    (lambda r: [p.update(compared=0) for c in r["cases"] for p in c["properties"]],
     "cases[0].properties: gradients 'pass' with 0 tensor(s) compared"),
    (lambda r: r["summary"].update(run=55, passed=55),
     "summary.run=55 but cases holds 1 case(s)"),
    (lambda r: r["cases"][0].update(seconds=float("nan")), "cases[0].seconds: NaN is not"),
    (lambda r: r["cases"][0]["properties"][0].update(max_floor="inf"),
     "max_floor='inf'"),
])
def test_report_fail_on_verdict_refuses_a_pass_that_verified_nothing(
        edit: Any, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report, _ = _passing_run(tmp_path)
    edit(report)
    folder = tmp_path / "edited"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(report), encoding="utf-8")
    capsys.readouterr()
    code = main(["report", str(folder), "--format", "md", "--fail-on-verdict"])
    err = capsys.readouterr().err
    assert code == 2 and named in err, err


def test_a_fault_only_above_four_sequences_is_caught_by_a_named_and_a_drawn_case() -> None:
    """Batches were drawn up to 4 sequences and so were the named cases: an implementation
    wrong only for bigger batches passed every case."""
    from hypothesis import find, settings

    from gradequiv.harness import find_case, resolve, verify
    from gradequiv.properties.strategies import cases

    wrong = resolve("wrong_impls:wrong_above_four_sequences")
    assert verify(wrong, find_case("1L-layer-dropout")).passed
    assert not verify(wrong, find_case("2L-layer-16x64-dropout")).passed
    long = find(cases(), lambda c: c.batch.batch_size > 4 and c.batch.seq_len > 32,
                settings=settings(database=None, max_examples=500, derandomize=True))
    assert long.batch.batch_size == 5 and long.batch.seq_len == 33  # shrunk to the least


def test_profile_refuses_sizes_too_large_to_build_before_allocating(
        capsys: pytest.CaptureFixture[str]) -> None:
    """It allocated first, and a width of a million ended in a 12 TB allocation's traceback."""
    assert main(["profile", "--impl", "torch", "--width", "1000000", "--layers", "2",
                 "--heads", "1"]) == 2
    err = capsys.readouterr().err
    assert "--layers, --width, --batch, --seq-len: its model would hold about 2.4e+13 " \
           "parameters (n_layer=2, n_embd=1000000" in err

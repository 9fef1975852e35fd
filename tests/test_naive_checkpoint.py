"""A user's first hand-written checkpoint (tests/naive_impls.py): its three faults named in one
run, the captured argument by name with the user's line, each fault alone named alone, and the
fixed one passing."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
from pathlib import Path
from typing import Any

import naive_impls
import pytest

from gradequiv.harness.cli import main
from gradequiv.harness.errors import user_frames

#: The closure of the first draft: the line the captured argument's cause must name.
_CLOSURE = "return function(*positional, **kwargs)"
_DECLARATION = 'gradequiv_unsupported = ("autograd-grad",)'


def _closure_line() -> str:
    lines, start = inspect.getsourcelines(naive_impls._checkpoint)
    number = next(start + i for i, line in enumerate(lines) if _CLOSURE in line)
    return f"naive_impls.py:{number}"


def _check(tmp_path: Path, *args: str) -> tuple[int, str, dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["check", "--in-process", *args, "--report-dir", str(tmp_path)])
    return code, out.getvalue(), json.loads((tmp_path / "report.json").read_text())


def _causes(report: dict[str, Any]) -> list[str]:
    return [fault["cause"] for fault in report["faults"]]


@pytest.mark.parametrize(("variant", "case", "cause"), [
    ("only_rng", "1L-layer-dropout", "rng-not-restored"),
    ("only_closure", "2L-layer-aux-shared-x0kw-dropout", "input-captured"),
    ("only_closure", "2L-layer-bf16-nested-inputs-dropout", "input-captured"),
    ("only_inner_backward", "2L-layer-autograd-grad-dropout", "grad-touched"),
])
def test_each_fault_alone_is_named_alone(tmp_path: Path, variant: str, case: str,
                                         cause: str) -> None:
    code, _, report = _check(tmp_path, "--impl", f"naive_impls:{variant}", "--case", case)
    assert code == 1
    assert _causes(report) == [cause], report["faults"]
    sentence = report["faults"][0]["sentence"]
    if cause == "input-captured":
        named = "`x0`" if "x0kw" in case else "a dict holding tensors"
        assert named in sentence and _closure_line() in sentence and _CLOSURE in sentence
    if cause == "grad-touched":
        assert _DECLARATION in sentence


@pytest.mark.parametrize("case", ["1L-layer-dropout", "2L-layer-aux-shared-x0kw-dropout",
                                  "2L-layer-bf16-nested-inputs-dropout"])
def test_the_fixed_checkpoint_passes(tmp_path: Path, case: str) -> None:
    code, out, _ = _check(tmp_path, "--impl", "naive_impls:fixed", "--case", case)
    assert code == 0, out


def test_a_failing_test_searches_on_for_another_cause(pytester: pytest.Pytester,
                                                      tmp_path: Path) -> None:
    """One property test alone, on few examples: its first failure (the first draft's
    backward inside backward, on the first torch.autograd.grad case drawn) does not end its
    search; a further one finds a failure with another cause, kept beside the first."""
    result = pytester.runpytest(
        "--pyargs", "gradequiv.properties", "-p", "no:cacheprovider", "-k",
        "test_gradients and not named", "--gradequiv-impl=naive_impls:naive",
        "--gradequiv-examples=2", "--gradequiv-seed=0", f"--gradequiv-report-dir={tmp_path}")
    result.assert_outcomes(failed=1)
    failures = json.loads((tmp_path / "report.json").read_text())["minimal_failures"]
    searches = [f.get("search") for f in failures]
    assert searches[0] is None and searches[1:] == list(range(1, len(failures))), searches
    first, *further = ({fault["cause"] for fault in f["diagnosis"]["faults"]} for f in failures)
    assert further and set().union(*further) - first, failures


@pytest.mark.slow
def test_the_first_draft_s_first_run_names_its_three_faults(tmp_path: Path) -> None:
    """The default check of the first draft: every fault in its first run, most important
    first (the RNG, which breaks every training with dropout; the captured keyword tensor;
    then what a declaration settles), the captured one by name with the user's line, the
    autograd.grad one with its declaration."""
    code, out, report = _check(tmp_path, "--impl", "naive_impls:naive")
    assert code == 1
    assert _causes(report) == ["rng-not-restored", "input-captured", "grad-touched"]
    rng, captured, touched = (fault["sentence"] for fault in report["faults"])
    assert "`x0`" in captured or "holding tensors" in captured
    assert _closure_line() in captured
    assert _DECLARATION in touched
    assert "likely causes (3 distinct faults):" in out
    assert any(f.get("search") for f in report["minimal_failures"])  # a further search's


def test_the_user_s_frames_are_those_outside_the_harness_torch_and_python() -> None:
    traceback = "\n".join([
        "Traceback (most recent call last):",
        '  File "/work/x/harness/engine/runner.py", line 295, in run_path',
        "    touched |= _backward_passes(case)",
        '  File "/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 3, in f',
        "    _engine_run_backward(",
        '  File "/home/me/train/ckpt.py", line 12, in backward',
        "    torch.autograd.backward(out, grads)",
        "    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        '  File "/venv/lib/python3.11/site-packages/mylib/layers.py", line 7, in forward',
        "    return self.proj(x)",
        "RuntimeError: boom"])
    traceback = traceback.replace("/work/x/harness", str(Path(main.__code__.co_filename).parent))
    assert user_frames(traceback) == [
        "/home/me/train/ckpt.py:12 in backward: torch.autograd.backward(out, grads)",
        "/venv/lib/python3.11/site-packages/mylib/layers.py:7 in forward: return self.proj(x)"]
    assert user_frames(traceback, limit=1) == [
        "/venv/lib/python3.11/site-packages/mylib/layers.py:7 in forward: return self.proj(x)"]


def test_an_exception_s_user_frame_is_in_the_report_and_the_summary(tmp_path: Path) -> None:
    code, out, report = _check(tmp_path, "--impl", "wrong_impls:raises_in_backward",
                               "--case", "1L-layer-dropout")
    assert code == 1
    frames = next(c for c in report["cases"] if c["error"])["user_frames"]
    assert frames[-1].startswith(f"{Path(__file__).parent / 'wrong_impls.py'}:")
    assert frames[-1].endswith('raise RuntimeError("recompute buffer was freed before backward")')
    assert f"(in your code at {frames[-1]})" in out

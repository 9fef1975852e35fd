"""gradequiv.check: the command line's check from Python, objects in, a Report out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gradequiv import InvalidArgument, Report, assert_equivalent, check

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
BF16 = "2L-layer-bf16-nodropout"  # a named case the hand-written checkpoint fails in seconds


@pytest.fixture(scope="module")
def hand_written():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import hand_written

        yield hand_written
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def failing(hand_written) -> Report:
    """The hand-written checkpoint that loses autocast, passed as an object: by its
    module:attr, in a child process."""
    return check(hand_written.my_checkpoint, case=BF16)


def test_a_failing_check_says_the_cause_the_op_and_how_to_reproduce(failing):
    assert not failing.passed and failing.verdict == "fail" and failing.exit_code == 1
    assert not failing.in_process and failing.notes == ()
    text = str(failing)
    assert "likely cause: the recompute runs addmm" in text
    assert "autocast state" in failing.likely_cause
    [first] = failing.failures
    assert first.properties[0] == "gradients" and "relative error" in first.message
    assert first.first_diverging_op.startswith("addmm in ")  # the attribute is the label
    assert first.reproduce.startswith("gradequiv check --impl hand_written:my_checkpoint ")
    assert first.reproduce in text and first.first_diverging_op in text
    shown = str(first)
    assert f"first diverging op: {first.first_diverging_op}" in shown
    assert shown.count("first diverging op") == 1
    assert text.endswith("verdict: FAIL")


def test_write_puts_check_s_files_in_a_folder(failing, tmp_path):
    folder = failing.write(tmp_path / "out")
    names = {p.name for p in folder.iterdir()}
    assert {"report.json", "report.md", "report.html", "junit.xml"} <= names
    assert json.loads((folder / "report.json").read_text())["verdict"] == "fail"
    assert "autocast" in (folder / "report.md").read_text()


@pytest.mark.slow
def test_a_declaration_is_honoured_as_check_honours_it(hand_written):
    """my_checkpoint_fixed claims no double backward and declines autograd.grad: a case of
    either is refused before it runs, as `check --case` refuses it (exit 2)."""
    for case in ("2L-layer-create-graph-manual-attn", "2L-layer-autograd-grad-dropout"):
        with pytest.raises(InvalidArgument, match="would check nothing"):
            check(hand_written.my_checkpoint_fixed, case=case)


def test_an_object_without_a_name_runs_in_this_process_and_says_so(hand_written):
    def ours(function, *args, **kwargs):
        return hand_written.my_checkpoint_fixed(function, *args, **kwargs)

    report = check(ours, case=BF16)
    assert report.passed and report.in_process
    assert "ran in this process" in report.notes[0] and "no timeout" in report.notes[0]
    assert str(report).endswith("verdict: pass")


@pytest.mark.slow
def test_a_timeout_ends_a_hanging_implementation():
    import wrong_impls

    report = check(wrong_impls.hangs, case="1L-layer-dropout", timeout=3)
    assert not report.passed and report.data["complete"] is False
    assert "hung" in str(report) and "nothing finished in 3 s" in str(report)


def test_a_user_model_instance_and_a_factory_are_checked():
    import user_models

    built = user_models.residual_stack(0)
    report = check("torch", model=built, examples=1)
    assert report.passed, str(report)
    assert report.in_process and "a UserModel instance" in report.notes[0]


def test_caller_mistakes_are_invalid_argument(hand_written):
    with pytest.raises(InvalidArgument, match="impl=42 is a int"):
        check(42)
    with pytest.raises(InvalidArgument, match="timeout=5 needs a child process"):
        check(lambda f, *a, **k: f(*a, **k), timeout=5)
    with pytest.raises(InvalidArgument, match="in_process=False"):
        check(lambda f, *a, **k: f(*a, **k), in_process=False)
    with pytest.raises(InvalidArgument, match="timeout=-1"):
        check("torch", timeout=-1)
    with pytest.raises(InvalidArgument, match="seed"):
        check("torch", seed=-3)
    with pytest.raises(InvalidArgument, match="could not be imported|no attribute"):
        check("hand_written:no_such_function", case=BF16)


@pytest.mark.slow
def test_assert_equivalent_fails_with_the_diagnosis(hand_written):
    with pytest.raises(AssertionError, match="likely cause: the recompute runs addmm"):
        assert_equivalent(hand_written.my_checkpoint, case=BF16, in_process=True)
    assert assert_equivalent(hand_written.my_checkpoint_fixed, case=BF16).passed


def test_the_api_is_at_the_top_of_the_package_as_the_engine_s_own() -> None:
    import gradequiv.harness

    for name in gradequiv.__all__:
        assert getattr(gradequiv, name) is getattr(gradequiv.harness, name), name
    with pytest.raises(AttributeError, match="has no attribute 'verify'"):
        gradequiv.verify  # noqa: B018  # the engine's own names stay in gradequiv.harness

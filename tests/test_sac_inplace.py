"""torch's selective checkpoint on in-place layers: loud where the write moves the saved
output's version counter, silently wrong where it goes through an alias that does not
(pytorch/pytorch#113737, #119590). The loud case is not applicable; the silent one fails,
its cause naming the saved op, the in-place op and the alias it wrote through."""

from __future__ import annotations

from dataclasses import replace

from test_diagnosis import FAULTS, diagnosed

from gradequiv.harness import find_case, resolve, verify
from gradequiv.harness.engine.localise import localise

SILENT = "2L-layer-inplace-ops-nobias-manual-attn"


def test_torch_sac_fails_where_an_in_place_op_changes_a_saved_output_unseen() -> None:
    verdict = verify("torch-sac", find_case(SILENT))
    assert not verdict.passed and verdict.error is None  # wrong gradients, no raise
    gradients = next(p for p in verdict.properties if p.name == "gradients")
    assert gradients.passed is False and "grad of blocks.0." in gradients.summary


def test_the_stale_read_names_the_saved_op_the_in_place_op_and_the_alias() -> None:
    """The bmm's output (saved by the matmul policy) is scaled in place by mul_ through
    _unsafe_view's output: the same memory, a version counter of its own."""
    d = localise(resolve("torch-sac"), find_case(SILENT)).divergence
    assert d is not None and d.stale_unversioned
    assert "reads bmm's output from the forward" in d.stale
    assert "mul_ in blocks.0.attn (op" in d.stale
    assert "through _unsafe_view's output" in d.stale and "not its version counter" in d.stale


def test_the_cause_says_torch_does_not_see_it_with_the_issue_numbers() -> None:
    cause, sentence, _ = diagnosed("torch-sac", SILENT)
    assert cause == "saved-output-changed", sentence
    assert "mul_ in blocks.0.attn" in sentence and "_unsafe_view's output" in sentence
    assert "pytorch/pytorch#113737, #119590" in sentence
    assert "raises on this" not in sentence


def test_a_write_through_a_tracked_view_is_one_torch_raises_on() -> None:
    """A store of the forward's matmul outputs by reference, a Linear with a bias: addmm's
    output is changed in place (an in-place dropout) through its view, which moves its
    version counter; torch's selective checkpoint raises there, and the cause says so."""
    case = find_case("2L-layer-inplace-ops-manual-attn-relu-dropout")
    case = replace(case, model=replace(case.model, attention="sdpa"))  # in-place dropout
    assert case.model.bias
    cause, sentence, failure = diagnosed(FAULTS + "matmul_outputs_cached", case)
    assert cause == "saved-output-changed", sentence
    assert failure["first_diverging_op"]["stale_unversioned"] is False
    assert "reads addmm's output" in sentence and "through a view of it" in sentence
    assert "(torch's selective checkpoint raises on this)" in sentence

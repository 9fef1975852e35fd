"""The likely cause of a failure, named in words: on faults that have it, and only there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_fault_library import CASES

from gradequiv.harness import Case, Implementation, find_case, resolve, verify
from gradequiv.harness.reports.diagnosis import CAUSES, diagnose
from gradequiv.harness.reports.report import verdict_record
from gradequiv.properties.assertions import locate

FAULTS = "gradequiv.harness.implementations.faults:"


def diagnosed(spec: str | Implementation, name: str | Case) -> tuple[str, str, dict[str, Any]]:
    """(cause, sentence, failure) of ``spec`` on the case (by name, or itself), as the suite
    would report its failure: the verdict's record, the localisation, then the diagnosis."""
    impl = resolve(spec) if isinstance(spec, str) else spec
    case = find_case(name) if isinstance(name, str) else name
    verdict = verify(impl, case, device="cpu")
    assert not verdict.passed, f"{impl.spec} passes {case.describe()}: no failure to diagnose"
    record = verdict_record(impl, verdict, torch.device("cpu"))
    # a run that raised fails every property test: the first one's failure, as the suite's
    prop = next((p["name"] for p in record["properties"] if p["status"] == "fail"),
                "gradients")
    failure = {"property": prop, "message": verdict.first_failure, "flaky": False,
               "case": case.to_dict(), "description": case.describe(),
               "reproduce": record["reproduce"]}
    locate(impl, failure)
    diagnosis = diagnose(failure, record)
    assert diagnosis.evidence[0].startswith("fails: ")
    return diagnosis.cause, diagnosis.sentence, failure


@pytest.mark.parametrize(("spec", "case", "cause", "words"), [
    (FAULTS + "no_rng_restore", "1L-layer-dropout", "rng-not-restored",
     "does not restore the RNG state"),
    (FAULTS + "caller_stream_moved", "2L-layer-manual-attn", "rng-stream-moved",
     "generator was left rewound"),
    (FAULTS + "caller_stream_moved", "2L-layer-accumulate-dropout", "rng-stream-moved",
     "micro-batch 2's random ops"),
    (FAULTS + "autocast_lost", "2L-layer-bf16-dropout", "autocast-lost", "float32"),
    (FAULTS + "kwargs_dropped", "1L-layer-dropout", "inputs-lost", "keyword argument"),
    # running statistics change between a forward and its re-run, which skips them: no
    # state of the model's that the re-run reads, so still the implementation's fault
    (FAULTS + "kwargs_dropped", "2L-layer-running-stats-inference-first", "inputs-lost",
     "keyword argument"),
    (FAULTS + "input_grads_dropped", "1L-layer-dropout", "input-grads-dropped", "input"),
    (FAULTS + "buffers_updated_twice", "batchnorm-layer", "buffers-updated-twice",
     "num_batches_tracked is 2 on the recompute path, 1 with full storage"),
    # the counter is behind, not ahead: only the re-run updates it
    (FAULTS + "bn_stats_in_recompute_only", CASES["batchnorm-inference"], "buffers-missed",
     "num_batches_tracked is 1 on the recompute path, 2 with full storage"),
    # the re-run's ops before it raised say why it raised
    ("wrong_impls:autocast_lost_in_rerun", "2L-layer-bf16-nodropout", "autocast-lost",
     "the re-run then raised: torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: "
     "Recomputed values for the following tensors have different metadata"),
    # a selective store leaves the saved matmuls out of the re-run: compared with the
    # forward ops it repeats, the first that differs is a dropout mask drawn anew
    (resolve("torch-sac", kwargs={"preserve_rng_state": False}), "2L-layer-manual-attn",
     "rng-not-restored", "bernoulli_ in blocks.0.attn.attn_dropout"),
    # the same through a store of copies: a copy of a forward output is that output still
    ("wrong_impls:copying_store_no_rng_restore", "2L-layer-manual-attn", "rng-not-restored",
     "bernoulli_ in blocks.0.attn.attn_dropout"),
    (FAULTS + "dropout_off", "2L-layer-manual-attn", "dropout-skipped",
     "runs no random ops where its forward ran"),
    (FAULTS + "matmul_outputs_cached", CASES["inplace-manual"], "saved-output-changed",
     "reads bmm's output from the forward"),
    (FAULTS + "no_op", "1L-layer-dropout", "no-memory-saved", "no memory was saved"),
    (FAULTS + "recomputed_kept", "1L-layer-dropout", "leak", "past backward"),
    ("wrong_impls:wrong_from_second_step", "1L-layer-dropout", "later-step", "step 2"),
    (FAULTS + "grad_via_backward", "2L-layer-autograd-grad-dropout", "grad-touched",
     '`gradequiv_unsupported = ("autograd-grad",)`'),  # the declaration that settles it
    (FAULTS + "grad_mode_forced_on", "2L-layer-frozen-first-layer", "grad-mode-ignored",
     "under no_grad"),
    # a keyword tensor in a closure: torch raises from its engine, with no frame of the
    # user's; the argument is found by passing it, and the closure's line by watching
    ("naive_impls:only_closure", "2L-layer-aux-shared-x0kw-dropout", "input-captured",
     "`x0`"),
    ("naive_impls:only_closure", "2L-layer-aux-shared-x0kw-dropout", "input-captured",
     "naive_impls.py:"),
    # detached, not captured: the segment is given a copy, and the gradient is dropped
    (FAULTS + "kwarg_tensors_detached", "2L-layer-aux-shared-x0kw-dropout",
     "input-grads-dropped", "keyword argument"),
    # an exception with the user's frame in its traceback: the sentence ends with it
    ("wrong_impls:raises_in_backward", "1L-layer-dropout", "raised",
     "in your code at " + str(Path(__file__).parent / "wrong_impls.py")),
    (FAULTS + "stash_kept_after_warmup", "1L-layer-dropout", "leak", "past backward"),
    (FAULTS + "recomputed_held_to_backward_end", "2L-layer-manual-attn", "recomputed-held",
     "backward's peak"),
])
def test_each_fault_is_diagnosed_by_its_cause(spec: str | Implementation, case: str | Case,
                                              cause: str, words: str) -> None:
    found, sentence, _ = diagnosed(spec, case)
    assert found == cause, sentence
    assert words in sentence


def test_a_layer_applied_twice_is_compared_run_by_run() -> None:
    """Backward recomputes a shared layer's second application first: compared in call
    order, a correct recompute looked like a deterministic op's values changing."""
    cause, sentence, failure = diagnosed(FAULTS + "tuple_tail_no_grad",
                                         "2L-layer-aux-shared-x0kw-dropout")
    assert failure["first_diverging_op"] is None, failure["localisation"]
    assert cause == "input-grads-dropped", sentence


def test_buffer_updates_are_no_diverging_op() -> None:
    """BatchNorm's counter, bumped again by a recompute, is the buffers property's finding;
    as an op it hid that every computation matched. Under torch's own checkpoint it is the
    model's: its training forward updates running statistics, which the re-run updates
    again."""
    cause, sentence, failure = diagnosed("torch", "batchnorm-layer")
    assert failure["first_diverging_op"] is None
    assert "module state" in failure["localisation"]
    assert cause == "model-state-changed", sentence
    assert sentence.startswith("your model is not safe to recompute here: ")
    assert ".running_mean (a buffer, written by " in sentence
    assert failure["localisation"].endswith("; and 2 more such changes")  # six in all


def _record(**statuses: str) -> dict[str, Any]:
    return {"error": None, "properties": [
        {"name": name, "status": status, "summary": f"{name} differs",
         "failures": [], "checks": [{"name": f"{name} tensor", "passed": status != "fail"}]}
        for name, status in statuses.items()]}


def _failure(prop: str, **extra: Any) -> dict[str, Any]:
    return {"property": prop, "message": f"{prop} differs", "flaky": False} | extra


def test_the_end_of_the_process_and_an_exception_are_named_before_any_property() -> None:
    assert diagnose(_failure("process", message="killed by SIGKILL"), None).cause == "process"
    record = _record(gradients="n/a") | {"error": "Traceback ...\nValueError: boom",
                                         "error_at": "step 1 backward"}
    raised = diagnose(_failure("gradients"), record)
    assert raised.cause == "raised" and "ValueError: boom" in raised.sentence


def test_a_refusal_of_autograd_grad_is_said_as_one_with_the_declaration_to_make() -> None:
    impl = resolve("correct_impls:undeclared_reentrant_checkpoint")
    verdict = verify(impl, find_case("2L-layer-autograd-grad-dropout"))
    assert verdict.error is not None  # it raises: a failure, not a skip
    said = diagnose(_failure("gradients"), verdict_record(impl, verdict, torch.device("cpu")))
    cause, sentence = said.cause, said.sentence
    assert cause == "refuses-autograd-grad"
    assert "refuses torch.autograd.grad" in sentence
    assert 'gradequiv_unsupported = ("autograd-grad",)' in sentence
    record = _record(gradients="n/a") | {"error": "Traceback ...\nRuntimeError: backward "
                                         "through .grad() failed: out of memory"}
    assert diagnose(_failure("gradients"), record).cause == "raised"


def test_frozen_inputs_of_a_reentrant_segment_are_named_as_such() -> None:
    impl = resolve("torch-reentrant")
    verdict = verify(impl, find_case("2L-layer-frozen-embeddings"))
    record = verdict_record(impl, verdict, torch.device("cpu"))
    said = diagnose(_failure("gradients"), record)
    assert said.cause == "no-input-requires-grad"
    assert "no input of the segment requires grad" in said.sentence
    assert "non-reentrant" in said.sentence
    record["warnings"] = []  # without torch's warning, the frozen embeddings still tell it
    assert diagnose(_failure("gradients"), record).cause == "no-input-requires-grad"


def test_a_forward_or_an_inference_fault_is_not_blamed_on_the_recompute() -> None:
    assert diagnose(_failure("outputs"), _record(outputs="fail")).cause == "forward-changed"
    assert diagnose(_failure("inference"),
                    _record(outputs="pass", inference="fail")).cause == "inference"


def test_a_failure_that_did_not_come_back_is_called_nondeterministic() -> None:
    found = diagnose(_failure("gradients", flaky=True), _record(gradients="fail"))
    assert found.cause == "nondeterministic"


def test_what_fits_no_rule_says_so_plainly() -> None:
    found = diagnose(_failure("gradients"), _record(gradients="fail"))
    assert found.cause == "other" and "gradients" in found.sentence


def test_a_global_switch_left_changed_is_named() -> None:
    record = _record(rng="fail")
    record["properties"][0]["failures"] = [
        "the implementation changed torch's global state and did not restore it: default "
        "dtype torch.float32 -> torch.float64"]
    found = diagnose(_failure("rng"), record)
    assert found.cause == "global-state" and "float64" in found.sentence


def test_a_failure_that_autocast_s_cast_cache_alone_makes_is_named_so() -> None:
    """Gradients that differ with every recomputed op matching, on an autocast case that
    passes with the cast cache off on both paths (``needs_autocast_cache``): the re-run's
    input leaves are cast once for all their uses; without that evidence the same failure
    is another cause."""
    record = _record(gradients="fail") | {"case": {"dtype": "bf16-autocast"}}
    record["properties"][0]["failures"] = ["grad of layers.0.query.weight: relative error "
                                           "4e-4 > bound 9.5e-07"]
    matched = {"localisation": "every recomputed op of step 1 matched its original"}
    found = diagnose(_failure("gradients", needs_autocast_cache=True, **matched), record)
    assert found.cause == "autocast-cast-cache"
    assert "grad of layers.0.query.weight" in found.sentence and "bfloat16" in found.sentence
    assert diagnose(_failure("gradients", **matched), record).cause != "autocast-cast-cache"


def test_every_cause_is_in_the_schema() -> None:
    from gradequiv.harness.reports.bundle import report_schema

    schema = report_schema()["$defs"]["diagnosis"]["properties"]["cause"]["enum"]
    assert tuple(schema) == CAUSES


def test_model_state_explains_only_the_segment_whose_re_run_diverged() -> None:
    """A counter of blocks.2 that changed says nothing of why blocks.0 re-ran another
    computation; one of blocks.0 does."""
    op = {"segment": "blocks.0", "index": 3, "op": "mul", "module": "blocks.0",
          "forward": "float32[8, 16]", "recompute": "float32[8, 16]", "rel_error": 0.5,
          "differing": 1.0, "random": False}
    state = ("model state: {0}.calls (an attribute: 0 at the forward, 1 at the re-run) was "
             "changed by {0}'s forward")
    failure = _failure("gradients", first_diverging_op=op, reproduce="gradequiv check "
                       "--impl mypkg:checkpoint --case {}")
    elsewhere = failure | {"localisation": f"first diverging op: mul; {state.format('blocks.2')}"}
    assert diagnose(elsewhere, _record(gradients="fail")).cause == "inputs-lost"
    here = failure | {"localisation": f"first diverging op: mul; {state.format('blocks.0')}"}
    found = diagnose(here, _record(gradients="fail"))
    assert found.cause == "model-state-changed"
    assert found.sentence.startswith("the model is not safe to recompute here, whichever")


def test_a_change_no_re_run_was_seen_to_read_is_the_model_s_under_torch_only() -> None:
    """A re-run past the hooks (a patched forward) is not seen: a buffer the forward moved
    may be one the re-run skips, so only torch's own faithful re-run makes it the model's."""
    op = {"segment": "blocks.0", "index": 3, "op": "mul", "module": "blocks.0",
          "forward": "float32[8, 16]", "recompute": "float32[8, 16]", "rel_error": 0.5,
          "differing": 1.0, "random": False}
    line = ("model state: blocks.0.stats (a buffer, written by add_) was changed by "
            "blocks.0's forward, which a re-run starts from (the re-run itself was not seen)")
    failure = _failure("gradients", first_diverging_op=op,
                       localisation=f"first diverging op: mul; {line}")
    mine = failure | {"reproduce": "gradequiv check --impl mypkg:checkpoint --case {}"}
    assert diagnose(mine, _record(gradients="fail")).cause == "inputs-lost"
    torch_s = failure | {"reproduce": "gradequiv check --impl torch-patched --case {}"}
    assert diagnose(torch_s, _record(gradients="fail")).cause == "model-state-changed"


def test_a_re_run_through_the_bound_forward_is_followed_by_its_submodules() -> None:
    """A wrapper that re-runs ``module.forward`` passes none of the segment's own hooks;
    its submodules' hooks still fire, so its re-run is compared all the same and the fault
    it has besides (autocast lost) is named, not input gradients or parameters."""
    from gradequiv.harness.implementations.faults import Faults, checkpoint_with_faults

    faults = Faults(hooks_skipped_in_recompute=True, autocast_lost=True)

    def bound_forward(function: Any, *args: Any, **kwargs: Any) -> Any:
        return checkpoint_with_faults(function, *args, faults=faults, **kwargs)

    cause, sentence, failure = diagnosed(Implementation("bound", bound_forward),
                                         "2L-layer-bf16-dropout")
    assert failure["first_diverging_op"]["op"] == "addmm", failure["localisation"]
    assert cause == "autocast-lost", sentence


def test_a_sentence_claims_matching_ops_only_where_they_were_compared() -> None:
    record = _record(gradients="fail")
    record["properties"][0]["checks"][0]["name"] = "grad of blocks.0.mlp.fc.weight"
    unseen = _failure("gradients", localisation="no diverging op found: no segment ran again")
    assert "no recomputed op was seen to differ" in diagnose(unseen, record).sentence
    seen = _failure("gradients", localisation="every recomputed op of step 1 matched")
    assert "the recomputed ops match" in diagnose(seen, record).sentence


def test_the_exception_line_is_the_one_naming_what_was_raised() -> None:
    """torch's checkpoint ends its error with tips; the line a user needs names the error."""
    from gradequiv.harness.errors import exception_line

    torch_s = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
               "torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed "
               "values differ.\ntensor at position 3:\n\nTip: pass `debug=True`\n"
               "workaround examples.\n")
    assert exception_line(torch_s).startswith("torch.utils.checkpoint.CheckpointError: ")
    assert exception_line("Traceback ...\nValueError: boom\n") == "ValueError: boom"
    assert exception_line("Traceback ...\nKeyboardInterrupt\n") == "KeyboardInterrupt"
    assert exception_line("no exception named here\nlast words") == "last words"


@pytest.mark.parametrize(("spec", "case", "memory"), [
    (FAULTS + "saved_inputs_kept", "2L-layer-manual-attn", True),  # a leak
    (FAULTS + "recomputed_held_to_backward_end", "2L-layer-manual-attn", True),
    (FAULTS + "no_op", "1L-layer-dropout", False),  # "did not run again": a count
    (FAULTS + "no_rng_restore", "1L-layer-dropout", False),  # values differ
])
def test_a_named_case_differing_in_memory_only_is_not_searched_op_by_op(
        spec: str, case: str, memory: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every failing named case was searched op by op, and its pattern experiments run (a
    sixth of a leaking run): for a fault seen in bytes alone, each could only say that
    every value agrees. Such a named case keeps its cause, unsearched; a drawn minimal
    failure of the same fault, and any case where values or counts differ, is searched."""
    from gradequiv.harness.engine import localise as localise_module
    from gradequiv.properties import assertions, runtime

    impl, named = resolve(spec), find_case(case)
    verdict, _ = runtime.RUN.cache.verify(impl, named, runtime.RUN.device())
    assert assertions.memory_only(verdict) is memory
    record = verdict_record(impl, verdict, torch.device("cpu"))
    prop = next(p["name"] for p in record["properties"] if p["status"] == "fail")
    failure = {"property": prop, "message": verdict.first_failure, "flaky": False,
               "case": named.to_dict(), "description": named.describe(),
               "reproduce": record["reproduce"]}

    def searched(*_: Any) -> Any:
        raise AssertionError("searched op by op")

    monkeypatch.setattr(localise_module, "localise", searched)
    runtime.RUN.cache.located.clear()
    if not memory:
        with pytest.raises(AssertionError, match="searched op by op"):
            locate(impl, dict(failure), named=True)
        return
    unsearched = dict(failure)
    locate(impl, unsearched, named=True)
    assert unsearched["localisation"] == assertions.MEMORY_ONLY
    assert unsearched["first_diverging_op"] is None
    cause = diagnose(unsearched, record).cause
    assert cause in ("leak", "recomputed-held")
    with pytest.raises(AssertionError, match="searched op by op"):
        locate(impl, dict(failure))  # a drawn minimal failure is searched
    monkeypatch.undo()
    runtime.RUN.cache.located.clear()
    located = dict(failure)
    locate(impl, located)
    assert diagnose(located, record).cause == cause  # the same cause, searched or not

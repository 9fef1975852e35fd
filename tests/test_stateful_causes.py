"""State the forward changes, named with whose it is (issue 49): an fp8 region with delayed
scaling and an expert-load counter (tests/stateful_models.py), under torch's checkpoints, a
right fp8 checkpoint and three wrong ones. The headline names the state by its qualified name
(a module-level class attribute, a buffer), says what happened to it and, run beside torch's
own checkpoint, whose it is."""

from __future__ import annotations

from typing import Any

import pytest
from test_diagnosis import diagnosed

from gradequiv.harness import Case, resolve, verify
from gradequiv.harness.reports.diagnosis import diagnose
from gradequiv.models import ExternalConfig, parse_granularity

FP8 = "stateful_models:fp8_delayed_scaling"
REGION = ("stateful_models.Fp8State.enabled (process-level state: True during blocks.0's "
          "forward, False at its re-run) was set around the forward and not around its re-run")


def _case(factory: str, **kwargs: Any) -> Case:
    return Case(model=ExternalConfig(factory), granularity=parse_granularity("layer"), **kwargs)


def _fails(spec: str, case: Case) -> str:
    verdict = verify(resolve(spec), case)
    return "" if verdict.passed else (verdict.error or "") + "; ".join(
        f"{p.name}: {p.summary}" for p in verdict.properties if p.passed is False)


@pytest.mark.parametrize("kwargs", [{}, {"dtype": "bf16-autocast"}, {"backward_passes": 2},
                                    {"grad_mode": "accumulate"}, {"schedule": "gpipe"}],
                         ids=["fp32", "bf16", "two-passes", "accumulate", "gpipe"])
def test_a_checkpoint_that_re_enters_the_region_with_the_forward_s_scales_passes(
        kwargs: dict[str, Any]) -> None:
    assert _fails("stateful_models:fp8_checkpoint", _case(FP8, **kwargs)) == ""


def test_torch_s_checkpoint_leaves_the_region_and_the_model_is_told_so() -> None:
    cause, sentence, _ = diagnosed("torch", _case(FP8))
    assert cause == "model-state-changed", sentence
    assert sentence.startswith(f"your model is not safe to recompute here: {REGION}")
    assert "set it inside the checkpointed module" in sentence


def test_a_region_not_re_entered_names_the_module_level_flag_and_torch_s_checkpoint_beside(
) -> None:
    """Megatron-LM#7538: the checkpoint restored the RNG state only."""
    cause, sentence, failure = diagnosed("stateful_models:fp8_region_not_reentered", _case(FP8))
    assert cause == "model-state-changed", sentence
    assert failure["torch_checkpoint"] == {"verdict": "same"}
    assert sentence.startswith(
        "the model is not safe to recompute here: torch's own checkpoint fails this case the "
        f"same way (run beside it), so the state is the model's to keep: {REGION}")


def test_scales_kept_by_reference_are_the_checkpoint_s_fault() -> None:
    """NVIDIA/TransformerEngine#1723: the re-run reads the scale the region's exit set."""
    cause, sentence, failure = diagnosed("stateful_models:fp8_scales_by_reference", _case(FP8))
    assert cause == "state-not-carried", sentence
    assert failure["torch_checkpoint"]["verdict"] == "other"
    assert sentence.startswith(
        "the checkpoint does not give the re-run the state its forward ran with: "
        "blocks.0.fc.scale (a buffer) was changed after blocks.0's forward, and its re-run "
        "read the changed value; torch's own checkpoint fails this case too, but on other "
        "state (stateful_models.Fp8State.enabled), so this state is the checkpoint's doing; "
        "keep copies of the state the forward ran with")


def test_an_amax_recorded_twice_is_named_with_the_history_it_went_into() -> None:
    """NVIDIA/TransformerEngine#415: the re-run is not marked as one."""
    cause, sentence, _ = diagnosed("stateful_models:fp8_amax_recorded_twice", _case(FP8))
    assert cause == "state-not-carried", sentence
    assert ("blocks.0.fc.amax_history (a buffer, written by copy_) was recorded into by "
            "blocks.0's forward and again by its re-run") in sentence
    assert "mark the re-run as one" in sentence


@pytest.mark.parametrize(("spec", "factory", "what"), [
    ("torch", "expert_load_counted", "by blocks.0's forward and again by its re-run"),
    ("torch-reentrant", "expert_load_counted", "by blocks.0's forward and again by its re-run"),
    ("torch", "expert_load_grad_guarded", "by blocks.0's forward and again by its re-run"),
    ("torch-reentrant", "expert_load_grad_guarded",
     "by the re-run of blocks.0 and not by blocks.0's forward"),
])
def test_an_expert_load_counted_in_the_re_run_is_the_model_s(spec: str, factory: str,
                                                              what: str) -> None:
    """torchtitan's MoE counts tokens per expert in every forward (its comment: a checkpoint's
    re-run counts them again); Megatron's router counts where grad mode is on, which a
    reentrant checkpoint's re-run is, once per backward pass."""
    case = _case(f"stateful_models:{factory}", backward_passes=2)
    cause, sentence, _ = diagnosed(spec, case)
    assert cause == "model-state-changed", sentence
    assert sentence.startswith("your model is not safe to recompute here: "
                               "blocks.0.tokens_per_expert (a buffer")
    assert f"was recorded into {what}" in sentence
    assert "`torch._C._current_graph_task_id() == -1`" in sentence


@pytest.mark.parametrize("spec", ["torch", "torch-reentrant"])
def test_an_expert_load_counted_outside_re_runs_passes(spec: str) -> None:
    assert _fails(spec, _case("stateful_models:expert_load_guarded", backward_passes=2)) == ""


def test_where_torch_s_checkpoint_passes_the_state_is_the_checkpoint_s() -> None:
    """The evidence read as the report carries it: torch's own checkpoint passed the case."""
    failure = {"property": "gradients", "message": "gradients differ", "case": {},
               "reproduce": "gradequiv check --impl mine:checkpoint --case x.json",
               "localisation": "model state: blocks.0.mlp.tokens_per_expert (a buffer, "
                               "written by add_) was recorded into by blocks.0's forward "
                               "and again by its re-run",
               "first_diverging_op": None, "torch_checkpoint": {"verdict": "passes"}}
    record = {"properties": [{"name": "gradients", "status": "fail", "failures": []}]}
    found = diagnose(failure, record)
    assert found.cause == "state-not-carried", found.sentence
    assert ("blocks.0.mlp.tokens_per_expert (a buffer, written by add_) was recorded into "
            "by blocks.0's forward and again by its re-run; torch's own checkpoint passes "
            "this case (run beside it), so the fault is the checkpoint's") in found.sentence
    del failure["torch_checkpoint"]  # no evidence: the cause the run saw stands
    assert diagnose(failure, record).cause != "state-not-carried"

"""Megatron-shaped RNG-state trackers (issue 47): a checkpoint that restores the default
generator and every tracker state passes, one that restores the default generator alone
fails with the tracker's state named, and the few bytes of state a checkpoint keeps between
steps (generator states, a counter) are a hold, not a leak."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_diagnosis import diagnosed

from gradequiv.harness import Case, Implementation, find_case, verify
from gradequiv.harness.cli import main
from gradequiv.harness.engine.memory import ActivationCounter
from gradequiv.harness.engine.runner import PathRun, StepRecord
from gradequiv.harness.engine.verify import PropertyResult, Verdict, _check_leaks
from gradequiv.harness.implementations.faults import MUTANTS
from gradequiv.models import ExternalConfig, parse_granularity

CASE = Case(model=ExternalConfig("tracker_setups:tracker_stack"),
            granularity=parse_granularity("layer"))

#: The headline for a checkpoint that puts back the default generator and not the tracker's.
NAMED = ("the recompute does not restore the RNG state of "
         "tracker_setups.TRACKER.states_['model-parallel-rng'], a named generator state: it "
         "puts torch's default generator back for the re-run of blocks.0, but that re-run drew "
         "under the named state advanced 2560 draws past the forward's, so bernoulli_ in "
         "blocks.0.parallel_dropout draws other random numbers than in the forward (39% of the "
         "draws differ); save and restore every named state with the default generator's, as "
         "Megatron's checkpoint does with its RNG tracker's states")


def _recompute(verdict: Verdict) -> PropertyResult:
    return next(p for p in verdict.properties if p.name == "recompute")


def test_the_checkpoint_that_restores_every_tracker_state_passes_the_drawn_cases(
        tmp_path: Path) -> None:
    assert main(["check", "--in-process", "--impl", "tracker_setups:tracker_checkpoint",
                 "--model", "tracker_setups:tracker_stack", "--examples", "3",
                 "--report-dir", str(tmp_path)]) == 0


@pytest.mark.parametrize("spec", ["tracker_setups:default_only_checkpoint", "torch"])
def test_restoring_the_default_generator_alone_fails_with_the_tracker_s_state_named(
        spec: str) -> None:
    """torch's own checkpoint does not know the tracker either: the truth, not a false
    alarm."""
    cause, sentence, failure = diagnosed(spec, CASE)
    assert cause == "rng-not-restored"
    assert sentence == NAMED, failure["localisation"]


def test_a_model_drawing_from_its_own_generator_is_still_the_model_s_fault() -> None:
    """A generator in the model's own attribute is no named state a checkpoint skipped (no
    checkpoint restores it): the cause stays the model's."""
    cause, sentence, failure = diagnosed("torch", Case(
        model=ExternalConfig("user_models:own_generator_dropout"),
        granularity=parse_granularity("layer")))
    assert cause == "model-own-generator", sentence
    assert "named rng state" not in failure["localisation"]


# -- the hold rule ------------------------------------------------------------------------------

def test_generator_states_kept_between_steps_are_no_activations() -> None:
    counter = ActivationCounter()
    with counter:
        state = torch.get_rng_state().clone()  # a copy, as a tracker's checkpoint keeps
        same_size = torch.zeros(state.numel(), dtype=torch.uint8)  # no state: counted
    assert counter.held_bytes() == same_size.nbytes


@pytest.mark.parametrize("spec", ["tracker_checkpoint", "counting_tracker_checkpoint"])
def test_the_state_a_tracker_checkpoint_keeps_between_steps_is_a_hold(spec: str) -> None:
    """Its copies of the tracker's states, and a call counter, outlive each step's backward:
    the same few bytes at every step, on any model."""
    recompute = _recompute(verify(f"tracker_setups:{spec}", CASE))
    assert recompute.passed, recompute.summary
    if spec == "counting_tracker_checkpoint":
        assert "8 bytes made in each step were still alive" in recompute.summary
        assert "not a leak" in recompute.summary


def test_a_leak_still_fails_beside_the_hold_rule() -> None:
    fault = next(m for m in MUTANTS if m.name == "saved-inputs-kept")
    recompute = _recompute(verify(Implementation(fault.name, fault.impl),
                                  find_case("1L-layer-dropout")))
    assert recompute.passed is False
    assert "still alive after its backward" in recompute.summary


def _run(left: list[int], held: int = 4096) -> PathRun:
    t = torch.zeros(1)
    return PathRun(steps=[StepRecord(t, t, {}, {}, {}, {}, left_bytes=n, held_bytes=held)
                          for n in left])


@pytest.mark.parametrize(("left", "leak"), [
    ([8, 8, 8], False),  # a counter: the same scrap at every step
    ([8, 8, 16], True),  # grows step over step
    ([0, 0, 8], True),  # not at every step: something started keeping
    ([64, 64, 64], True),  # a share of the activations (1/64), not a scrap
])
def test_only_the_same_scrap_at_every_step_is_a_hold(left: list[int], leak: bool) -> None:
    result = PropertyResult("recompute", True)
    _check_leaks(_run([0, 0, 0]), _run(left), result)
    assert bool(result.failures) is leak, result.failures or result.summary


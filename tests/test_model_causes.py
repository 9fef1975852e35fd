"""A model that is not safe to recompute is said to be, with the state it changed named
(issue 25): under torch's own checkpoint the fault is the model's, never the checkpoint's."""

from __future__ import annotations

from typing import Any

import pytest
from test_diagnosis import FAULTS, diagnosed

from gradequiv.harness import Case, Implementation, find_case, resolve, verify
from gradequiv.harness.implementations.faults import kwargs_dropped, reference_checkpoint
from gradequiv.harness.implementations.resolve import BUILTINS
from gradequiv.models import ExternalConfig, parse_granularity

#: factory -> (the cause, words the sentence must hold: the state, and how it changed)
UNSAFE = {
    "power_iteration": ("model-state-changed",
                        ["blocks.0.weight_u (a buffer, written by copy_)"]),
    "ema_codebook": ("model-state-changed", ["blocks.0.codebook (a buffer, written by lerp_)"]),
    "warmup_counter": ("model-state-changed", ["blocks.0.calls (an attribute: 0 "]),
    "hooked_running_mean": ("model-state-changed",
                            ["blocks.0.input_mean (a buffer, written by mul_, add_)"]),
    "python_coin_flip": ("model-python-random", ["drew from Python's random"]),
    "numpy_mixup": ("model-python-random", ["drew from NumPy's random"]),
    "numpy_generator_noise": ("model-python-random",
                              ["blocks.0.rng (a generator of the model's) moved"]),
    "python_generator_noise": ("model-python-random",
                               ["blocks.0.rng (a generator of the model's) moved"]),
    "own_generator_dropout": ("model-own-generator",
                              ["blocks.0 draws rand from a torch.Generator of the model's own "
                               "(blocks.0.generator)"]),
    "popped_side_channel": ("model-rerun-raised",
                            ["IndexError: pop from empty list",
                             ".gates (a list: length 1 "]),
    "input_halved_in_place": ("model-rerun-raised",
                              ["modified by an inplace operation",
                               "input 0 of blocks.0 was changed by blocks.0's forward (mul_)"]),
    "popped_argument": ("model-rerun-raised",
                        ["KeyError: 'gate'", "blocks.0's forward changed a list or dict it "
                         "was given (its arguments held 3 values before it, 2 after)"]),
}
#: what each cause tells the user to do
FIXES = {"model-state-changed": "make the update outside the checkpointed module",
         "model-python-random": "draw outside the checkpointed module",
         "model-own-generator": "draw from torch's default generator",
         "model-rerun-raised": "read without popping"}
#: Unusual, and safe: a counter the re-run skips, a cache the forward fills with what the
#: re-run would compute, a random draw made by the parent and passed in.
SAFE = ["guarded_counter", "lazy_position_cache", "random_outside_segment"]


def _user_case(factory: str, **kwargs: Any) -> Case:
    return Case(model=ExternalConfig(f"user_models:{factory}"),
                granularity=parse_granularity("layer"), **kwargs)


#: torch's checkpoint as a function, and patched into ``forward`` (its re-run calls the
#: bound forward, unseen by hooks: the state is read off the forward alone; the running
#: mean its pre-hook keeps is safe there, the hook being outside the patched forward)
SPECS = [(spec, factory) for spec in ("torch", "torch-patched") for factory in UNSAFE
         if (spec, factory) != ("torch-patched", "hooked_running_mean")]


@pytest.mark.parametrize(("spec", "factory"), SPECS)
def test_a_model_unsafe_to_recompute_is_named_with_the_state_it_changed(spec: str,
                                                                        factory: str) -> None:
    cause, words = UNSAFE[factory]
    found, sentence, failure = diagnosed(spec, _user_case(factory))
    assert found == cause, f"{sentence}\n{failure['localisation']}"
    assert sentence.startswith("your model is not safe to recompute here: ")
    for word in [*words, FIXES[cause]]:
        assert word in sentence, f"{word!r} not in {sentence!r}"
    assert "keyword argument" not in sentence  # not the implementation's inputs


def test_a_counter_the_next_micro_batch_reads_is_still_the_model_s() -> None:
    """Accumulating two micro-batches, the second forward already reads the count the first
    one's re-run moved on: the forward itself differs, and under torch's checkpoint that is
    the model's doing too."""
    cause, sentence, _ = diagnosed("torch", _user_case("warmup_counter",
                                                       grad_mode="accumulate"))
    assert cause == "model-state-changed", sentence
    assert "blocks.0.calls (an attribute: 0 at the forward, 1 at the re-run)" in sentence


@pytest.mark.parametrize("factory", SAFE)
@pytest.mark.parametrize("spec", [spec for spec in BUILTINS if spec.startswith("torch")])
def test_an_unusual_model_safe_to_recompute_passes(spec: str, factory: str) -> None:
    verdict = verify(resolve(spec), _user_case(factory))
    assert verdict.passed, (verdict.error or "") + "; ".join(
        f"{p.name}: {p.summary}" for p in verdict.properties if p.passed is False)


def test_under_another_checkpoint_the_model_is_named_without_blaming_torch() -> None:
    """A hand-written checkpoint re-runs the coin flip as torch's does: the model's fault
    still, said without claiming the implementation is known to be right."""
    impl = Implementation("reference", reference_checkpoint)
    cause, sentence, _ = diagnosed(impl, _user_case("python_coin_flip"))
    assert cause == "model-python-random"
    assert sentence.startswith("the model is not safe to recompute here, whichever checkpoint")


@pytest.mark.parametrize("impl", [
    Implementation("kwargs-dropped", kwargs_dropped),
    resolve("torch", kwargs={"preserve_rng_state": False}),  # torch's, told to be wrong
], ids=["kwargs-dropped", "torch-rng-not-preserved"])
def test_a_cache_the_forward_filled_does_not_take_an_implementation_s_blame(
        impl: Implementation) -> None:
    """The position table a block caches on its first call is there at its re-run: state
    changed, harmlessly, so the fault stays the implementation's."""
    cause, sentence, failure = diagnosed(impl, _user_case("lazy_position_cache"))
    assert "model state: blocks.0.tables (a dict: length 0 at the forward, 1 at the " \
           "re-run)" in failure["localisation"]
    assert not cause.startswith("model-") and "not safe to recompute" not in sentence, sentence


def test_a_watch_that_fails_leaves_the_search_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """A state of a kind the watch cannot copy or compare turns the watch off; it never
    fails the model's forward, which would read as the implementation raising."""
    from gradequiv.harness.engine import localise as search
    from gradequiv.harness.engine import model_watch

    def unreadable(*args: Any) -> None:
        raise TypeError("a state of a kind never seen")

    monkeypatch.setattr(model_watch, "_state", unreadable)
    found = search.localise(resolve(FAULTS + "no_rng_restore"), find_case("1L-layer-dropout"))
    assert found.divergence is not None and found.divergence.random, found.describe()
    assert found.model == ()

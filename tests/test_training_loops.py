"""The ways real training loops drive a segment, each a dimension of a case.

For each dimension (micro-batches in flight, several backward passes over one forward,
backward inside autocast, which parameters train) a recompute written the way real code
is, and wrong only under that dimension's pattern: it passes the same case with the
dimension off and fails it with the dimension on, so the test goes red if the runner stops
driving the pattern. Beside them: the schedules' order, the recompute counts under several
passes, replay of the new fields, the combinations that cannot be, and a user's model
getting the schedules and the loss in parts without writing anything new.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gradequiv.harness import Case, Implementation, find_case, verify
from gradequiv.harness.engine.runner import schedule_events
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.implementations.faults import Faults, checkpoint_with_faults
from gradequiv.models.kinds import SCHEDULE_MICRO_BATCHES

Checkpoint = Callable[..., Any]


def _recomputing(function: Checkpoint, swap: Callable[[tuple[Any, ...]], tuple[Any, ...]]
                 ) -> Checkpoint:
    """``function`` for torch's non-reentrant checkpoint: its first call as given, every
    later call (a re-run) on the arguments ``swap`` gives back."""
    calls = [0]

    def run(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return function(*(swap(args) if calls[0] > 1 else args), **kwargs)

    return run


_slots: weakref.WeakKeyDictionary[Any, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def slot_checkpoint(function: Checkpoint, *args: Any, **kwargs: Any) -> Any:
    """Boundary inputs kept in one slot per module, the last forward's: right while each
    forward's backward comes before the next forward, wrong with micro-batches in flight."""
    _slots[function] = args
    # taken by the first re-run after it (nothing kept past backward); a re-run that finds
    # the slot empty uses its own arguments
    return checkpoint(_recomputing(function, lambda own: _slots.pop(function, own)), *args,
                      use_reentrant=False, **kwargs)


class _Ring:
    """A module's host buffers, reused in turn."""

    def __init__(self) -> None:
        self.buffers: list[tuple[Any, ...]] = []
        self.count = 0


_rings: weakref.WeakKeyDictionary[Any, _Ring] = weakref.WeakKeyDictionary()
_RING = 3


def ring_checkpoint(function: Checkpoint, *args: Any, **kwargs: Any) -> Any:
    """Boundary inputs copied into a ring of 3 host buffers per module, reused in turn: only
    a fourth forward in flight overwrites one."""
    ring = _rings.setdefault(function, _Ring())
    slot, ring.count = ring.count % _RING, ring.count + 1
    if not ring.buffers:  # allocated once, on the first call
        ring.buffers = [tuple(a.detach().clone() if isinstance(a, Tensor) else a
                              for a in args) for _ in range(_RING)]
    else:  # then copied into
        with torch.no_grad():
            ring.buffers[slot] = tuple(b.copy_(a) if isinstance(a, Tensor) else a
                                       for a, b in zip(args, ring.buffers[slot]))
    return checkpoint(_recomputing(function, lambda own: _as_given(ring.buffers[slot], own)),
                      *args, use_reentrant=False, **kwargs)


def _as_given(buffers: tuple[Any, ...], own: tuple[Any, ...]) -> tuple[Any, ...]:
    """The buffers' values as the re-run's arguments, each requiring grad as its own did."""
    return tuple(b.detach().requires_grad_(a.requires_grad) if isinstance(b, Tensor) else b
                 for b, a in zip(buffers, own))


def rng_consumed_checkpoint(function: Checkpoint, *args: Any, **kwargs: Any) -> Any:
    """RNG state restored by the re-run that pops it: a second backward pass over the same
    forward re-runs with fresh random numbers."""
    states = [torch.get_rng_state()]

    def rerun(a: tuple[Any, ...]) -> tuple[Any, ...]:
        if states:
            torch.set_rng_state(states.pop())
        return a

    def run(*a: Any, **k: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            return inner(*a, **k)

    inner = _recomputing(function, rerun)
    first = [True]

    def call(*a: Any, **k: Any) -> Any:
        if first[0]:  # the forward draws from the caller's stream
            first[0] = False
            return inner(*a, **k)
        return run(*a, **k)

    return checkpoint(call, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def frozen_skipped_checkpoint(function: Checkpoint, *args: Any, **kwargs: Any) -> Any:
    """A segment with nothing to train run under no_grad, "as it needs no recompute": its
    input gets no gradient, and so nothing before it does."""
    if isinstance(function, nn.Module) and not any(p.requires_grad
                                                   for p in function.parameters()):
        with torch.no_grad():
            return function(*args, **kwargs)
    return checkpoint(function, *args, use_reentrant=False, **kwargs)


_first_seen: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def trainable_cached_checkpoint(function: Checkpoint, *args: Any, **kwargs: Any) -> Any:
    """Whether a segment trains, read at its first call and kept: a segment frozen then
    is skipped under no_grad when it is unfrozen later."""
    trains = _first_seen.setdefault(function, isinstance(function, nn.Module) and any(
        p.requires_grad for p in function.parameters()))
    if not trains:
        with torch.no_grad():
            return function(*args, **kwargs)
    return checkpoint(function, *args, use_reentrant=False, **kwargs)


def _faulty(name: str, **switches: bool) -> Implementation:
    faults = Faults(**switches)

    def target(function: Checkpoint, *args: Any, **kwargs: Any) -> Any:
        return checkpoint_with_faults(function, *args, faults=faults, **kwargs)

    return Implementation(name, target)


def _checks(target: Checkpoint) -> Implementation:
    return Implementation(target.__name__, target)


def _fails_only_with(impl: Implementation, case: Case, off: Case) -> None:
    """``impl`` passes ``off`` (the case with the dimension off) and fails ``case``, with a
    wrong value, not a crash."""
    plain = verify(impl, off)
    assert plain.passed, plain.first_failure
    caught = verify(impl, case)
    assert not caught.passed, f"{impl.spec} passed {case.describe()}"
    assert caught.error is None, caught.first_failure
    assert any(p.name in ("gradients", "outputs", "loss") and p.passed is False
               for p in caught.properties), caught.first_failure


@pytest.mark.parametrize("name", ["2L-layer-gpipe-dropout", "2L-layer-1f1b-dropout"])
def test_micro_batches_in_flight_catch_a_stash_kept_per_module(name: str) -> None:
    case = find_case(name)
    _fails_only_with(_checks(slot_checkpoint), case, replace(case, schedule="one"))


def test_four_in_flight_catch_a_ring_of_three_buffers() -> None:
    """A fault that needs 4 micro-batches in flight: 1F1B and GPipe have them, 2 in flight
    (accumulation) passes."""
    impl = _checks(ring_checkpoint)
    case = find_case("2L-layer-1f1b-dropout")
    _fails_only_with(impl, case, replace(case, schedule="one", grad_mode="accumulate"))
    for name in ("2L-layer-gpipe-dropout", "2L-layer-summed-micro-batches-dropout"):
        assert not verify(impl, find_case(name)).passed, name


def test_a_second_backward_pass_catches_rng_consumed_by_the_first() -> None:
    case = find_case("2L-layer-two-losses-dropout")
    _fails_only_with(_checks(rng_consumed_checkpoint), case, replace(case, backward_passes=1))


@pytest.mark.parametrize("name", ["2L-layer-fp32-backward-autocast-dropout",
                                  "2L-layer-bf16-fp32-last-layer-backward-autocast"])
def test_backward_under_autocast_catches_autocast_off_not_restored(name: str) -> None:
    """Where the forward (or its last layer) ran without autocast, a re-run that re-enters
    autocast only where it was on runs in backward's autocast."""
    case = find_case(name)
    impl = _faulty("autocast-off-not-restored", autocast_off_not_restored=True)
    _fails_only_with(impl, case, replace(case, backward_autocast=False))


def test_a_frozen_segment_catches_a_recompute_that_skips_it() -> None:
    case = find_case("3L-layer-frozen-layer-dropout")
    _fails_only_with(_checks(frozen_skipped_checkpoint), case, replace(case, trainable="all"))


def test_trainable_parameters_changing_catch_a_cached_choice() -> None:
    case = find_case("2L-layer-changing-trainable-dropout")
    _fails_only_with(_checks(trainable_cached_checkpoint), case,
                     replace(case, trainable="all"))


def test_adapters_only_keep_torch_and_the_reference_exact() -> None:
    """Frozen base weights and embeddings, the embedding output made to require grad (as
    transformers does for adapters): torch's checkpoints, reentrant too, are exact."""
    case = find_case("2L-layer-adapters-only-dropout")
    for spec in ("torch", "torch-reentrant"):
        verdict = verify(spec, case)
        assert verdict.passed, verdict.first_failure
    frozen_everywhere = verify(_checks(frozen_skipped_checkpoint), case)
    assert frozen_everywhere.passed, frozen_everywhere.first_failure  # LoRA trains in each


def test_schedules_run_in_the_order_they_name() -> None:
    assert schedule_events("gpipe", 2) == [("forward", 0), ("forward", 1), ("backward", 0),
                                           ("backward", 1)]
    assert schedule_events("gpipe-reverse", 2)[2:] == [("backward", 1), ("backward", 0)]
    assert schedule_events("summed", 3) == [("forward", 0), ("forward", 1), ("forward", 2),
                                            ("backward", -1)]
    onef = schedule_events("1f1b", SCHEDULE_MICRO_BATCHES["1f1b"])
    in_flight, most = 0, 0
    for action, _ in onef:
        in_flight += 1 if action == "forward" else -1
        most = max(most, in_flight)
    assert most == 4 and in_flight == 0
    assert onef[4:7] == [("backward", 0), ("forward", 4), ("backward", 1)]
    for schedule, n in SCHEDULE_MICRO_BATCHES.items():
        events = schedule_events(schedule, n)
        forwards = [k for action, k in events if action == "forward"]
        assert forwards == list(range(n))


def test_several_backward_passes_may_rerun_each_forward_once_per_pass() -> None:
    """torch re-runs each segment once per pass; the recompute property allows it and still
    counts: a recompute that re-runs nothing fails."""
    case = find_case("2L-layer-two-losses-dropout")
    verdict = verify("torch", case)
    assert verdict.passed, verdict.first_failure
    no_op = verify(_faulty("no-op", no_op=True), case)
    recompute = next(p for p in no_op.properties if p.name == "recompute")
    assert recompute.passed is False


def test_the_new_fields_replay_through_json_and_are_described() -> None:
    case = replace(find_case("2L-layer-gpipe-reverse-two-losses-dropout"),
                   backward_autocast=True, trainable="changing")
    again = Case.from_json(case.to_json())
    assert again == case
    assert json.loads(case.to_json())["schedule"] == "gpipe-reverse"
    text = case.describe()
    for words in ("GPipe, backwards reversed over 4 micro-batches", "2 backward passes",
                  "backward under autocast", "odd steps"):
        assert words in text


@pytest.mark.parametrize(("fields", "rule"), [
    ({"schedule": "pipedream"}, "is not one of"),
    ({"schedule": "gpipe", "grad_mode": "accumulate"}, "has its own micro-batches"),
    ({"backward_passes": 4}, "must be 1, 2 or 3"),
    ({"backward_passes": 2, "grad_mode": "create-graph"}, "backpropagates twice already"),
    ({"trainable": "adapters"}, "value_hooks=true"),
    ({"trainable": "lora"}, "is not one of"),
])
def test_combinations_that_cannot_be_are_refused(fields: dict[str, Any], rule: str) -> None:
    with pytest.raises(InvalidArgument, match=rule):
        replace(find_case("2L-layer-manual-attn"), **fields)


def test_a_users_model_gets_the_schedules_and_the_loss_in_parts() -> None:
    """The factory writes nothing new: its batch is split into micro-batches and its loss
    into parts."""
    from gradequiv.models import ExternalConfig

    model = ExternalConfig("user_models:residual_stack")
    for fields in ({"schedule": "gpipe"}, {"backward_passes": 2}):
        case = Case(model=model, **fields)  # type: ignore[arg-type]
        assert verify("torch", case).passed
        caught = verify(_checks(slot_checkpoint if "schedule" in fields
                                else rng_consumed_checkpoint), case)
        assert not caught.passed, case.describe()


class _OnePassOnly(torch.autograd.Function):
    """Refuses a second backward pass through it, in its own words (not torch's)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.passes = 0
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        ctx.passes += 1
        if ctx.passes > 1:
            raise RuntimeError("this checkpoint allows one backward pass only (no "
                               "retain_graph)")
        return grad


def _undeclared_one_pass(function: Checkpoint, *args: Any, **kwargs: Any) -> Any:
    """A checkpoint of the user's own that refuses a loss backpropagated in parts, loudly
    and undeclared (torch's own such refusal is not applicable, never a failure)."""
    out = checkpoint(function, *args, use_reentrant=False, **kwargs)
    return _OnePassOnly.apply(out)


@pytest.mark.parametrize(("target", "name", "cause", "words"), [
    (slot_checkpoint, "2L-layer-gpipe-dropout", "in-flight-state", "4 micro-batches in flight"),
    (ring_checkpoint, "2L-layer-1f1b-dropout", "in-flight-state", "(1f1b)"),
    (rng_consumed_checkpoint, "2L-layer-two-losses-dropout", "second-pass", "in 2 parts"),
    (None, "2L-layer-fp32-backward-autocast-dropout", "autocast-from-backward",
     "backward's autocast state"),
    (frozen_skipped_checkpoint, "3L-layer-frozen-layer-dropout", "trainable-misread",
     "trainable='frozen-layer'"),
    (trainable_cached_checkpoint, "2L-layer-changing-trainable-dropout", "trainable-misread",
     "trainable='changing'"),
    (_undeclared_one_pass, "2L-layer-two-losses-dropout", "refuses-pattern",
     'gradequiv_unsupported = ("retain-graph",)'),
])
def test_a_fault_only_a_pattern_shows_is_named_by_the_pattern(
        target: Checkpoint | None, name: str, cause: str, words: str) -> None:
    """The op-level search drives one forward and one backward, where these faults do not
    show; the cause says which pattern the failure needs, found by the case without it."""
    from test_diagnosis import diagnosed

    impl = _faulty("autocast-off-not-restored", autocast_off_not_restored=True) \
        if target is None else _checks(target)
    found, sentence, failure = diagnosed(impl, find_case(name))
    assert (found, words in sentence) == (cause, True), sentence


def test_autocast_around_backward_is_no_carry_of_recomputed_bytes() -> None:
    """Autocast around backward caches the weight casts each re-run makes until the block
    ends: torch's checkpoint is still right, and its backward's peak is not held against it."""
    from gradequiv.models import ExternalConfig

    case = Case(model=ExternalConfig("user_models:residual_stack"), dtype="bf16-autocast",
                backward_autocast=True)
    verdict = verify("torch", case)
    assert verdict.passed, verdict.first_failure


@pytest.mark.slow  # four searches with shrinking: most of a minute on 2 cores
def test_each_dimension_is_drawn_and_shrinks_off_alone() -> None:
    """The minimal drawn case drives the plain loop; one that needs a dimension shrinks to
    that dimension alone, on the cheapest model."""
    from hypothesis import HealthCheck, find, settings

    from gradequiv.properties.strategies import cases

    quick = settings(max_examples=300, database=None, deadline=None,
                     suppress_health_check=list(HealthCheck))
    plain = {"schedule": "one", "backward_passes": 1, "backward_autocast": False,
             "trainable": "all"}
    simplest = find(cases(), lambda c: True, settings=quick)
    assert {k: getattr(simplest, k) for k in plain} == plain
    for field, value in (("schedule", "1f1b"), ("backward_passes", 3),
                         ("backward_autocast", True), ("trainable", "changing")):
        found = find(cases(), lambda c, f=field, v=value: getattr(c, f) == v, settings=quick)
        assert {k: getattr(found, k) for k in plain} == plain | {field: value}
        assert found.model.n_layer == 1 and not found.model.has_randomness

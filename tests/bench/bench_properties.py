"""How fast the property suite finds broken recomputes (pytest-benchmark).

For each of several seeds, draw cases as the suite does (``cases()``, no
shrinking) and count the examples until ``preserve_rng_state=False`` fails
the gradients property; ``extra_info`` holds the median and the worst. The
same for each mutant of the fault library's newer families, grouped by what
of real training they need (and, in further tables, the families of segments as real
layers have them and of how training loops drive a segment): the examples until any
property fails (-1: not
within the limit), and which property fails first most often.
"""

from __future__ import annotations

import statistics
from typing import Any

from hypothesis import Phase, given, seed, settings

from gradequiv.harness import Implementation, resolve, verify
from gradequiv.harness.implementations.faults import MUTANTS
from gradequiv.properties.strategies import cases

SEEDS = range(12)


def examples_until_caught(run_seed: int) -> int:
    impl = resolve("torch", kwargs={"preserve_rng_state": False})
    count, first_failure = 0, -1

    @settings(max_examples=50, database=None, deadline=None, phases=[Phase.generate])
    @seed(run_seed)
    @given(case=cases())
    def search(case: Any) -> None:
        nonlocal count, first_failure
        count += 1
        grads = next(p for p in verify(impl, case).properties if p.name == "gradients")
        if grads.passed is False and first_failure < 0:
            first_failure = count  # Hypothesis replays the failure once more: count it once
        assert grads.passed is not False

    try:
        search()
    except AssertionError:
        pass
    return first_failure  # -1: not caught within 50 examples


def test_examples_until_no_rng_restore_is_caught(benchmark: Any) -> None:
    found: list[int] = []

    def all_seeds() -> None:
        found[:] = [examples_until_caught(s) for s in SEEDS]

    benchmark.pedantic(all_seeds, rounds=1, iterations=1)
    caught = [n for n in found if n > 0]
    benchmark.extra_info.update({"examples_per_seed": found,
                                 "median": statistics.median(caught) if caught else None,
                                 "worst": max(caught) if caught else None,
                                 "never_caught": found.count(-1)})
    print(f"\nexamples until caught, per seed: {found}; median {statistics.median(caught)}")


#: The families drawn cases reach since cases train as real training does, by what of real
#: training they need: how gradients are asked for, forwards without backward, precision,
#: size, the shapes of real layers, state across and around the step.
FAMILIES_BY_ITEM = {
    "gradients asked for otherwise": ("grad-via-backward", "accumulated-grad-overwritten",
                                      "grads-without-graph"),
    "forwards without backward": ("state-queue-without-backward",),
    "precision regimes": ("autocast-default-dtype", "autocast-forced-on"),
    "sizes": ("large-boundary-compressed",),
    "segment shapes": ("kwarg-tensors-detached", "tuple-tail-no-grad",
                       "state-per-module-slot", "group-layers-unchained"),
    "state across and around the step": ("recomputed-kept", "saved-inputs-kept",
                                         "stash-kept-after-warmup",
                                         "bn-stats-in-recompute-only", "autocast-latched",
                                         "grad-mode-forced-on"),
}
#: The families of segments as real layers have them (issue 24's first four items).
SEGMENT_FAMILIES_BY_ITEM = {
    "nested inputs": ("nested-tensors-no-grad", "rng-devices-from-positional",
                      "autocast-device-from-first-arg"),
    "in-place ops": ("matmul-outputs-cached",),
    "value-changing hooks": ("hooks-skipped-in-recompute", "hooks-run-twice"),
    "parameters from outside the segment": ("outside-params-no-grad",
                                            "outside-params-grad-doubled"),
}
#: The families of how training loops drive a segment: micro-batches in flight, several
#: backward passes over one forward, backward inside autocast, partial fine-tuning.
TRAINING_LOOP_FAMILIES_BY_ITEM = {
    "micro-batches in flight": ("boundary-per-module-slot", "state-per-module-stack",
                                "host-pool-of-three"),
    "several backward passes": ("input-leaves-grad-kept", "rng-state-consumed-by-backward",
                                "saved-inputs-freed-after-backward"),
    "backward inside autocast": ("autocast-off-not-restored",),
    "partial fine-tuning": ("trainable-params-cached", "frozen-segment-no-grad"),
}
NEW_FAMILIES = tuple(name for names in FAMILIES_BY_ITEM.values() for name in names)
MUTANT_SEEDS = range(5)


def first_failure(impl: Implementation, run_seed: int, limit: int = 100) -> tuple[int, str]:
    """Examples drawn until some property fails, and that property; (-1, "") if none."""
    count, found = 0, (-1, "")

    @settings(max_examples=limit, database=None, deadline=None, phases=[Phase.generate])
    @seed(run_seed)
    @given(case=cases(modes=impl.grad_modes))  # what check draws: the transformer
    def search(case: Any) -> None:
        nonlocal count, found
        count += 1
        failing = [p.name for p in verify(impl, case).properties if p.passed is False]
        if failing and found[0] < 0:
            found = (count, failing[0])
        assert not failing

    try:
        search()
    except AssertionError:
        pass
    return found


def _family_table(benchmark: Any, families: dict[str, tuple[str, ...]]) -> None:
    """Examples until each mutant of ``families`` is caught, per seed; printed as a table."""
    rows: dict[str, dict[str, Any]] = {}
    wanted = {name for names in families.values() for name in names}

    def all_mutants() -> None:
        for mutant in (m for m in MUTANTS if m.name in wanted):
            impl = Implementation(mutant.name, mutant.impl)
            found = [first_failure(impl, s) for s in MUTANT_SEEDS]
            caught = [n for n, _ in found if n > 0]
            names = [p for _, p in found if p]
            rows[mutant.name] = {
                "examples_per_seed": [n for n, _ in found],
                "median": statistics.median(caught) if caught else None,
                "property": max(set(names), key=names.count) if names else None}

    benchmark.pedantic(all_mutants, rounds=1, iterations=1)
    benchmark.extra_info.update(rows)
    print("\n| what it needs | mutant | caught first by | median examples | per seed |")
    print("|---|---|---|---|---|")
    for item, names in families.items():
        for name in names:
            row = rows[name]
            print(f"| {item} | {name} | {row['property']} | {row['median']} | "
                  f"{row['examples_per_seed']} |")


def test_examples_until_each_new_family_is_caught(benchmark: Any) -> None:
    _family_table(benchmark, FAMILIES_BY_ITEM)


def test_examples_until_each_segment_family_is_caught(benchmark: Any) -> None:
    """Segments as real layers have them: nested inputs, in-place ops, value-changing
    hooks, parameters from outside the segment's module."""
    _family_table(benchmark, SEGMENT_FAMILIES_BY_ITEM)


def test_examples_until_each_training_loop_family_is_caught(benchmark: Any) -> None:
    """How training loops drive a segment: schedules with micro-batches in flight, a loss
    backpropagated in parts, backward inside autocast, frozen and unfrozen parameters."""
    _family_table(benchmark, TRAINING_LOOP_FAMILIES_BY_ITEM)

"""Harness cost per case against the bare paths it runs (pytest-benchmark).

Run: ``tox -e bench`` or
``pytest tests/bench -o python_files='bench_*.py' --benchmark-json=bench.json``.

For each case, the bare work and ``verify`` run interleaved, so both see the
same machine noise. Bare work is plain training steps with nothing observed: the
full path and the recompute path (what a passing verdict runs), and the full path
once more (the noise floor, which only a verdict failing against a zero floor
runs). ``extra_info`` carries medians, p95 and both ratios; nothing here asserts
a time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from gradequiv.harness import Case, find_case, resolve, verify
from gradequiv.harness.engine.runner import LEARNING_RATE, MOMENTUM
from gradequiv.models import build

CASES = ["2L-layer-manual-attn", "2L-layer-bf16-dropout", "4Lx128x64-layer-dropout"]
ROUNDS = 15


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """One intra-op thread, as ``check`` runs (``--threads 1``): torch's default threads spin
    on a busy machine and measure the machine, not the harness."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def bare_path(case: Case, impl: Any) -> None:
    workload = build(case.model, case.batch, case.seed)
    segments = workload.segments(case.granularity)
    if impl is None:
        workload.model.router.install(segments, None)
    else:
        impl.install(workload.model, segments)
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    autocast = case.autocast(torch.device("cpu"))
    torch.manual_seed(case.seed + 1)
    for _ in range(case.steps):
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = workload.loss_fn(workload.model(*workload.inputs), workload.targets)
        loss.backward()
        optimizer.step()


def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1]


@pytest.mark.parametrize("name", CASES)
def test_harness_against_bare_paths(benchmark: Any, name: str) -> None:
    case = replace(find_case(name), name=name)
    impl = resolve("torch")
    bare_times: list[float] = []  # full, full again, recompute
    bare_two: list[float] = []  # full + recompute, without the floor's second full path
    harness_times: list[float] = []
    harness_no_floor: list[float] = []
    verdict_floor = [True]

    def bare() -> None:
        started = time.perf_counter()
        bare_path(case, None)
        middle = time.perf_counter()
        bare_path(case, None)
        resumed = time.perf_counter()
        bare_path(case, impl)
        done = time.perf_counter()
        bare_times.append(done - started)
        bare_two.append((middle - started) + (done - resumed))

    def harness() -> None:
        started = time.perf_counter()
        verdict = verify(impl, case)
        verdict_floor[:] = [verdict.floor_measured]
        harness_times.append(time.perf_counter() - started)
        harness_no_floor.append(harness_times[-1] - verdict.seconds.get("floor", 0.0))
        assert verdict.passed

    floored: list[float] = []  # the floor path on every verdict, as --deterministic runs

    def harness_floored() -> None:
        started = time.perf_counter()
        verify(impl, case, always_floor=True)
        floored.append(time.perf_counter() - started)

    bare()
    harness()  # warm-up: lazy imports inside torch's checkpoint
    harness_floored()
    for timings in (bare_times, bare_two, harness_times, harness_no_floor, floored):
        timings.clear()

    def interleaved() -> None:
        bare()
        harness()
        harness_floored()

    benchmark.pedantic(interleaved, rounds=ROUNDS, iterations=1)
    ratio = statistics.median(harness_times) / statistics.median(bare_times)
    ratio_no_floor = statistics.median(harness_no_floor) / statistics.median(bare_two)
    benchmark.extra_info.update({
        "case": case.describe(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "bare_median_s": statistics.median(bare_times),
        "bare_p95_s": _p95(bare_times),
        "harness_median_s": statistics.median(harness_times),
        "harness_p95_s": _p95(harness_times),
        "harness_over_bare": ratio,
        "harness_without_floor_over_full_plus_recompute": ratio_no_floor,
        "floor_measured": verdict_floor[0],
        "harness_floor_always_over_bare": statistics.median(floored) / statistics.median(
            bare_times),
    })
    print(f"\n{name}: harness/bare (full twice + recompute) = {ratio:.3f}, harness without "
          f"any floor run/(full + recompute) = {ratio_no_floor:.3f}, floor run: "
          f"{verdict_floor[0]}; with the floor path always "
          f"{statistics.median(floored) / statistics.median(bare_times):.3f} "
          f"(medians of {ROUNDS}; bare {statistics.median(bare_times) * 1e3:.1f} ms, "
          f"harness {statistics.median(harness_times) * 1e3:.1f} ms, p95 "
          f"{_p95(bare_times) * 1e3:.1f} / {_p95(harness_times) * 1e3:.1f} ms)")

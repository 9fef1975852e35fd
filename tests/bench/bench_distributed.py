"""A distributed check's cost against bare two-rank training (pytest-benchmark).

Run: ``tox -e bench`` or
``pytest tests/bench/bench_distributed.py -o python_files='bench_*.py' -s``.

Twenty cases drawn as ``gradequiv distributed`` draws them (every engine), each trained on
two gloo ranks by the same two processes, interleaved so that both see the same machine
noise: bare (full storage, then the recompute, under the engine, nothing observed) and
``verify`` as a rank runs it (both paths, the properties, the memory watch). Then the whole
command, ``gradequiv distributed --examples 20``, in a process of its own. ``extra_info``
carries medians, p95 and the ratios; nothing here asserts a time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = 20
ROUNDS = 3


def _drawn(examples: int, seed: int, engines: tuple[str, ...] = ("ddp", "fsdp", "tp")
           ) -> list[tuple[str, dict[str, Any]]]:
    """The cases a distributed run draws first (as JSON, with their engine)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as seeded

    from gradequiv.properties.strategies import distributed_cases

    drawn: list[tuple[str, dict[str, Any]]] = []

    @settings(max_examples=examples, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), phases=["generate"])
    @seeded(seed)
    @given(distributed_cases(world_size=2, engines=engines))
    def collect(case_and_engine: Any) -> None:
        drawn.append((case_and_engine[0].to_json(), case_and_engine[1].to_dict()))

    collect()
    return drawn


def _rank(rank: int, folder: str, drawn: list[tuple[str, dict[str, Any]]]) -> None:
    import torch
    import torch.distributed as dist

    from gradequiv.harness import resolve
    from gradequiv.harness.engine.case import Case
    from gradequiv.harness.engine.parallel import Parallel, RankSetup
    from gradequiv.harness.engine.path import prepare
    from gradequiv.harness.engine.pipeline import StagedPath
    from gradequiv.harness.engine.runner import LEARNING_RATE, MOMENTUM
    from gradequiv.harness.engine.verify import verify

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=2)
    impl, device = resolve("torch"), torch.device("cpu")

    def bare(case: Case, setup: RankSetup) -> None:
        if setup.parallel.pipeline is not None:  # the stages through torch's schedule
            for path_impl in (None, impl):
                path = prepare(case, path_impl, device, seed_offset=rank)
                staged = StagedPath(path, setup.parallel.pipeline, rank, 2)
                for _ in range(case.steps):
                    staged.step()
            return
        for path_impl in (None, impl):
            path = setup.share(prepare(case, path_impl, device, seed_offset=setup.seed_offset))
            call = setup.wrap(path.model, path.segments)
            optimizer = torch.optim.SGD(path.model.parameters(), lr=LEARNING_RATE,
                                        momentum=MOMENTUM)
            for _ in range(case.steps):
                optimizer.zero_grad(set_to_none=True)
                path.forward(call)[1].backward()
                optimizer.step()

    times: list[dict[str, float]] = []
    for case_json, engine in drawn:
        case = Case.from_json(case_json)
        setup = RankSetup(Parallel.from_dict(engine), rank, 2, "cpu", None)
        row = {"bare": [], "verify": []}
        for _ in range(ROUNDS):
            for name in ("bare", "verify"):
                dist.barrier()
                started = time.perf_counter()
                if name == "bare":
                    bare(case, setup)
                else:
                    verify(impl, case, device=device, ranks=setup)
                dist.barrier()
                row[name].append(time.perf_counter() - started)
        times.append({k: statistics.median(v) for k, v in row.items()}
                     | {"engine": engine["engine"]})
    if rank == 0:
        Path(folder, "times.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def _times(drawn: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(folder, drawn), nprocs=2)
        times: list[dict[str, Any]] = json.loads(Path(folder, "times.json").read_text())
    return times


@pytest.mark.benchmark(group="distributed")
def test_a_wide_case_on_two_ranks_against_bare_training_under_each_engine(
        benchmark: Any) -> None:
    """The 4-layer, 128-wide case of ``bench_engine``, under each engine: where the work is
    the model's, not the harness's fixed cost per op."""
    from gradequiv.harness import find_case
    from gradequiv.harness.engine.parallel import Parallel

    case = find_case("4Lx128x64-layer-dropout").to_json()
    times = _times([(case, Parallel(engine).to_dict()) for engine in ("ddp", "fsdp", "tp")])
    benchmark.extra_info.update({row["engine"]: {
        "bare_s": row["bare"], "verify_s": row["verify"],
        "ratio": row["verify"] / row["bare"]} for row in times})
    print(json.dumps(benchmark.extra_info, indent=1))
    benchmark.pedantic(lambda: None, rounds=1)


@pytest.mark.benchmark(group="distributed")
def test_a_drawn_case_on_two_ranks_against_bare_training(benchmark: Any) -> None:
    times = _times(_drawn(EXAMPLES, seed=0))
    ratios = [row["verify"] / row["bare"] for row in times]
    benchmark.extra_info.update({
        "cases": len(times), "rounds": ROUNDS,
        "bare_median_s": statistics.median(r["bare"] for r in times),
        "verify_median_s": statistics.median(r["verify"] for r in times),
        "ratio_median": statistics.median(ratios), "ratio_p95": _p95(ratios),
        "ratio_by_engine": {e: statistics.median(r["verify"] / r["bare"] for r in times
                                                 if r["engine"] == e)
                            for e in sorted({r["engine"] for r in times})}})
    print(json.dumps(benchmark.extra_info, indent=1))
    benchmark.pedantic(lambda: None, rounds=1)


@pytest.mark.benchmark(group="distributed")
def test_drawn_pipeline_cases_on_two_ranks_against_bare_schedules(benchmark: Any) -> None:
    """Twenty cases as ``--wrapper pp`` draws them (every schedule), bare: both paths through
    ``schedule.step``, nothing observed; ``verify``: as a rank runs it (the stages'
    boundaries kept per micro-batch on both paths included). Medians and p95 of each side
    by side, the ratio's, and the ratio by schedule."""
    drawn = _drawn(EXAMPLES, seed=0, engines=("pp",))
    times = _times(drawn)
    ratios = [row["verify"] / row["bare"] for row in times]
    schedules = [engine["pipeline"]["schedule"] for _, engine in drawn]
    benchmark.extra_info.update({
        "cases": len(times), "rounds": ROUNDS,
        "bare_median_s": statistics.median(r["bare"] for r in times),
        "bare_p95_s": _p95([r["bare"] for r in times]),
        "verify_median_s": statistics.median(r["verify"] for r in times),
        "verify_p95_s": _p95([r["verify"] for r in times]),
        "ratio_median": statistics.median(ratios), "ratio_p95": _p95(ratios),
        "ratio_by_schedule": {s: statistics.median(r for r, d in zip(ratios, schedules)
                                                   if d == s)
                              for s in sorted(set(schedules))}})
    print(json.dumps(benchmark.extra_info, indent=1))
    benchmark.pedantic(lambda: None, rounds=1)


@pytest.mark.benchmark(group="distributed")
@pytest.mark.parametrize("wrapper", ["all", "pp"])
def test_the_whole_command_on_twenty_drawn_cases(benchmark: Any, wrapper: str) -> None:
    command = [sys.executable, "-m", "gradequiv.harness", "distributed", "--impl", "torch",
               "--examples", str(EXAMPLES), "--wrapper", wrapper]

    def run() -> None:
        subprocess.run(command, check=True, capture_output=True)

    started = time.perf_counter()
    benchmark.pedantic(run, rounds=1)
    benchmark.extra_info["seconds"] = time.perf_counter() - started
    print(json.dumps(benchmark.extra_info))

"""The default ``gradequiv check --impl torch`` on an idle machine and beside busy processes,
as whole processes, side by side in one run.

A busy process is one single-threaded Python loop (what another CI job on the
same runner looks like to this one), started before the check and killed after
it. Each round runs every load (idle, beside 2, beside 4) with the default
``--threads 1`` and with ``--threads auto`` (torch's default: one intra-op
thread per core), the two in turn, so a machine that drifts slows both.
``test_check_under_load`` prints each one's median and p95 wall time and its
ratio to the idle run with the same threads. The aim: beside 4 busy processes,
at most 3x idle with the default.

Run: ``tox -e bench -- -k bench_load`` (about 15 minutes on 2 cores: torch's
default beside 4 busy processes alone is minutes a round), on an otherwise idle
machine; ``GRADEQUIV_BENCH_ROUNDS`` sets the rounds (default 3; p95 means
something from about 10).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

GRADEQUIV = Path(sys.executable).with_name("gradequiv")
LOADS = (0, 2, 4)  # busy single-thread processes beside the check
#: the default, and torch's own (``GRADEQUIV_BENCH_THREADS=1`` for the default alone: torch's
#: own beside 4 busy processes takes minutes a round)
THREADS = tuple(os.environ.get("GRADEQUIV_BENCH_THREADS", "1,auto").split(","))
ROUNDS = int(os.environ.get("GRADEQUIV_BENCH_ROUNDS", "3"))
#: a busy process ends by itself after this long, should the benchmark be killed
BUSY_S = 3600
_SPIN = f"import time\nend = time.monotonic() + {BUSY_S}\nwhile time.monotonic() < end: pass"


@contextlib.contextmanager
def busy(count: int) -> Iterator[None]:
    """``count`` processes that each keep one core busy, for the block, then killed."""
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(count)]
    try:
        time.sleep(0.5 if count else 0)  # running before the check starts
        yield
    finally:
        for process in spinners:
            process.kill()
        for process in spinners:
            process.wait()


def _check(threads: str, folder: Path) -> float:
    """Wall seconds of one default check (it must pass)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("GRADEQUIV_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    started = time.perf_counter()
    done = subprocess.run([str(GRADEQUIV), "check", "--impl", "torch", "--threads", threads,
                           "--report-dir", str(folder)],
                          capture_output=True, text=True, cwd=folder.parent, env=env,
                          check=False)
    wall = time.perf_counter() - started
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return wall


def _p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]  # nearest rank


def test_check_under_load(tmp_path: Path) -> None:
    import torch

    walls: dict[tuple[int, str], list[float]] = {(n, t): [] for n in LOADS for t in THREADS}
    load_before = os.getloadavg()[0]
    for round_ in range(ROUNDS):
        order = THREADS if round_ % 2 == 0 else THREADS[::-1]
        for count in LOADS:
            with busy(count):
                for threads in order:
                    folder = tmp_path / f"{round_}-{count}-{threads}"
                    folder.mkdir()
                    walls[count, threads].append(_check(threads, folder / "report"))
    print(f"\ncheck --impl torch, {ROUNDS} rounds, torch {torch.__version__}, "
          f"{os.cpu_count()} cores, load average {load_before:.1f} before the first run")
    for threads in THREADS:
        idle = statistics.median(walls[0, threads])
        for count in LOADS:
            values = walls[count, threads]
            median = statistics.median(values)
            print(f"--threads {threads:4} beside {count} busy: median {median:6.1f} s, "
                  f"p95 {_p95(values):6.1f} s, {median / idle:5.2f}x idle")

"""A failing ``gradequiv check`` against a passing one, as whole processes, side by side.

torch's checkpoint (passes) beside four failing kinds, each a fault family a real
checkpoint has: the RNG not restored (torch's own with preserve_rng_state=false), autocast
lost (the README's hand-written example), keyword arguments dropped, and a leak (saved
boundary inputs kept in a list never cleared). The rounds interleave all five, so a
machine that slows down slows all of them; ``test_failing_over_passing`` prints each
failing one's median and p95 wall time over the passing one's, and the report size. The
aim: at most 1.5, and report.json under 1 MB.

Run: ``tox -e bench -- -k bench_failing`` (about 10 minutes on 2 cores), on an otherwise
idle machine.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

GRADEQUIV = Path(sys.executable).with_name("gradequiv")
EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
RUNS = {
    "passing: torch": ["--impl", "torch"],
    "failing: torch without RNG restore": ["--impl", "torch", "--impl-kwarg",
                                           "preserve_rng_state=false"],
    "failing: README example (autocast lost)": ["--impl", "hand_written:my_checkpoint"],
    "failing: keyword arguments dropped": [
        "--impl", "gradequiv.harness.implementations.faults:kwargs_dropped"],
    "failing: a leak (saved inputs kept)": [
        "--impl", "gradequiv.harness.implementations.faults:saved_inputs_kept"],
}
ROUNDS = 5


def _run(args: list[str], folder: Path) -> tuple[float, int, int]:
    """Wall seconds, exit code and report.json bytes of one check."""
    started = time.perf_counter()
    done = subprocess.run([str(GRADEQUIV), "check", *args, "--report-dir", str(folder)],
                          capture_output=True, cwd=EXAMPLES, check=False)
    return time.perf_counter() - started, done.returncode, (folder / "report.json").stat().st_size


def test_failing_over_passing(tmp_path: Path) -> None:
    walls: dict[str, list[float]] = {name: [] for name in RUNS}
    sizes: dict[str, int] = {}
    for round_ in range(ROUNDS):
        for name, args in RUNS.items():
            wall, code, size = _run(args, tmp_path / f"{round_}-{len(walls[name])}")
            assert code == (0 if name.startswith("passing") else 1), name
            walls[name].append(wall)
            sizes[name] = size
    base = statistics.median(walls["passing: torch"])
    for name, values in walls.items():
        median = statistics.median(values)
        p95 = sorted(values)[max(0, round(0.95 * len(values)) - 1)]
        print(f"\n{name}: median {median:.1f} s, p95 {p95:.1f} s, {median / base:.2f}x the "
              f"passing run, report.json {sizes[name] / 1e6:.2f} MB")

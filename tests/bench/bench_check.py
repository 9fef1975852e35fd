"""The default ``gradequiv check --impl torch``: supervised (the default) against
``--in-process``, as whole processes (pytest-benchmark).

Run: ``tox -e bench -- -k bench_check`` (about 3 minutes on 2 cores), on an
otherwise idle machine, and compare the two members' medians: the
supervisor's cost is a second Python start-up and the events over its pipe.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

GRADEQUIV = Path(sys.executable).with_name("gradequiv")


@pytest.mark.parametrize("mode", ["supervised", "in-process"])
def test_default_check(benchmark: Any, mode: str, tmp_path: Path) -> None:
    benchmark.group = "check --impl torch"
    command = [str(GRADEQUIV), "check", "--impl", "torch", "--report-dir", str(tmp_path)]
    command += ["--in-process"] if mode == "in-process" else []

    def run() -> None:
        subprocess.run(command, check=True, capture_output=True, cwd=tmp_path)

    benchmark.pedantic(run, rounds=3, warmup_rounds=0)

"""State of one property-suite run: its options, its verdicts, its failures.

The pytest plugin fills :data:`OPTIONS` in ``pytest_configure``, before the
suite module is imported, so the suite's Hypothesis settings and seed come
from the command line. Verdicts are cached per process by case: the six
property tests draw the same cases from the same seed, so each case runs
down its three paths once, whichever property asks first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch stays unimported until a test runs
    from gradequiv.harness import Case, Implementation, Verdict

#: user_properties keys that carry verdicts and failures from a test (or an xdist worker).
CASE_KEY = "gradequiv_case"
FAILURE_KEY = "gradequiv_failure"

PROFILES = ("ci", "dev", "thorough")
#: Examples per property test in each profile.
PROFILE_EXAMPLES = {"ci": 20, "dev": 50, "thorough": 400}


@dataclass
class RunOptions:
    impl: str | None = None
    impl_kwargs: list[str] = field(default_factory=list)  # KEY=VALUE, parsed when resolved
    adapter: str | None = None
    seed: int = 0
    examples: int | None = None  # overrides the profile's count
    profile: str = "dev"
    device: str = "auto"
    report_dir: Path | None = None
    case: str | None = None  # replay one case (JSON or a named case) instead of drawing
    rtol: float | None = None  # explicit bounds, replacing the derived ones
    atol: float | None = None
    models: tuple[str, ...] = ("transformer",)  # reference models the cases are drawn for
    shrink: bool = True  # False: stop at the first failing example (mutant runs)
    shard: tuple[int, int] = (1, 1)  # (i, n): this run is shard i of n, 1-based
    model: str | None = None  # a user's model factory (package.module:attr) instead of ours

    @property
    def max_examples(self) -> int:
        """Examples per property test for this shard: its share of the run's count."""
        total = self.examples if self.examples is not None else PROFILE_EXAMPLES[self.profile]
        return -(-total // self.shard[1])

    @property
    def draw_seed(self) -> int:
        """The seed Hypothesis draws with: the run's seed, moved apart for each shard
        so that shards draw different cases."""
        index, count = self.shard
        return self.seed if count == 1 else self.seed + 1_000_003 * (index - 1)

    def in_shard(self, position: int) -> bool:
        """Whether the named case at ``position`` of the fixed spread runs on this shard."""
        index, count = self.shard
        return position % count == index - 1


OPTIONS = RunOptions()


def default_profile() -> str:
    """``ci`` where Hypothesis itself detects CI (it then loads its own ``ci`` profile)."""
    from hypothesis._settings import is_in_ci

    return "ci" if is_in_ci() or os.environ.get("CI") else "dev"


def resolve_device(choice: str) -> Any:
    """``auto`` is CUDA when torch sees a GPU, else the CPU."""
    import torch

    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


class VerdictCache:
    """One verdict per (implementation, case) in this process.

    ``on_verdict`` (set by the plugin) hears of each verdict computed, for
    progress lines on long runs.
    """

    def __init__(self) -> None:
        self._verdicts: dict[tuple[str, str, str], Verdict] = {}
        self.on_verdict: Callable[[Verdict], None] | None = None
        #: localisations of minimal failures, by (implementation, case): tests share them
        self.located: dict[tuple[str, str], Any] = {}

    def verify(self, impl: Implementation, case: Case, device: Any) -> tuple[Verdict, bool]:
        """The verdict, and whether it was computed now (False: from the cache)."""
        from gradequiv.harness import Tolerance, verify

        key = (repr((impl.spec, impl.adapter, sorted(impl.kwargs.items()))), case.to_json(),
               str(device))
        if key in self._verdicts:
            return self._verdicts[key], False
        tolerance = Tolerance(case.dtype, OPTIONS.rtol, OPTIONS.atol)
        verdict = verify(impl, case, device=device, tolerance=tolerance)
        self._verdicts[key] = verdict
        if self.on_verdict is not None:
            self.on_verdict(verdict)
        return verdict, True

    def clear(self) -> None:
        self._verdicts.clear()
        self.located.clear()


CACHE = VerdictCache()

"""State of one property-suite run: its options, its implementation, its verdicts.

The pytest plugin sets :data:`RUN` in ``pytest_configure``, before the suite
module is imported, so the suite's Hypothesis settings and seed come from the
run's :class:`~gradequiv.harness.options.CheckOptions`. The implementation and
the device are resolved once per run, on first use. Verdicts are cached per
process by case: the property tests draw the same cases from the same
seed, so each case runs down its paths once, whichever property asks first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from gradequiv.harness.options import CheckOptions

if TYPE_CHECKING:  # torch stays unimported until a test runs
    from gradequiv.harness import Case, Implementation, Verdict

#: user_properties keys that carry verdicts and failures from a test (or an xdist worker).
CASE_KEY = "gradequiv_case"
FAILURE_KEY = "gradequiv_failure"
#: What the skip of a case torch's own checkpoint refused by design says after the case:
#: the plugin reads it as the outcome "not applicable", which a pass allows.
NOT_APPLICABLE_SKIP = ": not applicable: "

#: New cases a test may try while shrinking its failure: a typical fault's minimal case is
#: reached in about 25, and the bound keeps a failing run's cost independent of the
#: machine's speed (``--shrink-budget`` adds a limit in seconds).
SHRINK_TRIES = 25

#: Further searches a failing property test makes, each for a failure whose causes are not
#: all known yet (``properties/assertions.py``, ``learn_causes``): so a run names every fault
#: it can reach, not the first one each test meets. They draw the same cases as the first
#: searches (from the cache) and go on past them, all of a run's further searches together
#: at most the run's examples of new cases (``--examples``), and each shrinks its new
#: failure within ``SHRINK_TRIES``; a passing test makes none.
FURTHER_SEARCHES = 2

#: Whether named cases run in fresh processes ahead of their tests, beside this process's
#: work: where a second core is free for them (this process runs its cases on one thread
#: unless told otherwise), not on one core.
AHEAD = (os.cpu_count() or 1) > 1

#: What a case tried while shrinking a property's failure needs: no memory watched, and the
#: first step alone where the property reads no later one; recompute needs the whole case.
PROBES = {"outputs": "first step", "gradients": "first step", "buffers": "first step",
          "inference": "first step", "rng": "every step", "trajectory": "every step"}


def default_profile() -> str:
    """``ci`` where Hypothesis itself detects CI (it then loads its own ``ci`` profile)."""
    from hypothesis._settings import is_in_ci

    return "ci" if is_in_ci() or os.environ.get("CI") else "dev"


def implementation_key(impl: Implementation) -> str:
    """What tells two implementations apart in a cache: SPEC, adapter and options."""
    return repr((impl.spec, impl.adapter, sorted(impl.kwargs.items())))


class RunObserver(Protocol):
    """Watches a run from outside: the case about to run, each record, each phase."""

    def case_started(self, impl: Implementation, case: Case, device: Any) -> None: ...

    def case_finished(self, record: dict[str, Any]) -> None: ...

    def phase(self, what: str) -> None: ...


class VerdictCache:
    """One verdict per (implementation, case) in this process.

    ``on_verdict`` (set by the plugin) hears of each verdict computed, for
    progress lines on long runs.
    """

    def __init__(self) -> None:
        self._verdicts: dict[tuple[str, str, str], Verdict] = {}
        #: verdicts of shrink tries: key -> PROBES kind -> verdict
        self._probes: dict[tuple[str, str, str], dict[str, Verdict]] = {}
        self.on_verdict: Callable[[Verdict], None] | None = None
        #: hears of each case about to run (a supervisor names the case a crash ended)
        self.on_start: Callable[[Implementation, Case, Any], None] | None = None
        #: localisations of minimal failures, by (implementation, case): tests share them
        self.located: dict[tuple[str, str], Any] = {}
        #: replays of minimal failures outside the cache, by (implementation, case)
        self.replayed: dict[tuple[str, str], Verdict] = {}
        #: where named cases are verified as a fresh process would (``engine/fresh.py``):
        #: set by the suite for an implementation another process can build
        self.fresh: Any = None
        #: (implementation, case) keys that fail in a fresh process and pass in this one
        self.fresh_only: set[tuple[str, str, str]] = set()
        #: named cases verified in fresh processes ahead of their tests (``fresh.Ahead``)
        self._ahead: Any = None

    def has(self, impl: Implementation, case: Case, device: Any) -> bool:
        key = (implementation_key(impl), case.to_json(), str(device))
        return key in self._verdicts or key in self._probes

    def get(self, impl: Implementation, case: Case, device: Any) -> Verdict | None:
        """The case's verdict: the whole one, else a probe."""
        key = (implementation_key(impl), case.to_json(), str(device))
        return self._verdicts.get(key) or next(iter(self._probes.get(key, {}).values()), None)

    def verify(self, impl: Implementation, case: Case, device: Any, *,
               probe: str | None = None) -> tuple[Verdict, bool]:
        """The verdict, and whether it was computed now (False: from the cache). The noise
        floor runs only where it can change the verdict (a failing tensor within its
        dtype's cap; a minimal failure's replay measures it for its figures), every time
        with ``--deterministic``. ``probe``: the property a case tried while shrinking asks
        about; the verdict watches memory only for recompute, and runs the first step alone
        where the property reads no later one (``PROBES``). Probes are kept apart, so that
        no test is handed one for a whole verdict."""
        from gradequiv.harness import verify
        from gradequiv.harness.engine.fresh import portable

        key = (implementation_key(impl), case.to_json(), str(device))
        if key in self._verdicts:
            return self._verdicts[key], False
        kind = PROBES.get(probe or "")
        if kind is not None and kind in self._probes.get(key, {}):
            return self._probes[key][kind], False
        if self.on_start is not None:
            self.on_start(impl, case, device)
        options = _verify_options(case, kind)
        if self.fresh is not None and case.name and kind is None and portable(impl, case):
            verdict = self._fresh(impl, case, device, options, key)
        else:
            verdict = verify(impl, case, device=device, **options)
        if kind is None:
            self._verdicts[key] = verdict
        else:
            self._probes.setdefault(key, {})[kind] = verdict
        if self.on_verdict is not None:
            self.on_verdict(verdict)
        return verdict, True

    def _fresh(self, impl: Implementation, case: Case, device: Any, options: dict[str, Any],
               key: tuple[str, str, str]) -> Verdict:
        """A named case's verdict as the first case of a fresh process; where it fails, the
        case again in this process, to say whether the failure needs a fresh process (state
        the implementation keeps across cases, set by whichever case ran first)."""
        from gradequiv.harness import Verdict, verify
        from gradequiv.harness.engine.fresh import FreshProcessEnded

        try:
            taken = self._ahead.take(key) if self._ahead is not None else None
            verdict: Verdict = taken if taken is not None else \
                self.fresh.verify(impl, case, device, **options)
        except FreshProcessEnded:
            # here, where a supervisor sees an end of the process and says so
            here = verify(impl, case, device=device, **options)
            if not here.passed:
                return here
            self.fresh_only.add(key)
            return Verdict(case=case, impl=impl.spec, device=str(device), error=(
                "SystemExit: the implementation ended a fresh process running this case (an "
                "exit or a signal) before it finished"), error_at="the case")
        if not verdict.passed and verify(impl, case, device=device, **options).passed:
            self.fresh_only.add(key)
        return verdict

    def ahead(self, impl: Implementation, cases: list[Case], device: Any) -> None:
        """Verify ``cases`` (named ones) in fresh processes ahead of their tests, one after
        another on a second core while this process runs the drawn cases (``AHEAD``); each
        child still runs its case as the first of its process."""
        from gradequiv.harness.engine.fresh import Ahead, portable

        if not AHEAD or self.fresh is None:
            return
        self.drop_ahead()
        self._ahead = Ahead(self.fresh, [
            ((implementation_key(impl), case.to_json(), str(device)), impl, case, device,
             _verify_options(case, None))
            for case in cases if portable(impl, case)])

    def drop_ahead(self) -> None:
        """End the work started ahead: its verdicts are wanted no more."""
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead = None

    def clear(self) -> None:
        self.drop_ahead()
        self._verdicts.clear()
        self._probes.clear()
        self.located.clear()
        self.replayed.clear()
        self.fresh_only.clear()


def _verify_options(case: Case, kind: str | None) -> dict[str, Any]:
    """``verify``'s options for ``case``: a whole verdict (``kind`` None) or a shrink try's
    (``PROBES``)."""
    return {"tolerance": RUN.tolerance(case), "floor_when_needed": True,
            "watch_memory": kind is None,
            "always_floor": RUN.options.deterministic and kind is None,
            "first_step_only": kind == "first step"}


class SuiteState:
    """The run in this process: its options and what is resolved from them, once."""

    def __init__(self, options: CheckOptions | None = None,
                 implementation: Implementation | None = None,
                 observer: RunObserver | None = None) -> None:
        self.options = options or CheckOptions()
        self._implementation = implementation
        self._device: Any = None
        #: the implementation the suite's tests were handed (a conftest may override it)
        self.used: Implementation | None = None
        self.cache = VerdictCache()
        #: which run this is (``reports.report.run_identity``), set by the plugin
        self.identity: dict[str, Any] | None = None
        #: hear of each case record as it is made (the report is rewritten as cases finish)
        self.on_record: list[Callable[[dict[str, Any]], None]] = []
        #: who watches this run from outside (``gradequiv check``'s supervisor), if anyone
        self.observer = observer
        #: (test, case) of each minimal failure so far: later tests try these first
        self.minimal_cases: list[tuple[str, Case]] = []
        #: (test, smallest failing case so far) while a test shrinks a failure, else None
        self.shrinking: tuple[str, Case] | None = None
        self._shrinks: dict[str, list[float]] = {}  # test -> [new cases tried, start]
        #: test -> the earlier test whose minimal failure has its failure's every cause
        self.unshrunk: dict[str, str] = {}
        #: test -> which further search it is making (1, 2, ...); absent: its first
        self.further: dict[str, int] = {}
        #: the causes (``diagnosis.fault_key``) of the failures found so far, and the causes
        #: a failure looks like before it is localised (``assertions._looks``) where it
        #: turned out to have known causes only: a further search looks past both
        self.known_causes: set[str] = set()
        self.known_looks: set[frozenset[str]] = set()
        #: new cases the further searches of the run drew (their budget: the run's examples)
        self.further_draws = 0
        #: a drawn test's minimal failure came back when replayed outside the cache
        self.failed_for_certain = False
        #: the pytest command line of a run started by pytest itself (None: by ``check``)
        self.pytest_args: list[str] | None = None
        #: the named cases this run's suite holds, in order (set by the suite module):
        #: verified in fresh processes ahead of their tests
        self.named: list[Case] = []
        #: torch's regime-defining switches the run set back to its defaults, and what each
        #: was (``global_state.pin_regime``): said in the report, put back after the run
        self.pinned: dict[str, Any] = {}
        if observer is not None:
            self.cache.on_start = observer.case_started
            self.on_record.append(observer.case_finished)

    def from_fixture(self, impl: Implementation) -> bool:
        """Whether ``impl`` came from a conftest's ``recompute_impl``, not from the options."""
        if self.options.impl is None:
            return True
        try:
            return impl is not self.implementation()
        except Exception:  # a SPEC that does not resolve: the fixture stood in for it
            return True

    def verify_named_fresh(self, impl: Implementation) -> None:
        """From now on, named cases of ``impl`` are verified as the first case of a fresh
        process (``engine/fresh.py``), where another process can build it from its SPEC."""
        if self.cache.fresh is not None or self.options.impl is None \
                or self.options.case is not None:  # one case replayed: no named case runs
            return
        from gradequiv.harness.engine.fresh import resolvable, shared

        if not self.from_fixture(impl) and resolvable(impl):
            self.cache.fresh = shared()
            self.cache.fresh.warm()
            self.cache.ahead(impl, [case for case in self.named if not self.declines(case)
                                    and not impl.declines(case.grad_mode, case.features())],
                             self.device())

    def close(self) -> None:
        """The run uses its fresh processes no more (their server outlives it, for the next
        suite of this process, until the process exits); nothing of the run listens to
        its cache any more (a progress line of a run that ended wrote to a closed
        terminal when another run in this process verified a case)."""
        self.cache.drop_ahead()
        self.cache.fresh = None
        self.cache.on_verdict = self.cache.on_start = None

    def may_shrink(self, test: str) -> bool:
        """Whether ``test`` may try one more new case while shrinking (counted if so)."""
        tries = self._shrinks.setdefault(test, [0, time.monotonic()])
        budget = self.options.shrink_budget
        # >=: a budget of 0 allows no try, even where the clock has not moved since the
        # test's first shrink (a coarse monotonic clock reads the same twice)
        if tries[0] >= SHRINK_TRIES or (budget is not None
                                        and time.monotonic() - tries[1] >= budget):
            return False
        tries[0] += 1
        return True

    def stop_shrinking(self, test: str) -> None:
        """``test`` tries no new case while shrinking from now on."""
        self._shrinks[test] = [SHRINK_TRIES, time.monotonic()]

    def phase(self, what: str) -> None:
        """The run moves on to ``what`` (a replay, a localisation): tell the observer."""
        if self.observer is not None:
            self.observer.phase(what)

    def record(self, record: dict[str, Any]) -> None:
        """A case finished: tell whoever listens (the plugin's report writer)."""
        for listener in self.on_record:
            listener(record)

    def implementation(self) -> Implementation:
        """The implementation named by the options, resolved on first use."""
        if self._implementation is None:
            from gradequiv.harness import resolve

            assert self.options.impl is not None
            self._implementation = resolve(self.options.impl, adapter=self.options.adapter,
                                           kwargs=self.options.kwargs)
            self.pin_regime()  # its module's import may have set one
        return self._implementation

    def pin_regime(self) -> None:
        """torch's switches that say what a regime means (the default dtype, ...) back at
        torch's defaults, whatever an import or the caller set: the first value each had
        is kept, to say so and to put back when the run ends."""
        from gradequiv.harness.engine.global_state import pin_regime

        for label, value in pin_regime().items():
            self.pinned.setdefault(label, value)

    def grad_modes(self) -> tuple[str, ...]:
        """The grad modes to draw: those the named implementation supports (every one where
        none is named: a conftest hands the suite its own) that the training regime runs."""
        from gradequiv.models.kinds import GRAD_MODES

        supported = GRAD_MODES if self.options.impl is None else self.implementation().grad_modes
        return self.options.regime.modes_within(supported)

    def outside_regime(self, case: Any) -> str:
        """Why ``case`` is not checked: what of it the stated training regime does not run
        ("" where it does, and where no regime is stated)."""
        why = self.options.regime.outside(case)
        return f"outside the training regime: {why}" if why else ""

    def declines(self, case: Any) -> str:
        """Why the named implementation is not checked on ``case`` ("" where it is, and
        where none is named: a conftest's is asked case by case)."""
        if self.options.impl is None:
            return ""
        return self.implementation().declines(case.grad_mode, case.features())

    def device(self) -> Any:
        """The run's torch device, resolved on first use."""
        if self._device is None:
            from gradequiv.harness.engine.devices import resolve_device

            self._device = resolve_device(self.options.device, flag="--gradequiv-device")
        return self._device

    def tolerance(self, case: Case) -> Any:
        from gradequiv.harness import Tolerance

        return Tolerance(case.dtype, self.options.rtol, self.options.atol)


#: The run of this process; replaced by the plugin at each pytest session.
RUN = SuiteState()

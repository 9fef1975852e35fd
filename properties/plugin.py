"""The pytest plugin (entry point ``pytest11``): options, fixture, header, progress, summary.

Loaded into every pytest run where gradequiv is installed, so it imports
neither torch nor the engine at import time, and it is inert unless the run
asks for gradequiv (:func:`_asked`: a ``--gradequiv-*`` option, a
``GRADEQUIV_*`` variable, a ``gradequiv_*`` ini key, the property suite named or
collected): elsewhere it prints nothing, adds no fixture and changes no outcome.
The run's options come from ``gradequiv check``
(a ``SuiteRun``), from the xdist controller, or from the ``--gradequiv-*``
options, each with an ini key and an environment variable (command line >
environment > ini > default), validated by ``gradequiv.harness.options``.
It gathers cases and outcomes; ``gradequiv.harness.reports.report`` turns
them into report.json.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Literal

import pytest

from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.options import CheckOptions, SuiteRun, check_options
from gradequiv.properties import runtime
from gradequiv.properties.runtime import CASE_KEY, FAILURE_KEY, NOT_APPLICABLE_SKIP

_OPTIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("impl", "implementation SPEC: torch, torch-reentrant, an entry point, or module:attr", {}),
    ("impl-kwarg", "KEY=VALUE forwarded to the implementation (repeatable)",
     {"action": "append"}),
    ("adapter", "how the implementation is called: function, wrapper or toggle", {}),
    ("seed", "seed of the drawn cases (default: 0 in CI, random elsewhere)", {}),
    ("examples", "examples per property test (overrides the profile)", {}),
    ("profile", "ci, dev or thorough (default: ci when CI is detected, else dev)", {}),
    ("device", "auto, cpu or cuda (default auto)", {}),
    ("report-dir", "write report.json into this folder at the end of the run", {}),
    ("case", "replay one case: its JSON, or a named case", {}),
    ("rtol", "explicit relative-error bound (replaces the derived one)", {}),
    ("atol", "explicit absolute-error bound (a tensor within it passes)", {}),
    ("model", "your own model: a factory package.module:attr, called with a seed, returning "
              "gradequiv.models.UserModel; replaces the reference models", {}),
    ("models", "reference models to draw cases for, comma-separated: transformer, batchnorm "
               "(default transformer)", {}),
    ("shard", "run shard I of N (e.g. 2/4): its share of the examples, drawn from its own "
              "seed, and of the named cases; N machines together do one run's work", {}),
    ("deterministic", "run with torch.use_deterministic_algorithms(True): on CUDA the "
                      "noise floor (statistics.max_noise_floor) should then be zero",
     {"action": "store_true"}),
    ("no-shrink", "report the first failing example as found, without shrinking it",
     {"action": "store_true"}),
    ("shrink-budget", "seconds a test may spend shrinking its failure (default: no limit)", {}),
    ("regime", "what your training runs, KEY=VALUE (repeatable; on top of pyproject.toml's "
               "[tool.gradequiv]): only it is drawn", {"action": "append"}),
    ("threads", "torch's intra-op threads while the suite runs: N, or auto for torch's default "
                "(default 1: more only slow its tiny tensors, badly on a busy machine)", {}),
]


def _dest(name: str) -> str:
    return "gradequiv_" + name.replace("-", "_")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gradequiv", "gradequiv: recompute equivalence")
    for name, help_text, extra in _OPTIONS:
        group.addoption(f"--gradequiv-{name}", dest=_dest(name), default=None,
                        help=f"{help_text}; env GRADEQUIV_{name.upper().replace('-', '_')}, "
                             f"ini {_dest(name)}", **extra)
        action = extra.get("action", "")
        kind: Literal["linelist", "bool", "string"] = (
            "linelist" if action == "append" else "bool" if action == "store_true" else "string")
        parser.addini(_dest(name), help_text, type=kind)


def _setting(config: pytest.Config, name: str) -> Any:
    value = config.getoption(_dest(name))
    if value is None:
        value = os.environ.get("GRADEQUIV_" + name.upper().replace("-", "_"))
        if value is not None and name in ("impl-kwarg", "regime"):
            value = value.split()
    if value is None or value == "" or value == []:
        value = config.getini(_dest(name)) or None
    return value


_DETERMINISTIC_BEFORE = pytest.StashKey[bool]()
_THREADS_BEFORE = pytest.StashKey[int]()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave torch's deterministic-algorithms switch and thread count as the run found them
    (check runs in-process)."""
    before = config.stash.get(_DETERMINISTIC_BEFORE, None)
    if before is not None:
        import torch

        torch.use_deterministic_algorithms(before)
    threads = config.stash.get(_THREADS_BEFORE, None)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if _active(config):
        runtime.RUN.close()
    if _active(config) and runtime.RUN.pinned:
        from gradequiv.harness.engine.global_state import unpin

        unpin(runtime.RUN.pinned)


def gpu_for_worker(worker: str, visible: list[str]) -> str | None:
    """The GPU xdist worker ``gwK`` should see: the K-th visible one, round robin."""
    index = worker.removeprefix("gw")
    if not visible or not index.isdigit():
        return None
    return visible[int(index) % len(visible)]


def _pin_worker_gpu(worker: str) -> None:
    """One GPU per xdist worker, chosen before CUDA starts in this worker process.

    The visible GPUs are CUDA_VISIBLE_DEVICES when set, else NVML's count (which
    does not start CUDA); a machine without GPUs is left alone.
    """
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        visible = [d.strip() for d in listed.split(",") if d.strip()]
    else:
        import torch

        count_nvml = getattr(torch.cuda, "_device_count_nvml", lambda: -1)
        visible = [str(i) for i in range(max(count_nvml(), 0))]
    gpu = gpu_for_worker(worker, visible)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu


def _options(config: pytest.Config) -> tuple[CheckOptions, Any, Any]:
    """The run's options, implementation and observer: handed over by ``gradequiv check`` (a
    :class:`SuiteRun` plugin object), by the xdist controller (as JSON), or read from
    this run's command line, environment and ini file, validated by ``check_options``."""
    for plugin in config.pluginmanager.get_plugins():
        if isinstance(plugin, SuiteRun):
            return plugin.options, plugin.implementation, plugin.observer
    given = getattr(config, "workerinput", {}).get("gradequiv_options")
    if given is not None:
        return CheckOptions.from_json(given), None, None
    profile = _setting(config, "profile") or runtime.default_profile()
    seed = _setting(config, "seed")
    if seed is None:
        seed = 0 if profile == "ci" else random.randrange(2**16)
    raw = {name.replace("-", "_"): _setting(config, name) for name in
           ("impl", "adapter", "examples", "device", "report-dir", "case", "rtol", "atol",
            "model", "shard", "models", "shrink-budget", "threads")}
    raw = {k: v for k, v in raw.items() if v is not None}
    try:
        options = check_options(
            flag=lambda name: "--gradequiv-" + name.replace("_", "-"), profile=profile,
            seed=seed, impl_kwargs=_setting(config, "impl-kwarg") or (),
            regime=_setting(config, "regime") or None,
            shrink=not _setting(config, "no-shrink"),
            deterministic=bool(_setting(config, "deterministic")), **raw)
    except InvalidArgument as exc:
        raise pytest.UsageError(str(exc)) from exc
    return options, None, None


_ACTIVE = pytest.StashKey[bool]()


def _asked(config: pytest.Config) -> bool:
    """Whether this run asked for gradequiv: a command or an xdist controller handed it
    options, a ``--gradequiv-*`` option, a ``GRADEQUIV_*`` variable or a ``gradequiv_*``
    ini key is set, or the arguments name the property suite. Elsewhere (a user's own
    suite in a project that installs gradequiv) the plugin adds nothing to the run."""
    if any(isinstance(p, SuiteRun) for p in config.pluginmanager.get_plugins()):
        return True
    if "gradequiv_options" in getattr(config, "workerinput", {}):
        return True
    for name, _, _ in _OPTIONS:
        if config.getoption(_dest(name)) not in (None, False, []):
            return True
        if os.environ.get("GRADEQUIV_" + name.upper().replace("-", "_")):
            return True
        if config.getini(_dest(name)):
            return True
    suite = Path(__file__).parent
    for arg in config.invocation_params.args:
        text = str(arg).split("::")[0]
        if text.startswith("gradequiv.properties"):
            return True
        with contextlib.suppress(OSError, ValueError):
            path = (config.invocation_params.dir / text).resolve()
            if path == suite or suite in path.parents or path in suite.parents:
                return True
    return False


def _active(config: pytest.Config) -> bool:
    return config.stash.get(_ACTIVE, False)


def pytest_configure(config: pytest.Config) -> None:
    if _asked(config):
        _activate(config)


def _activate(config: pytest.Config) -> None:
    """Set the run up: options, the implementation fixture, the gatherer, progress lines."""
    if _active(config):
        return
    config.stash[_ACTIVE] = True
    options, implementation, observer = _options(config)
    runtime.RUN = runtime.SuiteState(options, implementation, observer)
    if not any(isinstance(p, SuiteRun) for p in config.pluginmanager.get_plugins()):
        runtime.RUN.pytest_args = list(config.invocation_params.args)
    if options.deterministic:
        import torch

        config.stash[_DETERMINISTIC_BEFORE] = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        # cuBLAS needs a fixed workspace to be deterministic; set it before CUDA starts.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if options.impl:  # a run of the suite: the regime's switches at torch's defaults
        runtime.RUN.pin_regime()
    if options.impl and options.threads is not None:  # a run of the suite: set before it
        import torch

        config.stash[_THREADS_BEFORE] = torch.get_num_threads()
        torch.set_num_threads(options.threads)
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker and options.impl and options.device != "cpu":
        _pin_worker_gpu(worker)
    from gradequiv.properties import fixtures

    config.pluginmanager.register(fixtures, "gradequiv-fixtures")
    config.pluginmanager.register(_Gatherer(config), "gradequiv-gatherer")
    capture = config.pluginmanager.getplugin("capturemanager")
    if runtime.RUN.pytest_args is None and capture is not None:  # pytest shows none of it
        _CaseOutput(capture).listen(runtime.RUN)
    if not hasattr(config, "workerinput"):  # xdist workers cannot write to the terminal
        runtime.RUN.cache.on_verdict = _Progress(config)


class _Progress:
    """Progress lines on long runs: cases verified, failing, seconds, the case just run (or,
    while a failure is shrunk, the tries and the smallest failing case so far).

    Plain lines (they must read well in a CI log, where nothing is a
    terminal), written past pytest's output capture: the first after a few
    seconds, then at most one per interval, and at once for the first failure.
    """

    FIRST_S, EVERY_S = 5.0, 15.0

    def __init__(self, config: pytest.Config) -> None:
        self.config, self.clock = config, time.monotonic
        self.started = self.last = self.clock()
        self.cases = self.failing = self.tries = 0
        self.quiet = config.get_verbosity() < -1

    def __call__(self, verdict: Any) -> None:
        self.cases += 1
        first_failure = not verdict.passed and self.failing == 0
        self.failing += not verdict.passed
        shrinking = runtime.RUN.shrinking
        if shrinking is None:
            self.tries = 0
        else:
            self.tries += 1
        now = self.clock()
        due = self.FIRST_S if self.last == self.started else self.EVERY_S
        if self.quiet or not (first_failure or now - self.last >= due):
            return
        self.last = now
        cases = f"{self.cases} case{'s' if self.cases != 1 else ''}"
        if shrinking is not None:
            test, smallest = shrinking
            tries = f"{self.tries} {'try' if self.tries == 1 else 'tries'}"
            doing = (f"shrinking {test}'s failure: {tries}, smallest so far: "
                     f"{smallest.describe()}")
        else:
            doing = f"{'FAILED' if not verdict.passed else 'last'}: {verdict.case.describe()}"
        line = f"gradequiv: {cases} verified, {self.failing} failing, " \
               f"{now - self.started:.0f} s; {doing}"
        reporter = self.config.pluginmanager.getplugin("terminalreporter")
        capture = self.config.pluginmanager.getplugin("capturemanager")
        if reporter is None or capture is None:
            return
        with capture.global_and_fixture_disabled():
            if getattr(reporter._tw, "width_of_current_line", 0):  # after pytest's dots
                reporter.write_line("")
            reporter.write_line(line)


class _CaseOutput:
    """What the implementation printed during each case, kept on a failing case's record.

    In a ``gradequiv check`` run pytest captures the suite's stdout and stderr
    and, with its tracebacks off, shows none of it: print-debugging in an
    implementation would show nothing. The capture is read when a case starts
    (what came before is not the case's) and when its record is made.
    """

    def __init__(self, capture: Any) -> None:
        self.capture = capture

    def listen(self, run: runtime.SuiteState) -> None:
        before = run.cache.on_start

        def started(impl: Any, case: Any, device: Any) -> None:
            self._read()
            if before is not None:
                before(impl, case, device)

        run.cache.on_start = started
        run.on_record.insert(0, self.finished)  # before the record is sent or written

    def finished(self, record: dict[str, Any]) -> None:
        from gradequiv.harness.reports.report import bounded_output

        out, err = self._read()
        if record["verdict"] == "fail" and (out or err):
            record["output"] = bounded_output(out, err)

    def _read(self) -> tuple[str, str]:
        try:
            out, err = self.capture.read_global_capture()
        except Exception:  # no capture (-s) or not started: nothing to keep
            return "", ""
        return str(out or ""), str(err or "")


_SUITE = "gradequiv.properties.test_recompute"


class _SuiteModule(pytest.Module):
    """The suite, imported under its own name, afresh for each session.

    pytest would derive a module name from the file's folders ('properties.
    test_recompute') and could clash with a user's own 'properties' package;
    and the suite reads the run's options when imported, so an earlier
    in-process run must not linger.
    """

    def _getobj(self) -> Any:
        sys.modules.pop(_SUITE, None)
        return importlib.import_module(_SUITE)


def _why_failed(longrepr: str) -> str:
    """The line of a failed test's report that says what was raised: not Hypothesis's
    advice on reproducing the example ("You can reproduce this test case by ..."), which
    names nobody's mistake."""
    from gradequiv.harness.errors import exception_line

    lines = [line.removeprefix("E").strip() for line in longrepr.splitlines()]
    kept = [line for line in lines if line and "reproduce_failure" not in line
            and not line.startswith(("You can reproduce", "Falsifying example"))]
    return exception_line("\n".join(kept))


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Any:
    if module_path.name == "test_recompute.py" and module_path.parent == Path(__file__).parent:
        _activate(parent.config)  # the suite collected by a path the arguments did not name
        return _SuiteModule.from_parent(parent, path=module_path)
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist: every worker runs with the controller's options (its seed included)."""
    if _active(node.config):
        node.workerinput["gradequiv_options"] = runtime.RUN.options.to_json()


def pytest_report_header(config: pytest.Config) -> str | None:
    if not _active(config):
        return None
    options = runtime.RUN.options
    shard = "" if options.shard == (1, 1) else f", shard {options.shard[0]}/{options.shard[1]}"
    return (f"gradequiv: Using --gradequiv-seed={options.seed} (profile {options.profile}, "
            f"{options.max_examples} examples per property{shard}, "
            f"impl {options.impl or 'unset'})")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _active(item.config):
        runtime.RUN.shrinking = None  # a new test: no failure of its own yet


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Replay a suite test's minimal failure once, outside the cache (flaky or not), and
    find the first recompute op that differs from the original forward."""
    report = yield
    funcargs: dict[str, Any] = getattr(item, "funcargs", {})
    if (call.when == "call" and report.failed and "recompute_impl" in funcargs
            and _active(item.config)):
        from gradequiv.properties.assertions import locate, replay_passes

        impl = funcargs["recompute_impl"]
        for key, failure in report.user_properties:
            if key != FAILURE_KEY:
                continue
            test = item.nodeid.split("::")[-1]
            named = test.startswith("test_named_case")
            if not named and "found_by" not in failure:
                from gradequiv.harness import Case

                runtime.RUN.minimal_cases.append((test, Case.from_dict(failure["case"])))
            # Once a drawn minimal failure came back on replay, the implementation is known
            # to fail for certain; replaying each named case's failure too (seconds apiece on
            # the large ones) would only say so again.
            if not (named and runtime.RUN.failed_for_certain):
                runtime.RUN.phase(f"the replay of {test}'s minimal failure, "
                                  f"{failure['description']}")
                if replay_passes(impl, failure):
                    failure["flaky"] = True
                    report.longrepr = (f"FLAKY (passed on replay: nondeterministic)\n"
                                       f"{report.longrepr}")
                elif not named:
                    runtime.RUN.failed_for_certain = True
            runtime.RUN.phase(f"the localisation of {test}'s minimal failure, "
                              f"{failure['description']}")
            locate(impl, failure, named=named)
            report.longrepr = f"{report.longrepr}\n  {failure['localisation']}"
    return report


class _Gatherer:
    """Gathers verdicts and failures (from this process or xdist workers); writes the report."""

    #: at most one rewrite of report.json per this many seconds as cases and tests finish
    #: (the run's last one is always written)
    WRITE_EVERY_S = 1.0

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.records: dict[str, dict[str, Any]] = {}
        self.failures: list[dict[str, Any]] = []
        self.outcomes: dict[str, str] = {}
        #: test -> its case and torch's refusal, where the outcome is "not applicable"
        self.not_applicable: dict[str, str] = {}
        self.errors: dict[str, str] = {}  # tests that failed without a property failure
        self.case_files: dict[str, str] = {}  # reproduce -> its case file
        self.collected = False
        self.is_worker = hasattr(config, "workerinput")
        self.written_at = -float("inf")
        self.write_cost = 0.0  # seconds the last report write took
        if not self.is_worker:
            runtime.RUN.on_record.append(self.case_finished)

    def case_finished(self, record: dict[str, Any]) -> None:
        """Keep a case as soon as it is verified: a kill or an interrupt keeps it too."""
        self._keep(record)
        self._write_when_due()

    def _write_when_due(self) -> None:
        """Rewrite report.json unless it was rewritten within the last second (or ten times
        its own cost): never more than a tenth of the run spent rewriting a report that
        grows with it; the run's last write always comes."""
        wait = max(self.WRITE_EVERY_S, 10 * self.write_cost)
        if self._writes_report() and time.monotonic() - self.written_at >= wait:
            self.write_report(complete=False)

    def _keep(self, record: dict[str, Any]) -> None:
        from gradequiv.harness.reports.report import kept_record

        self.records[record["reproduce"]] = kept_record(self.records.get(record["reproduce"]),
                                                        record)

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """The folder is this run's: what an earlier run left there goes first."""
        report_dir = runtime.RUN.options.report_dir
        if self.is_worker or report_dir is None:
            return
        from gradequiv.harness.reports.files import claim_report_dir, run_identity

        runtime.RUN.identity = run_identity()
        if runtime.RUN.observer is not None:
            return  # a supervisor claimed the folder, and wrote its starting report there
        try:
            claim_report_dir(report_dir)
        except InvalidArgument as exc:
            raise pytest.UsageError(str(exc)) from exc

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.collected = any("test_recompute.py::" in item.nodeid for item in items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Only the named cases whose tests were selected (``-k``, a node id) are verified
        ahead: the others would be asked for by no test."""
        chosen = {getattr(getattr(item, "callspec", None), "params", {}).get("name")
                  for item in session.items if "::test_named_case[" in item.nodeid}
        runtime.RUN.named = [case for case in runtime.RUN.named if case.name in chosen]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if "test_recompute.py::" not in report.nodeid:
            return
        self.collected = True  # under xdist the controller collects nothing itself
        from gradequiv.harness.reports.report import NOT_APPLICABLE
        from gradequiv.harness.reports.text import bounded, bounded_texts

        test = report.nodeid.split("::")[-1]
        found = []
        for key, value in report.user_properties:
            if not isinstance(value, dict):
                continue
            if key == CASE_KEY:
                self._keep(value)
            elif key == FAILURE_KEY and report.failed and report.when == "call":
                # its message and localisation quote the implementation's exception
                found.append(bounded_texts(dict(value, test=test)))
        for failure in found:  # after the loop: its case's record is in by now
            self._explain(failure)
            self.failures.append(failure)
        if report.failed and not found:  # no verdict to show: say why it failed
            self.errors[test] = bounded(_why_failed(str(report.longrepr)) or report.outcome)
        if report.when == "call" or report.failed:
            reason = _skip_reason(report) if report.outcome == "skipped" else ""
            refused = NOT_APPLICABLE_SKIP in reason
            self.outcomes[test] = NOT_APPLICABLE if refused else report.outcome
            if refused:
                self.not_applicable[test] = bounded(reason.removeprefix("Skipped: "))
        if report.when == "teardown":
            self._write_when_due()  # a kill from here on keeps what finished

    def _explain(self, failure: dict[str, Any]) -> None:
        """A minimal failure's likely cause in words, and its case in a file of the report
        folder (one per distinct case) for a reproduce line short enough to copy."""
        from gradequiv.harness.reports.diagnosis import diagnose
        from gradequiv.harness.reports.files import CASES_DIR, write_json_atomic
        from gradequiv.harness.reports.report import with_case_file

        record = self.records.get(failure["reproduce"])
        failure["diagnosis"] = diagnose(failure, record).to_dict()
        if record is not None and "output" in record:
            failure["output"] = record["output"]
        report_dir = runtime.RUN.options.report_dir
        if report_dir is None or self.is_worker:
            return
        path = self.case_files.get(failure["reproduce"])
        if path is None:
            path = str(report_dir / CASES_DIR / f"minimal-{len(self.case_files) + 1}.json")
            write_json_atomic(Path(path), failure["case"])
            self.case_files[failure["reproduce"]] = path
        failure["reproduce_file"] = with_case_file(failure["reproduce"], path)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.outcomes:
            return
        from gradequiv.harness.reports.report import (
            NOT_APPLICABLE,
            PASSING_OUTCOMES,
            distinct_cases,
        )
        from gradequiv.harness.reports.terminal import headline_lines, summary_lines

        write = terminalreporter.write_line
        terminalreporter.section("gradequiv")
        kept, shrunk = distinct_cases(list(self.records.values()), self.failures)
        failing = sum(r["verdict"] == "fail" for r in kept)
        passed = sum(o == "passed" for o in self.outcomes.values())
        tried = f" (and {shrunk} more tried while shrinking)" if shrunk else ""
        refused = sum(o == NOT_APPLICABLE for o in self.outcomes.values())
        also = f", {refused} not applicable (torch's own checkpoint refused them by design)" \
            if refused else ""
        write(f"{len(kept)} case(s) verified{tried}, {failing} failing; "
              f"{passed} of {len(self.outcomes)} property tests passed{also}")
        for test, reason in sorted(self.not_applicable.items()):
            write(f"not applicable: {test}: {reason}")
        if runtime.RUN.options.regime.stated:
            write(runtime.RUN.options.regime.describe())
        from gradequiv.harness.engine.global_state import pinned_lines

        for line in pinned_lines(runtime.RUN.pinned):
            write(f"note: torch's {line}")
        failed = self.failures or any(o not in PASSING_OUTCOMES for o in self.outcomes.values())
        for line in [*headline_lines(self.failures), *summary_lines(self.failures,
                                                                  self.errors)]:
            write(line)
        if runtime.RUN.options.report_dir is not None:
            write(f"report: {runtime.RUN.options.report_dir / 'report.json'}")
        write(f"verdict: {'FAIL' if failed else 'pass'} (Using --gradequiv-seed="
              f"{runtime.RUN.options.seed})")

    def _writes_report(self) -> bool:
        return (not self.is_worker and runtime.RUN.options.report_dir is not None
                and self.collected)

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        if self._writes_report():
            self.write_report(complete=exitstatus in (0, 1))

    def write_report(self, *, complete: bool) -> None:
        """report.json, assembled by its one author from what this run gathered."""
        from gradequiv.harness.reports.files import REPORT_FILE, write_json_atomic
        from gradequiv.harness.reports.report import assemble_check_report

        started = time.monotonic()
        run = runtime.RUN
        impl = run.used
        if impl is None:
            impl = run.implementation() if run.options.impl else None
        report = assemble_check_report(
            options=run.options, impl=impl, device=run.device(),
            records=list(self.records.values()), outcomes=self.outcomes,
            failures=self.failures, complete=complete, run=run.identity,
            not_applicable=self.not_applicable)
        if run.pinned:
            from gradequiv.harness.engine.global_state import pinned_lines

            report["conditions"]["set_to_torch_defaults"] = pinned_lines(run.pinned)
        assert run.options.report_dir is not None
        write_json_atomic(run.options.report_dir / REPORT_FILE, report)
        self.written_at = time.monotonic()
        self.write_cost = self.written_at - started


def _skip_reason(report: Any) -> str:
    """The reason a skipped test's report gives (pytest keeps it as (path, line, reason))."""
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 \
        else str(longrepr)

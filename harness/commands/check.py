"""``gradequiv check`` in the process that runs the implementation: validate the run's
options, resolve the implementation, run the suite.

Every mistake that can be found before the first case is found here and is a
usage error (exit 2). The suite then runs under pytest in this process,
handed the options object and the resolved implementation as a
:class:`~gradequiv.harness.options.SuiteRun` plugin object;
pytest's own command line only carries pytest's options. By default this is
a child process that :mod:`.supervise` watches (``observer`` tells it what
runs); with ``--in-process``, the user's own.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from gradequiv.harness.errors import (
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_PASS,
    EXIT_USAGE,
    InvalidArgument,
)
from gradequiv.harness.options import CheckOptions, SuiteRun


def run(options: CheckOptions, *, observer: Any = None) -> int:
    """The check command: exit 0 pass, 1 fail, 2 usage error, 130 interrupted.

    ``observer`` (a ``properties.runtime.RunObserver``) is the supervisor's channel;
    without one this process owns the report folder and locks it itself.
    """
    with torch_threads(options.threads):  # before anything runs, the user's model included
        return _run(options, observer)


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads at ``count`` (None: left as they are) for a run, then back.

    Set once, before the first case: each case snapshots torch's switches, the
    thread count among them, and holds every path to that snapshot.
    """
    import torch

    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if count is not None:
            torch.set_num_threads(before)


def _run(options: CheckOptions, observer: Any) -> int:
    # torch is imported here, not at module import, so --help and usage errors stay fast.
    from gradequiv.harness.engine.bindings import fingerprint
    from gradequiv.harness.engine.compare import Tolerance
    from gradequiv.harness.engine.devices import resolve_device
    from gradequiv.harness.engine.spread import load_case
    from gradequiv.harness.engine.verify import check_runnable
    from gradequiv.harness.implementations.libraries import TOGGLES_NEEDING_MODEL
    from gradequiv.harness.implementations.resolve import resolve
    from gradequiv.models.kinds import EXTERNAL

    if options.impl is None:
        raise InvalidArgument("--impl is required; name a built-in (e.g. --impl torch) or a "
                              "'module:attr' reference")
    bound = fingerprint()  # before the implementation's code first runs: its import
    impl = resolve(options.impl, adapter=options.adapter, kwargs=options.kwargs)
    device = resolve_device(options.device)
    options = replace(options, device=device.type)
    case = None
    if options.case is not None:
        case = load_case(options.case)
        _refuse_model_mismatch(options, case)
        refuse_too_large(case, said=f"--case={_short(options.case)}")
        try:
            check_runnable(case, device)
        except (MemoryError, RuntimeError) as exc:
            if not isinstance(exc, MemoryError) and "allocate" not in str(exc):
                raise
            raise InvalidArgument(
                f"--case={_short(options.case)}: its model could not be built on this "
                f"machine ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); pick "
                f"smaller sizes") from exc
        Tolerance(case.dtype, options.rtol, options.atol)
        declined = impl.declines(case.grad_mode, case.features())
        if declined:
            raise InvalidArgument(
                f"--case={options.case!r}: {declined}, so the case would check nothing; "
                f"pick another case")
    if options.model is not None:
        check_model(options.model)
    elif impl.spec in TOGGLES_NEEDING_MODEL and (case is None or
                                                 case.model_kind != EXTERNAL):
        raise InvalidArgument(TOGGLES_NEEDING_MODEL[impl.spec])
    _refuse_failed_imports(impl, options, case, device)
    if case is None:
        _refuse_empty_regime(options, impl)
    Tolerance("fp32", options.rtol, options.atol)
    with contextlib.ExitStack() as stack:
        if options.report_dir is not None:
            _claim(stack, options, observer)
        code = _run_suite(options, impl, device, observer)
        replaced = bound.replaced()
        if replaced:
            code = _refuse_tampered(options.report_dir, replaced)
        if options.report_dir is not None:
            from gradequiv.harness.commands.render import write_views

            write_views(options.report_dir)  # users look for report.md, .html beside .json
        return code


def _refuse_tampered(report_dir: Path | None, replaced: list[str]) -> int:
    """A run whose process had what the comparison calls replaced is no pass, whatever it
    found: say so, and make report.json's failure say it too."""
    from gradequiv.harness.engine.bindings import said

    message = said(replaced)
    print(f"gradequiv: FAIL: {message}", file=sys.stderr, flush=True)
    if report_dir is not None:
        import json

        from gradequiv.harness.reports.files import REPORT_FILE, write_json_atomic
        from gradequiv.harness.reports.report import process_ended_report

        path = report_dir / REPORT_FILE
        with contextlib.suppress(OSError, ValueError):
            last = json.loads(path.read_text(encoding="utf-8"))
            ended = process_ended_report(last, [], message=message, during=None)
            write_json_atomic(path, ended)
    return EXIT_FAIL


def _claim(stack: contextlib.ExitStack, options: CheckOptions, observer: Any) -> None:
    """The report folder made this run's, once every argument is valid. A supervisor
    (``observer``) holds its lock and claimed it already, setting the earlier run's files
    aside for a usage error to put back: now they go."""
    from gradequiv.harness.reports.files import (
        claim_report_dir,
        discard_set_aside,
        lock_report_dir,
        run_identity,
    )

    assert options.report_dir is not None
    if observer is not None:
        discard_set_aside(options.report_dir)
        return
    stack.enter_context(lock_report_dir(options.report_dir, run_identity()))
    claim_report_dir(options.report_dir)


def _refuse_empty_regime(options: CheckOptions, impl: Any) -> None:
    """A stated training regime that leaves nothing to draw is the caller's mistake, said
    before the suite starts (exit 2), not a suite that breaks off collecting."""
    options.regime.modes_within(impl.grad_modes)
    if options.model is not None:
        from gradequiv.models.external import declared_regimes

        options.regime.dtypes_within(declared_regimes(options.model), options.model)


def _short(text: str, limit: int = 80) -> str:
    """A --case value for a message: its repr, cut to ``limit`` characters."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[:limit - 4] + "...'"


def _refuse_model_mismatch(options: CheckOptions, case: Any) -> None:
    """--model with a case of another model would check that model and drop --model."""
    from gradequiv.models.kinds import EXTERNAL

    if options.model is None:
        return
    if case.model_kind != EXTERNAL:
        raise InvalidArgument(
            f"--case={_short(options.case or '')} is a case of the {case.model_kind} model, "
            f"so --model={options.model!r} would not be checked; drop --case to check your "
            f"model, or drop --model to replay the case")
    if case.model.factory != options.model:
        raise InvalidArgument(
            f"--case={_short(options.case or '')} is a case of the model "
            f"{case.model.factory!r}, not of --model={options.model!r}; drop --model (the case "
            f"names its model) or pass the case of that model")


#: The most elements a replayed case's model may hold (its parameters) or a forward make
#: (its activations): 2**28, a gigabyte in fp32 before the copies a case keeps.
MAX_CASE_ELEMENTS = 2**28


def refuse_too_large(case: Any, *, said: str) -> None:
    """A case too large to build is a usage error (exit 2) before it is built; ``said``
    names where its sizes came from (``--case='...'``, profile's size options)."""
    from gradequiv.models import BatchNormConfig, TransformerConfig

    config, batch = case.model, case.batch
    tokens = batch.batch_size * batch.seq_len
    if isinstance(config, TransformerConfig):
        width, layers = config.n_embd, config.n_layer
        params = ((config.vocab_size + config.max_seq_len) * width
                  + layers * (4 + 2 * config.ffn_mult) * width * width)
        activations = layers * (tokens * width * (8 + 2 * config.ffn_mult)
                                + batch.batch_size * config.n_head * batch.seq_len ** 2)
        sizes = f"n_layer={layers}, n_embd={width}, vocab_size={config.vocab_size}"
    elif isinstance(config, BatchNormConfig):
        params = config.n_layer * config.width * config.width
        activations = config.n_layer * tokens * config.width * 4
        sizes = f"n_layer={config.n_layer}, width={config.width}"
    else:  # a user's model: its factory decides, and check_model reports its failures
        return
    sizes += f", batch_size={batch.batch_size}, seq_len={batch.seq_len}"
    for what, count in (("parameters", params), ("activation elements", activations)):
        if count > MAX_CASE_ELEMENTS:
            raise InvalidArgument(
                f"{said}: its model would hold about {count:.3g} {what} "
                f"({sizes}), more than the {MAX_CASE_ELEMENTS:.3g} a case may; pick "
                f"smaller sizes")


def _run_suite(options: CheckOptions, impl: Any, device: Any, observer: Any) -> int:
    """The suite under pytest, after a header line; pytest's code as the command's."""
    import torch

    shard = "" if options.shard == (1, 1) else f", shard {options.shard[0]}/{options.shard[1]}"
    count = torch.get_num_threads()
    threads = f"{count} thread{'s' if count != 1 else ''} (--threads {options.threads or 'auto'})"
    print(f"gradequiv check: {impl.spec} ({impl.adapter}) on {device}, torch "
          f"{torch.__version__}, {threads}{shard}", flush=True)
    if options.regime.stated:
        print(f"gradequiv check: {options.regime.describe()}", flush=True)
    # Failures are printed once, by the plugin's summary, not again by pytest's tracebacks
    # and short summary (which would name the suite's temporary folder).
    from gradequiv.harness.reports.files import take_write_failure

    take_write_failure()  # an earlier run's in this process is not this one's
    code = run_suite(SuiteRun(options, impl, observer), ["-q", "--tb=no", "-rN"])
    failed_write = take_write_failure()
    if failed_write is not None:  # met inside pytest: its error or a case's, not the verdict
        raise failed_write
    if code == 2:
        print("gradequiv: interrupted; the report keeps what finished, marked incomplete",
              file=sys.stderr)
    if code == 3:  # pytest's internal error: the run broke off, so no verdict and no pass
        print("gradequiv: FAIL: the suite broke off on an internal error (above) before its "
              "verdict; the report keeps what finished, marked incomplete", file=sys.stderr)
    return {0: EXIT_PASS, 1: EXIT_FAIL, 2: EXIT_INTERRUPTED, 3: EXIT_FAIL}.get(code, EXIT_USAGE)


def _refuse_failed_imports(impl: Any, options: CheckOptions, case: Any, device: Any) -> None:
    """An implementation that cannot import what it needs when applied (a toggle importing
    its library in its body) is exit 2, whatever the adapter, not a raise in every case."""
    from gradequiv.harness.engine.case import Case
    from gradequiv.harness.engine.probe import import_problem
    from gradequiv.models import ExternalConfig

    if impl.compiled is not None:  # compiling a probe costs more than the cases' first raise
        return
    if case is None:
        case = Case(model=ExternalConfig(options.model)) if options.model else Case()
    problem = import_problem(impl, case, device)
    if problem is not None:
        raise InvalidArgument(problem)


def check_model(spec: str) -> None:
    """Build the user's model, then twice more to compare: a factory that cannot build, or
    builds differently from one seed (a noise floor that would fail or hide recompute's
    errors), is exit 2, not 30 failures."""
    from gradequiv.models import BatchConfig, ExternalConfig, build
    from gradequiv.models.external import reproducibility_problem

    try:
        build(ExternalConfig(spec), BatchConfig(), 0, "cpu")
        problem = reproducibility_problem(ExternalConfig(spec), seed=0)
        if problem is not None:
            raise InvalidArgument(problem)
    except InvalidArgument:
        raise
    except Exception as exc:
        raise InvalidArgument(f"--model={spec!r}: the factory raised {type(exc).__name__}: "
                              f"{exc}") from exc
    problem = full_storage_problem(spec)
    if problem is not None:
        raise InvalidArgument(problem)


def full_storage_problem(spec: str) -> str | None:
    """One training step of the user's model on full storage (no recompute, fp32, CPU):
    what makes it no model to check (None: nothing). A loss that is no tensor, a loss_fn
    that cannot take the model's outputs, a loss or gradients that are NaN or inf (nothing
    could be compared: NaN equals nothing) are the factory's, said before any case."""
    import torch

    from gradequiv.models import ExternalConfig
    from gradequiv.models.external import seeded_user_model

    built = seeded_user_model(ExternalConfig(spec), 0)
    name = f"--model={spec!r}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            outputs = built.model(*built.positional, **built.keywords)
        except Exception as exc:
            return (f"{name}: its model raised in a forward on its own inputs, without "
                    f"recompute: {type(exc).__name__}: {exc}; fix the model or its inputs")
        try:
            loss = built.loss_fn(outputs, built.targets)
        except Exception as exc:
            return (f"{name}: its loss_fn raised on the model's outputs ({_shape(outputs)}), "
                    f"without recompute: {type(exc).__name__}: {exc}; make loss_fn take "
                    f"what the model returns")
        if not isinstance(loss, torch.Tensor):
            return (f"{name}: its loss_fn returned {type(loss).__name__} {loss!r:.60}, not a "
                    f"tensor; return the loss as a 0-dim tensor (e.g. F.cross_entropy(...), "
                    f"not float(...) or .item())")
        if loss.numel() != 1 or not loss.requires_grad:
            why = "needs no gradient" if loss.numel() == 1 else f"has shape {list(loss.shape)}"
            return (f"{name}: its loss_fn returned a tensor that {why}; return one number "
                    f"that backward can start from (a mean or sum of the model's outputs)")
        if not torch.isfinite(loss.detach()).all():
            return (f"{name}: its loss is {loss.item()} on full storage, without recompute: "
                    f"nothing could be compared (NaN equals nothing); fix the model or its "
                    f"inputs so that one training step gives a finite loss")
        try:
            loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch
        except Exception as exc:
            return (f"{name}: backward from its loss raised, without recompute: "
                    f"{type(exc).__name__}: {exc}; fix the model")
    grads = [(n, p.grad) for n, p in built.model.named_parameters() if p.grad is not None]
    if grads and not any(bool(torch.isfinite(g).any()) for _, g in grads):
        first, grad = grads[0]
        return (f"{name}: every gradient is non-finite on full storage, without recompute "
                f"(grad of {first} holds {grad.reshape(-1)[0].item()}): nothing could be "
                f"compared; fix the model or its inputs")
    return None


def _shape(value: Any) -> str:
    """What a model returned, in a few words: a tensor's dtype and shape, else its type."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    return type(value).__name__


#: The plugins the suite's pytest session loads, and no other installed one: its own, and
#: Hypothesis's.
SUITE_PLUGINS = ("gradequiv.properties.plugin", "_hypothesis_pytestplugin")
#: What pytest reads from the environment to change any session: options added to every
#: run, and plugins to load.
CALLERS_PYTEST = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")


def run_suite(suite_run: SuiteRun, pytest_args: list[str]) -> int:
    """pytest.main on the property suite, blind to the current folder's pytest configuration.

    The caller's addopts, filterwarnings or plugins must not change a verdict;
    an empty ini file in a temporary folder stands in for theirs, and no conftest.py is
    loaded: pytest would otherwise import the current folder's and its ``test*`` folders'
    (the suite is named as a package, so the folder it starts from is the anchor), whose
    code can change what is verified (a default dtype set) or end the check (an import
    that fails). Nor does the session read the caller's ``PYTEST_ADDOPTS`` or
    ``PYTEST_PLUGINS``, or load the plugins installed beside it (``SUITE_PLUGINS`` only):
    a CI's ``-k`` or ``--collect-only`` verified a part or nothing and still said pass, and
    a plugin that shuffles tests breaks the order the search relies on.
    """
    import pytest

    # Without pytest's unraisable- and thread-exception plugins: at the end of a session
    # they collect garbage several times over (about 0.4 s of every check), to turn
    # exceptions no verdict reads into warnings.
    args = ["--pyargs", "gradequiv.properties", "--noconftest", "-p", "no:cacheprovider",
            "-p", "no:unraisableexception", "-p", "no:threadexception",
            "-W", "ignore::pytest.PytestAssertRewriteWarning", *pytest_args]
    for plugin in SUITE_PLUGINS:
        args += ["-p", plugin]
    with torch_threads(suite_run.options.threads), _suite_environment(), \
            tempfile.TemporaryDirectory(prefix="gradequiv-") as folder:
        ini = Path(folder) / "pytest.ini"
        ini.write_text("[pytest]\n", encoding="utf-8")
        return int(pytest.main(["-c", str(ini), f"--rootdir={folder}", *args],
                               plugins=[suite_run]))


@contextlib.contextmanager
def _suite_environment() -> Iterator[None]:
    """The process's environment as the suite's pytest session must see it (no caller's
    options or plugins, no plugin autoloading), put back as it was afterwards."""
    saved = {name: os.environ.get(name) for name in (*CALLERS_PYTEST,
                                                     "PYTEST_DISABLE_PLUGIN_AUTOLOAD")}
    for name in CALLERS_PYTEST:
        os.environ.pop(name, None)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

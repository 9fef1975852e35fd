"""``check(impl, model=...)``: the command line's ``check`` for a user's own test suite.

Python objects in (a checkpoint function, a wrapper, a toggle or a SPEC
string; a model factory, a :class:`~gradequiv.models.UserModel` or a SPEC
string), a :class:`Report` out, with the same verdict, diagnosis and files
as ``gradequiv check``. The options are validated once, by
:func:`~gradequiv.harness.options.check_options`, before anything runs.

By default the run is ``gradequiv check`` in a child process, so a hang, a
crash or an ``os._exit`` in the implementation cannot take the caller's test
suite with it. A child can only import what has a name: an object defined at
the top of an importable module goes by its ``module:attr``; any other (a
lambda, a closure, something defined in ``__main__``) runs in this process,
without a timeout, and the report says so.

No torch at import: this module loads on first use of ``gradequiv.harness.check``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradequiv.harness.errors import (
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_PASS,
    EXIT_USAGE,
    InvalidArgument,
)
from gradequiv.harness.options import ADAPTERS, CheckOptions, check_options

__all__ = ["Failure", "Report", "assert_equivalent", "check"]

#: seconds without progress (no case started or finished) after which a run fails, as
#: ``gradequiv check --case-timeout``'s default
DEFAULT_TIMEOUT_S = 600.0

#: the words that begin a localisation which found the op (``localise.Localisation``)
DIVERGING_OP_LABEL = "first diverging op: "

#: objects that could not go to a child by name, reachable here by a reference of their own
#: (``gradequiv.harness.api:given.impl_1``) for a run in this process
given = types.SimpleNamespace()
_numbers = itertools.count(1)


@dataclass(frozen=True)
class Failure:
    """One minimal failure: the case, what failed, why, and the command that replays it."""

    description: str  # the case in words: layers x width x tokens, granularity, dtype, ...
    properties: tuple[str, ...]  # which properties fail on it
    message: str  # the headline mismatch (which tensor, by how much, against which bound)
    cause: str | None  # the likely cause in one sentence (None: no diagnosis)
    #: where the re-run first differs from its forward, without the label (None: not found)
    first_diverging_op: str | None
    reproduce: str  # one command that replays exactly this case
    data: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    def __str__(self) -> str:
        lines = [f"{self.description}: fails {', '.join(self.properties)}"]
        if self.cause:
            lines.append(f"    cause: {self.cause}")
        lines.append(f"    {self.message}")
        if self.first_diverging_op:
            lines.append(f"    {DIVERGING_OP_LABEL}{self.first_diverging_op}")
        elif self.data.get("localisation"):  # why no op was found
            lines.append(f"    {self.data['localisation']}")
        lines.append(f"    reproduce: {self.reproduce}")
        return "\n".join(lines)


@dataclass
class Report:
    """What one :func:`check` found: ``passed``, the diagnosis, report.json as ``data``.

    ``str(report)`` reads as the end of ``gradequiv check``'s output (the likely
    cause, each minimal failure with its cause, first diverging op and
    reproduce command, the verdict); :meth:`write` puts the files ``check
    --report-dir`` writes into a folder.
    """

    exit_code: int  # gradequiv check's: 0 pass, 1 fail (130 is raised as KeyboardInterrupt)
    data: dict[str, Any]  # report.json
    output: str  # what the run printed (gradequiv check's terminal output)
    in_process: bool  # True: ran in this process (no child, no timeout); ``notes`` says why
    notes: tuple[str, ...] = ()
    folder: Path | None = None  # where the run's files are (None: a temporary one, gone)
    _keep: Path | None = field(default=None, repr=False)  # the temporary folder, if any

    @property
    def passed(self) -> bool:
        return self.exit_code == EXIT_PASS and self.data.get("verdict") == "pass"

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "fail"

    @property
    def failures(self) -> list[Failure]:
        """The minimal failures, one per failing case, drawn ones first."""
        seen: dict[str, Failure] = {}
        for item in self.data.get("minimal_failures") or []:
            key = item.get("reproduce", "")
            known = seen.get(key)
            if known is not None:
                props = (*known.properties, item["property"])
                seen[key] = Failure(**{**known.__dict__, "properties": tuple(dict.fromkeys(
                    props))})
                continue
            diagnosis = item.get("diagnosis") or {}
            seen[key] = Failure(
                description=item.get("description", ""),
                properties=(item.get("property", ""),),
                message=item.get("message", ""),
                cause=diagnosis.get("sentence"),
                first_diverging_op=_diverging_op(item.get("localisation")),
                # the short line reads the case file, which a temporary folder does not keep
                reproduce=(item.get("reproduce_file") if self.folder is not None else None)
                or key,
                data=item)
        return list(seen.values())

    @property
    def likely_cause(self) -> str | None:
        """The likely cause of the first fault in one sentence (None: the run passed, or
        failed without one, e.g. the process ended: see ``str(report)``)."""
        faults = self.data.get("faults") or []
        if faults:
            return str(faults[0].get("sentence"))
        return next((f.cause for f in self.failures if f.cause), None)

    @property
    def reproduce(self) -> str | None:
        """The command that replays the first minimal failure (None: nothing failed)."""
        failures = self.failures
        return failures[0].reproduce if failures else None

    def __str__(self) -> str:
        from gradequiv.harness.reports.terminal import headline_lines, summary_lines
        from gradequiv.harness.reports.text import bounded, printable

        impl = self.data.get("implementation") or {}
        lines = [f"gradequiv check: {impl.get('spec', '?')} ({impl.get('adapter', '?')}): "
                 f"{'pass' if self.passed else 'FAIL'}"]
        lines += [f"note: {note}" for note in self.notes]
        ended = self.data.get("failure") if self.data.get("complete") is False else None
        if ended:
            message = ended.get("message", ended) if isinstance(ended, dict) else ended
            lines.append(f"the run did not finish: {printable(bounded(str(message)))}")
        failures = [dict(f, test=f.get("test", "")) for f in
                    self.data.get("minimal_failures") or []]
        if self.folder is None:  # the case files went with the temporary folder
            failures = [{k: v for k, v in f.items() if k != "reproduce_file"}
                        for f in failures]
        lines += headline_lines(failures)
        lines += summary_lines(failures, {})
        if not self.passed and not failures and not ended:
            lines += [printable(bounded(line)) for line in
                      self.output.strip().splitlines()[-5:]]
        lines.append(f"verdict: {'pass' if self.passed else 'FAIL'}")
        return "\n".join(lines)

    def write(self, folder: str | os.PathLike[str]) -> Path:
        """Write report.json, report.md, report.html, junit.xml and the failures' case files
        (``cases/minimal-N.json``) into ``folder``; returns it."""
        from gradequiv.harness.commands.render import FORMATS, render
        from gradequiv.harness.reports.bundle import load_bundle
        from gradequiv.harness.reports.files import CASES_DIR, REPORT_FILE, write_text_atomic

        target = Path(folder)
        target.mkdir(parents=True, exist_ok=True)
        source = self.folder or self._keep
        if source is not None and (source / CASES_DIR).is_dir() and source != target:
            shutil.copytree(source / CASES_DIR, target / CASES_DIR, dirs_exist_ok=True)
        write_text_atomic(target / REPORT_FILE, json.dumps(self.data, indent=1))
        bundle = load_bundle(target)
        for name, filename in FORMATS.items():
            write_text_atomic(target / filename, render(name, bundle))
        return target


def _diverging_op(localisation: str | None) -> str | None:
    """The op a localisation names, its label left to whoever shows it under one."""
    if not localisation or not localisation.startswith(DIVERGING_OP_LABEL):
        return None
    return localisation.removeprefix(DIVERGING_OP_LABEL)


def check(
    impl: Any,
    *,
    model: Any = None,
    adapter: str | None = None,
    impl_kwargs: Mapping[str, Any] | None = None,
    examples: int | None = None,
    seed: int = 0,
    profile: str = "ci",
    case: Any = None,
    device: str = "auto",
    rtol: float | None = None,
    atol: float | None = None,
    shrink: bool = True,
    threads: int | None = 1,
    report_dir: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    in_process: bool | None = None,
    regime: Mapping[str, Any] | None = None,
) -> Report:
    """Check ``impl`` against full storage, as ``gradequiv check`` does; return the report.

    ``impl``: a SPEC string (``"torch"``, ``"pkg.mod:attr"``) or the object itself (a
    function called as ``impl(function, *args, **kwargs)``, or with ``adapter="wrapper"``
    or ``"toggle"`` a wrapper or a toggle). Its ``gradequiv_unsupported`` and
    ``gradequiv_supports`` declarations are read exactly as ``check`` reads them.
    ``model``: None (the reference transformer), a factory ``seed -> UserModel``, a
    :class:`~gradequiv.models.UserModel` (copied for every build), or a SPEC string.
    ``case``: one case to replay (a named case, its JSON, a dict or a ``Case``).
    ``examples``, ``seed``, ``profile`` (default ``"ci"``, as ``check``), ``device``,
    ``rtol``/``atol``, ``shrink``, ``threads``: as ``check``'s options. ``regime``: what
    your training runs, keys as in ``[tool.gradequiv]`` (``{"dtypes": ["bf16-autocast"],
    "loss-parts": 1}``), on top of that table; only it is drawn.
    ``report_dir``: where the files go (default: a temporary folder; :meth:`Report.write`
    copies them later). ``timeout``: seconds without progress before the run fails
    (default 600; 0 for none); it needs the child process, so an object that must run in
    this process with a timeout is an error. ``in_process``: None (a child where the
    objects can go there), True (this process: for a debugger), False (a child, or an
    error saying why not).

    A caller's mistake raises :class:`~gradequiv.harness.errors.InvalidArgument` (the
    command line's exit 2); an interrupted run raises KeyboardInterrupt (exit 130).
    """
    notes: list[str] = []
    impl_spec, impl_named = _spec("impl", impl, notes)
    model_spec, model_named = (None, True) if model is None else _model_spec(model, notes)
    kwargs_given = [f"{k}={v!r}" for k, v in (impl_kwargs or {}).items()]
    options = check_options(
        flag=lambda name: name.replace("-", "_"), impl=impl_spec, impl_kwargs=kwargs_given,
        adapter=adapter, seed=seed, examples=examples, profile=profile, device=device,
        report_dir=report_dir, case=_case_text(case), rtol=rtol, atol=atol, shrink=shrink,
        model=model_spec, threads=threads, regime=regime)
    if adapter is not None and adapter not in ADAPTERS:  # check_options has said so already
        raise InvalidArgument(f"adapter={adapter!r} is not one of {', '.join(ADAPTERS)}")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
        raise InvalidArgument(f"timeout={timeout!r} is not a number of seconds >= 0; pass "
                              f"e.g. timeout=600, or 0 for no limit")
    named = impl_named and model_named
    if in_process is False and not named:
        raise InvalidArgument(
            f"in_process=False: {' '.join(notes)}; define it at the top of an importable "
            f"module, or drop in_process=False")
    here = bool(in_process) or not named
    if here and timeout:
        raise InvalidArgument(
            f"timeout={timeout!r} needs a child process, and this run is in this process "
            f"({' '.join(notes) or 'in_process=True'}); define the objects at the top of "
            f"an importable module, or drop timeout")
    if in_process:
        notes.append("ran in this process (in_process=True): no child, no timeout")
    temporary = options.report_dir is None
    if temporary:
        made = tempfile.mkdtemp(prefix="gradequiv-check-")
        options = check_options(**{**_raw(options), "report_dir": made})
    folder = options.report_dir
    assert folder is not None
    try:
        if here:
            code, output = _in_this_process(options)
        else:
            code, output = _in_child(options, DEFAULT_TIMEOUT_S if timeout is None else timeout)
        data = _read_report(folder)
    except BaseException:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if code in (EXIT_USAGE, EXIT_INTERRUPTED) and temporary:
        shutil.rmtree(folder, ignore_errors=True)
    if code == EXIT_USAGE:
        raise InvalidArgument(_usage_line(output))
    if code == EXIT_INTERRUPTED:
        raise KeyboardInterrupt(f"gradequiv check was interrupted: {_usage_line(output)}")
    report = Report(exit_code=code if code in (EXIT_PASS, EXIT_FAIL) else EXIT_FAIL,
                    data=data, output=output, in_process=here, notes=tuple(notes),
                    folder=None if temporary else folder,
                    _keep=folder if temporary else None)
    if temporary:  # the case files live as long as the report (write() copies them)
        weakref.finalize(report, shutil.rmtree, str(folder), True)
    return report


def assert_equivalent(impl: Any, **options: Any) -> Report:
    """:func:`check`, failing the caller's test with the diagnosis as its message (the
    likely cause, each minimal failure with its first diverging op and reproduce command);
    returns the report when every property held."""
    __tracebackhide__ = True
    report = check(impl, **options)
    if not report.passed:
        raise AssertionError(str(report))
    return report


def _spec(name: str, obj: Any, notes: list[str]) -> tuple[str, bool]:
    """``obj`` as a SPEC, and whether a child can resolve it (False: registered here)."""
    if isinstance(obj, str):
        return obj, True
    if not callable(obj):
        raise InvalidArgument(
            f"{name}={obj!r} is a {type(obj).__name__}, not a callable nor a SPEC string; pass "
            f"the checkpoint function itself, or a name such as 'torch' or 'pkg.mod:attr'")
    reference = _reference(obj)
    if reference is not None:
        return reference, True
    return _register(name, obj, notes), False


def _model_spec(model: Any, notes: list[str]) -> tuple[str, bool]:
    from gradequiv.models import UserModel

    if isinstance(model, UserModel):
        built = model

        def factory(seed: int) -> UserModel:
            return copy.deepcopy(built)  # every build its own tensors, the same values

        factory.gradequiv_regimes = getattr(model, "regimes", None)  # type: ignore[attr-defined]
        return _register("model", factory, notes, shown="a UserModel instance"), False
    return _spec("model", model, notes)


def _reference(obj: Any) -> str | None:
    """``module:qualname`` when that names ``obj`` from a fresh process, else None."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    reference = f"{module}:{qualname}"
    try:
        found = pkgutil.resolve_name(reference)
    except Exception:
        return None
    return reference if found is obj else None


def _register(name: str, obj: Any, notes: list[str], shown: str | None = None) -> str:
    attr = f"{name}_{next(_numbers)}"
    setattr(given, attr, obj)
    what = shown or f"{getattr(obj, '__qualname__', type(obj).__name__)} (from " \
                    f"{getattr(obj, '__module__', '?')})"
    notes.append(f"ran in this process: {name}={what} has no importable module:attr for a "
                 f"child process to load, so there is no timeout and its reproduce lines "
                 f"name gradequiv.harness.api:given.{attr}, which only this process has")
    return f"{__name__}:given.{attr}"


def _case_text(case: Any) -> str | None:
    if case is None or isinstance(case, str):
        return case
    if isinstance(case, Mapping):
        return json.dumps(dict(case), sort_keys=True)
    to_json = getattr(case, "to_json", None)
    if callable(to_json):
        return str(to_json())
    raise InvalidArgument(f"case={case!r} is a {type(case).__name__}; pass a named case, its "
                          f"JSON, a dict or a gradequiv.harness.Case")


def _raw(options: CheckOptions) -> dict[str, Any]:
    """The options as check_options takes them (to change one field and validate again)."""
    data = json.loads(options.to_json())
    return {k: v for k, v in data.items() if k != "kwargs"}


def _argv(options: CheckOptions, timeout: float) -> list[str]:
    """``gradequiv check``'s arguments for these (validated) options."""
    argv = ["check", "--impl", str(options.impl), "--seed", str(options.seed),
            "--profile", options.profile, "--device", options.device,
            "--threads", "auto" if options.threads is None else str(options.threads),
            "--case-timeout", str(int(timeout) if float(timeout).is_integer() else timeout)]
    pairs = {"--adapter": options.adapter, "--examples": options.examples,
             "--case": options.case, "--rtol": options.rtol, "--atol": options.atol,
             "--model": options.model, "--report-dir": options.report_dir}
    for flag, value in pairs.items():
        if value is not None:
            argv += [flag, str(value)]
    for item in options.impl_kwargs:
        argv += ["--impl-kwarg", item]
    for item in options.regime.entries():  # the child reads the same pyproject.toml first
        argv += ["--regime", item]
    if not options.shrink:
        argv.append("--no-shrink")
    return argv


def _in_child(options: CheckOptions, timeout: float) -> tuple[int, str]:
    """``gradequiv check`` as a command (its supervisor, its child): exit code and output."""
    env = dict(os.environ)
    path = [p for p in sys.path if p and Path(p).exists()]
    env["PYTHONPATH"] = os.pathsep.join(p for p in [*path, env.get("PYTHONPATH")] if p)
    done = subprocess.run([sys.executable, "-m", "gradequiv.harness", *_argv(options, timeout)],
                          env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace", check=False)
    return done.returncode, done.stdout


def _in_this_process(options: CheckOptions) -> tuple[int, str]:
    """``check.run`` here, its output captured (Python's streams and fds 1 and 2)."""
    from gradequiv.harness.commands import check as check_command

    buffer = io.StringIO()
    with _captured_fds() as read_fds, contextlib.redirect_stdout(buffer), \
            contextlib.redirect_stderr(buffer):
        try:
            code = check_command.run(options)
        except InvalidArgument as exc:
            print(f"gradequiv: error: {exc}", file=buffer)
            code = EXIT_USAGE
        except KeyboardInterrupt:
            code = EXIT_INTERRUPTED
    return code, read_fds() + buffer.getvalue()


@contextlib.contextmanager
def _captured_fds() -> Iterator[Callable[[], str]]:
    """fds 1 and 2 into a temporary file for the block; yields a reader of what came."""
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = []
        for fd in (1, 2):
            try:
                saved.append((fd, os.dup(fd)))
            except OSError:  # no such fd (a daemon): nothing to capture there
                continue
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, _ in saved:
            os.dup2(sink.fileno(), fd)
        text: list[str] = []
        try:
            yield lambda: "".join(text)
        finally:
            for stream in (sys.__stdout__, sys.__stderr__):
                with contextlib.suppress(Exception):
                    stream.flush()  # type: ignore[union-attr]
            for fd, copy_fd in saved:
                os.dup2(copy_fd, fd)
                os.close(copy_fd)
            sink.seek(0)
            text.append(sink.read().decode("utf-8", errors="replace"))


def _read_report(folder: Path) -> dict[str, Any]:
    from gradequiv.harness.reports.files import REPORT_FILE

    try:
        data = json.loads((folder / REPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _usage_line(output: str) -> str:
    """The line a usage error (or an interruption) was told in, without its prefix."""
    for line in reversed(output.strip().splitlines()):
        for prefix in ("gradequiv: error: ", "gradequiv: interrupted: ", "gradequiv: "):
            if line.startswith(prefix):
                return line.removeprefix(prefix)
    return output.strip().splitlines()[-1] if output.strip() else "no output"

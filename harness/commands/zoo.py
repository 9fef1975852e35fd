"""``gradequiv zoo``: every architecture a library exports, checked through its own toggle.

For ``--library transformers``: every class transformers exports whose name ends in a head
the ``hf:NAME`` route takes a loss from, and that sets ``supports_gradient_checkpointing``,
is built tiny by that route and checked by ``--impl hf`` four ways (non-reentrant and
reentrant, each in fp32 and under bf16 autocast), one case each. The rows go to a Markdown
table (and JSON) that names the command that made it; ``--check FILE`` re-runs the rows
of such a table and exits 1 where a verdict moved.

The checks run in one child process (multiprocessing, spawn) that takes one architecture
at a time: importing torch and transformers, once and not per architecture, is most of
what a row costs. An architecture that gives no answer within ``--seconds-per-arch`` (a
hang) or takes the child down (a crash) is a row that says so, and a fresh child takes the
next. (``check``'s supervisor, :mod:`.supervise`, watches one whole suite run per child:
the start-up, paid four times per architecture, would be most of the sweep.)
"""

from __future__ import annotations

import contextlib
import fnmatch
import multiprocessing
import os
import platform
import re
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from gradequiv.harness import validate
from gradequiv.harness.errors import EXIT_FAIL, EXIT_PASS, InvalidArgument, exception_line
from gradequiv.harness.reports.zoo_table import (
    CANNOT_BUILD,
    CHECKED,
    CONFIGS,
    CRASHED,
    DEFAULT_OUT,
    ERROR,
    FAIL,
    NOT_APPLICABLE,
    PASS,
    SEED,
    TIMED_OUT,
    duration,
    markdown,
    one_line,
    outcome,
    plural,
    read_verdicts,
    verdicts,
)

__all__ = ["architectures", "check_architecture", "run", "sweep"]

_REFUSED = {
    "timm": "the sweep does not list timm's models yet: check them one by one with "
            "--model timm:NAME (vit_tiny_patch16_224, deit_tiny_patch16_224, convnext_atto, "
            "resnet18)",
    "diffusers": "the sweep does not list or build diffusers' models yet",
}
SECONDS_PER_ARCH = 120
#: seconds a fresh child may take to import torch and the library before it takes a row
STARTUP_S = 300.0
#: bytes of address space the child may map: a model far past "tiny" fails to allocate
#: instead of taking the machine's memory
MEMORY_LIMIT = 6 * 2**30
#: rows a child checks before a fresh one takes over (what each imports stays bounded)
ROWS_PER_CHILD = 100

def run(args: Any) -> int:
    """The zoo command: exit 0 when every architecture built passes (``--check``: when every
    verdict is the file's), 1 otherwise, 2 for a usage error."""
    from gradequiv.harness.commands.check import torch_threads

    if args.library in _REFUSED:
        raise InvalidArgument(f"--library={args.library}: {_REFUSED[args.library]}; sweep "
                              f"--library transformers, or check one of its models with a "
                              f"factory of your own (gradequiv check --model "
                              f"package.module:attr)")
    threads = validate.threads("--threads", validate.threads_given(args.threads))
    recorded = read_verdicts(args.check) if args.check is not None else None
    with torch_threads(threads):
        return _sweep_command(args, threads, recorded)


def _sweep_command(args: Any, threads: int | None,
                   recorded: dict[str, tuple[str, ...]] | None) -> int:
    started = time.perf_counter()
    if recorded is None:
        names = architectures(args.arch)
    else:
        names = [n for n in sorted(recorded) if _matches(n, args.arch)]
        if not names:
            raise InvalidArgument(f"--arch={args.arch[0]!r} matches none of the "
                                  f"{len(recorded)} architectures in --check {args.check}")
    names = names[:args.limit] if args.limit else names
    out = args.out if args.out is not None or recorded is not None else DEFAULT_OUT
    data = _report(args, names, _conditions(), started)
    what = f"re-checking {args.check}'s" if recorded is not None else "sweeping"
    print(f"gradequiv zoo: {what} {plural(len(names), 'transformers architecture')}, "
          f"{len(CONFIGS)} checks each, {plural(data['conditions']['threads'], 'thread')}; "
          f"table: {out or 'none'}", flush=True)

    def after_each(rows: list[dict[str, Any]]) -> None:
        data.update(_summary(rows, started), rows=rows, complete=len(rows) == len(names))
        _write(data, out, args.json)

    rows = sweep(names, seconds=args.seconds_per_arch, threads=threads, after_each=after_each)
    counts = data["counts"]
    print(f"{plural(len(rows), 'architecture')}: {counts['pass']} pass, {counts['fail']} fail, "
          f"{counts['cannot build']} cannot build ({duration(data['wall_seconds'])})")
    if recorded is None:
        return EXIT_FAIL if counts["fail"] else EXIT_PASS
    moved = [f"{row['architecture']}: {column}: {was} in {args.check}, now {now}"
             for row in rows
             for column, was, now in zip(CONFIGS, recorded[row["architecture"]], verdicts(row))
             if was != now]
    for line in moved:
        print(line)
    if moved:
        print(f"gradequiv zoo: FAIL: {len(moved)} verdict(s) differ from {args.check}")
        return EXIT_FAIL
    print(f"gradequiv zoo: every verdict as in {args.check}")
    return EXIT_PASS


def _matches(name: str, patterns: Sequence[str] | None) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def architectures(patterns: Sequence[str] | None = None) -> list[str]:
    """Every class transformers exports with a head the ``hf:NAME`` route takes a loss from
    and ``supports_gradient_checkpointing``, sorted; only those matching one of
    ``patterns`` (fnmatch, case-sensitive) where given. One whose import fails is kept: its
    row says why."""
    from gradequiv.models.library import _HEADS

    transformers = _import_transformers()
    headed = [n for n in dir(transformers) if n.endswith(_HEADS)]
    chosen = [n for n in headed if _matches(n, patterns)]
    if patterns and not chosen:
        raise InvalidArgument(
            f"--arch={patterns[0]!r} matches none of the {len(headed)} transformers classes "
            f"with a head; patterns are fnmatch and case-sensitive, e.g. --arch "
            f"'*ForCausalLM' or --arch BertForMaskedLM")
    found = []
    for name in sorted(chosen):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cls = getattr(transformers, name)
        except Exception:  # the row says what the import raised
            found.append(name)
            continue
        if isinstance(cls, type) and getattr(cls, "supports_gradient_checkpointing", False):
            found.append(name)
    return found


def _import_transformers() -> Any:
    from gradequiv.models.library_import import import_library

    return import_library("transformers", "--library=transformers", "hf")


# -- one architecture, in the child ----------------------------------------------------


def check_architecture(name: str) -> dict[str, Any]:
    """``hf:NAME`` built, then checked by ``--impl hf`` each way of :data:`CONFIGS`: the
    row. What cannot be built (or whose full storage fails in every regime) is a row that
    says why."""
    from gradequiv.models import library

    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            library.transformers_model(name, SEED)  # not tiny: refused before it is built
    except Exception as exc:  # any failure to build is the row's reason
        return _row(name, CANNOT_BUILD, _build_reason(name, exc), {}, started)
    checks = {column: _check(name, items, dtype) for column, (items, dtype) in CONFIGS.items()}
    if all(c["verdict"] in (CANNOT_BUILD, NOT_APPLICABLE) for c in checks.values()):
        # nothing verified: full storage itself fails in every regime
        first = min(checks.values(), key=lambda c: c["verdict"] != CANNOT_BUILD)
        return _row(name, CANNOT_BUILD, first["sentence"], checks, started)
    return _row(name, CHECKED, "", checks, started)


def _row(name: str, status: str, reason: str, checks: dict[str, Any],
         started: float) -> dict[str, Any]:
    return {"architecture": name, "status": status, "reason": reason, "checks": checks,
            "seconds": round(time.perf_counter() - started, 2)}


def _build_reason(name: str, exc: BaseException) -> str:
    """One line: the route's own reason (its ``--model='hf:NAME':`` prefix left out), or
    the exception's."""
    text = str(exc) if isinstance(exc, InvalidArgument) else f"{type(exc).__name__}: {exc}"
    text = text.removeprefix(f"--model='hf:{name}'").lstrip(": ")
    return one_line(text)


def _check(name: str, items: tuple[str, ...], dtype: str) -> dict[str, Any]:
    """One case of ``hf:NAME`` through ``--impl hf`` with ``items`` as its ``--impl-kwarg``."""
    from gradequiv.harness.engine.case import Case
    from gradequiv.harness.engine.verify import verify
    from gradequiv.harness.implementations.resolve import resolve
    from gradequiv.models import ExternalConfig, parse_granularity

    impl = resolve("hf", kwargs=validate.impl_kwargs(items))
    case = Case(model=ExternalConfig(f"hf:{name}"), granularity=parse_granularity("layer"),
                dtype=dtype, seed=SEED)
    started = time.perf_counter()
    cell: dict[str, Any] = {"verdict": PASS, "failing": [], "cause": None, "sentence": "",
                            "first_failure": ""}
    try:
        verdict = verify(impl, case)
    except Exception as exc:  # the full-storage path's fault: the model's
        cell |= {"verdict": CANNOT_BUILD, "sentence": _full_storage_failed(exc, dtype)}
    else:
        failing = [p.name for p in verdict.properties if p.passed is False]
        if verdict.error is not None or failing:
            cause, sentence = _diagnosis(impl, case, verdict, failing)
            cell |= {"verdict": ERROR if verdict.error is not None else FAIL,
                     "failing": failing, "cause": cause, "sentence": sentence,
                     "first_failure": verdict.first_failure}
        elif all(p.passed is None for p in verdict.properties):
            said = verdict.properties[0].summary if verdict.properties else ""
            said = said.removeprefix("not applicable to this model: ").split("; declare")[0]
            cell |= {"verdict": NOT_APPLICABLE, "sentence": one_line(said)}
    cell["seconds"] = round(time.perf_counter() - started, 2)
    return cell


def _full_storage_failed(exc: Exception, dtype: str) -> str:
    """One line for a full-storage run that failed: in which regime, where, and what it
    raised (the engine's message holds the whole traceback)."""
    text = str(exc)
    where = re.search(r"failed at (.*?); this is", text)
    if where is not None:
        return one_line(f"full storage itself fails in {dtype}, at {where[1]}: "
                         f"{exception_line(text)}")
    return one_line(f"full storage itself fails in {dtype}: "
                     f"{text.splitlines()[0] if text else type(exc).__name__}")


def _diagnosis(impl: Any, case: Any, verdict: Any, failing: list[str]) -> tuple[str, str]:
    """The likely cause and its sentence, from the evidence ``check`` gathers for a minimal
    failure: the op-level search (a tiny model's is a fraction of a second) and, where it
    finds no diverging op under autocast, the same case with autocast's cast cache off."""
    import torch

    from gradequiv.harness.engine.localise import localise
    from gradequiv.harness.engine.verify import verify_without_autocast_cache
    from gradequiv.harness.reports.report import verdict_diagnosis

    device = torch.device("cpu")
    evidence: dict[str, Any] = {}
    try:
        found = localise(impl, case, device)
        evidence["localisation"] = found.describe()
        evidence["first_diverging_op"] = (found.divergence.to_dict()
                                          if found.divergence else None)
        if (found.divergence is None and verdict.error is None and failing
                and case.dtype.endswith("-autocast")
                and set(failing) <= {"gradients", "trajectory"}):
            evidence["needs_autocast_cache"] = verify_without_autocast_cache(
                impl, case, device=device).passed
    except Exception:  # the diagnosis reads what evidence there is
        pass
    diagnosis = verdict_diagnosis(impl, verdict, device, **evidence)
    return diagnosis.cause, diagnosis.sentence


# -- the sweep: a child that takes one architecture at a time --------------------------


def sweep(names: Sequence[str], *, seconds: float = SECONDS_PER_ARCH,
          threads: int | None = 1,
          check: Callable[[str], dict[str, Any]] = check_architecture,
          after_each: Callable[[list[dict[str, Any]]], None] | None = None,
          progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """``check(name)`` for each name in a child process, a row each; a row that takes more
    than ``seconds`` or ends the child is a row that says so, and the next goes to a fresh
    child. ``check`` must be importable by name (the child is spawned). Progress goes to
    stderr (or ``progress``); ``after_each(rows)`` runs after every row."""
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    worker = _Worker(check, threads)
    try:
        for k, name in enumerate(names, start=1):
            if k % ROWS_PER_CHILD == 0:
                worker.close()
            rows.append(worker.ask(name, seconds))
            elapsed = time.perf_counter() - started
            left = elapsed / k * (len(names) - k)
            row = rows[-1]
            said = (" ".join(verdicts(row)) if row["status"] == CHECKED else row["status"])
            say(f"[{k}/{len(names)}] {name}: {said} ({row['seconds']:.1f} s), elapsed "
                f"{duration(elapsed)}, estimated left {duration(left)}")
            if after_each is not None:
                after_each(rows)
    finally:
        worker.close()
    return rows


class _Worker:
    """The child process that checks one architecture at a time: spawned on first use,
    replaced after a hang or a crash."""

    def __init__(self, check: Callable[[str], dict[str, Any]], threads: int | None) -> None:
        self._check, self._threads = check, threads
        self._process: Any = None
        self._conn: Connection | None = None

    def ask(self, name: str, seconds: float) -> dict[str, Any]:
        started = time.perf_counter()
        if self._conn is None:
            failed = self._start()
            if failed:
                return _stopped(name, CRASHED, failed, started)
        assert self._conn is not None
        self._conn.send(name)
        try:
            if self._conn.poll(seconds):
                row: dict[str, Any] = self._conn.recv()
                return row
        except (EOFError, OSError):
            return _stopped(name, CRASHED, f"its checking process ended during it ("
                            f"{self._end()}) without an answer", started)
        self._end()
        return _stopped(name, TIMED_OUT, f"no answer within {seconds:g} s "
                        f"(--seconds-per-arch): a hang, or too slow; its checking process "
                        f"was stopped", started)

    def _start(self) -> str:
        """Spawn the child and wait for it to say it is ready; "" or why it is not."""
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        self._process = context.Process(target=_serve, args=(theirs, self._check,
                                                              self._threads), daemon=True)
        self._process.start()
        theirs.close()
        self._conn = ours
        try:
            if ours.poll(STARTUP_S) and ours.recv() == "ready":
                return ""
        except (EOFError, OSError):
            pass
        return f"its checking process did not start ({self._end()})"

    def _end(self) -> str:
        """Stop the child (if it still runs); how it ended, in words."""
        process, self._process = self._process, None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if process is None:
            return "not started"
        process.join(1.0)
        if process.is_alive():
            process.kill()
            process.join()
            return "stopped"
        return f"exit code {process.exitcode}"

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            if self._process is not None:
                self._process.join(5.0)
        self._end()


def _stopped(name: str, status: str, reason: str, started: float) -> dict[str, Any]:
    """The row of an architecture whose checks gave no answer: each an ERROR."""
    cell = {"verdict": ERROR, "failing": [], "cause": "process", "sentence": reason,
            "first_failure": reason, "seconds": 0.0}
    return _row(name, status, reason, {column: dict(cell) for column in CONFIGS}, started)


def _serve(conn: Connection, check: Callable[[str], dict[str, Any]],
           threads: int | None) -> None:
    """The child: quiet, ``threads`` torch threads, then ``check`` each name it is sent
    until it is sent None. What a model prints goes to stderr, beside the progress."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    with contextlib.suppress(ImportError, ValueError, OSError):  # no limits off Unix
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = MEMORY_LIMIT if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.simplefilter("ignore")
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    if check is check_architecture:  # its import, before the first row's clock starts
        _import_transformers()
    conn.send("ready")
    while (name := conn.recv()) is not None:
        conn.send(check(name))


def _summary(rows: list[dict[str, Any]], started: float) -> dict[str, Any]:
    counts = {"pass": 0, "fail": 0, "cannot build": 0}
    for row in rows:
        counts[outcome(row)] += 1
    built = [r["seconds"] for r in rows if r["status"] != CANNOT_BUILD]
    return {"counts": counts, "wall_seconds": round(time.perf_counter() - started, 1),
            "median_seconds": round(statistics.median(r["seconds"] for r in rows), 2)
            if rows else 0.0,
            "median_built_seconds": round(statistics.median(built), 2) if built else 0.0}


def _report(args: Any, names: list[str], conditions: dict[str, Any],
            started: float) -> dict[str, Any]:
    from gradequiv.harness.engine.case import Case
    from gradequiv.models.library import _HEADS

    return {"schema_version": 1, "command": "zoo", "library": args.library,
            "reproduce": _command(args), "patterns": args.arch, "limit": args.limit,
            "architectures": len(names), "complete": not names, "conditions": conditions,
            "steps": Case().steps, "heads": list(_HEADS),
            "seconds_per_arch": args.seconds_per_arch, **_summary([], started), "rows": []}


def _command(args: Any) -> str:
    """The one command that makes the same table (and JSON) again."""
    words = ["gradequiv", "zoo", "--library", args.library]
    for pattern in args.arch or ():
        words += ["--arch", pattern]
    if args.limit:
        words += ["--limit", str(args.limit)]
    if args.seconds_per_arch != SECONDS_PER_ARCH:
        words += ["--seconds-per-arch", str(args.seconds_per_arch)]
    if args.threads is not None:
        words += ["--threads", str(args.threads)]
    words += ["--out", str(args.out or DEFAULT_OUT)]
    if args.json is not None:
        words += ["--json", str(args.json)]
    return " ".join(shlex.quote(w) for w in words)


def _conditions() -> dict[str, Any]:
    import torch

    from gradequiv.harness.reports.report import run_conditions

    transformers = _import_transformers()
    return run_conditions(torch.device("cpu"), SEED) | {
        "transformers": transformers.__version__, "cpu": _cpu_name(),
        "toggle": _toggle_name(transformers)}


def _toggle_name(transformers: Any) -> str:
    """The name ``--impl hf`` turns checkpointing on by in this transformers (5.25 renamed
    ``gradient_checkpointing_enable``), for the table's header."""
    new = "activation_checkpointing_enable"
    return new if hasattr(transformers.PreTrainedModel, new) else "gradient_checkpointing_enable"


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def _write(data: dict[str, Any], out: Path | None, json_out: Path | None) -> None:
    from gradequiv.harness.reports.files import write_json_atomic, write_text_atomic

    if out is not None:
        write_text_atomic(out, markdown(data))
    if json_out is not None:
        write_json_atomic(json_out, data)



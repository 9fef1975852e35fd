"""The ``gradequiv`` command line.

Exit codes (a contract): 0 every property held; 1 a property failed (an
implementation that raises counts here); 2 a usage or configuration error,
told in one line that names the value, the rule and a fix.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line and exit code 2, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message}; see '{self.prog} --help'")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number >= 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gradequiv", description=(
        "Prove that an activation-recompute implementation gives the same gradients as "
        "keeping every activation."))
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    check = commands.add_parser("check", help="verify an implementation against full storage")
    check.add_argument("--impl", required=True, metavar="SPEC", help=(
        "a built-in name (torch, torch-reentrant), an entry point in "
        "'gradequiv.implementations', or 'package.module:attr'"))
    check.add_argument("--adapter", choices=("function", "wrapper", "toggle"), default=None,
                       help="how the implementation is called (default: function)")
    check.add_argument("--impl-kwarg", action="append", default=[], metavar="KEY=VALUE",
                       help="keyword argument forwarded to the implementation (repeatable)")
    check.add_argument("--examples", type=_count, default=None, metavar="N",
                       help="run only the first N cases of the spread")
    check.add_argument("--seed", type=_seed, default=0, metavar="S",
                       help="offset added to every case's seed (default 0)")
    check.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    check.add_argument("--case", default=None, metavar="NAME|JSON",
                       help="run one case: a name from the spread or a case's JSON")
    check.add_argument("--rtol", type=_tolerance, default=None,
                       help="explicit relative-error bound (replaces the derived one)")
    check.add_argument("--atol", type=_tolerance, default=None,
                       help="explicit absolute-error bound (a tensor within it passes)")
    check.add_argument("--report-dir", type=Path, default=None, metavar="DIR",
                       help="write DIR/report.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return _check(args)
    except _UsageError as exc:
        print(f"gradequiv: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("gradequiv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _check(args: argparse.Namespace) -> int:
    # torch is imported here, not at module import, so --help and usage errors stay fast.
    import torch

    from gradequiv.harness.adapters import parse_impl_kwargs, resolve
    from gradequiv.harness.case import Case
    from gradequiv.harness.compare import Tolerance
    from gradequiv.harness.report import (
        build_report,
        run_conditions,
        verdict_record,
        write_json_atomic,
    )
    from gradequiv.harness.spread import default_cases, find_case
    from gradequiv.harness.verify import verify
    from gradequiv.models import InvalidArgument

    try:
        impl = resolve(args.impl, adapter=args.adapter, kwargs=parse_impl_kwargs(args.impl_kwarg))
        device = _device(args.device, torch)
        if args.case is None:
            cases = default_cases()[: args.examples]
        elif args.case.lstrip().startswith("{"):
            cases = [Case.from_json(args.case)]
        else:
            cases = [find_case(args.case)]
        cases = [c.with_seed_offset(args.seed) for c in cases]
        tolerances = [Tolerance(c.dtype, args.rtol, args.atol) for c in cases]
    except InvalidArgument as exc:
        raise _UsageError(str(exc)) from exc

    conditions = run_conditions(device, args.seed)
    report_path = args.report_dir / "report.json" if args.report_dir else None
    records: list[dict[str, Any]] = []

    def write(complete: bool) -> None:
        if report_path is not None:
            write_json_atomic(report_path, build_report(
                command="check", impl=impl, conditions=conditions, records=records,
                planned=len(cases), complete=complete))

    print(f"gradequiv check: {impl.spec} ({impl.adapter}) on {device}, {len(cases)} case(s), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    started = time.perf_counter()
    try:
        for i, (case, tolerance) in enumerate(zip(cases, tolerances), start=1):
            try:
                verdict = verify(impl, case, device=device, tolerance=tolerance)
            except InvalidArgument as exc:
                raise _UsageError(str(exc)) from exc
            record = verdict_record(impl, verdict, device)
            records.append(record)
            write(complete=False)
            status = "pass" if verdict.passed else "FAIL"
            spent = sum(verdict.seconds.values())
            print(f"[{i}/{len(cases)}] {status} {case.name or 'case'}: {case.describe()} "
                  f"({spent:.2f}s)", flush=True)
            if not verdict.passed:
                print(f"    {verdict.first_failure}", flush=True)
    except KeyboardInterrupt:
        write(complete=False)
        raise
    write(complete=True)
    failed = [r for r in records if r["verdict"] == "fail"]
    elapsed = time.perf_counter() - started
    if failed:
        print(f"verdict: FAIL ({len(failed)} of {len(records)} cases failed) in {elapsed:.1f}s")
        print(f"first failure: {failed[0]['name']}: {failed[0]['first_failure']}")
        print(f"reproduce: {failed[0]['reproduce']}")
    else:
        print(f"verdict: pass ({len(records)} of {len(records)} cases) in {elapsed:.1f}s")
    if report_path is not None:
        print(f"report: {report_path}")
    return EXIT_FAIL if failed else EXIT_PASS


def _device(choice: str, torch: Any) -> Any:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise _UsageError(
            "--device='cuda' but torch.cuda.is_available() is False (a CPU build of torch, "
            "or no GPU visible); use --device cpu or auto"
        )
    return torch.device(choice)


if __name__ == "__main__":
    sys.exit(main())

"""The ``gradequiv`` command line.

Exit codes (a contract): 0 every property held; 1 a property failed (an
implementation that raises counts here); 2 a usage or configuration error,
told in one line that names the value, the rule and a fix.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
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


def _shard(text: str) -> str:
    index, sep, count = text.partition("/")
    if not (sep and index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N with 1 <= I <= N (e.g. 2/4)")
    return text


def _implementation_options(command: argparse.ArgumentParser) -> None:
    """--impl, --adapter, --impl-kwarg: the same for every command that runs an implementation."""
    command.add_argument("--impl", required=True, metavar="SPEC", help=(
        "a built-in name (torch, torch-reentrant, torch-sac, torch-wrapper, fairscale, "
        "deepspeed, deepspeed-nonreentrant, megatron, hf), a compiler setting "
        "(compile-budget:X, compile-sac:POLICY, compile-torch), an entry point in "
        "'gradequiv.implementations', or 'package.module:attr'"))
    command.add_argument("--adapter", choices=("function", "wrapper", "toggle"), default=None,
                         help="how the implementation is called (default: function)")
    command.add_argument("--impl-kwarg", action="append", default=[], metavar="KEY=VALUE",
                         help="keyword argument forwarded to the implementation (repeatable)")


def _implementation(args: argparse.Namespace) -> Any:
    """The implementation named by the options of :func:`_implementation_options`."""
    from gradequiv.harness.adapters import parse_impl_kwargs, resolve

    return resolve(args.impl, adapter=args.adapter, kwargs=parse_impl_kwargs(args.impl_kwarg))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gradequiv", description=(
        "Prove that an activation-recompute implementation gives the same gradients as "
        "keeping every activation."))
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    check = commands.add_parser("check", help="verify an implementation against full storage")
    _implementation_options(check)
    check.add_argument("--examples", type=_count, default=None, metavar="N",
                       help="examples Hypothesis draws per property (default: the profile's)")
    check.add_argument("--deterministic", action="store_true",
                       help="torch.use_deterministic_algorithms(True) for the run; the report "
                            "records it and the noise floor it leaves")
    check.add_argument("--model", default=None, metavar="SPEC",
                       help="your own model: package.module:attr, a factory called with a "
                            "seed that returns gradequiv.models.UserModel")
    check.add_argument("--shard", type=_shard, default=None, metavar="I/N",
                       help="run shard I of N: its share of the examples (from its own seed) "
                            "and of the named cases, for CI matrices")
    check.add_argument("--profile", choices=("ci", "dev", "thorough"), default="ci",
                       help="how hard to search: ci (20 examples per property, no example "
                            "database; the default), dev (50), thorough (400)")
    check.add_argument("--seed", type=_seed, default=0, metavar="S",
                       help="seed of the drawn cases, added to the named cases' seeds "
                            "(default 0)")
    check.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    check.add_argument("--case", default=None, metavar="NAME|JSON",
                       help="replay one case: its JSON, a .json file holding it, or a named case")
    check.add_argument("--rtol", type=_tolerance, default=None,
                       help="explicit relative-error bound (replaces the derived one)")
    check.add_argument("--atol", type=_tolerance, default=None,
                       help="explicit absolute-error bound (a tensor within it passes)")
    check.add_argument("--report-dir", type=Path, default=None, metavar="DIR",
                       help="write DIR/report.json")
    mutants = commands.add_parser(
        "mutants", help="prove the suite catches every deliberately broken implementation")
    mutants.add_argument("--examples", type=_count, default=20, metavar="N",
                         help="examples per property for each implementation (default 20)")
    mutants.add_argument("--seed", type=_seed, default=0, metavar="S")
    mutants.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    mutants.add_argument("--report-dir", type=Path, default=None, metavar="DIR",
                         help="write DIR/mutants.json and DIR/mutants.md")
    prof = commands.add_parser(
        "profile", help="activation memory and step time per granularity, and the frontier")
    _implementation_options(prof)
    prof.add_argument("--granularity", default=",".join(_DEFAULT_GRANULARITIES),
                      metavar="LIST", help="comma-separated (default: %(default)s)")
    prof.add_argument("--layers", type=_count, default=4)
    prof.add_argument("--width", type=_count, default=128)
    prof.add_argument("--heads", type=_count, default=4)
    prof.add_argument("--seq-len", type=_count, default=64)
    prof.add_argument("--batch", type=_count, default=4)
    prof.add_argument("--dropout", type=_tolerance, default=0.1,
                      help="probability at every dropout site (default 0.1)")
    prof.add_argument("--dtype", choices=("fp32", "bf16-autocast", "fp16-autocast"),
                      default="fp32")
    prof.add_argument("--steps", type=_count, default=20, help="timed steps per granularity")
    prof.add_argument("--warmup", type=_count, default=3)
    prof.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    prof.add_argument("--report-dir", type=Path, default=None, metavar="DIR",
                      help="write DIR/profile.json, profile.md and profile.png")
    dist = commands.add_parser(
        "distributed", help="DDP / FSDP training with and without recompute on N ranks")
    _implementation_options(dist)
    dist.add_argument("--wrapper", choices=("ddp", "fsdp", "both"), default="both")
    dist.add_argument("--world-size", type=_count, default=2, metavar="N")
    dist.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                      help="cpu: gloo; cuda: NCCL, one GPU per rank (default %(default)s)")
    dist.add_argument("--case", default="4L-group2-dropout-untied", metavar="NAME|JSON|FILE",
                      help="the case to train (default %(default)s)")
    dist.add_argument("--timeout", type=_tolerance, default=300.0, metavar="SECONDS",
                      help="kill the ranks after this long (default %(default)s)")
    report = commands.add_parser(
        "report", help="render a report folder as Markdown, HTML or JUnit XML")
    report.add_argument("folder", type=Path, metavar="DIR",
                        help="a --report-dir of check, mutants and/or profile")
    report.add_argument("--format", choices=(*FORMATS, "all"), default="all",
                        help="md (CI job summary), html (self-contained page with plots), "
                             "junit (XML); all: every format (default)")
    report.add_argument("--output", default=None, metavar="PATH",
                        help="where to write one format ('-': standard output); default "
                             "DIR/report.md, DIR/report.html, DIR/junit.xml")
    report.add_argument("--fail-on-verdict", action="store_true",
                        help="exit 1 when the report's verdict is not pass (CI gates)")
    return parser


#: Output formats of ``gradequiv report`` and their default file names.
FORMATS = {"md": "report.md", "html": "report.html", "junit": "junit.xml"}
_DEFAULT_GRANULARITIES = ("none", "layer", "every:2", "group:2", "attention", "mlp")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        commands = {"check": _check, "mutants": _mutants, "profile": _profile,
                    "distributed": _distributed, "report": _report}
        with _sigterm_as_interrupt():  # a CI timeout or cancel ends like Ctrl-C
            return commands[args.command](args)
    except _UsageError as exc:
        print(f"gradequiv: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("gradequiv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _check(args: argparse.Namespace) -> int:
    """Validate every option here (exit 2), then run the property suite under pytest."""
    # torch is imported here, not at module import, so --help and usage errors stay fast.
    import torch

    from gradequiv.harness.compare import Tolerance
    from gradequiv.harness.spread import load_case
    from gradequiv.models import InvalidArgument

    try:
        impl = _implementation(args)
        device = _device(args.device, torch)
        if args.case is not None:
            case = load_case(args.case)
            Tolerance(case.dtype, args.rtol, args.atol)
        if args.model is not None:
            _check_model(args.model)
        elif impl.spec == "hf" and (args.case is None or case.model_kind != "external"):
            from gradequiv.harness.peers import HF_NEEDS_MODEL

            raise InvalidArgument(HF_NEEDS_MODEL)
        Tolerance("fp32", args.rtol, args.atol)
    except InvalidArgument as exc:
        raise _UsageError(str(exc)) from exc

    pytest_args = ["--pyargs", "gradequiv.properties", "-p", "no:cacheprovider", "-q",
                   "-W", "ignore::pytest.PytestAssertRewriteWarning",
                   f"--gradequiv-impl={impl.spec}", f"--gradequiv-seed={args.seed}",
                   f"--gradequiv-profile={args.profile}",
                   f"--gradequiv-device={device.type}"]
    pytest_args += [f"--gradequiv-impl-kwarg={item}" for item in args.impl_kwarg]
    optional = {"adapter": args.adapter, "examples": args.examples, "case": args.case,
                "shard": args.shard, "model": args.model,
                "report-dir": args.report_dir, "rtol": args.rtol, "atol": args.atol}
    pytest_args += [f"--gradequiv-{k}={v}" for k, v in optional.items() if v is not None]
    if args.deterministic:
        pytest_args.append("--gradequiv-deterministic")
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        pytest_args += ["-p", "gradequiv.properties.plugin"]
    shard = f", shard {args.shard}" if args.shard else ""
    print(f"gradequiv check: {impl.spec} ({impl.adapter}) on {device}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads{shard}", flush=True)
    code = run_pytest(pytest_args)
    if code == 2:
        print("gradequiv: interrupted; the report keeps what finished, marked incomplete",
              file=sys.stderr)
    return {0: EXIT_PASS, 1: EXIT_FAIL, 2: EXIT_INTERRUPTED}.get(code, EXIT_USAGE)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """A CI runner's SIGTERM (timeout, cancel) stops the run like Ctrl-C: the report is
    written, marked incomplete, instead of the process vanishing mid-case."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_model(spec: str) -> None:
    """Build the user's model once: a factory that cannot build is exit 2, not 30 failures."""
    from gradequiv.models import BatchConfig, ExternalConfig, InvalidArgument, build

    try:
        build(ExternalConfig(spec), BatchConfig(), 0, "cpu")
    except InvalidArgument:
        raise
    except Exception as exc:
        raise InvalidArgument(f"--model={spec!r}: the factory raised {type(exc).__name__}: "
                              f"{exc}") from exc


def run_pytest(args: list[str]) -> int:
    """pytest.main on the suite, blind to the current folder's pytest configuration.

    The caller's addopts, filterwarnings or plugins must not change a verdict;
    an empty ini file in a temporary folder stands in for theirs.
    """
    import tempfile

    import pytest

    with tempfile.TemporaryDirectory(prefix="gradequiv-") as folder:
        ini = Path(folder) / "pytest.ini"
        ini.write_text("[pytest]\n", encoding="utf-8")
        return int(pytest.main(["-c", str(ini), f"--rootdir={folder}", *args]))


def _mutants(args: argparse.Namespace) -> int:
    import torch

    from gradequiv.harness import mutation
    from gradequiv.harness.mutants import MUTANTS
    from gradequiv.harness.report import run_conditions

    device = _device(args.device, torch)
    print(f"gradequiv mutants: {len(MUTANTS)} mutants, {len(mutation.CORRECT)} correct "
          f"implementations first; {args.examples} examples per property, seed {args.seed}, "
          f"{device}", flush=True)
    conditions = run_conditions(device, args.seed)

    def write_partial(outcomes: list[Any]) -> None:
        if args.report_dir is not None:
            mutation.write(args.report_dir, outcomes, mutation.score(outcomes), conditions,
                           complete=False)

    outcomes = mutation.run_all(seed=args.seed, examples=args.examples, device=device.type,
                                progress=lambda line: print(line, flush=True),
                                after_each=write_partial)
    summary = mutation.score(outcomes)
    print(mutation.markdown(outcomes, summary).splitlines()[0])
    if args.report_dir is not None:
        mutation.write(args.report_dir, outcomes, summary, conditions)
        print(f"report: {args.report_dir / 'mutants.json'}, {args.report_dir / 'mutants.md'}")
    return EXIT_PASS if summary["verdict"] == "pass" else EXIT_FAIL


def _profile(args: argparse.Namespace) -> int:
    import torch

    from gradequiv.harness import profile as profiling
    from gradequiv.harness.case import Case
    from gradequiv.harness.report import write_json_atomic
    from gradequiv.models import BatchConfig, InvalidArgument, TransformerConfig
    from gradequiv.models import parse_granularity as parse

    try:
        impl = _implementation(args)
        device = _device(args.device, torch)
        granularities = [parse(text) for text in args.granularity.split(",") if text.strip()]
        if not granularities:
            raise InvalidArgument(f"--granularity={args.granularity!r} names none; "
                                  f"write e.g. none,layer,every:2")
        rates = {site: args.dropout for site in
                 ("embd_dropout", "attn_dropout", "resid_dropout", "mlp_dropout")}
        model = TransformerConfig(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                                  max_seq_len=args.seq_len, **rates)
        case = Case(model=model, batch=BatchConfig(args.batch, args.seq_len, padding=False),
                    dtype=args.dtype, name="profile")
        if case.dtype == "fp16-autocast" and device.type != "cuda":
            raise InvalidArgument("--dtype=fp16-autocast needs CUDA; use fp32 or bf16-autocast")
    except InvalidArgument as exc:
        raise _UsageError(str(exc)) from exc
    print(f"gradequiv profile: {impl.spec} on {device}, {case.describe()}, "
          f"{len(granularities)} granularities x {args.steps} steps", flush=True)
    result = profiling.profile(impl, case, granularities, steps=args.steps,
                               warmup=args.warmup, device=device)
    table = profiling.markdown(result)
    print(table)
    if args.report_dir is not None:
        missing = profiling.plot(result, args.report_dir / "profile.png")
        data = result.to_dict() | {"plot": None if missing else "profile.png",
                                   "plot_missing": missing}
        write_json_atomic(args.report_dir / "profile.json", data)
        (args.report_dir / "profile.md").write_text(
            table + ("" if missing else "\n![memory against step time](profile.png)\n"),
            encoding="utf-8")
        print(f"report: {args.report_dir / 'profile.json'}" + (f" (no plot: {missing})"
                                                              if missing else ""))
    return EXIT_PASS


def _distributed(args: argparse.Namespace) -> int:
    from gradequiv.harness.distributed import WRAPPERS, verify_distributed
    from gradequiv.harness.spread import load_case
    from gradequiv.models import InvalidArgument

    wrappers = list(WRAPPERS) if args.wrapper == "both" else [args.wrapper]
    failed = False
    try:
        impl = _implementation(args)
        case = load_case(args.case)
        for wrapper in wrappers:
            backend = "NCCL" if args.device == "cuda" else "gloo"
            print(f"gradequiv distributed: {impl.spec} under {wrapper}, {args.world_size} ranks "
                  f"({backend}), {case.describe()}", flush=True)
            verdict = verify_distributed(impl, case, wrapper=wrapper, device=args.device,
                                         world_size=args.world_size, timeout_s=args.timeout)
            if verdict.passed:
                print(f"  pass: {verdict.compared} tensors equal on every rank "
                      f"({verdict.seconds:.1f} s)")
            else:
                failed = True
                print(f"  FAIL: {verdict.first_failure}")
                for line in verdict.failures[1:5]:
                    print(f"        {line}")
    except InvalidArgument as exc:
        raise _UsageError(str(exc)) from exc
    return EXIT_FAIL if failed else EXIT_PASS


def _report(args: argparse.Namespace) -> int:
    """Render the folder's JSON in the asked formats; writes are atomic, like the JSON's."""
    from gradequiv.harness.bundle import load_bundle
    from gradequiv.harness.report import write_text_atomic
    from gradequiv.models import InvalidArgument

    try:
        bundle = load_bundle(args.folder)
    except InvalidArgument as exc:
        raise _UsageError(str(exc)) from exc
    formats = list(FORMATS) if args.format == "all" else [args.format]
    if args.output is not None and len(formats) > 1:
        raise _UsageError(f"--output={args.output!r} names one file but --format=all writes "
                          f"{len(formats)}; add --format md, html or junit")
    if "junit" in formats and bundle.report is None:
        if args.format == "junit":
            raise _UsageError(f"--format junit needs {args.folder / 'report.json'}, written by "
                              f"`gradequiv check --report-dir {args.folder}`")
        formats.remove("junit")
    for name in formats:
        text = _render(name, bundle)
        if args.output == "-":
            sys.stdout.write(text)
            continue
        path = Path(args.output) if args.output else args.folder / FORMATS[name]
        write_text_atomic(path, text)
        print(f"gradequiv report: wrote {path}", file=sys.stderr)
    if args.fail_on_verdict and bundle.verdict != "pass":
        return EXIT_FAIL
    return EXIT_PASS


def _render(name: str, bundle: Any) -> str:
    if name == "md":
        from gradequiv.harness.summary_md import render_markdown

        return render_markdown(bundle)
    if name == "html":
        from gradequiv.harness.html_page import render_html

        return render_html(bundle)
    from gradequiv.harness.junit import render_junit

    return render_junit(bundle.report)


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

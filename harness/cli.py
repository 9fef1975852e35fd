"""The ``gradequiv`` command line: argparse, then the command's module.

Exit codes (a contract): 0 every property held; 1 a property failed (an
implementation that raises counts here); 2 a usage or configuration error,
told in one line that names the value, the rule and a fix (every caller
mistake is an :class:`InvalidArgument`, from argparse or from a command).

The commands live in :mod:`gradequiv.harness.commands`, imported only when
chosen, so ``--help`` and usage errors do not import torch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from gradequiv.harness import validate
from gradequiv.harness.engine.schedules import PIPELINE_SCHEDULES
from gradequiv.harness.errors import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_USAGE, InvalidArgument
from gradequiv.harness.implementations.resolve import BUILTINS
from gradequiv.harness.options import ADAPTERS, DEVICES, PROFILES, CheckOptions, check_options
from gradequiv.harness.reports.files import RENDERED

#: seconds without progress (no case finished or started) after which a check run fails
CASE_TIMEOUT_S = 600


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line and exit code 2, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        raise InvalidArgument(f"{message}; see '{self.prog} --help'")


def _count(flag: str) -> Callable[[str], int]:
    return validate.as_argparse_type(validate.whole_number, flag)


def _seed(flag: str) -> Callable[[str], int]:
    return validate.as_argparse_type(validate.seed, flag)


def _seconds(flag: str) -> Callable[[str], int]:
    return validate.as_argparse_type(lambda name, value: validate.whole_number(
        name, value, low=0), flag)


def _reshard(value: str) -> bool | int:
    """--reshard-after-forward: true, false, or a group size of at least 2."""
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered.isdigit() and int(lowered) >= 2:
        return int(lowered)
    raise InvalidArgument(f"--reshard-after-forward={value!r}: write true, false, or a group "
                          f"size of at least 2 that divides --world-size")


def _tolerance(flag: str) -> Callable[[str], float]:
    return validate.as_argparse_type(validate.bound, flag)


def _implementation_options(command: argparse.ArgumentParser,
                            impl_default: str | None = None) -> None:
    """--impl, --adapter, --impl-kwarg: the same for every command that runs an implementation
    (``impl_default``: where the command has a sensible one, so --impl may be left out)."""
    command.add_argument("--impl", required=impl_default is None, default=impl_default,
                         metavar="SPEC", help=(
        f"a built-in name ({', '.join(BUILTINS)}), a compiler setting "
        "(compile-budget:X, compile-sac:POLICY, compile-torch), an entry point in "
        "'gradequiv.implementations', or 'package.module:attr'"
        + (f" (default: {impl_default})" if impl_default else "")))
    command.add_argument("--adapter", choices=ADAPTERS, default=None,
                         help="how the implementation is called (default: function)")
    command.add_argument("--impl-kwarg", action="append", default=[], metavar="KEY=VALUE",
                         help="keyword argument forwarded to the implementation (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gradequiv", description=(
        "Prove that an activation-recompute implementation gives the same gradients as "
        "keeping every activation."))
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    check = commands.add_parser("check", help="verify an implementation against full storage")
    _implementation_options(check)
    check.add_argument("--examples", default=None, metavar="N",
                       help="examples Hypothesis draws per property (default: the profile's)")
    check.add_argument("--deterministic", action="store_true",
                       help="torch.use_deterministic_algorithms(True) for the run; the report "
                            "records it and the noise floor it leaves")
    check.add_argument("--model", default=None, metavar="SPEC",
                       help="your own model: package.module:attr, a factory called with a "
                            "seed that returns gradequiv.models.UserModel")
    check.add_argument("--shard", default=None, metavar="I/N",
                       help="run shard I of N: its share of the examples (from its own seed) "
                            "and of the named cases, for CI matrices")
    check.add_argument("--profile", choices=PROFILES, default="ci",
                       help="how hard to search: ci (20 examples per property, no example "
                            "database; the default), dev (50), thorough (400)")
    check.add_argument("--seed", default=0, metavar="S",
                       help="seed of the drawn cases, added to the named cases' seeds "
                            "(default 0)")
    check.add_argument("--device", choices=DEVICES, default="auto")
    check.add_argument("--regime", action="append", default=[], metavar="KEY=VALUE",
                       help="what your training runs, so that only it is drawn (repeatable; "
                            "each replaces that key of pyproject.toml's [tool.gradequiv]): "
                            "dtypes=bf16-autocast, backward=outside-autocast, loss-parts=1, "
                            "grad-modes=..., schedules=..., pipeline-schedules=..., "
                            "micro-batches=N")
    check.add_argument("--threads", default=None, metavar="N|auto",
                       help="torch's intra-op threads for the run (default 1, or "
                            "GRADEQUIV_THREADS): more only slows the suite's tiny tensors, "
                            "badly beside other jobs; auto: torch's default (OMP_NUM_THREADS)")
    check.add_argument("--case", default=None, metavar="NAME|JSON",
                       help="replay one case: its JSON, a .json file holding it, or a named case")
    check.add_argument("--rtol", default=None,
                       help="explicit relative-error bound (replaces the derived one)")
    check.add_argument("--atol", default=None,
                       help="explicit absolute-error bound (a tensor within it passes)")
    check.add_argument("--report-dir", type=Path, default=None, metavar="DIR",
                       help="write DIR/report.json, report.md, report.html and junit.xml")
    check.add_argument("--no-shrink", action="store_true",
                       help="report each failing example as found, without shrinking it")
    check.add_argument("--shrink-budget", default=None, metavar="SECONDS",
                       help="stop shrinking a failure after this long and report the smallest "
                            "found (default: no time limit; the same seed then gives the same "
                            "report on any machine)")
    check.add_argument("--case-timeout", type=_seconds("--case-timeout"),
                       default=None, metavar="SECONDS",
                       help="fail the run when the implementation makes no progress for "
                            f"this long: a case that hangs (default {CASE_TIMEOUT_S}; 0: no "
                            "limit)")
    check.add_argument("--in-process", action="store_true",
                       help="run the implementation in this process, not in a supervised "
                            "child (for a debugger; an implementation that exits or hangs "
                            "then ends or stalls the run itself)")
    mutants = commands.add_parser(
        "mutants", help="prove the suite catches every deliberately broken implementation")
    mutants.add_argument("--examples", type=_count("--examples"), default=20, metavar="N",
                         help="examples per property for each implementation (default 20)")
    mutants.add_argument("--seed", type=_seed("--seed"), default=0, metavar="S")
    mutants.add_argument("--mutant", action="append", default=None, metavar="NAME",
                         help="run only this mutant (repeatable); the correct ones always run")
    mutants.add_argument("--device", choices=DEVICES, default="auto")
    mutants.add_argument("--report-dir", type=Path, default=None, metavar="DIR",
                         help="write DIR/mutants.json and DIR/mutants.md")
    prof = commands.add_parser(
        "profile", help="activation memory and step time per granularity, and the frontier")
    _implementation_options(prof, impl_default="torch")  # torch's own checkpoint: a baseline
    prof.add_argument("--granularity", default=None, metavar="LIST", help=(
        "comma-separated (default: none,layer,every:2,group:2,attention,mlp; with --model: "
        "none,layer,every:2, and its segments by name joined by '+', e.g. blocks.0+blocks.2; "
        "with a transformers --model also its own toggle: hf, hf:every_n_layers=2, "
        "hf:offload)"))
    prof.add_argument("--model", default=None, metavar="SPEC",
                      help="profile your own model: package.module:attr, the factory check "
                           "--model takes (then --layers, --width, --heads, --seq-len, "
                           "--batch and --dropout do not apply: the factory decides)")
    prof.add_argument("--memory-budget", default=None, metavar="BYTES",
                      help="activation bytes a step may hold at its peak (e.g. 512MiB): "
                           "recommend the fastest granularity that fits, and the largest "
                           "batch each one could run within it")
    prof.add_argument("--layers", type=_count("--layers"), default=4)
    prof.add_argument("--width", type=_count("--width"), default=128)
    prof.add_argument("--heads", type=_count("--heads"), default=4)
    prof.add_argument("--seq-len", type=_count("--seq-len"), default=64)
    prof.add_argument("--batch", type=_count("--batch"), default=4)
    prof.add_argument("--dropout", type=_tolerance("--dropout"), default=0.1,
                      help="probability at every dropout site (default 0.1)")
    prof.add_argument("--dtype", choices=("fp32", "bf16-autocast", "fp16-autocast"),
                      default="fp32")
    prof.add_argument("--steps", type=_count("--steps"), default=20,
                      help="timed steps per granularity")
    prof.add_argument("--warmup", type=_seconds("--warmup"), default=3,
                      help="untimed steps per granularity first (default 3; 0: none)")
    prof.add_argument("--device", choices=DEVICES, default="auto")
    prof.add_argument("--threads", default=None, metavar="N|auto",
                      help="torch's intra-op threads while measuring (default 1, or "
                           "GRADEQUIV_THREADS, as for check): step times at torch's default "
                           "swing with whatever else runs; auto: torch's default")
    prof.add_argument("--report-dir", type=Path, default=None, metavar="DIR",
                      help="write DIR/profile.json, profile.md and profile.png")
    dist = commands.add_parser(
        "distributed", help="DDP / FSDP / tensor-parallel training with and without "
                            "recompute on N ranks")
    _implementation_options(dist)
    dist.add_argument("--wrapper", choices=("ddp", "fsdp", "tp", "fsdp-tp", "pp", "user",
                                            "both", "all"),
                      default="all",
                      help="the engine: DDP, FSDP2's fully_shard per layer and at the root, "
                           "tensor parallelism with DTensor (tp), both on a 2-D mesh "
                           "(fsdp-tp: tp in pairs of ranks, 4 ranks or more), torch's "
                           "pipeline schedules over the model's stages (pp), your "
                           "--parallelize function (user); ddp and fsdp (both), or every "
                           "one the world size allows but user (all, the default; user "
                           "when --parallelize is given)")
    dist.add_argument("--schedule", choices=tuple(PIPELINE_SCHEDULES), default=None,
                      help="under pp, the schedule your training runs: drawn cases use it "
                           "only (default: every one drawn; --case: gpipe)")
    dist.add_argument("--regime", action="append", default=[], metavar="KEY=VALUE",
                      help="what your training runs (as check's --regime, on top of "
                           "pyproject.toml's [tool.gradequiv]): its dtypes, "
                           "pipeline-schedules and micro-batches are drawn only")
    dist.add_argument("--micro-batches", type=_count("--micro-batches"), default=None,
                      metavar="N", help="under pp with --case, the micro-batches of a step "
                                        "(default: one per rank, or per stage where a rank "
                                        "holds several)")
    dist.add_argument("--world-size", type=_count("--world-size"), default=2, metavar="N",
                      help="ranks: drawn cases draw 2 to N of them (shrinking towards 2), "
                           "--case runs on N (default %(default)s)")
    dist.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                      help="cpu: gloo; cuda: NCCL, one GPU per rank (default %(default)s)")
    dist.add_argument("--case", default=None, metavar="NAME|JSON|FILE",
                      help="train this one case instead of drawn ones")
    dist.add_argument("--examples", type=_count("--examples"), default=8, metavar="N",
                      help="cases drawn (default %(default)s), each on every rank")
    dist.add_argument("--seed", type=_seed("--seed"), default=0, metavar="N",
                      help="the seed the cases are drawn from (default %(default)s)")
    dist.add_argument("--model", default=None, metavar="SPEC",
                      help="your model's factory, as for check --model")
    dist.add_argument("--split", default=None, metavar="MODULE:FUNCTION",
                      help="under pp with --model, your model's stages: called as "
                           "function(model, n_stages), returning n_stages nn.Modules in order "
                           "that hold the model's own submodules (torchtitan's pipeline_llm "
                           "split)")
    dist.add_argument("--parallelize", default=None, metavar="MODULE:FUNCTION",
                      help="your set-up, called with the model and the device mesh and "
                           "returning the model to train (torchtitan's parallelize_* shape)")
    dist.add_argument("--reshard-after-forward", type=_reshard, default=True,
                      metavar="true|false|N",
                      help="FSDP2's reshard_after_forward for --case (drawn cases draw it)")
    dist.add_argument("--model-parallel", action="store_true",
                      help="your --parallelize set-up is model-parallel over the whole mesh: "
                           "every rank trains the same rows with the same masks (needed by "
                           "--impl deepspeed-partitioned)")
    dist.add_argument("--mixed-precision", action="store_true",
                      help="FSDP2's MixedPrecisionPolicy (bf16 parameters, fp32 reduce) for "
                           "--case (drawn cases draw it)")
    dist.add_argument("--sequence-parallel", action="store_true",
                      help="under tp and fsdp-tp, the norm before each MLP runs on a part of "
                           "the sequence (torch's SequenceParallel) for --case (drawn cases "
                           "draw it)")
    dist.add_argument("--timeout", type=_tolerance("--timeout"), default=300.0, metavar="SECONDS",
                      help="kill the ranks after this long (default %(default)s)")
    dist.add_argument("--report-dir", type=Path, default=None, metavar="DIR",
                      help="write DIR/report.json and report.md (render junit.xml and "
                           "report.html with gradequiv report DIR)")
    zoo = commands.add_parser(
        "zoo", help="every architecture of a library through its own checkpointing: a table")
    zoo.add_argument("--library", required=True, choices=("transformers", "timm", "diffusers"),
                     help="whose architectures (transformers only, for now)")
    zoo.add_argument("--arch", action="append", default=None, metavar="PATTERN",
                     help="only the classes whose name matches (fnmatch, case-sensitive, "
                          "e.g. '*ForCausalLM'; repeatable)")
    zoo.add_argument("--limit", type=_count("--limit"), default=None, metavar="N",
                     help="only the first N, in sorted order")
    zoo.add_argument("--out", type=Path, default=None, metavar="FILE",
                     help="the Markdown table (default docs/zoo-transformers.md; with "
                          "--check: none)")
    zoo.add_argument("--json", type=Path, default=None, metavar="FILE",
                     help="the same rows as JSON")
    zoo.add_argument("--check", type=Path, default=None, metavar="FILE",
                     help="re-run the architectures of a table (or JSON) this command wrote, "
                          "those matching --arch where given; exit 1 where a verdict differs")
    zoo.add_argument("--seconds-per-arch", type=_count("--seconds-per-arch"), default=120,
                     metavar="S", help="stop an architecture's checks after this long and "
                                       "say so in its row (default %(default)s)")
    zoo.add_argument("--threads", default=None, metavar="N|auto",
                     help="torch's intra-op threads (default 1, or GRADEQUIV_THREADS, as "
                          "for check)")
    report = commands.add_parser(
        "report", help="render a report folder as Markdown, HTML or JUnit XML")
    report.add_argument("folder", type=Path, metavar="DIR",
                        help="a --report-dir of check, distributed, mutants and/or profile")
    report.add_argument("--format", choices=(*RENDERED, "all"), default="all",
                        help="md (CI job summary), html (self-contained page with plots), "
                             "junit (XML); all: every format (default)")
    report.add_argument("--output", default=None, metavar="PATH",
                        help="where to write one format ('-': standard output); default "
                             "DIR/report.md, DIR/report.html, DIR/junit.xml")
    report.add_argument("--require-run", default=None, metavar="ID",
                        help="exit 1 unless report.json is there, complete, and written by "
                             "the run with this id (GRADEQUIV_RUN_ID; ci/gate.sh sets one)")
    report.add_argument("--fail-on-verdict", action="store_true",
                        help="exit 1 when the report's verdict is not pass (CI gates)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code. A supervised child tells its supervisor the code."""
    from gradequiv.harness.commands.supervise import ChildChannel

    channel = ChildChannel.from_environment()
    try:
        code = _run(sys.argv[1:] if argv is None else argv, channel)
    except Exception as exc:
        if channel is None:
            raise
        # In a supervised child, a fault of the harness itself (the implementation's own
        # are caught as its verdicts) is said as ours, not as the implementation's end.
        traceback.print_exc()
        print(f"gradequiv: internal error: {type(exc).__name__}: {exc}; this is a fault of "
              f"gradequiv, not of the implementation: please report it with the traceback "
              f"above", file=sys.stderr)
        code = EXIT_FAIL
    if channel is not None:
        channel.ended(code)
    return code


def entry() -> NoReturn:
    """The console script: main, and an exit that does not wait for threads left running
    (they would hang the process after its verdict; the implementation's were named)."""
    code = main()
    if any(t is not threading.main_thread() and t.is_alive() and not t.daemon
           for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _run(argv: list[str], channel: Any) -> int:
    try:
        args = build_parser().parse_args(argv)
        with _sigterm_as_interrupt():  # a CI timeout or cancel ends like Ctrl-C
            if args.command == "check":
                options = options_from_args(args)
                if not args.in_process:
                    from gradequiv.harness.commands import supervise

                    timeout = CASE_TIMEOUT_S if args.case_timeout is None else args.case_timeout
                    return supervise.run(options, argv, case_timeout=timeout)
                if channel is None and args.case_timeout is not None:
                    raise InvalidArgument(
                        f"--case-timeout={args.case_timeout} needs the supervised child that "
                        f"--in-process turns off (nothing could stop a hang in this "
                        f"process); drop --in-process, or drop --case-timeout")
                from gradequiv.harness.commands import check, leftovers, supervise

                if channel is not None:
                    supervise.stop_quietly_on_hang()
                    supervise.keep_own_streams()  # the implementation may close fds 1 and 2
                leftovers.watch()  # what runs from here on may be the implementation's
                try:
                    return check.run(options, observer=channel)
                finally:
                    _say_leftovers()
            module = _MODULES[args.command]
            command = importlib.import_module(f"gradequiv.harness.commands.{module}")
            return int(command.run(args))
    except InvalidArgument as exc:
        print(f"gradequiv: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("gradequiv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _say_leftovers() -> None:
    """Warn of the threads and processes the implementation left running (stopping the
    processes, which would hold the run's output open); nothing for anyone else's."""
    from gradequiv.harness.commands import leftovers

    left = leftovers.left_running()
    for line in left.warnings():
        print(f"gradequiv: warning: {line}", file=sys.stderr)
    leftovers.stop(left.processes)


#: subcommand -> its module in gradequiv.harness.commands
_MODULES = {"mutants": "mutants", "profile": "profiling", "distributed": "distributed",
            "report": "render", "zoo": "zoo"}


def options_from_args(args: argparse.Namespace) -> CheckOptions:
    """``check``'s argparse namespace as the run's options (validated there, once)."""
    return check_options(
        impl=args.impl, impl_kwargs=args.impl_kwarg, adapter=args.adapter, seed=args.seed,
        examples=args.examples, profile=args.profile, device=args.device,
        report_dir=args.report_dir, case=args.case, rtol=args.rtol, atol=args.atol,
        shrink=not args.no_shrink, shrink_budget=args.shrink_budget,
        shard=args.shard or (1, 1), model=args.model, deterministic=args.deterministic,
        threads=validate.threads_given(args.threads), regime=args.regime)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """A CI runner's SIGTERM (timeout, cancel) stops the run like Ctrl-C: the report is
    written, marked incomplete, instead of the process vanishing mid-case."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the report is being written
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    entry()

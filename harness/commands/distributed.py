"""Recompute on N ranks: DDP, FSDP2, tensor parallelism, both on a 2-D mesh, or the user's
own set-up, training with and without it.

Recompute is used together with data, sharded and tensor parallelism, and the
combination has its own ways to go wrong: a reentrant checkpoint re-runs a
segment whose parameters DDP has already marked ready, FSDP must gather
sharded weights again for the recompute, dropout in a tensor-parallel region
draws from a distributed generator, and each replica draws its own dropout
masks. So each rank runs the case as ``check`` runs it (``verify``: full
storage, the recompute, the same properties) under the engine, on its share
of the batch, with gradients and weights made whole where sharded; this
module only starts the ranks, hands them cases and collects their verdicts.

Ranks are started with torch's own launcher (multiprocessing spawn), talk
over gloo on the CPU (NCCL on GPUs), rendezvous through a file, and are
killed when the run exceeds its time limit, so a hang in a collective ends
as a failed verdict, not a stuck CI job.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

from gradequiv.harness.engine.case import Case
from gradequiv.harness.engine.parallel import PAIR, Parallel, RankSetup
from gradequiv.harness.engine.verify import FullStorageError, Verdict, verify
from gradequiv.harness.errors import InvalidArgument, exception_line
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.harness.regime import EVERYTHING, Regime, stated_regime

__all__ = ["WRAPPERS", "DistributedVerdict", "Found", "RankPool", "RankPools", "likely_cause",
           "search", "verify_distributed"]

#: the engines the harness sets up itself (``user``: the function ``--parallelize`` names)
WRAPPERS = ("ddp", "fsdp", "tp", "fsdp-tp", "pp")
#: what ``--wrapper`` accepts beyond one engine: every engine the harness sets up that the
#: world size allows (``all``, the default) or the two data-parallel ones (``both``)
WRAPPER_GROUPS = {"all": WRAPPERS, "both": ("ddp", "fsdp")}


def engines_for(wrapper: str, world_size: int) -> tuple[str, ...]:
    """The engines ``--wrapper`` names that ``world_size`` ranks can form (the 2-D mesh
    needs pairs of pairs)."""
    named = WRAPPER_GROUPS.get(wrapper, (wrapper,))
    if wrapper in WRAPPER_GROUPS and (world_size < 2 * PAIR or world_size % PAIR):
        named = tuple(e for e in named if e != "fsdp-tp")
    return named


@dataclass
class DistributedVerdict:
    """What the ranks found of one case: each rank's verdict, as ``check`` gives one."""

    wrapper: str
    world_size: int
    passed: bool = False
    failures: list[str] = field(default_factory=list)  # each failing rank's first failure
    compared: int = 0  # tensors compared, over all ranks and steps
    error: str | None = None  # a rank's traceback, or the timeout
    seconds: float = 0.0
    verdicts: list[Verdict] = field(default_factory=list)  # by rank
    #: by rank, where a rank failed: the first diverging op on it (``localise``'s findings)
    evidence: list[dict[str, Any]] = field(default_factory=list)
    #: why no verdict could be given: full storage itself fails under the engine (the
    #: model's or the engine's fault, never the implementation's)
    unrunnable: str | None = None
    #: under a pipeline, where the two paths first part (``boundaries.Locus.to_dict``: the
    #: stage, its rank, the micro-batch), or where a path raised (``where``, in words)
    locus: dict[str, Any] | None = None

    def take(self, verdicts: tuple[Verdict, ...], evidence: tuple[dict[str, Any], ...]
             ) -> None:
        """The ranks' verdicts, and what each rank's op-level search found where one
        failed: failing ranks first by rank, the properties' own words; under a pipeline,
        the earliest of the ranks' first differences at their stages' boundaries."""
        evidence = tuple({k: v for k, v in e.items() if k != "pipeline"} for e in evidence)
        self.verdicts, self.evidence = list(verdicts), list(evidence)
        self.compared = sum(len(p.checks) for v in verdicts for p in v.properties)
        self.failures = [f"rank {rank}: {v.first_failure}"
                         for rank, v in enumerate(verdicts) if not v.passed]

    def take_locus(self, evidence: tuple[dict[str, Any], ...]) -> None:
        """The earliest of the ranks' first differences (each rank sees its own stages)."""
        from gradequiv.harness.engine.boundaries import Locus

        found = [Locus(**e["pipeline"]) for e in evidence if e.get("pipeline")]
        if found:
            self.locus = min(found, key=lambda locus: locus.order).to_dict()

    @property
    def first_failure(self) -> str:
        if self.unrunnable is not None:
            return f"not checked: {self.unrunnable}"
        said = exception_line(self.error) if self.error else (
            self.failures[0] if self.failures else "")
        return f"{said}; {self.where}" if said and self.where else said

    @property
    def where(self) -> str:
        """Where a pipeline case parted or raised, in words ("" where not told)."""
        from gradequiv.harness.engine.boundaries import Locus

        if self.locus is None:
            return ""
        if "where" in self.locus:
            return f"raised at {self.locus['where']}"
        return Locus(**self.locus).describe()


def verify_distributed(
    impl: Implementation,
    case: Case,
    *,
    wrapper: str = "ddp",
    world_size: int = 2,
    timeout_s: float = 300.0,
    device: str = "cpu",
    reshard_after_forward: bool | int = True,
    mixed_precision: bool = False,
    parallelize: str | None = None,
) -> DistributedVerdict:
    """Train ``case`` under ``wrapper`` (an engine: ddp, fsdp, or ``user``, the function
    ``parallelize`` names) on ``world_size`` ranks, full storage then recompute through
    ``impl``, and compare what every rank saw.

    ``device="cpu"``: gloo, every rank on the CPU. ``device="cuda"``: NCCL, rank r
    on GPU r, so it needs ``world_size`` GPUs.
    """
    parallel = _parallel(wrapper, reshard_after_forward, mixed_precision, parallelize)
    _check_pool(world_size, device, parallelize)
    refusal = case_refusal(case, world_size)
    if refusal:
        raise InvalidArgument(refusal)
    with RankPool(impl, world_size=world_size, device=device, timeout_s=timeout_s,
                  parallelize=parallelize) as pool:
        return pool.run(case, parallel)


def _parallel(wrapper: str, reshard: bool | int, mixed_precision: bool,
              parallelize: str | None) -> Parallel:
    if wrapper not in (*WRAPPERS, "user"):
        raise InvalidArgument(f"wrapper={wrapper!r} is not one of {', '.join(WRAPPERS)}, "
                              f"user")
    if wrapper == "user" and parallelize is None:
        raise InvalidArgument("wrapper='user' needs parallelize='module:function'")
    return Parallel(wrapper, reshard, mixed_precision)


def _check_pool(world_size: int, device: str, parallelize: str | None) -> None:
    """What a pool of ranks needs, refused before any rank starts."""
    if world_size < 2:
        raise InvalidArgument(f"world_size={world_size}: data parallelism needs at least 2")
    if device not in ("cpu", "cuda"):
        raise InvalidArgument(f"device={device!r} is not one of cpu, cuda")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise InvalidArgument(
            f"device='cuda' with world_size={world_size} needs {world_size} GPUs for NCCL (one "
            f"per rank); this machine has {torch.cuda.device_count()}; use device='cpu' (gloo)")
    if parallelize is not None:
        load_parallelize(parallelize)


def case_refusal(case: Case, world_size: int) -> str:
    """Why ``case`` cannot be trained on ``world_size`` ranks ("" where it can)."""
    if case.batch.batch_size < world_size:
        return (f"batch_size={case.batch.batch_size} < world_size={world_size}: every rank "
                f"needs a sample; raise batch_size in the case")
    undriven = [*case.loop_patterns()] + ([case.grad_mode] if case.grad_mode != "backward"
                                           else [])
    if undriven:
        return (f"the case has {', '.join(undriven)}: the distributed property trains one "
                f"forward and one loss.backward() per step, every parameter trained; give it "
                f"a case with grad_mode='backward', schedule='one', backward_passes=1, "
                f"backward_autocast=false, trainable='all'")
    experts = getattr(case.model, "moe_top_k", 0)
    if experts:
        return (f"moe_top_k={experts}: the engines' set-ups shard and wrap the "
                f"dense MLP (tensor parallelism's plan names mlp.fc and mlp.proj, DDP needs "
                f"every parameter used, and an expert no token reached is not); give the case "
                f"moe_top_k=0")
    return ""


def load_parallelize(spec: str) -> Callable[[Any, Any], Any]:
    """The user's ``parallelize(model, mesh) -> model`` named by ``module:function``."""
    from gradequiv.harness.implementations.resolve import user_function

    if ":" not in spec:
        raise InvalidArgument(f"--parallelize={spec!r} is not a 'module:function' reference; "
                              f"write e.g. 'my_models:parallelize'")
    return user_function("--parallelize", spec, "function (model, mesh) -> model")


class RankPool:
    """``world_size`` ranks, started once, each in one process group for the whole run,
    taking cases one after another (a process group per case costs seconds of start-up),
    each with ``impl`` or the implementation it is given (a rank imports each once).
    A rank that raises, dies or hangs fails its case; the pool is then started anew."""

    def __init__(self, impl: Implementation, *, world_size: int, device: str = "cpu",
                 timeout_s: float = 300.0, parallelize: str | None = None) -> None:
        self.impl, self.world_size, self.device = impl, world_size, device
        self.timeout_s, self.parallelize = timeout_s, parallelize
        self._folder = tempfile.TemporaryDirectory(prefix="gradequiv-dist-")
        self._context: Any = None
        self._tasks: list[Any] = []
        self._number = 0

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        import torch.multiprocessing as mp

        spawn = mp.get_context("spawn")
        self._tasks = [spawn.Queue() for _ in range(self.world_size)]
        started = Path(self._folder.name) / f"pool{self._number}"
        started.mkdir()
        self._out = started
        self._context = start_processes(  # type: ignore[no-untyped-call]  # untyped in torch
            _rank_main, args=(self.world_size, str(started), self.device, self._tasks,
                              self.parallelize),
            nprocs=self.world_size, join=False, start_method="spawn")

    def run(self, case: Case, parallel: Parallel, impl: Implementation | None = None
            ) -> DistributedVerdict:
        """``case`` under ``parallel`` on every rank: full storage, then the recompute
        through ``impl`` (by default the pool's)."""
        impl = impl or self.impl
        spec = (impl.spec, impl.adapter, impl.kwargs)
        if self._context is None:
            self._start()
        self._number += 1
        number = self._number
        verdict = DistributedVerdict(parallel.describe(), self.world_size)
        started = time.perf_counter()
        for queue in self._tasks:
            queue.put((number, spec, case.to_json(), parallel.to_dict()))
        results = [self._out / f"{number}-rank{r}.pt" for r in range(self.world_size)]
        errors = [self._out / f"{number}-rank{r}.err" for r in range(self.world_size)]
        refused = [self._out / f"{number}-rank{r}.ref" for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        while not all(p.exists() for p in results):
            refusal = next((r for r in refused if r.exists()), None)
            if refusal is not None:  # the model fails under the engine without recompute
                verdict.unrunnable = refusal.read_text(errors="replace")
                break
            if any(e.exists() for e in errors):
                time.sleep(0.2)  # the other ranks' errors, if they come at once
                verdict.error = "\n".join(f"{e.stem.split('-')[1]}: {e.read_text()}"
                                           for e in errors if e.exists())
                break
            if time.monotonic() > deadline:
                verdict.error = (f"the ranks did not finish within {self.timeout_s:.0f} s "
                                 f"(a collective that never completes?)"
                                 f"{self._where_ranks_wait()}")
                break
            dead = [p for p in self._context.processes if not p.is_alive()]
            if dead:
                said = "".join(f"\n{e.stem.split('-')[1]}: {e.read_text()}"
                               for e in sorted(self._out.glob("0-rank*.err")))
                said += "".join(f"\n{c.stem}: {c.read_text(errors='replace')}"
                                for c in sorted(self._out.glob("rank*.crash"))
                                if c.stat().st_size)
                verdict.error = (f"a rank died: exit code {dead[0].exitcode} (os._exit, a "
                                 f"signal or a crash in the implementation?){said}")
                break
            time.sleep(0.02)
        if verdict.error is not None or verdict.unrunnable is not None:
            raised = next((w.read_text() for w in sorted(self._out.glob(f"{number}-rank*.where"))),
                          None)
            verdict.locus = {"where": raised} if raised else None
            self._stop()  # its process group may be mid-collective: a fresh one next case
        else:
            verdicts, evidence = zip(*(_load_verdict(p) for p in results))
            verdict.take(verdicts, evidence)
            verdict.take_locus(evidence)
            for p in results:
                p.unlink()
        verdict.seconds = time.perf_counter() - started
        verdict.passed = verdict.error is None and not verdict.failures and verdict.compared > 0
        return verdict

    def _where_ranks_wait(self) -> str:
        """The Python stacks of the ranks still running, each asked for its own (a rank
        that raised may leave the others waiting on a send or a collective for ever)."""
        assert self._context is not None
        for process in self._context.processes:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(process.pid, signal.SIGUSR1)
        time.sleep(0.5)
        stacks = [f"\n{c.stem}, where it waited:\n{c.read_text(errors='replace').strip()}"
                  for c in sorted(self._out.glob("rank*.crash")) if c.stat().st_size]
        return "".join(stacks)

    def _stop(self) -> None:
        if self._context is None:
            return
        for process in self._context.processes:
            if process.is_alive():
                process.kill()
            process.join()
        self._context = None

    def close(self) -> None:
        """Ask the ranks to leave their process group and end; stop those that do not."""
        if self._context is not None:
            for queue in self._tasks:
                queue.put(None)
            for process in self._context.processes:
                process.join(10)
            self._stop()
        self._folder.cleanup()


class RankPools:
    """A :class:`RankPool` per world size a run trains on, each started on first use and
    kept for the run (a drawn run may try 2, 3 and 4 ranks)."""

    def __init__(self, impl: Implementation, *, device: str = "cpu", timeout_s: float = 300.0,
                 parallelize: str | None = None) -> None:
        self.impl, self.device, self.timeout_s = impl, device, timeout_s
        self.parallelize = parallelize
        self._pools: dict[int, RankPool] = {}

    def __enter__(self) -> RankPools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, case: Case, parallel: Parallel, world_size: int) -> DistributedVerdict:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(
                self.impl, world_size=world_size, device=self.device,
                timeout_s=self.timeout_s, parallelize=self.parallelize)
        return self._pools[world_size].run(case, parallel)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _load_verdict(path: Path) -> tuple[Verdict, dict[str, Any]]:
    with path.open("rb") as file:
        found: tuple[Verdict, dict[str, Any]] = pickle.load(file)  # this run's own ranks'
    return found


def _evidence(impl: Implementation, case: Case, device: torch.device, setup: RankSetup,
              verdict: Verdict) -> dict[str, Any]:
    """Where any rank's verdict failed, this rank's first diverging op (every rank searches
    together: the search trains the case's first step under the engine again)."""
    from gradequiv.harness.engine.boundaries import first_difference
    from gradequiv.harness.engine.localise import localise

    if setup.all_agree(verdict.passed):
        return {}
    if setup.parallel.pipeline is not None:  # its stages' boundaries, not yet their ops
        locus = first_difference(setup.rank)
        return {"pipeline": locus.to_dict() if locus is not None else None}
    found = localise(impl, case, device, ranks=setup)
    return {"localisation": found.describe(),
            "first_diverging_op": found.divergence.to_dict() if found.divergence else None}


def _rank_main(rank: int, world_size: int, folder: str, device_type: str, tasks: list[Any],
               parallelize: str | None) -> None:
    """One rank: one process group, then each case it is sent, both paths; results or a
    traceback to ``folder``, until it is sent None. A crash (a signal) leaves the Python
    stacks of the rank's threads in ``rank<r>.crash`` there."""
    import faulthandler
    import logging

    # DTensor logs, once per gather of a 2-D sharded tensor, that two all-gathers are slower
    # than one: the whole tensors the properties compare, not the training's own traffic
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out = Path(folder)
    crash = (out / f"rank{rank}.crash").open("w")  # open for the life of the rank
    faulthandler.enable(crash, all_threads=True)
    # the parent asks a rank past its time where it waits (RankPool._where_ranks_wait)
    faulthandler.register(signal.SIGUSR1, file=crash, all_threads=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: loopback, not a NIC
    torch.set_num_threads(1)  # the ranks share the machine's cores
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{out / 'rendezvous'}",
                                rank=rank, world_size=world_size)
        from gradequiv.harness.implementations.resolve import resolve

        resolved: dict[str, Implementation] = {}
        user = load_parallelize(parallelize) if parallelize is not None else None
        while (task := tasks[rank].get()) is not None:
            number, spec, case_json, parallel = task
            try:
                if repr(spec) not in resolved:
                    resolved[repr(spec)] = resolve(spec[0], adapter=spec[1], kwargs=spec[2])
                impl = resolved[repr(spec)]
                case = Case.from_json(case_json)
                setup = RankSetup(Parallel.from_dict(parallel), rank, world_size, device.type,
                                  user)
                try:
                    verdict = verify(impl, case, device=device, ranks=setup)
                except FullStorageError as exc:
                    where = str(exc).splitlines()[0].split("; this is")[0]
                    (out / f"{number}-rank{rank}.ref").write_text(
                        f"{where} under {setup.parallel.describe()}: "
                        f"{exception_line(str(exc))}; a fault of the model under this "
                        f"engine, not of the implementation")
                    continue
                evidence = _evidence(impl, case, device, setup, verdict)
                with (out / f".{number}-rank{rank}.pt").open("wb") as file:
                    pickle.dump((verdict, evidence), file)
                os.replace(out / f".{number}-rank{rank}.pt", out / f"{number}-rank{rank}.pt")
            except Exception as exc:
                where = _raised_at(exc)
                if where:  # the pipeline's stage and micro-batch, before the traceback
                    (out / f"{number}-rank{rank}.where").write_text(where)
                (out / f"{number}-rank{rank}.err").write_text(traceback.format_exc())
    except Exception:
        (out / f"0-rank{rank}.err").write_text(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        faulthandler.disable()
        crash.close()


def _raised_at(exc: BaseException) -> str:
    """The stage, micro-batch and pass a pipeline path raised in ("" where not one)."""
    from gradequiv.harness.engine.staged import StagedPathError

    return exc.where if isinstance(exc, StagedPathError) else ""


#: cases a drawn run tries while shrinking a failure, at most: each is seconds on the ranks
SHRINK_TRIES = 20


@dataclass
class Found:
    """The smallest failing case a drawn run found, its engine and what the ranks saw."""

    case: Case
    parallel: Parallel
    verdict: DistributedVerdict


class _Failed(Exception):
    def __init__(self, found: Found) -> None:
        super().__init__(found.verdict.first_failure)
        self.found = found


def search(pools: RankPools, *, max_world_size: int, engines: tuple[str, ...],
           model: str | None, examples: int, seed: int, say: Callable[[str], None],
           seen: Callable[[Found, bool], None] | None = None, model_parallel: bool = False,
           schedules: tuple[str, ...] | None = None, split: str | None = None,
           regime: Regime = EVERYTHING) -> tuple[int, Found | None]:
    """Draw ``examples`` cases with their engine and world size
    (:func:`~gradequiv.properties.strategies.distributed_runs`) and run each on its ranks;
    shrink a failure (at most :data:`SHRINK_TRIES` more cases), towards the fewest ranks.
    ``seen`` is told of each case run, and whether it was tried while shrinking. How many
    cases ran, and the smallest failure found (None: every case passed)."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
    from hypothesis import seed as seeded

    from gradequiv.properties.strategies import distributed_runs

    ran = [0, 0]  # cases run, of them while shrinking
    smallest: list[Found] = []  # each failure is smaller than the last: the shrinker's order

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              report_multiple_bugs=False, verbosity=Verbosity.quiet, print_blob=False,
              phases=[p for p in Phase if p != Phase.explain],
              suppress_health_check=list(HealthCheck))
    @seeded(seed)
    @given(drawn=distributed_runs(max_world_size=max_world_size, engines=engines,
                                  model=model, device=pools.device,
                                  model_parallel=model_parallel, schedules=schedules,
                                  split=split, regime=regime))
    def one(drawn: tuple[Case, Parallel, int]) -> None:
        case, parallel, world = drawn
        shrinking = ran[1] > 0
        if case_refusal(case, world) or shrinking and ran[1] > SHRINK_TRIES:
            reject()
        if split is not None and _pipeline_refusal(case, parallel, world):
            reject()  # a layout the user's batch does not divide into (checked up front)
        verdict = pools.run(case, parallel, world)
        on = f" on {world} ranks" if max_world_size > 2 else ""
        if verdict.unrunnable is not None:  # no verdict: a case the engine cannot train
            say(f"[-] {case.describe()}, {parallel.describe()}{on}: {verdict.first_failure}")
            reject()
        if seen is not None:
            seen(Found(case, parallel, verdict), shrinking)
        ran[0] += 1
        ran[1] += shrinking or not verdict.passed
        said = "pass" if verdict.passed else f"FAIL: {verdict.first_failure}"
        say(f"[{ran[0]}] {case.describe()}, {parallel.describe()}{on}: {said} "
            f"({verdict.seconds:.1f} s)")
        if not verdict.passed:
            smallest[:] = [Found(case, parallel, verdict)]
            raise _Failed(smallest[0])

    try:
        one()
    except BaseException as exc:  # the last replay may be refused once the budget is spent
        if not smallest or isinstance(exc, KeyboardInterrupt):
            raise
    return ran[0], smallest[0] if smallest else None


#: what :func:`single_process` says of a case that passes in one process
PASSES_ALONE = "the same case passes in one process: it goes wrong only across ranks"
#: ... and of an implementation that runs on ranks only (DeepSpeed's partitioning)
RANKS_ONLY = "it runs on ranks only: not checked in one process"


def single_process(impl: Implementation, case: Case) -> str:
    """What ``check`` says of ``case`` in one process: its likely cause, or
    :data:`PASSES_ALONE` (what goes wrong then happens only across ranks)."""
    import contextlib
    import io
    import json

    from gradequiv.harness.commands import check
    from gradequiv.harness.options import check_options

    if getattr(impl.target, "gradequiv_needs_ranks", False):
        return RANKS_ONLY
    named = impl.command_args()  # --impl SPEC [--adapter A] [--impl-kwarg K=V ...]
    kwargs = [value for flag, value in zip(named, named[1:]) if flag == "--impl-kwarg"]
    with tempfile.TemporaryDirectory(prefix="gradequiv-dist-cause-") as folder:
        try:
            options = check_options(impl=impl.spec, adapter=impl.adapter, impl_kwargs=kwargs,
                                    case=case.to_json(), profile="ci", report_dir=folder,
                                    read_pyproject=False)  # one given case: as it is
            with contextlib.redirect_stdout(io.StringIO()):
                code = check.run(options)
            report = json.loads((Path(folder) / "report.json").read_text(encoding="utf-8"))
        except Exception as exc:  # the single-process check itself refused: say so, go on
            return f"not checked in one process ({type(exc).__name__}: {exc})"
    if code == 0:
        return PASSES_ALONE
    failure = report.get("failure") or {}
    sentence = (failure.get("diagnosis") or {}).get("sentence") or failure.get("message")
    return str(sentence or "it fails in one process too")


def reproduce_line(impl: Implementation, case: Case, parallel: Parallel, world_size: int,
                   parallelize: str | None) -> str:
    """The command that replays ``case`` on its ranks under its engine."""
    import shlex

    words = ["gradequiv", "distributed", *impl.command_args(), "--world-size", str(world_size),
             "--wrapper", parallel.engine]
    if parallel.sharded:
        words += ["--reshard-after-forward", str(parallel.reshard_after_forward).lower()]
    if parallel.mixed_precision:
        words += ["--mixed-precision"]
    if parallel.sequence_parallel:
        words += ["--sequence-parallel"]
    if parallel.model_parallel:
        words += ["--model-parallel"]
    if parallel.pipeline is not None:
        words += ["--schedule", parallel.pipeline.schedule,
                  "--micro-batches", str(parallel.pipeline.micro_batches)]
        if parallel.pipeline.split is not None:
            words += ["--split", parallel.pipeline.split]
    if parallelize is not None:
        words += ["--parallelize", parallelize]
    words += ["--case", case.to_json()]
    return shlex.join(words)


def run(args: Any) -> int:
    """The distributed command: drawn cases (or the one ``--case``) on N ranks under each
    engine; exit 1 when any case's ranks disagree with full storage."""
    import contextlib

    from gradequiv.harness.engine.spread import load_case
    from gradequiv.harness.implementations.resolve import resolve
    from gradequiv.harness.validate import impl_kwargs

    impl = resolve(args.impl, adapter=args.adapter, kwargs=impl_kwargs(args.impl_kwarg))
    engines = engines_for(args.wrapper, args.world_size)
    if args.parallelize is not None and args.wrapper in WRAPPER_GROUPS:
        engines = ("user",)
    if args.model_parallel and args.parallelize is None:
        raise InvalidArgument("--model-parallel says what your --parallelize set-up does: "
                              "give --parallelize MODULE:FUNCTION too (the harness's own "
                              "tensor parallelism is --wrapper tp)")
    if "user" in engines and args.parallelize is None:
        raise InvalidArgument("--wrapper=user needs --parallelize MODULE:FUNCTION, your "
                              "function (model, mesh) -> model")
    regime = stated_regime(args.regime or None)
    args.regime = regime  # read once: the report's options take it whole
    args.micro_batches = args.micro_batches or regime.micro_batches
    _check_split(args, engines)
    _check_pool(args.world_size, args.device, args.parallelize)
    case = load_case(args.case) if args.case is not None else None
    if case is not None and case_refusal(case, args.world_size):
        raise InvalidArgument(f"--case: {case_refusal(case, args.world_size)}")
    backend = "NCCL" if args.device == "cuda" else "gloo"
    with contextlib.ExitStack() as stack:  # the report folder locked to the end
        report = RunReport.claim(stack, args, impl) if args.report_dir is not None else None
        seen = report.add if report is not None else None
        with RankPools(impl, device=args.device, timeout_s=args.timeout,
                       parallelize=args.parallelize) as pools:  # the ranks end here
            if case is not None:
                ran, found = _run_one(pools, impl, case, engines, args, backend, seen)
            else:
                sizes = (f"2 to {args.world_size} ranks" if args.world_size > 2
                         else f"{args.world_size} ranks")
                print(f"gradequiv distributed: {impl.spec} on {sizes} ({backend}), "
                      f"{args.examples} drawn cases under {', '.join(engines)}, "
                      f"seed {args.seed}", flush=True)
                if regime.stated:
                    print(f"gradequiv distributed: {regime.describe()}", flush=True)
                ran, found = search(pools, max_world_size=args.world_size, engines=engines,
                                    model=args.model, examples=args.examples, seed=args.seed,
                                    say=lambda line: print(line, flush=True), seen=seen,
                                    model_parallel=args.model_parallel,
                                    schedules=(args.schedule,) if args.schedule
                                    else regime.pipeline_schedules,
                                    split=args.split, regime=regime)
        diagnosis = None
        if found is None:
            print(f"{ran} case(s) verified on every rank\nverdict: pass")
        else:
            if case is None:
                print(f"{ran} case(s) run, the last ones shrinking a failure")
            diagnosis = _say_failure(impl, found, args.parallelize)
        if report is not None:
            report.finish(found, diagnosis)
    return 0 if found is None else 1


def _run_one(pools: RankPools, impl: Implementation, case: Case, engines: tuple[str, ...],
             args: Any, backend: str, seen: Callable[[Found, bool], None] | None
             ) -> tuple[int, Found | None]:
    """``--case``: the one case under each engine; the first failure."""
    failed = None
    for engine in engines:
        parallel = Parallel(engine, args.reshard_after_forward,
                            args.mixed_precision and engine in ("fsdp", "fsdp-tp"),
                            args.model_parallel and engine == "user",
                            args.sequence_parallel and engine in ("tp", "fsdp-tp"),
                            _pipelining(args) if engine == "pp" else None)
        refused = _pipeline_refusal(case, parallel, args.world_size)
        if refused and len(engines) > 1:
            print(f"gradequiv distributed: not run under {parallel.describe()}: {refused}")
            continue
        if refused:
            raise InvalidArgument(f"--case under --wrapper pp: {refused}")
        print(f"gradequiv distributed: {impl.spec} under {parallel.describe()}, "
              f"{args.world_size} ranks ({backend}), {case.describe()}", flush=True)
        verdict = pools.run(case, parallel, args.world_size)
        if seen is not None:
            seen(Found(case, parallel, verdict), False)
        if verdict.passed:
            print(f"  pass: {verdict.compared} tensors equal on every rank; {_held(verdict)} "
                  f"({verdict.seconds:.1f} s)", flush=True)
        else:
            print(f"  FAIL: {verdict.first_failure}", flush=True)
            for line in verdict.failures[1:5]:
                print(f"        {line}")
            failed = failed or Found(case, parallel, verdict)
    return len(engines), failed


def _check_split(args: Any, engines: tuple[str, ...]) -> None:
    """``--split`` cuts the user's model (``--model``) into the stages of ``--wrapper pp``:
    refused without either, before any rank starts."""
    split = getattr(args, "split", None)
    if split is None:
        if engines == ("pp",) and args.model is not None:
            raise InvalidArgument(f"--wrapper pp with --model {args.model} needs --split "
                                  f"MODULE:FUNCTION: the split by layers is the reference "
                                  f"transformer's; name your function (model, n_stages) -> "
                                  f"list of n_stages nn.Modules")
        return
    if args.model is None and args.case is None:
        raise InvalidArgument(f"--split={split!r} without --model: a split function cuts "
                              f"your model into stages (the reference transformer is split "
                              f"by layers); give --model MODULE:FACTORY too")
    if "pp" not in engines:
        raise InvalidArgument(f"--split={split!r} with --wrapper {args.wrapper}: the split "
                              f"is a pipeline's stages; use --wrapper pp")
    from gradequiv.harness.engine.pipeline import load_split, user_split_refusal
    from gradequiv.models import ExternalConfig

    load_split(split)
    if args.case is None:  # drawn cases: the split and the batch seen once, on two ranks
        drawn = Case(model=ExternalConfig(args.model))
        layout = _pipelining(argparse.Namespace(**{**vars(args), "world_size": 2}))
        why = user_split_refusal(drawn, layout, 2)
        if why:
            raise InvalidArgument(f"--split under {layout.describe()} on 2 ranks: {why}")


def _pipelining(args: Any) -> Any:
    """The pipeline ``--schedule``, ``--micro-batches`` and ``--split`` stated for
    ``--case`` (GPipe, and one micro-batch per rank or per stage, where not given)."""
    from gradequiv.harness.engine.pipeline import Pipelining

    schedule = args.schedule or "gpipe"
    micro = args.micro_batches or Pipelining(schedule, 1).n_stages(args.world_size)
    return Pipelining(schedule, micro, split=getattr(args, "split", None))


def _pipeline_refusal(case: Case, parallel: Parallel, world_size: int) -> str | None:
    """Why ``case`` cannot go through ``parallel``'s pipeline; None where it can, or no
    pipeline is asked for. A user's model is built once here to see its batch and its
    split (a mistake there is the user's to fix, not a case that fails on the ranks)."""
    if parallel.pipeline is None:
        return None
    from gradequiv.harness.engine.pipeline import pipeline_refusal, user_split_refusal

    return (pipeline_refusal(case, parallel.pipeline, world_size)
            or user_split_refusal(case, parallel.pipeline, world_size))


def _held(verdict: DistributedVerdict) -> str:
    """The bytes each rank held for backward, recompute against full storage."""
    said = []
    for rank, seen in enumerate(verdict.verdicts):
        held = seen.held_bytes
        if held.get("recompute") is not None and held.get("full") is not None:
            said.append(f"rank {rank} {held['recompute']} of {held['full']}")
    return ("held for backward (recompute of full storage, bytes): " + ", ".join(said)
            if said else "no memory watched")


def _say_failure(impl: Implementation, found: Found,
                 parallelize: str | None) -> dict[str, Any] | None:
    """Print the minimal failure, its likely cause and the line that replays it; the
    cause's diagnosis, for the report."""
    verdict = found.verdict
    print(f"minimal failure: {found.case.describe()}, under {found.parallel.describe()} on "
          f"{verdict.world_size} ranks")
    print(f"    {verdict.first_failure}")
    for line in verdict.failures[1:4]:
        print(f"    {line}")
    diagnosis = likely_cause(impl, found)
    if diagnosis is not None:
        print(f"likely cause: {diagnosis['sentence']}")
    line = reproduce_line(impl, found.case, found.parallel, verdict.world_size, parallelize)
    print(f"    reproduce: {line}")
    print("verdict: FAIL")
    return diagnosis


def likely_cause(impl: Implementation, found: Found) -> dict[str, Any] | None:
    """The likely cause of a failure on the ranks, a diagnosis as report.json keeps one
    (None where no rank gave a verdict: one died or hung). Read from a failing rank's own
    evidence as ``check`` reads a case's: first a rank whose re-run itself parted from its
    forward (its first diverging op: under DDP every rank's gradients differ once one
    rank's do), and said with the rank; then what ``check`` says of the same case in one
    process: that it fails there too, or that it goes wrong only across ranks."""
    from gradequiv.harness.reports.report import verdict_diagnosis

    verdict = found.verdict
    evidence = verdict.evidence or [{} for _ in verdict.verdicts]
    failing = [(rank, v, evidence[rank]) for rank, v in enumerate(verdict.verdicts)
               if not v.passed]
    if not failing:
        return None
    rank, seen, found_there = next(
        (f for f in failing if f[2].get("first_diverging_op")), failing[0])
    diagnosis = verdict_diagnosis(impl, seen, torch.device("cpu"), **found_there).to_dict()
    alone = single_process(impl, found.case)
    if alone == PASSES_ALONE:
        diagnosis["sentence"] += (f" (rank {rank}; {PASSES_ALONE}, under "
                                  f"{found.parallel.describe()})")
    elif alone == RANKS_ONLY:
        diagnosis["sentence"] += f" (rank {rank}; {RANKS_ONLY})"
    elif not found_there.get("first_diverging_op"):
        # no op-level evidence on the ranks (a pipeline's stages are not searched yet):
        # the cause check finds in one process, where it has the first diverging op
        diagnosis["sentence"] = (f"{alone} (the cause of the same case in one process; "
                                 f"rank {rank} fails under {found.parallel.describe()})")
    else:
        diagnosis["sentence"] += f" (rank {rank}; the same case fails in one process too)"
    return diagnosis


class RunReport:
    """report.json and report.md of a distributed run in ``--report-dir``, by the one author
    (:mod:`~gradequiv.harness.reports.report`): rewritten whole after each case, so a run
    that is killed leaves the cases that finished, marked incomplete."""

    def __init__(self, folder: Path, impl: Implementation, args: Any) -> None:
        from gradequiv.harness.options import check_options
        from gradequiv.harness.reports.files import run_identity

        self.folder, self.impl, self.args = folder, impl, args
        self.options = check_options(impl=impl.spec, adapter=impl.adapter, seed=args.seed,
                                     examples=args.examples, profile="ci", report_dir=folder,
                                     regime=args.regime)
        self.identity = run_identity()
        self.records: list[dict[str, Any]] = []

    @classmethod
    def claim(cls, stack: Any, args: Any, impl: Implementation) -> RunReport:
        """The folder made this run's (locked, an earlier run's report files removed)."""
        from gradequiv.harness.reports.files import claim_report_dir, lock_report_dir

        report = cls(args.report_dir, impl, args)
        stack.enter_context(lock_report_dir(args.report_dir, report.identity))
        claim_report_dir(args.report_dir)
        return report

    def add(self, found: Found, shrinking: bool) -> None:
        from gradequiv.harness.reports.report import SHRINK_KEY, ranks_record

        verdict = found.verdict
        record = ranks_record(
            self.impl, verdict.verdicts, case=found.case, passed=verdict.passed,
            first_failure=verdict.first_failure, error=verdict.error,
            seconds=verdict.seconds, engine={**found.parallel.to_dict(),
                                             "world_size": verdict.world_size},
            device=torch.device(self.args.device), reproduce=self._reproduce(found))
        if shrinking:
            record[SHRINK_KEY] = True
        self.records.append(record)
        self._write(None, None, complete=False)

    def finish(self, found: Found | None, diagnosis: dict[str, Any] | None) -> None:
        from gradequiv.harness.commands.render import write_views

        self._write(found, diagnosis, complete=True)
        write_views(self.folder, ("md",))

    def _reproduce(self, found: Found) -> str:
        return reproduce_line(self.impl, found.case, found.parallel,
                              found.verdict.world_size, self.args.parallelize)

    def _write(self, found: Found | None, diagnosis: dict[str, Any] | None, *,
               complete: bool) -> None:
        from gradequiv.harness.reports.files import REPORT_FILE, write_json_atomic
        from gradequiv.harness.reports.report import assemble_check_report

        failures = []
        if found is not None:
            failing = next((v for v in found.verdict.verdicts if not v.passed), None)
            prop = next((p.name for p in failing.properties if p.passed is False),
                        "gradients") if failing is not None else "process"
            failure: dict[str, Any] = {
                "test": "distributed", "property": prop,
                "message": found.verdict.first_failure, "flaky": False,
                "case": found.case.to_dict(), "description": found.case.describe(),
                "reproduce": self._reproduce(found)}
            if diagnosis is not None:
                failure["diagnosis"] = diagnosis
            if found.verdict.locus is not None:
                failure["pipeline"] = found.verdict.locus
            failures.append(failure)
        outcome = "passed" if found is None else "failed"
        report = assemble_check_report(
            options=self.options, impl=self.impl, device=torch.device(self.args.device),
            records=self.records, outcomes={"distributed": outcome} if complete else {},
            failures=failures, complete=complete, run=self.identity, command="distributed")
        write_json_atomic(self.folder / REPORT_FILE, report)

"""Recompute under data parallelism: DDP or FSDP training with and without it, world size N.

Recompute is used together with DDP and sharded data parallelism, and the
combination has its own ways to go wrong: a reentrant checkpoint re-runs a
segment whose parameters DDP has already marked ready, FSDP must gather
sharded weights again for the recompute, and each rank draws its own dropout
masks. So the same case is trained twice in the same process group, full
storage then recompute, and every rank's losses, the reduced gradients and
the final weights must match.

Ranks are started with torch's own launcher (multiprocessing spawn), talk
over gloo on the CPU (NCCL on GPUs), rendezvous through a file, and are
killed when the run exceeds its time limit, so a hang in a collective ends
as a failed verdict, not a stuck CI job.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.multiprocessing.spawn import (
    ProcessExitedException,
    ProcessRaisedException,
    start_processes,
)

from gradequiv.harness.engine.case import Case
from gradequiv.harness.engine.compare import Tolerance, measure_pairs
from gradequiv.harness.engine.path import prepare
from gradequiv.harness.errors import InvalidArgument, exception_line
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.models.kinds import TRANSFORMER

__all__ = ["WRAPPERS", "DistributedVerdict", "verify_distributed"]

WRAPPERS = ("ddp", "fsdp")


@dataclass
class DistributedVerdict:
    wrapper: str
    world_size: int
    passed: bool = False
    failures: list[str] = field(default_factory=list)  # one line per mismatched tensor
    compared: int = 0  # tensors compared, over all ranks and steps
    error: str | None = None  # a rank's traceback, or the timeout
    seconds: float = 0.0

    @property
    def first_failure(self) -> str:
        return exception_line(self.error) if self.error else (
            self.failures[0] if self.failures else "")


def verify_distributed(
    impl: Implementation,
    case: Case,
    *,
    wrapper: str = "ddp",
    world_size: int = 2,
    timeout_s: float = 300.0,
    device: str = "cpu",
) -> DistributedVerdict:
    """Train ``case`` under ``wrapper`` on ``world_size`` ranks, full storage then
    recompute through ``impl``, and compare what every rank saw.

    ``device="cpu"``: gloo, every rank on the CPU. ``device="cuda"``: NCCL, rank r
    on GPU r, so it needs ``world_size`` GPUs.
    """
    if wrapper not in WRAPPERS:
        raise InvalidArgument(f"wrapper={wrapper!r} is not one of {', '.join(WRAPPERS)}")
    if world_size < 2:
        raise InvalidArgument(f"world_size={world_size}: data parallelism needs at least 2")
    if case.batch.batch_size < world_size:
        raise InvalidArgument(
            f"batch_size={case.batch.batch_size} < world_size={world_size}: every rank needs "
            f"a sample; raise batch_size in the case")
    if device not in ("cpu", "cuda"):
        raise InvalidArgument(f"device={device!r} is not one of cpu, cuda")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise InvalidArgument(
            f"device='cuda' with world_size={world_size} needs {world_size} GPUs for NCCL (one "
            f"per rank); this machine has {torch.cuda.device_count()}; use device='cpu' (gloo)")
    undriven = [*case.loop_patterns()] + ([case.grad_mode] if case.grad_mode != "backward"
                                           else [])
    if undriven:
        raise InvalidArgument(
            f"the case has {', '.join(undriven)}: the distributed property trains one forward "
            f"and one loss.backward() per step, every parameter trained; give it a case with "
            f"grad_mode='backward', schedule='one', backward_passes=1, "
            f"backward_autocast=false, trainable='all'")
    if case.model_kind != TRANSFORMER:
        raise InvalidArgument(f"model_kind={case.model_kind!r}: the distributed property runs "
                              f"the transformer")
    verdict = DistributedVerdict(wrapper, world_size)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradequiv-dist-") as folder:
        out = Path(folder)
        spec = (impl.spec, impl.adapter, impl.kwargs)
        context = start_processes(  # type: ignore[no-untyped-call]  # untyped in torch
            _rank_main, args=(world_size, spec, case.to_json(), wrapper, str(out), device),
            nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    verdict.error = (f"the ranks did not finish within {timeout_s:.0f} s "
                                     f"(a collective that never completes?)")
                    break
        except ProcessRaisedException as exc:  # pragma: no cover - ranks catch their own
            verdict.error = str(exc)
        except ProcessExitedException as exc:
            verdict.error = f"a rank died: {exc}"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        errors = sorted(out.glob("rank*.err"))
        if verdict.error is None and errors:
            verdict.error = "\n".join(f"{e.stem}: {e.read_text()}" for e in errors)
        if verdict.error is None:
            results = [torch.load(out / f"rank{r}.pt") for r in range(world_size)]
            _compare(results, case, verdict)
    verdict.seconds = time.perf_counter() - started
    verdict.passed = verdict.error is None and not verdict.failures and verdict.compared > 0
    return verdict


def _compare(results: list[dict[str, dict[str, Tensor]]], case: Case,
             verdict: DistributedVerdict) -> None:
    tolerance = Tolerance(case.dtype)
    names, pairs = [], []
    for rank, result in enumerate(results):
        full, recompute = result["full"], result["recompute"]
        for name in (n for n in full if n in recompute):
            names.append(f"rank {rank}: {name}")
            pairs.append((recompute[name], full[name]))
        missing = sorted(set(full) ^ set(recompute))
        verdict.failures += [f"rank {rank}: {n} exists on one path only" for n in missing]
    for name, (_, reference), metrics in zip(names, pairs, measure_pairs(pairs)):
        bound = tolerance.bound(0.0, reference.dtype)
        if not tolerance.passes(metrics, bound):
            verdict.failures.append(
                f"{name}: relative error {metrics.rel_error:.3g} > bound {bound:.3g}; "
                f"{metrics.mismatched} of {metrics.numel} elements differ")
    verdict.compared = len(pairs)


def _rank_main(rank: int, world_size: int, spec: tuple[str, str, dict[str, Any]],
               case_json: str, wrapper: str, folder: str, device_type: str) -> None:
    """One rank: both paths in one process group; results or a traceback to ``folder``."""
    out = Path(folder)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: loopback, not a NIC
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{out / 'rendezvous'}",
                                rank=rank, world_size=world_size)
        from gradequiv.harness.implementations.resolve import resolve

        impl = resolve(spec[0], adapter=spec[1], kwargs=spec[2])
        case = Case.from_json(case_json)
        results = {"full": _train(case, None, wrapper, rank, world_size, device),
                   "recompute": _train(case, impl, wrapper, rank, world_size, device)}
        torch.save(results, out / f"rank{rank}.pt")
    except Exception:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(case: Case, impl: Implementation | None, wrapper: str, rank: int,
           world_size: int, device: torch.device) -> dict[str, Tensor]:
    """``case.steps`` SGD steps on this rank's share of the fixed batch; what it saw.

    Every rank builds the same weights, but seeds the training stream ``rank``
    past the case's: each rank draws its own dropout masks, as in real training.
    """
    path = prepare(case, impl, device, seed_offset=rank)  # wrapping below draws nothing
    model = path.model
    path = replace(path, inputs=tuple(t[rank::world_size] if t is not None else None
                                      for t in path.inputs),
                   targets=path.targets[rank::world_size])
    wrapped: Any
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.get_submodule("blocks").children():
            fully_shard(block)
        wrapped = fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[str, Tensor] = {}
    for step in range(1, case.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        loss = path.forward(wrapped)[1]
        loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch
        seen[f"step {step} loss"] = loss.detach().clone()
        for name, param in model.named_parameters():
            if param.grad is not None:
                seen[f"step {step} grad of {name}"] = _full(param.grad)
        optimizer.step()
    for name, param in model.named_parameters():
        seen[f"weight {name}"] = _full(param.detach())
    return seen


def _full(t: Tensor) -> Tensor:
    """The whole tensor on this rank (FSDP keeps shards: gather them)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().to("cpu", copy=True)



def run(args: Any) -> int:
    """The distributed command: exit 1 when any wrapper's ranks disagree with full storage."""
    from gradequiv.harness.engine.spread import load_case
    from gradequiv.harness.implementations.resolve import resolve
    from gradequiv.harness.validate import impl_kwargs

    wrappers = list(WRAPPERS) if args.wrapper == "both" else [args.wrapper]
    impl = resolve(args.impl, adapter=args.adapter, kwargs=impl_kwargs(args.impl_kwarg))
    case = load_case(args.case)
    failed = False
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
    return 1 if failed else 0

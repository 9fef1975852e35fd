"""Run one case down one path and observe everything the properties need.

A path (set up by :mod:`.path`) is: build the workload from the case's seed
(so every path starts from the same weights and batch), route the selected
segments through the implementation (or call them plainly: the full-storage
path), then train for ``case.steps`` optimizer steps from one seeded random
stream, asking for gradients as the case says (``loss.backward()``,
``torch.autograd.grad``, two micro-batches accumulated, or a gradient penalty taken
with ``create_graph=True`` and backpropagated again), after an eval and
a ``no_grad`` forward where the case has them. Observed per step: loss,
outputs, every parameter and input gradient (``None`` kept as ``None``), any
``.grad`` that ``torch.autograd.grad`` changed, buffers, RNG state, how often
each segment's forward ran in the forward and in the backward phase, and on
the recompute path the backward ops that read its parameters, the activation
bytes held for backward after the step's first forward and those the step left
alive after its backward (a leak may start at any step: a stash a later step
fills); once: the eval and ``no_grad`` outputs, the final parameters, and
torch's global switches as the path left them (:mod:`.global_state`).

An exception raised by the implementation is caught here and kept with its
traceback: it becomes a failed verdict, never a crash of the harness.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from gradequiv.harness.engine.attribution import ParameterUses
from gradequiv.harness.engine.case import Case
from gradequiv.harness.engine.global_state import GlobalState, snapshot
from gradequiv.harness.engine.memory import ActivationCounter, RecomputeCarry, SavedBytes
from gradequiv.harness.engine.outputs import main_output
from gradequiv.harness.engine.parallel import RankSetup
from gradequiv.harness.engine.path import PreparedPath, build_path
from gradequiv.harness.engine.saves import SavedCalls
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.harness.implementations.compiled import CompileSettings, compile_model
from gradequiv.models import Segment
from gradequiv.models.segments import RoutedModel, Router, UserNames

LEARNING_RATE = 1e-2
MOMENTUM = 0.9
#: The weight of the gradient penalty in ``create-graph`` cases: small, so that training
#: stays the loss's, and still far above the bound in what it adds to every gradient.
GRADIENT_PENALTY = 1e-2


@dataclass
class StepRecord:
    """What one optimizer step left behind, before the optimizer moved the weights."""

    loss: Tensor
    outputs: Tensor
    grads: dict[str, Tensor | None]  # "param:<name>" and "input:<segment>:<arg>"
    buffers: dict[str, Tensor]
    rng: dict[str, Tensor]  # "cpu", "cuda:N": the global generator states after the step
    # counted module -> [forward-phase calls, backward-phase calls with grad on, forward-phase
    # calls with grad on]
    calls: dict[str, list[int]]
    touched: list[str] = field(default_factory=list)  # .grad changed by torch.autograd.grad
    left_bytes: int | None = None  # bytes the step made, alive after its backward (a leak)
    # bytes the step's first forward made, alive at backward and let go of by it
    held_bytes: int | None = None
    # counted module -> [ops reading its parameters in forward, the same in backward with
    # grad on]
    uses: dict[str, list[int]] = field(default_factory=dict)
    # counted module -> forward calls that saved a tensor for backward (full storage only)
    saved: dict[str, int] = field(default_factory=dict)
    held_saved: bool | None = None  # whether that forward of held_bytes saved any (the same)
    # the most activation bytes alive in that micro-batch's backward (the forward's left, plus
    # what re-runs made; full storage: held_bytes)
    backward_peak_bytes: int | None = None
    # the most bytes earlier re-runs of other segments still held when a segment's re-run
    # ended, those segments, that segment, and its own re-run's bytes then (RecomputeCarry)
    carried_bytes: int | None = None
    carried_from: tuple[str, ...] = ()
    carried_at: tuple[str, ...] = ()
    carried_own: int = 0
    # the backward passes over each micro-batch, where the runtime decides them (a pipeline
    # schedule's input and weight passes); None: the case's own (``backward_passes``)
    backward_passes: int | None = None


@dataclass
class PathRun:
    steps: list[StepRecord] = field(default_factory=list)
    params: dict[str, Tensor] = field(default_factory=dict)  # after the last optimizer step
    held_bytes: int | None = None  # step 1's held_bytes (StepRecord)
    held_on: dict[str, int] | None = None  # the same bytes by device ("cpu", "cuda:0")
    seconds: float = 0.0
    error: str | None = None  # traceback of an exception raised inside the path
    error_at: str = ""  # "step 1 forward", "step 2 backward", ...
    warnings: list[str] = field(default_factory=list)
    starts: list[StepStart] = field(default_factory=list)  # state at the start of steps 2, 3, ...
    probes: dict[str, Tensor] = field(default_factory=dict)  # eval and no_grad forward outputs
    global_state: GlobalState | None = None  # torch's global switches as the path left them
    # each segment call's return signature, in order (full storage's: what a recompute
    # path's calls must return; models.segments.Router)
    returns: list[Any] = field(default_factory=list)
    # counted modules of the selected segments the implementation left plain (a toggle's
    # every_n_layers): counted like the others, and none of them may re-run in backward
    left_plain: frozenset[str] = frozenset()


@dataclass
class StepStart:
    """Where a step begins: weights, optimizer state, RNG state (for ``start_from``)."""

    params: dict[str, Tensor]
    optimizer: dict[str, dict[str, Any]]  # parameter name -> its optimizer state
    rng: dict[str, Tensor]


class _Phase:
    """Which part of a step is running; read by the forward-call counter."""

    def __init__(self) -> None:
        self.index = 0  # 0: forward, 1: backward

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        self.index = 1
        try:
            yield
        finally:
            self.index = 0


def run_path(
    case: Case,
    impl: Implementation | None,
    *,
    device: torch.device,
    count_memory: bool = False,
    start_from: PathRun | None = None,
    compiled: CompileSettings | None = None,
    steps: int | None = None,
    ranks: RankSetup | None = None,
) -> PathRun:
    """Train ``case`` for its steps (or the first ``steps``); ``impl=None`` is the
    full-storage path.

    With ``compiled``, the model runs compiled whole under those settings.
    Python cannot watch inside a compiled graph, so segment forward calls and
    segment-input gradients are not observed there, and held bytes are what
    the graph saves for backward (``SavedBytes``).

    With ``start_from`` (the reference path), every step after the first
    begins from the state the reference had there, so a fault is reported at
    the step it happens in, not smeared over the steps after it. Without it,
    that state is recorded for the other paths to start from.

    With ``ranks``, this process is one rank of a distributed case: it trains its share
    of the batch under the engine, and keeps whole gradients and weights where sharded.
    """
    run = PathRun()
    path = build_path(case, device)
    if ranks is not None:
        path = ranks.share(path)
    whole = ranks.whole if ranks is not None else _as_is
    model, segments, inputs = path.model, path.segments, path.inputs
    router: Router | None = getattr(model, "router", None)
    where = "setup"
    # Names before the installation: a toggle or wrapper may wrap, rename or replace modules
    names = UserNames(model)
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plain = path.install(impl)  # inside: what an implementation raises is a verdict
            run.left_plain = frozenset(_counted_modules(names, plain))
            if router is not None and start_from is not None and compiled is None:
                router.expected = start_from.returns  # a wrong return is named as returned
            phase = _Phase()
            counted = {} if compiled else _counted_modules(names, segments)
            calls = _count_calls(counted, phase)
            saves = SavedCalls(counted).counts if impl is None else {}  # nothing saved: no re-run
            # What re-ran in backward, by the ops that read each segment's parameters: a
            # recompute that calls the bound forward (instance patching) passes no hook.
            # Recompute path only; the forward's counts say how much a full re-run is.
            uses = ParameterUses(counted, lambda: phase.index) \
                if impl is not None and counted else None
            grads_in = _SegmentInputGrads(model, [] if compiled else segments)
            call = model if compiled is None else compile_model(model, compiled)
            if ranks is not None:
                call = ranks.wrap(model, segments)
            params = names.parameters()
            optimizer = torch.optim.SGD([p for _, p in params], lr=LEARNING_RATE,
                                        momentum=MOMENTUM)
            model.train()
            # one training stream, the same for every path (on a rank: the rank's own)
            path.seed(ranks.seed_offset if ranks is not None else 0)
            if case.inference:
                path.set_trainable(1)
                where = "the eval and no_grad forwards"
                run.probes = _inference_forwards(path, call)
            n_steps = case.steps if steps is None else steps
            for step in range(1, n_steps + 1):
                where = f"step {step} start"
                start_step(step, run, start_from, params, optimizer, device)
                path.set_trainable(step)
                optimizer.zero_grad(set_to_none=True)
                for t in inputs:  # input leaves are no parameters: zero_grad misses them
                    if t is not None:
                        t.grad = None
                _reset(calls)
                _reset(saves)
                grads_in.reset()
                if uses is not None:
                    uses.reset()
                batches = path.micro_batches()
                # Eager: what the step makes, held after its forward and still alive after
                # its backward (a leak), by one counter over both, at every step.
                made = ActivationCounter(exclude=path.not_activations()) \
                    if count_memory and compiled is None else None
                kept: list[Tensor] = []
                touched: set[str] = set()
                step_held: int | None = None
                carry: RecomputeCarry | None = None
                held_saved: bool | None = None  # a selected segment saved in that forward
                held_keys: frozenset[int] = frozenset()  # the storages step_held counts
                # Full storage's first step of several: nothing reads what its backward
                # makes (a leak is counted from step 2 on), so its backward runs unwatched.
                unwatched = impl is None and step == 1 < n_steps
                # Under a schedule several forwards are in flight: their outputs and losses
                # wait here for their backward.
                pending: dict[int, tuple[Any, Tensor]] = {}
                n = len(batches)
                # A retained graph keeps what the first pass re-ran for the next one, a
                # summed backward re-runs every micro-batch's segments in one pass, and
                # autocast around backward caches the weight casts every re-run makes until
                # the block ends: none of them is a carry (and create-graph's first backward
                # keeps the graph for the double backward's)
                carried = case.grad_mode != "create-graph" and case.backward_passes == 1 \
                    and case.schedule != "summed" and not case.backward_autocast
                with made if made is not None else contextlib.nullcontext():
                    for action, k in schedule_events(case.schedule, n):
                        part = f" (micro-batch {k + 1} of {n})" if k > 0 or (
                            k == 0 and case.schedule != "one") else ""
                        if action == "forward":
                            grads_in.suffix = f" (micro-batch {k + 1})" if k else ""
                            where = f"step {step} forward{part}"
                            measure = count_memory and k == 0
                            if made is not None:
                                # The forward's ops on each segment's parameters: what a
                                # re-run that skips some (a selective policy) is measured
                                # against.
                                with uses if uses is not None else contextlib.nullcontext():
                                    outputs, loss = path.forward(call, batches[k])
                                if ranks is not None and measure:
                                    ranks.settle()
                                held = made.held_bytes_by_device(ignore=[outputs, loss]) \
                                    if measure else None
                                if measure:
                                    held_keys = made.alive_keys(ignore=[outputs, loss])
                            else:
                                outputs, loss, held = _forward(path, call, measure, batches[k],
                                                               compiled=compiled is not None)
                            if measure and held is not None:
                                step_held = sum(held.values())
                                held_saved = any(c[0] for c in saves.values()) \
                                    if saves else None
                                if step == 1:
                                    run.held_on = held
                            if n > 1:  # the step's loss: the micro-batches' mean
                                loss = loss / n
                            kept += [loss.detach(), main_output(outputs).detach()]
                            pending[k] = (outputs, loss)
                            del outputs, loss
                            continue
                        if k < 0:  # one backward of every micro-batch's loss summed
                            where = f"step {step} backward (the {n} micro-batches' summed loss)"
                            loss = torch.stack([pending.pop(j)[1] for j in sorted(pending)]
                                               ).sum()
                        else:
                            where = f"step {step} backward{part}"
                            loss = pending.pop(k)[1]
                        if k == 0 and count_memory and made is not None and uses is not None \
                                and carried:
                            carry = RecomputeCarry(held_keys, functools.partial(
                                _rerun_segments, uses, _segment_of(names, segments)))
                        with phase.backward(), case.backward_context(device), \
                                carry if carry is not None and k == 0 \
                                else made.paused() if unwatched and made is not None \
                                else contextlib.nullcontext():
                            touched |= _backward_passes(case, loss, params, inputs, uses,
                                                        _input_names(model, inputs))
                        del loss
                # The model's inputs live on with or without recompute, whatever storage
                # they point at now: a checkpoint that partitions its saved inputs in place
                # (DeepSpeed's partition_activations, Megatron's distribute_saved_activations)
                # gives the caller's input a new storage of the same size in backward.
                ignored = [*kept, *grads_in.grads.values(),
                           *(p.grad for _, p in params if p.grad is not None),
                           *(t for t in inputs if t is not None),
                           *(t.grad for t in inputs if t is not None and t.grad is not None)]
                left = None
                if made is not None and not unwatched:
                    if ranks is not None:
                        ranks.settle()  # the engine's collectives let go of their buffers
                    left = made.held_bytes(ignore=ignored)
                    if ranks is not None and not ranks.all_agree(not left):
                        # a worker slower than the barriers: what it let go of since was
                        # none of the step's
                        ranks.settle()
                        left = min(left, made.held_bytes(ignore=ignored))
                if made is not None and step_held is not None:
                    # Held for backward is what backward let go of: what the forward made and
                    # is still alive after backward is no activation (a pool allocated on
                    # first use) or a leak, which the later steps' left bytes show.
                    still = made.bytes_still_alive(held_keys)
                    step_held -= still
                    peak = carry.peak_bytes - still if carry is not None else step_held
                if step == 1:
                    run.held_bytes = step_held
                run.steps.append(_record(model, params, inputs, kept, grads_in.grads, calls,
                                         device, sorted(touched), left, names, whole))
                run.steps[-1].held_bytes = step_held
                run.steps[-1].saved = {n: c[0] for n, c in saves.items()}
                run.steps[-1].held_saved = held_saved
                if made is not None and step_held is not None:
                    run.steps[-1].backward_peak_bytes = max(peak, step_held)
                if carry is not None:
                    record = run.steps[-1]
                    record.carried_bytes, record.carried_own = carry.carried_bytes, carry.own_bytes
                    record.carried_from, record.carried_at = carry.carried_from, carry.carried_at
                if uses is not None:
                    run.steps[-1].uses = {n: list(c) for n, c in uses.uses.items()}
                where = f"step {step} optimizer"
                optimizer.step()
            weights = whole([p.detach() for _, p in params])
            run.params = {n: w for (n, _), w in zip(params, weights) if w is not None}
        except Exception:
            run.error, run.error_at = traceback.format_exc(), where
        except SystemExit as exc:  # the implementation asked the process to end: its fault
            run.error = (f"the implementation called sys.exit({exc.code!r}) during {where}\n"
                         f"{traceback.format_exc()}")
            run.error_at = where
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    run.seconds = time.perf_counter() - started
    run.global_state = snapshot()  # outside the forward's autocast, after the last step
    run.returns = router.returns if router is not None else []
    run.warnings = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    return run


def _inference_forwards(path: PreparedPath, call: nn.Module) -> dict[str, Tensor]:
    """An eval forward (grad on, as a validation loop without no_grad runs) and a training
    forward under ``torch.no_grad()`` (dropout draws), neither followed by backward: what
    each gave, to compare with full storage; the training after them must not change."""
    path.model.eval()
    evaluated, _ = path.forward(call)
    path.model.train()
    with torch.no_grad():
        no_grad, _ = path.forward(call)
    return {"eval forward output": main_output(evaluated).detach(),
            "no_grad forward output": main_output(no_grad).detach()}


def _ask_gradients(mode: str, loss: Tensor, params: list[tuple[str, nn.Parameter]],
                   inputs: tuple[Tensor | None, ...],
                   watch: ParameterUses | None = None,
                   input_names: list[str] | None = None,
                   retain_graph: bool = False) -> set[str]:
    """Backpropagate ``loss`` the way the case asks; accumulate into ``.grad`` either way.

    With ``autograd-grad``, the gradients ``torch.autograd.grad`` returns are added into
    ``.grad`` by hand, so the properties compare them like any others; the names of the
    tensors whose ``.grad`` the call itself changed come back (it must change none).
    With ``create-graph``, a gradient penalty: the parameters' gradients are taken with
    ``create_graph=True``, and ``loss + GRADIENT_PENALTY * (their squares summed)`` is
    backpropagated, through the graph of that first backward too (double backward).

    ``watch`` (the recompute path's op counter) is active for the last backward only:
    under ``create_graph`` backward kernels run with grad mode on, so the weight reads of
    that first pass would count as re-runs where nothing re-ran.
    """
    watching = watch if watch is not None else contextlib.nullcontext()
    if mode == "create-graph":
        loss = loss + GRADIENT_PENALTY * _gradient_penalty(loss, params)
    if mode != "autograd-grad":
        with watching:
            loss.backward(retain_graph=retain_graph or None)  # type: ignore[no-untyped-call]
        return set()
    named: list[tuple[str, Tensor]] = [(f"param:{n}", p) for n, p in params if p.requires_grad]
    labels = input_names or [f"arg{i}" for i in range(len(inputs))]
    named += [(f"input:model:{label}", t) for label, t in zip(labels, inputs)
              if t is not None and t.requires_grad]
    before = {name: None if t.grad is None else t.grad.clone() for name, t in named}
    with watching:
        got = torch.autograd.grad(loss, [t for _, t in named], allow_unused=True,
                                  retain_graph=retain_graph or None)
    touched = {name for name, t in named if not _same_grad(before[name], t.grad)}
    with torch.no_grad():
        for (_, t), g in zip(named, got):
            if g is not None:
                t.grad = g.detach() if t.grad is None else t.grad + g
    return touched


def schedule_events(schedule: str, n: int) -> list[tuple[str, int]]:
    """The order a step runs its ``n`` micro-batches in: ``("forward", k)`` and
    ``("backward", k)``; ``("backward", -1)`` is one backward of every loss summed."""
    forwards = [("forward", k) for k in range(n)]
    if schedule == "one":
        return [event for k in range(n) for event in (("forward", k), ("backward", k))]
    if schedule == "gpipe":
        return forwards + [("backward", k) for k in range(n)]
    if schedule == "gpipe-reverse":
        return forwards + [("backward", k) for k in reversed(range(n))]
    if schedule == "summed":
        return [*forwards, ("backward", -1)]
    # 1f1b: a pipeline's first stage of several: IN_FLIGHT forwards, then a backward before
    # each new forward, then the last backwards
    warm = min(IN_FLIGHT, n)
    events = forwards[:warm]
    for k in range(warm, n):
        events += [("backward", k - warm), ("forward", k)]
    return events + [("backward", k) for k in range(n - warm, n)]


#: The most micro-batches in flight under ``1f1b`` (some faults need 4 to show).
IN_FLIGHT = 4


def _backward_passes(case: Case, loss: Tensor, params: list[tuple[str, nn.Parameter]],
                     inputs: tuple[Tensor | None, ...], watch: ParameterUses | None,
                     input_names: list[str]) -> set[str]:
    """Backpropagate ``loss`` the way the case asks, in ``case.backward_passes`` parts whose
    sum is the loss (weights 1, 2, 3, ... over their sum: each pass's gradients differ, so
    one pass lost or run twice shows), the graph retained for all but the last."""
    passes = case.backward_passes
    if passes == 1:
        return _ask_gradients(case.grad_mode, loss, params, inputs, watch=watch,
                              input_names=input_names)
    total = passes * (passes + 1) / 2
    touched: set[str] = set()
    for i in range(passes):
        touched |= _ask_gradients(case.grad_mode, loss * ((i + 1) / total), params, inputs,
                                  watch=watch, input_names=input_names,
                                  retain_graph=i < passes - 1)
    return touched


def _gradient_penalty(loss: Tensor, params: list[tuple[str, nn.Parameter]]) -> Tensor:
    """The squared norm of the parameters' gradients, differentiable (``create_graph``): the
    penalty's own gradient needs second derivatives through every segment."""
    wanted = [p for _, p in params if p.requires_grad]
    grads = torch.autograd.grad(loss, wanted, create_graph=True, allow_unused=True)
    return torch.stack([g.float().square().sum() for g in grads if g is not None]).sum()


def _same_grad(before: Tensor | None, now: Tensor | None) -> bool:
    if before is None or now is None:
        return before is None and now is None
    return bool(torch.equal(before, now))


def _rng_states(device: torch.device) -> dict[str, Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states[f"cuda:{device.index or 0}"] = torch.cuda.get_rng_state(device)
    return states


def start_step(step: int, run: PathRun, start_from: PathRun | None,
               params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer,
               device: torch.device) -> None:
    """Where ``step`` begins: from the reference's state there (``start_from``), or, on the
    reference, that state kept for the other paths."""
    if step > 1 and start_from is not None:
        _restore(start_from.starts[step - 2], params, optimizer, device)
    elif step > 1:
        run.starts.append(_snapshot(params, optimizer, device))


def _snapshot(params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer,
              device: torch.device) -> StepStart:
    return StepStart(params={n: p.detach().clone() for n, p in params},
                     optimizer={n: _copy_state(optimizer.state[p]) for n, p in params},
                     rng=_rng_states(device))


def _restore(start: StepStart, params: list[tuple[str, nn.Parameter]],
             optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Copies, never the snapshot's own tensors: two paths restore from one snapshot."""
    with torch.no_grad():
        for name, p in params:
            p.copy_(start.params[name])
            optimizer.state[p] = _copy_state(start.optimizer[name])
    torch.set_rng_state(start.rng["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(start.rng[f"cuda:{device.index or 0}"], device)


def _copy_state(state: dict[str, Any]) -> dict[str, Any]:
    """One parameter's optimizer state (SGD: its momentum buffer), tensors cloned."""
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}


def _main_output(outputs: Any) -> Tensor:
    """The tensor the outputs property compares (:func:`.outputs.main_output`)."""
    return main_output(outputs)


def _input_names(model: nn.Module, inputs: tuple[Tensor | None, ...]) -> list[str]:
    """How the model's inputs are named in gradients: ``arg0``, ... for positional ones, the
    keyword for those a user's model takes by keyword (``ExternalModel.input_keys``)."""
    keys = tuple(getattr(model, "input_keys", ()))
    k = len(inputs) - len(keys)
    return [f"arg{i}" for i in range(k)] + list(keys)


def _forward(path: PreparedPath, call: nn.Module, measure: bool,
             batch: tuple[tuple[Tensor | None, ...], Tensor], compiled: bool = False
             ) -> tuple[Tensor, Tensor, dict[str, int] | None]:
    """One forward and loss of ``batch``, optionally counting held bytes (by device)."""
    if not measure:
        return *path.forward(call, batch), None
    never = path.not_activations()
    if compiled:
        with SavedBytes(exclude=never) as saved:
            outputs, loss = path.forward(call, batch)
        return outputs, loss, saved.held_bytes_by_device()
    with ActivationCounter(exclude=never) as counter:
        outputs, loss = path.forward(call, batch)
    return outputs, loss, counter.held_bytes_by_device(ignore=[outputs, loss])


def _counted_modules(names: UserNames, segments: list[Segment]) -> dict[str, nn.Module]:
    """The modules whose runs prove each segment ran, by their names in the user's model."""
    return {names.module(module, segment.name): module
            for segment in segments for module in segment.counted}


def _segment_of(names: UserNames, segments: list[Segment]) -> dict[str, str]:
    """Each counted module's segment (a group's layers are one segment), by the names
    ``_counted_modules`` gives them."""
    return {names.module(module, segment.name): segment.name
            for segment in segments for module in segment.counted}


def _rerun_segments(uses: ParameterUses, segment_of: dict[str, str]) -> set[str]:
    """The segments whose parameters the re-run that just ended read."""
    return {segment_of.get(name, name) for name in uses.take_rerun_hits()}


def _count_calls(counted: dict[str, nn.Module], phase: Any) -> dict[str, list[int]]:
    """Count each counted module's forward calls, with forward pre-hooks:
    ``[forward phase, backward phase with grad on, forward phase with grad on]``.

    A call in backward with grad mode off is no recompute (a recompute re-runs forward
    under ``enable_grad``; a layer the model runs under ``no_grad`` re-runs under it
    again). On the full-storage path the last count is how many of the forwards backward
    must recompute: a forward under ``no_grad`` made nothing to recompute. (Inside a
    reentrant checkpoint every forward runs under ``no_grad``, so that count means
    nothing on the recompute path.) ``phase.index``: 0 forward, 1 backward, None a call
    not counted.
    """
    calls: dict[str, list[int]] = {}
    for name, module in counted.items():
        counter = calls[name] = [0, 0, 0]

        def hook(_module: nn.Module, _args: Any, counter: list[int] = counter) -> None:
            grad = torch.is_grad_enabled()
            if phase.index is None:  # a pass no step of training makes (engine.staged)
                return
            if phase.index == 0:
                counter[0] += 1
                counter[2] += grad
            elif grad:
                counter[1] += 1

        module.register_forward_pre_hook(hook)
    return calls


def _reset(calls: dict[str, list[int]]) -> None:
    for counter in calls.values():
        counter[:] = [0] * len(counter)


def _address(t: Tensor) -> Any:
    """Where ``t``'s elements are: its data pointer, or those of the tensors a wrapper
    subclass holds (a DTensor's local shard: the wrapper itself has no memory, and every
    DTensor of a shape would look alike)."""
    if is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        return tuple(_address(part) for part in (getattr(t, name) for name in inner)
                     if isinstance(part, Tensor))
    return t.data_ptr()


class _SegmentInputGrads:
    """Capture the gradient that reaches each tensor a selected segment receives.

    A gradient hook on the tensor (not a reference to it) keeps nothing alive,
    so the activation count is not disturbed. The first name a tensor is seen
    under wins (``x0`` goes to every layer), and so does the name of a tensor it aliases
    (same memory and layout: a checkpoint Function's output for a segment that returns
    its input); weak references tell a tensor seen before from a new one that reuses a
    freed tensor's memory.
    """

    def __init__(self, model: RoutedModel, segments: list[Segment]) -> None:
        self.grads: dict[str, Tensor] = {}
        self.suffix = ""  # names the micro-batch after the first: " (micro-batch 2)"
        self._seen: dict[tuple[Any, ...], weakref.ref[Tensor]] = {}
        self._modules = {s.name: s.module for s in segments}
        self._signatures: dict[type, inspect.Signature] = {}
        if segments:
            model.router.on_call = self._on_call

    def reset(self) -> None:
        self.grads = {}
        self._seen.clear()

    def _on_call(self, segment: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Under no_grad too: a model that checkpoints its own layers reentrantly calls them
        # under no_grad on the recompute path only; the hook on an input sees the gradient
        # it gets from every use, so both paths see the same, wherever the call ran.
        module = self._modules[segment]
        # The class's forward, not the instance's: a wrapper may have patched the instance's
        # forward into (*args, **kwargs), which would lose the parameter names.
        sig = self._signatures.setdefault(type(module), inspect.signature(type(module).forward))
        try:
            named = dict(sig.bind(module, *args, **kwargs).arguments)
            named.pop(next(iter(sig.parameters)))  # self
        except TypeError:
            named = {f"arg{i}": a for i, a in enumerate(args)} | kwargs
        for arg, value in named.items():
            if not (isinstance(value, Tensor) and value.requires_grad):
                continue
            key = (_address(value), value.shape, value.stride(), value.dtype)
            known = self._seen.get(key)
            seen = known() if known is not None else None
            # Alive and still over the same memory: a checkpoint that swaps a saved input's
            # storage for a partition (``.data =``) lets a new tensor take the old address.
            if seen is not None and _address(seen) == key[0] and seen.shape == key[1]:
                continue
            self._seen[key] = weakref.ref(value)
            value.register_hook(self._store(f"input:{segment}:{arg}{self.suffix}"))  # type: ignore[no-untyped-call]

    def _store(self, key: str) -> Any:
        def hook(grad: Tensor | None) -> None:
            # A custom Function may hand None to an input that requires grad: no gradient.
            if grad is not None:
                self.grads[key] = grad.detach().clone()

        return hook


def _record(
    model: nn.Module, params: list[tuple[str, nn.Parameter]], inputs: tuple[Tensor | None, ...],
    kept: list[Tensor], grads_in: dict[str, Tensor], calls: dict[str, list[int]],
    device: torch.device, touched: list[str], left: int | None,
    names: UserNames | None = None,
    whole: Callable[[list[Tensor | None]], list[Tensor | None]] | None = None,
) -> StepRecord:
    """Keep this step's observations; ``kept``: loss and main output of each micro-batch.

    The step's loss is the sum of its micro-batches' (each scaled by their count), its
    output their outputs joined along the batch. Gradients, loss and outputs are kept
    without a copy: ``zero_grad(set_to_none=True)``
    gives the next step fresh gradient tensors, and SGD reads gradients without
    writing them. Buffers change in place, so they are copied. ``whole``: sharded
    gradients made whole (a rank's).
    """
    whole = whole or _as_is
    grads: dict[str, Tensor | None] = dict(zip(
        [f"param:{n}" for n, _ in params],
        whole([None if p.grad is None else p.grad.detach() for _, p in params])))
    for label, t in zip(_input_names(model, inputs), inputs):
        if t is not None and t.requires_grad:
            grads[f"input:model:{label}"] = None if t.grad is None else t.grad.detach()
    # a segment's input may be sharded too (sequence parallelism hands the MLP its part of
    # the sequence): made whole, in the order backward reached them (the same on every
    # rank: each runs the same graph)
    names_in = list(grads_in)
    grads.update(zip(names_in, whole([grads_in[n] for n in names_in])))
    rng = _rng_states(device)
    losses, outputs = kept[0::2], kept[1::2]
    return StepRecord(
        loss=losses[0] if len(losses) == 1 else torch.stack(losses).sum(),
        outputs=outputs[0] if len(outputs) == 1 else _join(outputs),
        grads=grads,
        buffers={n: b.detach().clone() for n, b in (
            names or UserNames(model)).buffers()},
        rng=rng,
        calls={n: list(c) for n, c in calls.items()},
        touched=touched,
        left_bytes=left,
    )


def _as_is(tensors: list[Tensor | None]) -> list[Tensor | None]:
    return tensors


def _join(outputs: list[Tensor]) -> Tensor:
    """Micro-batch outputs as one batch; side by side where their shapes disagree."""
    try:
        return torch.cat(outputs)
    except RuntimeError:
        return torch.cat([o.reshape(-1) for o in outputs])

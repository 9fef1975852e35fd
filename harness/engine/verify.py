"""The seven properties of one case, and the verdict that gathers them.

``verify(impl, case)`` runs the full-storage path twice (the second run is the
noise floor) and the recompute path once, then checks, in this order:

1. ``outputs``: loss and model outputs of the first step;
2. ``gradients``: every parameter and segment-input gradient of the first step,
   including which exist at all, and under ``torch.autograd.grad`` no ``.grad`` touched;
3. ``buffers``: buffers after the first step;
4. ``rng``: the process-global state after the step equals full storage's: the global
   RNG state after every step, and torch's global switches (default dtype and device,
   grad mode, deterministic algorithms, threads, autocast, matmul precision, backend and
   SDPA flags: ``global_state``) at the end of the path; every path starts from the
   switches as the case found them, and they are put back after the case, so a switch
   the implementation left changed fails here and never reaches the next case;
5. ``trajectory``: losses, gradients and weights over the later steps, each
   step started from the full path's weights, optimizer and RNG state, so a
   fault shows at the step it happens in (a step-1 fault is not counted again);
6. ``inference``: an eval forward and a ``no_grad`` forward before training (where the
   case has them) give the full path's outputs; the training after them is checked by
   the other properties;
7. ``recompute``: each selected segment ran again in backward once per forward
   (seen by forward hooks, or by ops on its parameters under grad mode, as a recompute
   that calls the bound forward passes no hook), fewer activation bytes were held than
   on the full path (unless the re-run skipped ops a selective policy saved), and from
   step 2 on nothing a step made outlived its backward more than with full storage (a
   leak grows with the steps; step 1 may allocate a pool once); for an offload: ran
   once and never again, fewer bytes left on the accelerator; inside a compiled graph:
   the bytes only.

A compiled implementation (``compile-...``) runs all three paths compiled:
the full path with torch's defaults, its floor run rounding where inductor
rounds by default (``harness/compiled.py``).

Structure (which tensors exist, shape, dtype, device) is checked before
values, and a value check names the tensor, the error and the bound.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradequiv.harness.engine import global_state
from gradequiv.harness.engine.case import Case
from gradequiv.harness.engine.compare import (
    DTYPE_CAPS,
    Tolerance,
    measure_pairs,
    non_finite_reference,
)
from gradequiv.harness.engine.parallel import RankSetup
from gradequiv.harness.engine.rng_story import rng_stories
from gradequiv.harness.engine.runner import PathRun, StepRecord, run_path
from gradequiv.harness.engine.staged import run_staged
from gradequiv.harness.errors import exception_line, torch_refusal
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.harness.implementations.compiled import FLOOR, REFERENCE, CompileSpec
from gradequiv.harness.implementations.resolve import resolve
from gradequiv.models import ExternalConfig, NoRecompute, build
from gradequiv.models.external import declared_regimes
from gradequiv.models.kinds import INPLACE_OPS

#: What torch's selective checkpoint raises when an in-place op wrote into an output its
#: policy saved (torch/utils/checkpoint.py).
SAC_REFUSES_MUTATION = "Tensor cached during selective activation checkpoint has been mutated"

PROPERTIES = ("outputs", "gradients", "buffers", "rng", "trajectory", "inference", "recompute")


class FullStorageError(RuntimeError):
    """Full storage itself failed or verifies nothing: a fault of the model (or of the
    engine it trains under), never of the implementation; no verdict is given."""


@dataclass(frozen=True)
class TensorCheck:
    """One tensor compared: recompute path against the first full path."""

    property: str
    name: str
    passed: bool
    rel_error: float
    bound: float
    floor: float  # rel error between the two full-path runs
    max_abs: float
    cosine: float
    mismatched: int
    numel: int
    max_ulps: int | None = 0  # greatest distance in units in the last place (None: not floats)
    #: a counter's (a one-element integer tensor's) value on each path, recompute then full
    #: storage: which way it is off (a second update, or one missed); None for other tensors
    counts: list[int] | None = None
    #: the tensor's own scale: the greater norm of the two paths' (0: not a float tensor)
    scale: float = 0.0
    #: False where no floor path ran (floor 0 stands in): it could not change the verdict
    floor_measured: bool = True

    def describe(self) -> str:
        if self.property == "rng" and self.name.startswith("RNG state after "):
            # A generator's state is equal or not: its bytes are no float to measure.
            step, _, generator = self.name.removeprefix("RNG state after ").partition(": ")
            return (f"RNG state after {step}: the {generator} generator's state differs from "
                    f"full storage's")
        share = 100.0 * self.mismatched / max(self.numel, 1)
        floor = f"noise floor {self.floor:.3g}" if self.floor_measured else \
            "noise floor not measured: no floor raises a bound this far"
        return (
            f"{self.name}: relative error {self.rel_error:.3g} > bound {self.bound:.3g} "
            f"({floor}); {self.mismatched} of {self.numel} elements "
            f"differ ({share:.1f}%), greatest absolute difference {self.max_abs:.3g}"
        )


@dataclass
class PropertyResult:
    name: str
    passed: bool | None  # None: does not apply to this case (said in ``summary``)
    summary: str = ""
    failures: list[str] = field(default_factory=list)  # structure and count failures
    checks: list[TensorCheck] = field(default_factory=list)
    #: the selected segments' names: a tensor of theirs headlines a failure
    segments: tuple[str, ...] = ()

    @property
    def first_failure(self) -> str:
        if self.failures:
            return self.failures[0]
        worst = self.worst_first()
        return worst[0].describe() if worst and not worst[0].passed else ""

    def worst_first(self) -> list[TensorCheck]:
        """Failing checks first; among them one whose error matters at the gradients' own
        scale before one whose error does not (a bias off by 1e-9 where the gradients are of
        order 1: far past its own bound, and nothing to training), then a tensor inside a
        re-run segment (where a recompute fault sits) before one outside (the embeddings,
        the head); then by how far past their bound."""
        total = gradient_scale(self.checks)
        return sorted(self.checks, key=lambda c: (not c.passed, not negligible(c, total),
                                                  self.inside(c.name), severity(c)),
                      reverse=True)

    def inside(self, name: str) -> bool:
        """Whether a check's tensor belongs to one of the segments."""
        tensor = name.split()[-1]
        return any(tensor.startswith((s + ".", s + ":")) for s in self.segments)


def gradient_scale(checks: list[TensorCheck]) -> float:
    """The gradients' own scale: the norm of every gradient the checks compare, together."""
    return math.sqrt(sum(c.scale ** 2 for c in checks
                         if "grad of " in c.name and math.isfinite(c.scale)))


def negligible(check: TensorCheck, total: float) -> bool:
    """Whether a gradient's difference is below its bound even measured against every
    gradient's scale (``total``): off by far less than what training moves by."""
    if "grad of " not in check.name or not check.scale or not total \
            or not math.isfinite(check.rel_error):
        return False
    return check.rel_error * check.scale < check.bound * total


def _not_applicable(verdict: Verdict, why: str) -> Verdict:
    verdict.not_applicable = why
    verdict.properties = [PropertyResult(name, None, f"not applicable: {why}")
                          for name in PROPERTIES]
    return verdict


def severity(check: TensorCheck) -> float:
    """How far past (or near) its bound a check is."""
    if check.bound:
        return check.rel_error / check.bound if math.isfinite(check.rel_error) else math.inf
    return math.inf if check.rel_error else 0.0


@dataclass
class Verdict:
    case: Case
    impl: str
    device: str
    properties: list[PropertyResult] = field(default_factory=list)
    error: str | None = None  # traceback from inside the implementation
    error_at: str = ""
    warnings: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    held_bytes: dict[str, int | None] = field(default_factory=dict)
    held_on: dict[str, dict[str, int] | None] = field(default_factory=dict)  # path -> device
    floor_measured: bool = True  # False: the floor path was not needed for this verdict
    memory_watched: bool = True  # False: the recompute property was not checked
    first_step_only: bool = False  # True: rng and trajectory were not checked
    #: why the case does not apply, where torch's own checkpoint refused it loudly and by
    #: design ("": it applies): no property checked, no failure, never counted as a pass
    not_applicable: str = ""

    @property
    def passed(self) -> bool:
        return self.error is None and all(p.passed is not False for p in self.properties)

    @property
    def first_failure(self) -> str:
        """One line saying what failed first, for terminals and reports."""
        if self.error is not None:
            last = exception_line(self.error)
            said = f"the implementation raised during {self.error_at}: {last}"
            # A global switch it left changed (rng) is still checked, and may be the cause.
            failed = [p for p in self.properties if p.passed is False]
            return said + "".join(f"; {p.name}: {p.first_failure}" for p in failed[:1])
        for prop in self.properties:
            if prop.passed is False:
                return f"{prop.name}: {prop.first_failure}"
        return ""


def verify(
    impl: Implementation | str,
    case: Case,
    *,
    device: str | torch.device = "cpu",
    tolerance: Tolerance | None = None,
    floor_when_needed: bool = False,
    always_floor: bool = False,
    watch_memory: bool = True,
    first_step_only: bool = False,
    ranks: RankSetup | None = None,
) -> Verdict:
    """Check ``impl`` on ``case`` against full storage; never raises for the impl's faults.

    The noise-floor path (full storage again) runs only for a verdict that fails against
    a floor of zero: one that passes there passes at any floor, a third cheaper
    (``Verdict.floor_measured`` says whether it ran). ``floor_when_needed``: a failing
    verdict measures it only where it can change the verdict (a tensor off by more than a
    reordered sum, and by no more than the dtype's cap): the same verdict, without the
    floor's figures. For the cases tried while a failure is shrunk. ``always_floor``: run
    it for every verdict (a ``--deterministic`` run reports the floor it leaves).
    ``watch_memory=False``: no storage is watched (about a third cheaper again), and the
    recompute property, which reads them, is not checked (``Verdict.memory_watched``);
    ``first_step_only``: one optimizer step (half the work), and the properties that read
    later ones (rng, trajectory) are not checked. For the cases tried while a failure of
    another property is shrunk. ``ranks``: this process is one rank of a distributed case
    (``commands.distributed``): every path runs under its engine, on its share.
    """
    # torch's global switches as the case finds them (after the run's own, --deterministic):
    # every path starts from them, and they are put back after the case.
    impl = resolve(impl) if isinstance(impl, str) else impl
    device = torch.device(device)
    verdict = Verdict(case=case, impl=impl.spec, device=str(device))
    declined = impl.declines(case.grad_mode, case.features(), unclaimed=False)
    declined = f"not applicable: {declined}" if declined else _regime_declared(case)
    if declined:  # what it says it does not do is not held against it
        verdict.properties = [PropertyResult(name, None, declined) for name in PROPERTIES]
        return verdict
    clean = global_state.snapshot()
    tolerance = tolerance or Tolerance(
        regime=case.dtype, compute=ranks.compute_dtype if ranks is not None else None)
    reference = REFERENCE if impl.compiled else None  # compiled code is compared to compiled
    # a pipeline's paths run through torch's schedule, stage by stage (engine.staged)
    run: Any = run_path if ranks is None or ranks.parallel.pipeline is None else run_staged
    try:
        with _caller_rng_untouched(device):
            global_state.restore(clean)
            steps = 1 if first_step_only else case.steps
            full = run(case, None, device=device, count_memory=watch_memory,
                       compiled=reference, steps=steps, ranks=ranks)
            if full.error is not None:
                limit = _regime_limit(case, full)
                if limit:  # the model's own limit: nothing to hold against the implementation
                    verdict.properties = [PropertyResult(name, None, limit)
                                          for name in PROPERTIES]
                    return verdict
                raise FullStorageError(
                    f"the full-storage path of case {case.describe()} failed at "
                    f"{full.error_at}; this is a fault of the model, not of the "
                    f"implementation:\n{full.error}"
                )
            nothing = non_finite_reference(full.steps[0].loss, full.steps[0].grads)
            if nothing is not None:  # NaN equals nothing: no case verified, no false pass
                raise FullStorageError(
                    f"the full-storage path of case {case.describe()} verifies nothing: "
                    f"{nothing}; this is a fault of the model, not of the implementation")
            global_state.restore(clean)
            recompute = run(case, impl, device=device, count_memory=watch_memory,
                            start_from=full, steps=steps, ranks=ranks,
                            compiled=impl.compiled.settings if impl.compiled else None)
            floor: PathRun | None = None
            quick: list[PropertyResult] | None = None  # the checks against a zero floor
            if recompute.error is None and not impl.compiled:
                # A verdict that passes at a zero floor passes at any: the floor only
                # raises bounds. A failing one measures it, for its figures, unless it is a
                # shrink try the floor cannot change.
                quick = _check_all(case, full, full, recompute, tolerance,
                                   selective=impl.selective)
                held = all(p.passed is not False for p in quick)
                if ranks is not None:  # the floor path's collectives: every rank or none
                    held = ranks.all_agree(held)
                if always_floor or not held and (
                        not floor_when_needed or _floor_matters(quick, tolerance)):
                    quick = None
            if quick is None:
                global_state.restore(clean)
                floor = run(case, None, device=device, start_from=full, steps=steps,
                            compiled=FLOOR if impl.compiled else None, ranks=ranks)
    finally:
        stuck = global_state.restore(clean)  # what could not be put back for the next case
    verdict.floor_measured = floor is not None
    verdict.seconds = {"full": full.seconds, "recompute": recompute.seconds}
    if floor is None:  # the verdict cannot depend on it: the full path stands in, floor 0
        floor = full
    else:
        verdict.seconds["floor"] = floor.seconds
    verdict.held_bytes = {"full": full.held_bytes, "recompute": recompute.held_bytes}
    verdict.warnings = recompute.warnings
    if stuck:
        verdict.warnings = [*verdict.warnings, "gradequiv: torch's global switches could not "
                            f"be put back after this case: {'; '.join(stuck)}"]
    refused = recompute.error is not None and SAC_REFUSES_MUTATION in recompute.error
    if refused and INPLACE_OPS in case.features():
        # torch's selective checkpoint refuses, loudly and by design, an in-place op on an
        # output its policy saved: the case asks what this policy cannot do, nothing wrong.
        # Only where the write moved the saved tensor's version counter: one through an
        # alias that does not (a bias-free Linear's _unsafe_view) goes unseen and is checked
        # like any other case (pytorch/pytorch#113737, #119590).
        return _not_applicable(verdict, (
            f"a loud refusal: torch's selective checkpoint raised \"{SAC_REFUSES_MUTATION}\" "
            f"(an in-place op wrote into an output its policy saved), no wrong gradient"))
    refusal = torch_refusal(recompute.error or "")
    if refusal:
        return _not_applicable(verdict, f"a loud refusal: {refusal}")
    if recompute.error is not None:
        verdict.error, verdict.error_at = recompute.error, recompute.error_at
        verdict.properties = [
            PropertyResult(name, None, "not checked: the implementation raised")
            for name in PROPERTIES
        ]
        leaked = _global_state_leak(full, recompute)  # it may be why the implementation raised
        if leaked:
            verdict.properties[PROPERTIES.index("rng")] = PropertyResult(
                "rng", False, leaked, failures=[leaked])
        return verdict
    started = time.perf_counter()
    verdict.held_on = {"full": full.held_on, "recompute": recompute.held_on}
    verdict.properties = quick if quick is not None else _check_all(
        case, full, floor, recompute, tolerance, impl.compiled, selective=impl.selective)
    if impl.offloads and watch_memory:  # the last property asks another question of one
        verdict.properties[-1] = _check_offload(case, full, recompute, device)
    verdict.memory_watched, verdict.first_step_only = watch_memory, first_step_only
    unchecked = {"recompute": "no memory was watched"} if not watch_memory else {}
    if first_step_only:
        unchecked |= {name: "only the first step ran" for name in ("rng", "trajectory")}
    verdict.properties = [PropertyResult(p.name, None, f"not checked: {unchecked[p.name]} (a "
                                         f"case tried while another property's failure is "
                                         f"shrunk)") if p.name in unchecked else p
                          for p in verdict.properties]
    verdict.seconds["compare"] = time.perf_counter() - started
    return verdict


def verify_without_autocast_cache(impl: Implementation, case: Case, *,
                                  device: str | torch.device = "cpu") -> Verdict:
    """``verify`` with autocast's cast cache off on both paths: a re-run whose inputs are
    leaves that require grad (a reentrant checkpoint detaches them) gets one cached cast
    for all their uses, so their gradients are summed in the low precision, where full
    storage casts each use and sums in float32. Where the verdict passes only this way,
    the cache is the whole difference (cause ``autocast-cast-cache``)."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)  # each torch.autocast() reads it as its default
    try:
        return verify(impl, case, device=device)
    finally:
        torch.set_autocast_cache_enabled(before)


def _regime_declared(case: Case) -> str:
    """Why a user's model is not checked in the case's precision regime: its factory
    declares the regimes it runs (``UserModel.regimes``) and this is none of them ("" where
    it is, or the factory declares none)."""
    if not isinstance(case.model, ExternalConfig):
        return ""
    regimes = declared_regimes(case.model.factory)
    if regimes is None or case.dtype in regimes:
        return ""
    return (f"not applicable to this model: its factory declares regimes="
            f"{tuple(regimes)!r}, not {case.dtype}")


def _regime_limit(case: Case, full: PathRun) -> str:
    """A user's model that raises on full storage in a regime other than fp32 cannot run
    that regime (``torch.fft.rfft`` refuses bfloat16): the regime is not applicable to
    this model, said in one line ("" for anything else, which stays the model's fault)."""
    if not isinstance(case.model, ExternalConfig) or case.dtype == "fp32" or not full.error:
        return ""
    return (f"not applicable to this model: {case.dtype} raises on full storage itself, "
            f"at {full.error_at} ({exception_line(full.error)}); declare the regimes it "
            f"runs in its factory (UserModel(..., regimes=...)) to skip them")


def _floor_matters(checked: list[PropertyResult], tolerance: Tolerance) -> bool:
    """Whether the noise floor can change a verdict ``checked`` against a floor of zero: a
    tensor fails by no more than the dtype's cap (a measured floor may raise its bound that
    far). A tensor that passes at a zero floor passes at any; one past the cap fails at
    any; integer tensors and explicit bounds ignore the floor."""
    if tolerance.rtol is not None:
        return False
    cap = DTYPE_CAPS[tolerance.regime]
    return any(not c.passed and c.bound > 0 and c.rel_error <= cap
               for result in checked for c in result.checks)


def check_runnable(case: Case, device: str | torch.device) -> None:
    """Raise InvalidArgument now if ``case`` cannot run on ``device``: a batch longer than
    the model's positions, a granularity the model has no segments for. For a command to
    refuse before its first case (exit 2), not fail it. Every precision regime runs on
    either device (fp16 autocast too, on the CPU)."""
    del device  # every regime runs on either device; kept for callers that name one
    build(case.model, case.batch, case.seed, "cpu").segments(case.granularity)


@contextlib.contextmanager
def _caller_rng_untouched(device: torch.device) -> Iterator[None]:
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        yield


def _global_state_leak(full: PathRun, rc: PathRun) -> str:
    """The switches the recompute path left otherwise than full storage did ("" if none):
    both started from the case's own, so the implementation set them and did not put
    them back (one it sets and restores inside its call is fine)."""
    if full.global_state is None or rc.global_state is None:
        return ""
    changed = global_state.diff(full.global_state, rc.global_state)
    if not changed:
        return ""
    return ("the implementation changed torch's global state and did not restore it: "
            + "; ".join(changed))


_Item = tuple[str, str, Any, Any, Any]  # property, name, recompute, full, floor run


def _check_all(
    case: Case, full: PathRun, floor: PathRun, rc: PathRun, tolerance: Tolerance,
    compiled: CompileSpec | None = None, *, selective: bool = False,
) -> list[PropertyResult]:
    segments = tuple(full.steps[0].calls)  # the counted modules of the selected segments
    results = {name: PropertyResult(name, True, segments=segments) for name in PROPERTIES}
    items: list[_Item] = []
    first = (rc.steps[0], full.steps[0], floor.steps[0])
    items += [_item("outputs", "loss", [s.loss for s in first]),
              _item("outputs", "model output", [s.outputs for s in first])]
    items += _named("gradients", "", [s.grads for s in first])
    items += _named("inference", "", [rc.probes, full.probes, floor.probes])
    items += _named("buffers", "buffer ", [s.buffers for s in first])
    for k, steps in enumerate(zip(rc.steps, full.steps, floor.steps), start=1):
        items += _named("rng", f"RNG state after step {k}: ", [s.rng for s in steps])
        if k > 1:
            items += [_item("trajectory", f"step {k} loss", [s.loss for s in steps])]
            items += _named("trajectory", f"step {k} ", [s.grads for s in steps])
    items += _named("trajectory", f"weight after step {case.steps}: ",
                    [rc.params, full.params, floor.params])

    comparable = []
    # gradients that are no fault by themselves: property -> (what was seen, why no fault)
    evidence: dict[str, list[tuple[str, str]]] = {}
    for prop, name, a, b, c in items:
        problem = _structure_problem(name, a, b)
        if problem and _intermediate_only_here(name, a, b):
            evidence.setdefault(prop, []).append((problem, ONE_SIDED))
        elif problem:
            results[prop].failures.append(problem)
        elif a is not None:
            comparable.append((prop, name, a, b, c))
    metrics = measure_pairs([(a, b) for _, _, a, b, _ in comparable])
    floors = measure_pairs([(c, b) for _, _, _, b, c in comparable], ulps=False)
    scales = _scales([(a, b) for _, _, a, b, _ in comparable],
                     [m.mismatched == 0 for m in metrics])
    measured = floor is not full  # full storage stands in for a floor path not run
    for (prop, name, a, b, _), m, f, scale in zip(comparable, metrics, floors, scales):
        bound = tolerance.bound(f.rel_error, b.dtype)
        check = TensorCheck(prop, name, tolerance.passes(m, bound), m.rel_error, bound,
                            f.rel_error, m.max_abs, m.cosine, m.mismatched, m.numel,
                            m.max_ulps, _counts(a, b), scale, floor_measured=measured)
        results[prop].checks.append(check)
    for prop in ("gradients", "trajectory"):
        for check in _measured_elsewhere(results[prop]):
            results[prop].checks.remove(check)
            evidence.setdefault(prop, []).append((check.describe(), MEASURED_ELSEWHERE))
        for check in _rounding_noise(results[prop]):
            results[prop].checks.remove(check)
            evidence.setdefault(prop, []).append((check.describe(), ROUNDING_NOISE))

    if not full.steps[0].buffers:
        results["buffers"].summary = "the model has no buffers"
    if not case.inference:
        results["inference"].passed = None
        results["inference"].summary = "no eval or no_grad forward in this case"
    for k, step in enumerate(rc.steps, start=1):
        if step.touched:
            results["gradients"].failures.append(
                f"step {k}: torch.autograd.grad changed .grad of {len(step.touched)} "
                f"tensor(s) ({', '.join(_label(n) for n in step.touched[:3])}); it must "
                f"return gradients and touch no .grad (a recompute that calls backward "
                f"inside backward accumulates into .grad)")
    leaked = _global_state_leak(full, rc)
    if leaked:
        results["rng"].failures.append(leaked)
    results["rng"].failures += rng_stories(full, rc)
    _check_recompute(case, full, rc, results["recompute"], compiled, selective=selective)
    for result in results.values():
        if result.passed is not None:
            result.passed = not result.failures and all(c.passed for c in result.checks)
            if not result.passed:
                result.summary = result.first_failure
            elif not result.summary:
                result.summary = _summary(result)
        seen = evidence.get(result.name, [])
        for why in dict.fromkeys(w for _, w in seen):  # each reason once, its first example
            said = [what for what, w in seen if w == why]
            result.summary += (f"; evidence, not a fault: {said[0]}"
                               + (f" (and {len(said) - 1} more)" if len(said) > 1 else "")
                               + f", {why}")
    return [results[name] for name in PROPERTIES]


#: Why a segment input's gradient on the recompute path only is no fault by itself.
ONE_SIDED = ("a tensor that is neither a parameter nor a model input: only the recompute "
             "path made it require grad (a toggle's enable_input_require_grads, a bias "
             "marked requires_grad)")
#: Why a segment input's gradient that differs is no fault where every leaf's agrees.
MEASURED_ELSEWHERE = (
    "a tensor that is neither a parameter nor a model input, and every parameter's and model "
    "input's gradient of its step agrees: the two paths measured it at different tensors (a "
    "reentrant checkpoint's output, with full storage the tensor an earlier segment made and "
    "used itself, as T5's first layer does its position bias)")


#: Why a gradient whose norm is rounding noise on its step's scale is no fault.
ROUNDING_NOISE = (
    "a tensor that is zero but for rounding on both paths (its norm, and so its "
    "difference, below eight fp32 ULPs of every gradient of its step, or every final "
    "weight, together: a key projection's bias, whose gradient softmax cancels, sums to "
    "1e-15 in one order and 8e-15 in another), so its relative error measures nothing")
#: How small against its step's gradients a gradient's norm is rounding noise: eight ULPs of
#: fp32 (``reorder_slack``), whatever the tensor's own dtype.
NOISE_SCALE = 8 * torch.finfo(torch.float32).eps


def _rounding_noise(result: PropertyResult) -> list[TensorCheck]:
    """The failing gradients that are zero but for rounding: on both paths their norm is
    below ``NOISE_SCALE`` times the norm of every gradient of their step together; and the
    final weights that are, against every final weight (a bias that starts at zero and is
    only ever moved by such a gradient). A fault that gives such a tensor a value that
    matters, or loses one that has it, puts its norm far above that and is still judged by
    its relative error."""
    groups: dict[str, list[TensorCheck]] = {}
    for check in result.checks:
        if "grad of " in check.name:
            groups.setdefault(check.name.partition("grad of ")[0], []).append(check)
        elif check.name.startswith("weight after step "):
            groups.setdefault("weights", []).append(check)
    noise = []
    for checks in groups.values():
        total = math.sqrt(sum(c.scale ** 2 for c in checks if math.isfinite(c.scale)))
        noise += [c for c in checks if not c.passed and math.isfinite(c.scale)
                  and c.scale <= NOISE_SCALE * total]
    return noise


def _segment_input(name: str) -> bool:
    """Whether a gradient check's tensor (or a structure failure's, which starts with its
    name) is a segment's input, not a model input."""
    label = name.partition("grad of ")[2]
    return label.startswith("input ") and not label.startswith("input model:")


def _measured_elsewhere(result: PropertyResult) -> list[TensorCheck]:
    """The failing segment-input gradients of a step whose leaves all agree: a segment input's
    gradient reaches training only through the parameters and model inputs it flows into,
    and a tensor an earlier segment made, used and passed on is, under a reentrant
    checkpoint, that checkpoint's output: its gradient lacks the earlier segment's own use,
    which went straight to that segment's parameters. A wrong gradient that reaches a leaf
    fails there, and then every failing check stays."""
    steps: dict[str, list[TensorCheck]] = {}
    for check in result.checks:
        if "grad of " in check.name:
            steps.setdefault(check.name.partition("grad of ")[0], []).append(check)
    moved = []
    for step, checks in steps.items():
        leaves_differ = any(not c.passed for c in checks if not _segment_input(c.name)) or any(
            f.startswith(f"{step}grad of ") and not _segment_input(f)
            for f in result.failures)
        if not leaves_differ:
            moved += [c for c in checks if not c.passed and _segment_input(c.name)]
    return moved


def _scales(pairs: list[tuple[Any, Any]], equal: list[bool]) -> list[float]:
    """Each pair's scale (``TensorCheck.scale``): the greater of the two norms, for float
    tensors (one pass over them all, summed in float64 without a float64 copy); 0.0 for
    the others. Where a pair is ``equal`` (no element differs) one norm is both."""
    floats = [i for i, (a, b) in enumerate(pairs) if isinstance(b, Tensor)
              and b.is_floating_point() and isinstance(a, Tensor) and a.numel()]
    scales = [0.0] * len(pairs)
    if floats:
        unequal = [i for i in floats if not equal[i]]
        norms_b = torch._foreach_norm([pairs[i][1].detach() for i in floats], 2,
                                      dtype=torch.float64)
        norms_a = dict(zip(unequal, torch._foreach_norm(
            [pairs[i][0].detach() for i in unequal], 2, dtype=torch.float64))) \
            if unequal else {}
        for i, y in zip(floats, norms_b):
            x = norms_a.get(i)
            scales[i] = float(y) if x is None else max(float(x), float(y))
    return scales


def _intermediate_only_here(name: str, rc: Any, full: Any) -> bool:
    """Whether a one-sided gradient is evidence rather than a fault: the recompute path has
    a gradient full storage has none of, for a segment input that is neither a parameter
    nor a model input (an activation only the checkpointed model made require grad, as
    transformers' ``enable_input_require_grads`` does). A leaf's gradient decides: the
    parameters' and model inputs' are compared on their own, so a frozen layer trained
    on the recompute path still fails."""
    if not _segment_input(name):
        return False
    return rc is not None and rc is not MISSING and (full is None or full is MISSING)


def _counts(a: Any, b: Any) -> list[int] | None:
    """Two versions of a counter (a one-element integer tensor), else None."""
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.numel() != 1 \
            or b.numel() != 1 or a.is_floating_point() or a.is_complex() or a.dtype == torch.bool:
        return None
    return [int(a.item()), int(b.item())]


def _item(prop: str, name: str, values: list[Any]) -> _Item:
    """One item from the three paths' values (recompute, full, floor run)."""
    rc, full, floor = values
    return (prop, name, rc, full, floor)


def _named(prop: str, prefix: str, maps: list[dict[str, Any]]) -> list[_Item]:
    """Align three name->tensor maps; a name absent on one side pairs with MISSING."""
    rc, full, floor = maps
    names = [*full, *(n for n in rc if n not in full)]  # model order: parameters, then inputs
    return [(prop, prefix + _label(n), rc.get(n, MISSING), full.get(n, MISSING),
             floor.get(n, MISSING)) for n in names]


class _Missing:
    def __repr__(self) -> str:
        return "missing"


MISSING: Any = _Missing()


def _label(key: str) -> str:
    """'param:blocks.0.fc.weight' -> 'grad of blocks.0.fc.weight'."""
    kind, _, rest = key.partition(":")
    if kind == "param":
        return f"grad of {rest}"
    if kind == "input":
        return f"grad of input {rest}"
    return key


def _structure_problem(name: str, a: Any, b: Any) -> str:
    """Existence, then shape, dtype, device: the failures that values cannot explain."""
    if a is MISSING or b is MISSING:
        side = "recompute" if a is MISSING else "full-storage"
        return f"{name}: absent on the {side} path"
    if (a is None) != (b is None):
        has = "full-storage" if a is None else "recompute"
        return f"{name}: exists only on the {has} path (the other has None)"
    if a is None:
        return ""
    for attr in ("shape", "dtype", "device"):
        if getattr(a, attr) != getattr(b, attr):
            return (f"{name}: {attr} {getattr(a, attr)} on the recompute path, "
                    f"{getattr(b, attr)} on the full-storage path")
    return ""


def _check_recompute(case: Case, full: PathRun, rc: PathRun, result: PropertyResult,
                     compiled: CompileSpec | None = None, *, selective: bool = False) -> None:
    """Recompute happened: forward calls per phase, and fewer bytes held.

    Inside a compiled graph no segment call can be watched, so there only the
    bytes are checked; a budget acts on the whole graph, whatever is selected.
    """
    whole_graph = compiled is not None and compiled.kind == "budget"
    if isinstance(case.granularity, NoRecompute) and not whole_graph:
        result.passed, result.summary = None, "no segment selected (granularity none)"
        return
    if compiled is not None:
        result.summary = ("the compiled graph saved fewer bytes for backward than the compiled "
                          "full-storage graph (segment re-runs cannot be watched inside a "
                          "compiled graph)")
    # A gradient penalty backpropagates twice (create_graph, then through that graph), and
    # a loss split in parts once per part: each pass may recompute each forward once; one
    # recompute kept for every pass is right too.
    passes = (2 if case.grad_mode == "create-graph" else 1) * case.backward_passes
    # calls[module][2]: forwards with grad on, on the full path the ones backward must re-run.
    if compiled is None and full.steps and full.steps[0].calls and not any(
            counts[2] for counts in full.steps[0].calls.values()):
        result.passed = None
        result.summary = ("every selected segment ran under no_grad: nothing was saved for "
                          "backward, so there was nothing to recompute")
        return
    idle: dict[str, list[str]] = {}  # what had nothing to re-run or to free -> its steps
    for k, (step_rc, step_full) in enumerate(zip(rc.steps, full.steps), start=1):
        saved = step_full.saved  # the forwards that saved a tensor for backward
        if saved and not any(saved.values()):
            notes = ["no selected segment saved a tensor for backward (skipped or saving "
                     "nothing): nothing to re-run or to free"]
        else:
            quiet = [m for m, n in saved.items() if n == 0 and step_full.calls[m][2]]
            notes = [f"{', '.join(quiet)} saved nothing for backward: nothing to re-run"
                     ] if quiet else []
            if step_full.held_saved is False:
                notes.append("no selected segment saved a tensor for backward in the first "
                             "micro-batch, whose held bytes are measured: nothing to free")
        for what in notes:
            idle.setdefault(what, []).append(str(k))
        for module, counts in step_rc.calls.items():
            fwd, bwd = counts[0], counts[1]
            full_fwd, _, with_grad = step_full.calls.get(module, [0, 0, 0])
            to_recompute = saved.get(module, with_grad)  # the forwards backward must re-run
            read_bwd = step_rc.uses.get(module, [0, 0])[1]
            if fwd != full_fwd:
                result.failures.append(
                    f"step {k}: {module} ran {fwd} time(s) in forward on the recompute path and "
                    f"{full_fwd} on the full-storage path"
                )
            if module in rc.left_plain:  # the toggle said it keeps this one's activations
                if bwd > 0 or read_bwd > 0:
                    result.failures.append(
                        f"step {k}: {module} ran again in backward ({bwd} forward call(s), "
                        f"{read_bwd} op(s) on its parameters with grad on), but the "
                        f"implementation said it left it out of its checkpointing: it keeps "
                        f"its activations, nothing of it was to recompute")
                continue
            if with_grad == 0:  # its forwards all ran under no_grad: nothing to re-run
                if bwd > 0:
                    result.failures.append(
                        f"step {k}: {module} ran {bwd} time(s) in backward, but its "
                        f"forward ran under no_grad: nothing of it was to recompute")
                continue
            if to_recompute == 0:  # it saved nothing: a reentrant checkpoint re-runs it anyway
                continue
            if bwd == 0 and read_bwd == 0:
                result.failures.append(
                    f"step {k}: {module} did not run again in backward (no forward call, no op "
                    f"on its parameters with grad on), {to_recompute} forward(s) to recompute; "
                    f"nothing was recomputed"
                )
            elif bwd > with_grad * (step_rc.backward_passes or passes):
                # Hooks only: op counts are no measure of how often (autocast caches a
                # weight's cast in forward, not in a recompute; torch's early stop re-runs
                # fewer ops), only of whether the segment re-ran at all.
                per = " per backward pass" if (step_rc.backward_passes or passes) > 1 else ""
                result.failures.append(
                    f"step {k}: {module} ran {bwd} time(s) in backward and {with_grad} in "
                    f"forward; a recompute re-runs each forward once{per}, not more"
                )
            elif 0 < bwd < to_recompute:
                result.failures.append(
                    f"step {k}: {module} ran {bwd} time(s) in backward and {to_recompute} in "
                    f"forward; each of its forwards must be recomputed once"
                )
    notes = [f"not applicable on step{'s' * (len(ks) > 1)} {', '.join(ks)}: {what}"
             for what, ks in idle.items()]
    if rc.left_plain:
        notes.append(f"{', '.join(sorted(rc.left_plain))} left out of the checkpointing by "
                     f"the implementation and not re-run")
    if notes:
        result.summary = "; ".join([_summary(result), *notes])
    _check_leaks(full, rc, result)
    _check_freed(full, rc, result, selective=selective)
    _check_backward_peak(full, rc, result)


def _check_freed(full: PathRun, rc: PathRun, result: PropertyResult, *,
                 selective: bool = False) -> None:
    """Fewer activation bytes held between forward and backward than with full storage, at
    every step: a recompute that falls back to keeping activations after its first step (a
    warm-up path, a cache filled once) saves nothing from then on.

    A selective recompute saves some ops' outputs by policy: where the policy keeps outputs
    full storage would not keep (a matmul's, whose backward needs only its input), it may
    hold as many bytes or more, and what it holds is the policy's choice. It is told by
    what re-ran, not by a marker: fewer ops on a segment's parameters in the re-run than in
    its forward (the ops its policy saved are served from its cache; the re-run's ops are
    checked against the forward's by the values they give, in the other properties and
    the localisation). ``selective`` (``gradequiv_strategy = "selective"``) says so up
    front. For it the bytes are a note in the summary (the counts above still demand that
    each segment re-ran)."""
    for k, (step_rc, step_full) in enumerate(zip(rc.steps, full.steps), start=1):
        held_rc, held_full = step_rc.held_bytes, step_full.held_bytes
        if held_rc is None or held_full is None or held_rc < held_full:
            continue
        if step_full.held_saved is False:
            continue  # no selected segment saved anything: nothing to free (in the summary)
        at = f"step {k}: " if k > 1 else ""
        skipped = _reran_part(step_rc)
        if selective or skipped:
            why = (f"its re-run skipped {skipped} of the forward's ops on the segments' "
                   f"parameters: a selective policy saved their outputs"
                   if skipped else "its policy keeps outputs full storage does not")
            result.summary = (
                f"{result.summary + '; ' if result.summary else ''}{at}the selective "
                f"recompute held {held_rc} activation bytes between forward and backward, "
                f"full storage {held_full} ({why}; reported, not failed)")
            return
        result.failures.append(
            f"{at}activation bytes held between forward and backward: {held_rc} on the "
            f"recompute path, {held_full} on the full-storage path; nothing was freed"
        )
        return


def _check_backward_peak(full: PathRun, rc: PathRun, result: PropertyResult) -> None:
    """The backward's peak stays near what the forward kept plus one segment's activations.

    A correct recompute lets each segment's recomputed activations go as its backward uses
    them; one that keeps them (a reference cycle between a Function's context and its graph,
    a list cleared when backward ends) passes every check after backward and still holds
    full storage's peak in the middle of it. So, at the end of each segment's re-run, the
    bytes that earlier re-runs of other segments made and still hold must stay under half of
    that segment's own (``memory.RecomputeCarry``; correct code carries next to nothing), or
    under a sixteenth of what full storage held: a scrap is no peak. The figures go in the
    summary either way (offload re-runs nothing, and a selective re-run is held to it too)."""
    for k, (step_rc, step_full) in enumerate(zip(rc.steps, full.steps), start=1):
        carried, own, held_full = step_rc.carried_bytes, step_rc.carried_own, step_full.held_bytes
        if not carried or carried * 2 < own or (held_full and carried * 16 < held_full):
            continue
        at = f"step {k}: " if k > 1 else ""
        result.failures.append(
            f"{at}when backward's re-run of {', '.join(step_rc.carried_at)} ended, "
            f"{carried} bytes recomputed earlier for {', '.join(step_rc.carried_from)} were "
            f"still alive ({own} of its own): the recompute keeps recomputed activations "
            f"until backward ends (a reference cycle, a list cleared at the end), so "
            f"activation bytes in backward peaked at {step_rc.backward_peak_bytes} on the "
            f"recompute path, {step_full.backward_peak_bytes} with full storage")
        return
    if result.failures or not rc.steps or not full.steps:
        return
    peak_rc, peak_full = rc.steps[0].backward_peak_bytes, full.steps[0].backward_peak_bytes
    if peak_rc is not None and peak_full is not None:
        figures = (f"activation bytes in backward peaked at {peak_rc} (full storage "
                   f"{peak_full})")
        base = _summary(result)  # the figures go right after it, before any note
        summary = result.summary or base
        rest = summary.removeprefix(base)
        result.summary = f"{base}; {figures}{rest}" if rest != summary else \
            f"{summary}; {figures}"


def _reran_part(step: StepRecord) -> int:
    """How many of the forward's ops on the segments' parameters the re-run left out, where
    every segment re-ran some of them (0: a full re-run, or none; a segment that re-ran
    nothing is no selective policy, and fails the counts)."""
    if not step.uses or any(back == 0 for fwd, back in step.uses.values() if fwd):
        return 0
    return sum(max(fwd - back, 0) for fwd, back in step.uses.values())


def _check_leaks(full: PathRun, rc: PathRun, result: PropertyResult) -> None:
    """Memory that grows with the steps: from step 2 on, nothing a step made may outlive its
    backward more than with full storage (a stash that only later steps fill leaks too). A
    recompute that keeps graphs, saved inputs or recomputed activations alive leaks them
    step after step. Step 1 is a warm-up: a pool or a table a library allocates on its
    first call and reuses for the life of the process is made there once, and stays.

    A hold is no leak: state a checkpoint keeps from one step to the next whose size does
    not grow with the batch, the sequence or the depth (a counter; a generator's state is
    no activation and never counted, ``memory.generator_state``) leaves the same bytes at
    every step, a scrap beside the activations (``_is_hold``). It goes in the summary."""
    steps = list(zip(rc.steps, full.steps))
    kept: list[tuple[int, int, int, int | None]] = []  # step, left on each path, held
    for k, (step_rc, step_full) in enumerate(steps, start=1):
        if k == 1 and len(steps) > 1:
            continue
        left_rc, left_full = step_rc.left_bytes, step_full.left_bytes
        if left_rc is not None and left_full is not None and left_rc > left_full:
            kept.append((k, left_rc, left_full, step_full.held_bytes))
    if not kept:
        return
    k, left_rc, left_full, held = kept[0]
    if _is_hold(kept, len(steps) - (len(steps) > 1)):
        result.summary = (
            f"{result.summary or _summary(result)}; {left_rc - left_full} bytes made in each "
            f"step were still alive after its backward on the recompute path beyond full "
            f"storage's, the same at every step and under 1/{_HOLD_SHARE} of the {held} "
            f"activation bytes full storage held: state of a constant size kept between "
            f"steps (a counter), not a leak")
        return
    result.failures.append(
        f"step {k}: {left_rc} bytes made in the step were still alive after its "
        f"backward on the recompute path ({left_full} with full storage): the "
        f"implementation (or a model that stores what its re-run makes) keeps "
        f"activations or graphs past backward: a leak that grows with every step, "
        f"or memory held until the next forward")


#: A hold is under this share of the activation bytes full storage held (1/256).
_HOLD_SHARE = 256


def _is_hold(kept: list[tuple[int, int, int, int | None]], checked: int) -> bool:
    """Whether the bytes each checked step left beyond full storage's (``kept``: step, left
    on each path, full storage's held bytes) are state of a constant size: left at every
    checked step (``checked`` of them), the same bytes each time, and a scrap beside the
    activations (under 1/``_HOLD_SHARE`` of them). What recompute keeps alive, inputs,
    graphs or re-run activations, is a share of the activations whatever the model's size
    (one segment's input is a few percent of a layer's); a counter or a generator's state
    is the same few bytes on any model."""
    extra = {rc - full for _, rc, full, _ in kept}
    return len(kept) == checked and len(extra) == 1 and all(
        held is not None and (rc - full) * _HOLD_SHARE < held for _, rc, full, held in kept)


def _check_offload(case: Case, full: PathRun, rc: PathRun,
                   device: torch.device) -> PropertyResult:
    """An offload keeps what autograd saves in host memory: each selected segment runs once
    in forward and never again, and on an accelerator fewer bytes stay on it."""
    result = PropertyResult("recompute", True)
    if isinstance(case.granularity, NoRecompute):
        result.passed, result.summary = None, "no segment selected (granularity none)"
        return result
    for k, (step_rc, step_full) in enumerate(zip(rc.steps, full.steps), start=1):
        for module, counts in step_rc.calls.items():
            fwd, bwd = counts[0], counts[1]
            full_fwd = step_full.calls.get(module, [0, 0])[0]
            bwd = max(bwd, step_rc.uses.get(module, [0, 0])[1])  # by hooks or by its ops
            if fwd != full_fwd or bwd != 0:
                result.failures.append(
                    f"step {k}: {module} ran {fwd} time(s) in forward (full storage: "
                    f"{full_fwd}) and {bwd} in backward; an offload runs each segment once "
                    f"and re-runs nothing")
    on_rc, on_full = rc.held_on or {}, full.held_on or {}
    host_rc = on_rc.get("cpu", 0)
    if device.type == "cpu":
        result.summary = (f"each segment ran once and not again in backward; on a CPU device "
                          f"the host is the device, so nothing can move off it ({host_rc} "
                          f"bytes held, {on_full.get('cpu', 0)} with full storage)")
    else:
        name = str(device) if device.index is not None else f"{device.type}:0"
        kept, before = on_rc.get(name, 0), on_full.get(name, 0)
        if kept >= before:
            result.failures.append(f"activation bytes on {name} between forward and backward: "
                                   f"{kept} with offload, {before} with full storage; nothing "
                                   f"moved to the host")
        result.summary = (f"each segment ran once and not again in backward; {before - kept} "
                          f"bytes moved off {name}, {host_rc} bytes held on the host")
    if result.failures:
        result.passed, result.summary = False, result.failures[0]
    return result


def _summary(result: PropertyResult) -> str:
    if result.name == "recompute":
        return "each segment re-ran once in backward and fewer bytes were held"
    if result.name == "rng":
        switches = "torch's global switches as full storage left them"
        generators = _tensor_summary(result)
        return f"{generators}; {switches}" if generators else switches
    return _tensor_summary(result)


def _tensor_summary(result: PropertyResult) -> str:
    worst = max(result.checks, key=lambda c: c.rel_error / c.bound if c.bound else
                (math.inf if c.rel_error else 0.0), default=None)
    if worst is None:
        return result.summary
    equal = all(c.mismatched == 0 for c in result.checks)
    if equal:
        return f"{len(result.checks)} tensors bitwise equal"
    return (f"{len(result.checks)} tensors within bound; worst {worst.name}: "
            f"{worst.rel_error:.3g} <= {worst.bound:.3g}")

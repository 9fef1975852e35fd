"""``gradequiv profile``: activation memory and step time per granularity, and the frontier.

Matching gradients say nothing about memory, and less memory says nothing
about speed: this measures both on one model, for each granularity, side by
side. Steps of every granularity are interleaved round by round, so machine
noise falls on all of them alike; times are reported as p50/p95/p99 with
the run conditions. Memory is the activation bytes alive between forward and
backward (the implementation-agnostic count of ``memory.py``), and the peak
during backward, when recomputed activations are alive for a moment.

A user's model (``--model``) is profiled the same way; its granularities are its
own segments: every one (``layer``), every k-th (``every:K``) or any set of them
by name (``blocks.0+blocks.2``). A transformers model may add rows of its own toggle
(``hf``, ``hf:every_n_layers=2``, ``hf:offload``): transformers picks the layers, whatever
``--impl`` the other rows run. The recommendation reads the frontier
(:func:`recommend`): its knee, and with a memory budget the fastest granularity
that fits and the largest batch each one could run within it. Byte counts are
exact and the same every run; step times are not, so rows whose times are
within the measured noise (:func:`within_noise`) are tied, and memory decides
between them.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradequiv.harness.engine.case import Case
from gradequiv.harness.engine.memory import ActivationCounter, AllocatorWatch, BackwardPeak
from gradequiv.harness.engine.path import build_path
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.models import EveryLayer, ExternalConfig, Granularity, parse_granularity
from gradequiv.models.granularity import SINGLE_LAYERS, NoRecompute, TogglesOwn


@dataclass(frozen=True)
class NamedSegments:
    """Recompute exactly these segments of a user's model, by their dotted names."""

    names: tuple[str, ...]

    def __str__(self) -> str:
        return "+".join(self.names)


@dataclass(frozen=True)
class ToggleRun:
    """transformers' own toggle (``--impl hf``) with these of its options, on every layer it
    checkpoints: a row of its own, whatever ``--impl`` the other rows run."""

    options: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        said = [k if v is True else f"{k}={v}" for k, v in self.options]
        return "+".join([f"{TOGGLE_ROW}:{said[0]}", *said[1:]]) if said else TOGGLE_ROW


#: The row name of transformers' toggle in ``--granularity`` (``hf:every_n_layers=2``).
TOGGLE_ROW = "hf"

#: What one profile row recomputes: a granularity, a user's segments by name, or
#: transformers' own toggle.
Selection = Granularity | NamedSegments | ToggleRun


def parse_selection(text: str, segments: list[str] | None = None) -> Selection:
    """One item of ``--granularity``: a granularity's text form, or, for a user's model
    (``segments``: its dotted segment names), ``NAME+NAME...`` of those segments."""
    text = text.strip()
    head = text.partition(":")[0]
    if head == TOGGLE_ROW:
        if segments is None:
            raise InvalidArgument(
                f"--granularity item {text!r} profiles transformers' own toggle, which needs "
                f"a transformers model: add --model gradequiv.models.hf:llama (or hf:NAME, "
                f"or a factory of your own PreTrainedModel), or leave the item out")
        return _toggle_run(text)
    if segments is None:
        return parse_granularity(text)
    if head in ("none", "layer", "every", "group", "attention", "mlp"):
        granularity = parse_granularity(text)
        if not isinstance(granularity, SINGLE_LAYERS):
            raise InvalidArgument(
                f"--granularity item {text!r}: a --model's segments are called one by one by "
                f"its own forward, so only none, layer, every:K or segment names apply; to "
                f"recompute several as one, name the module that holds them in the factory's "
                f"segments")
        return granularity
    names = tuple(n.strip() for n in text.split("+"))
    unknown = [n for n in names if n not in segments]
    if unknown or not all(names):
        raise InvalidArgument(
            f"--granularity item {text!r}: {unknown[0] if unknown else ''!r} is not a segment "
            f"of the model; its segments are {', '.join(segments)} (join several with '+', "
            f"e.g. {'+'.join(segments[:2])})")
    return NamedSegments(names)


def _toggle_run(text: str) -> ToggleRun:
    """``hf``, ``hf:every_n_layers=2``, ``hf:offload`` or several joined by ``+``."""
    from gradequiv.harness.implementations.libraries import HF_TOGGLE_OPTIONS
    from gradequiv.harness.validate import impl_kwargs

    _, colon, rest = text.partition(":")
    items = [i.strip() for i in rest.split("+")] if colon else []
    options = impl_kwargs([i if "=" in i else f"{i}=true" for i in items],
                          name=f"--granularity item {text!r}:")
    unknown = [k for k in options if k not in HF_TOGGLE_OPTIONS]
    if unknown or (colon and not options):
        raise InvalidArgument(
            f"--granularity item {text!r}: {unknown[0] if unknown else rest!r} is no option "
            f"of transformers' toggle; its options are {', '.join(HF_TOGGLE_OPTIONS)} (e.g. "
            f"hf:every_n_layers=2, hf:offload, hf:every_n_layers=2+offload)")
    return ToggleRun(tuple(options.items()))


def _transformers_toggle(case: Case, row: ToggleRun) -> Implementation:
    """``--impl hf`` with the row's options, once the case's model is a transformers one."""
    from gradequiv.harness.implementations.resolve import resolve
    from gradequiv.models.external import seeded_user_model

    model = seeded_user_model(case.model, 0).model if isinstance(case.model, ExternalConfig) \
        else None
    if not (hasattr(model, "config") and (hasattr(model, "activation_checkpointing_enable")
                                          or hasattr(model, "gradient_checkpointing_enable"))):
        raise InvalidArgument(
            f"--granularity item {str(row)!r} profiles transformers' own toggle, and the "
            f"model is a {type(model).__name__}, not a transformers PreTrainedModel: leave "
            f"the item out, or profile a transformers model (--model hf:NAME)")
    return resolve("hf", kwargs=dict(row.options))


@dataclass
class GranularityProfile:
    granularity: str
    held_bytes: int  # activation bytes alive between forward and backward
    peak_backward_bytes: int  # the most alive at once during backward, recomputed ones included
    step_s: dict[str, float]  # p50, p95, p99 (and p25, p75) of forward + backward + optimizer
    forward_s: float  # p50
    backward_s: float  # p50, with the optimizer step
    tokens_per_s: float  # at the p50 step time (samples for a user's model: conditions' unit)
    recompute_s: float = 0.0  # p50 time inside segment forwards run during backward
    extra_backward_s: float = 0.0  # p50 backward minus that of "none"
    overhead_vs_none: float = 0.0  # p50 step time / that of "none" - 1
    memory_saved_vs_none: float = 0.0  # 1 - held bytes / those of "none"
    on_frontier: bool = False  # no other row beats it on both peak bytes and p50 step time
    held_on: dict[str, int] = field(default_factory=dict)  # held bytes by device (offload)
    # CUDA only (None elsewhere): the caching allocator's own view of the same step.
    cuda_allocated_held_bytes: int | None = None  # memory_allocated() after forward - before
    cuda_requested_held_bytes: int | None = None  # the same for requested_bytes (no rounding)
    cuda_max_allocated_bytes: int | None = None  # max_memory_allocated() over the step - before


@dataclass
class ProfileResult:
    impl: str
    case: dict[str, Any]
    conditions: dict[str, Any]
    rows: list[GranularityProfile] = field(default_factory=list)
    adapter: str = "function"
    kwargs: dict[str, str] = field(default_factory=dict)  # the implementation's, as repr()
    recommendation: dict[str, Any] = field(default_factory=dict)  # recommend()'s

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": 1, "command": "profile", "implementation": self.impl,
                "adapter": self.adapter, "kwargs": self.kwargs, "case": self.case,
                "conditions": self.conditions, "rows": [asdict(r) for r in self.rows],
                "recommendation": self.recommendation}


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p95, p99 (inclusive method: no extrapolation past the slowest step)."""
    if len(values) == 1:
        return {"p50": values[0], "p95": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": statistics.median(values), "p95": cuts[94], "p99": cuts[98]}


def quartiles(values: list[float]) -> dict[str, float]:
    """p25 and p75: the band the middle half of the steps fell in, the noise of a row."""
    if len(values) == 1:
        return {"p25": values[0], "p75": values[0]}
    cuts = statistics.quantiles(values, n=4, method="inclusive")
    return {"p25": cuts[0], "p75": cuts[2]}


def pareto_frontier(points: list[tuple[float, float]]) -> list[bool]:
    """Which (memory, time) points no other point beats on both (and strictly on one)."""
    def beaten(i: int) -> bool:
        m, t = points[i]
        return any(m2 <= m and t2 <= t and (m2 < m or t2 < t)
                   for j, (m2, t2) in enumerate(points) if j != i)
    return [not beaten(i) for i in range(len(points))]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _RecomputeClock:
    """Time spent in segment forwards while backward runs: the recompute's own share.

    Forward hooks on each selected segment module see every call, whoever
    makes it; during backward the only callers are recompute. The post hook
    is registered with ``always_call`` because non-reentrant checkpoint stops
    a recompute early by raising once it has what backward needs. On CUDA the
    interval is measured with events, so no synchronisation is added inside
    backward.
    """

    def __init__(self, modules: list[nn.Module], device: torch.device) -> None:
        self.device, self.in_backward = device, False
        self._cpu_s = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._open: dict[int, Any] = {}
        for module in modules:
            module.register_forward_pre_hook(self._start)
            module.register_forward_hook(self._stop, always_call=True)

    def _now(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def _start(self, module: nn.Module, args: Any) -> None:
        if self.in_backward and id(module) not in self._open:
            self._open[id(module)] = self._now()

    def _stop(self, module: nn.Module, args: Any, output: Any) -> None:
        started = self._open.pop(id(module), None)
        if started is None:
            return
        if self.device.type == "cuda":
            self._events.append((started, self._now()))
        else:
            self._cpu_s += time.perf_counter() - started

    def take(self) -> float:
        """Seconds of recompute since the last call (after the step has synchronised)."""
        seconds = self._cpu_s + sum(float(a.elapsed_time(b)) for a, b in self._events) / 1e3
        self._cpu_s, self._events = 0.0, []
        return seconds


PROGRESS_EVERY_S = 15.0  # the most often a long phase says how far it has got


class _Progress:
    """Plain lines for a CI log, where a terminal's carriage returns would pile up: one as
    each phase starts and ends, and in between at most one every ``every_s`` seconds, so a
    short run stays quiet and a long one still shows it is alive."""

    def __init__(self, write: Callable[[str], None] | None, every_s: float = PROGRESS_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.write, self.every_s, self.clock = write, every_s, clock
        self.phase, self.started, self.last = "", 0.0, 0.0

    def _say(self, text: str) -> None:
        if self.write is not None:
            self.write(f"profile: {self.phase}: {text}")

    def start(self, phase: str, what: str) -> None:
        self.phase = phase
        self.started = self.last = self.clock()
        self._say(f"{what} ...")

    def tick(self, what: str, fraction: float | None = None) -> None:
        """``what`` is done so far; ``fraction`` of the phase, for an estimate of the rest."""
        now = self.clock()
        if now - self.last < self.every_s:
            return
        self.last = now
        elapsed = now - self.started
        left = (f", about {elapsed / fraction * (1 - fraction):.0f} s left"
                if fraction is not None and 0 < fraction < 1 else "")
        self._say(f"{what}, {elapsed:.0f} s so far{left}")

    def end(self) -> None:
        self._say(f"done in {self.clock() - self.started:.1f} s")


class _Runner:
    """One granularity's model, ready to step."""

    def __init__(self, case: Case, granularity: Selection, impl: Implementation,
                 device: torch.device) -> None:
        self.device = device
        if isinstance(granularity, NamedSegments):  # every segment, then keep those named
            self.path = build_path(replace(case, granularity=EveryLayer()), device)
            self.path.segments = [s for s in self.path.segments if s.name in granularity.names]
        elif isinstance(granularity, ToggleRun):  # every segment: the toggle picks
            self.path = build_path(replace(case, granularity=EveryLayer()), device)
            impl = _transformers_toggle(case, granularity)
        else:
            self.path = build_path(replace(case, granularity=granularity), device)
        self.path.install(impl)
        self.path.model.train()
        self.path.seed()
        self.model = self.path.model
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.clock = _RecomputeClock([s.module for s in self.path.segments], device)
        self.forward_s: list[float] = []
        self.backward_s: list[float] = []
        self.recompute_s: list[float] = []
        self.held_on: dict[str, int] = {}

    def memory(self) -> dict[str, int | None]:
        """Bytes held between forward and backward, the peak during backward, and on CUDA
        the allocator's figures for the same step (they include the output and loss)."""
        never = self.path.not_activations()
        allocator = AllocatorWatch(self.device)
        with ActivationCounter(exclude=never) as counter:
            out, loss = self.path.forward()
        allocator.after_forward()
        held = counter.held_bytes(ignore=[out, loss])
        self.held_on = counter.held_bytes_by_device(ignore=[out, loss])
        seed = torch.ones_like(loss)
        with BackwardPeak(counter, ignore=[out, loss]) as peak:
            loss.backward(seed)  # type: ignore[no-untyped-call]  # untyped in torch
        figures: dict[str, int | None] = {"held_bytes": held,
                                          "peak_backward_bytes": peak.peak_bytes}
        figures.update(allocator.after_backward())
        self.optimizer.zero_grad(set_to_none=True)
        return figures

    def step(self, record: bool) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        _sync(self.device)
        started = time.perf_counter()
        loss = self.path.forward()[1]  # the outputs dropped: backward keeps what it needs
        _sync(self.device)
        middle = time.perf_counter()
        self.clock.in_backward = True
        try:
            loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch
        finally:
            self.clock.in_backward = False
        self.optimizer.step()
        _sync(self.device)
        ended = time.perf_counter()
        recompute = self.clock.take()
        if record:
            self.forward_s.append(middle - started)
            self.backward_s.append(ended - middle)
            self.recompute_s.append(recompute)


def profile(
    impl: Implementation,
    case: Case,
    granularities: list[Selection],
    *,
    steps: int = 20,
    warmup: int = 3,
    device: torch.device | str = "cpu",
    progress: Callable[[str], None] | None = None,
    memory_budget: int | None = None,
) -> ProfileResult:
    """Memory and step time of ``case``'s model under each granularity, through ``impl``,
    and :func:`recommend`'s reading of them (``memory_budget``: activation bytes).

    ``progress`` receives a line as each phase starts and ends and, within a long phase, at
    most one per ``PROGRESS_EVERY_S`` seconds; it runs between steps, never inside a timed
    interval.
    """
    if steps < 1 or warmup < 0:
        raise InvalidArgument(f"steps={steps}, warmup={warmup}: need steps >= 1, warmup >= 0")
    granularities = same_configurations_once(impl, case, granularities)
    device = torch.device(device)
    say, n = _Progress(progress, every_s=PROGRESS_EVERY_S), len(granularities)
    say.start("setup", f"building {n} models ({', '.join(map(str, granularities))}) and "
                       f"counting the memory of one step of each")
    for g in granularities:
        if isinstance(g, ToggleRun):
            _transformers_toggle(case, g)  # not a transformers model: exit 2 before any step
    runners = []
    for g in granularities:
        runners.append(_Runner(case, g, impl, device))
        say.tick(f"{len(runners)} of {n} models built")
    memory = []
    for runner, g in zip(runners, granularities):
        memory.append(_toggle_step(g, runner.memory))
        say.tick(f"memory of {len(memory)} of {n} counted ({g} last)")
    say.end()
    for phase, rounds, record in (("warm-up", warmup, False), ("timing", steps, True)):
        if not rounds:
            continue
        say.start(phase, f"{rounds} round{'s' * (rounds != 1)} of {n} steps, one per "
                         f"granularity, interleaved{'' if record else ', not timed'}")
        for round_ in range(rounds):
            for k, runner in enumerate(runners):
                runner.step(record=record)
                done = round_ * n + k + 1
                say.tick(f"round {round_ + 1} of {rounds}, {done} of {rounds * n} steps",
                         done / (rounds * n))
        say.end()
    if isinstance(case.model, ExternalConfig):  # the factory chose the batch: count samples
        targets = runners[0].path.targets
        unit, batch = "samples", int(targets.shape[0]) if targets.dim() else 1
        tokens = batch
        shape = f"model {case.model.factory} x batch {batch}, {case.dtype}, seed {case.seed}"
    else:
        unit, batch = "tokens", case.batch.batch_size
        tokens = case.batch.batch_size * case.batch.seq_len
        shape = case.describe().replace(f", {case.granularity}, ", ", ")
        shape = shape.replace("t, ", f"t x batch {case.batch.batch_size}, ", 1)
    rows = []
    for g, runner, figures in zip(granularities, runners, memory):
        totals = [f + b for f, b in zip(runner.forward_s, runner.backward_s)]
        step = percentiles(totals) | quartiles(totals)
        rows.append(GranularityProfile(
            granularity=str(g), step_s=step, **figures,  # type: ignore[arg-type]
            forward_s=statistics.median(runner.forward_s),
            backward_s=statistics.median(runner.backward_s),
            recompute_s=statistics.median(runner.recompute_s),
            tokens_per_s=tokens / step["p50"], held_on=runner.held_on))
    baseline = next((r for r in rows if r.granularity == "none"), None)
    if baseline is not None:
        for row in rows:
            row.extra_backward_s = row.backward_s - baseline.backward_s
            row.overhead_vs_none = row.step_s["p50"] / baseline.step_s["p50"] - 1
            row.memory_saved_vs_none = (1 - row.held_bytes / baseline.held_bytes
                                        if baseline.held_bytes else 0.0)
    # The frontier is of the step's peak, the memory that must fit: a granularity that
    # holds little but recomputes a large segment at once saves less than it seems.
    for row, on in zip(rows, pareto_frontier([(peak_bytes(r), r.step_s["p50"]) for r in rows])):
        row.on_frontier = on
    conditions = {"torch": torch.__version__, "device": str(device),
                  "threads": torch.get_num_threads(), "load_average": _load_average(),
                  "dtype": case.dtype,
                  "steps": steps, "warmup": warmup, "tokens_per_step": tokens,
                  "unit": unit, "batch": batch, "shape": shape}
    return ProfileResult(impl.spec, case.to_dict(), conditions, rows, impl.adapter,
                         {k: repr(v) for k, v in impl.kwargs.items()},
                         recommend(rows, batch=batch, unit=unit, memory_budget=memory_budget))


def _toggle_step(row: Selection, measure: Callable[[], dict[str, int | None]]
                 ) -> dict[str, int | None]:
    """The first step's memory; where transformers' toggle raises in it, exit 2 with its
    error: transformers 5.25's offload pins its host copies, which torch refuses on a
    machine without an accelerator."""
    try:
        return measure()
    except RuntimeError as exc:
        if not isinstance(row, ToggleRun):
            raise
        raise InvalidArgument(
            f"--granularity item {str(row)!r}: transformers' toggle raised in the first step: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0].rstrip('.')}; leave the item out "
            f"here (offload needs an accelerator: --device cuda)") from exc


def _load_average() -> list[float] | None:
    """The machine's load over 1, 5 and 15 minutes as the steps ended (None where the
    platform keeps none): step times on a loaded machine are not comparable."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def same_configurations_once(impl: Implementation, case: Case,
                             granularities: list[Selection]) -> list[Selection]:
    """Each configuration once: a toggle that chooses its own segments (timm's
    ``set_grad_checkpointing``) checkpoints the same layers whatever is selected, so every
    selection but ``none`` is one row, "toggle" (the toggle's), not rows to rank."""
    if not (isinstance(case.model, ExternalConfig) and impl.chooses_segments):
        return granularities
    rows: list[Selection] = []
    for g in granularities:
        one = g if isinstance(g, (NoRecompute, ToggleRun)) else TogglesOwn()
        if one not in rows:
            rows.append(one)
    return rows


#: A step along the frontier costs "clearly more" when its time per byte saved is more than
#: this many times that of the steps before it, taken together.
KNEE_FACTOR = 2.0


def peak_bytes(row: GranularityProfile) -> int:
    """The most activation bytes alive at once in a step: held, or more during backward."""
    return max(row.held_bytes, row.peak_backward_bytes)


def within_noise(a: GranularityProfile, b: GranularityProfile) -> bool:
    """Whether two rows' step times are tied: their interquartile ranges overlap.

    Steps are interleaved round by round, so the spread of a row's timed steps is the
    noise every row saw; a p50 difference inside it is one a rerun can reverse. A row
    without quartiles (one timed step, an older file) is its p50 alone.
    """
    (a25, a75), (b25, b75) = _band(a), _band(b)
    return a25 <= b75 and b25 <= a75


def _band(row: GranularityProfile) -> tuple[float, float]:
    p50 = row.step_s["p50"]
    return row.step_s.get("p25", p50), row.step_s.get("p75", p50)


def least_memory_among_tied(
        best: GranularityProfile, candidates: list[GranularityProfile],
) -> tuple[GranularityProfile, list[GranularityProfile]]:
    """The row to recommend in ``best``'s place, and the candidates tied with it (``best``
    included, in the candidates' order; ``best`` alone when none is).

    Among tied rows time ranks nothing, so the smallest :func:`peak_bytes` wins, and
    equal peaks go to the earlier candidate: the same rows give the same pick every run.
    """
    tied = [r for r in candidates if r is best or within_noise(r, best)]
    order = {id(r): k for k, r in enumerate(candidates)}
    return min(tied, key=lambda r: (peak_bytes(r), order[id(r)])), tied


def _tie_sentence(pick: GranularityProfile, tied: list[GranularityProfile]) -> str:
    """Which rows are tied, on what evidence, and which one memory picks."""
    names = [r.granularity for r in tied]
    listed = " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"
    bands = ", ".join(f"{r.granularity} {_band(r)[0] * 1e3:.1f}-{_band(r)[1] * 1e3:.1f} ms"
                      for r in tied)
    return (f"{listed} are tied within noise (step-time interquartile ranges overlap: "
            f"{bands}), so time does not rank them and memory picks: the smallest peak is "
            f"recommended, {pick.granularity}, peak {peak_bytes(pick):,} bytes (held between "
            f"forward and backward: {pick.held_bytes:,} bytes)")


def recommend(rows: list[GranularityProfile], *, batch: int, unit: str = "tokens",
              memory_budget: int | None = None) -> dict[str, Any]:
    """The frontier's knee, and with ``memory_budget`` what fits it.

    The knee: walk the frontier (:func:`peak_bytes` against p50 step time) from its
    fastest point towards less memory; the knee is the last point before a step whose
    time per byte saved is more than ``KNEE_FACTOR`` times that of all the steps before it
    together, at the ends of their interquartile ranges (:func:`_clearly_more`), or the
    last point, when no step is. Rows tied with it in time (:func:`within_noise`) are not
    ranked by time: the one with the smallest peak is recommended (``knee``), and ``tied`` names
    them. With a budget: the fastest granularity whose peak fits (the same tie rule
    among the fitting rows), and per granularity the largest batch whose peak
    would fit (activation bytes grow with the batch, so the measured peak per sample
    times the batch), with its rate as measured.
    """
    frontier = sorted((r for r in rows if r.on_frontier),
                      key=lambda r: (r.step_s["p50"], -peak_bytes(r)))
    knee, why = frontier[0], "it is the only point on the frontier"
    if len(frontier) > 1:
        why = (f"no step along the frontier costs more than {KNEE_FACTOR:g}x the time per byte "
               f"saved of the steps before it (at the ends of their step times' interquartile "
               f"ranges), so the point that saves the most is still a fair buy")
        knee = frontier[-1]
        start = frontier[0]
        for before, after in zip(frontier, frontier[1:]):
            saved_so_far = peak_bytes(start) - peak_bytes(before)
            step_saved = peak_bytes(before) - peak_bytes(after)
            # per MiB, or per KiB where the steps are that small (a test model's)
            per, size = (("MiB", 2**20) if min(saved_so_far, step_saved) >= 2**20
                         else ("KiB", 2**10))
            so_far = (_ms_per(before.step_s["p50"] - start.step_s["p50"], saved_so_far, size)
                      if before is not start else None)
            this = _ms_per(after.step_s["p50"] - before.step_s["p50"], step_saved, size)
            if so_far is not None and _clearly_more(start, before, after, saved_so_far,
                                                    step_saved, size):
                knee = before
                why = (f"reaching it from {start.granularity} costs {so_far:.2f} ms of step time "
                       f"per {per} of peak saved; going on to {after.granularity} costs "
                       f"{this:.2f} ms per {per}, "
                       f"{this / so_far if so_far else float('inf'):.2f}x as much (more than "
                       f"{KNEE_FACTOR:g}x is clearly more, and is so even at the ends of their "
                       f"step times' interquartile ranges)")
                break
    pick, tied = least_memory_among_tied(knee, rows)
    if len(tied) > 1:
        why = _tie_sentence(pick, tied) + (
            f"; {why}" if pick is knee else f"; by p50 alone the knee is {knee.granularity}: "
                                            f"{why}")
    result: dict[str, Any] = {
        "rule": (f"the knee: along the frontier (peak activation bytes against p50 step "
                 f"time) from its fastest point, the last granularity before a step whose "
                 f"step time per byte of peak saved is more than {KNEE_FACTOR:g}x that of the "
                 f"steps before it together, even at the ends of their step times' "
                 f"interquartile ranges; granularities whose step-time interquartile "
                 f"ranges overlap the knee's are tied with it within noise, and of those the "
                 f"one with the smallest peak is recommended (the first listed where peaks "
                 f"are equal)"),
        "knee": pick.granularity, "why": why,
        "tied": [r.granularity for r in tied] if len(tied) > 1 else [],
        "memory_budget": memory_budget}
    if memory_budget is None:
        return result
    fitting = [r for r in rows if peak_bytes(r) <= memory_budget]
    fastest = min(fitting, key=lambda r: r.step_s["p50"]) if fitting else None
    tied_fitting: list[GranularityProfile] = []
    if fastest is not None:
        fastest, tied_fitting = least_memory_among_tied(fastest, fitting)
    largest = []
    for r in rows:
        per_sample = peak_bytes(r) / batch if batch else float(peak_bytes(r))
        most = int(memory_budget // per_sample) if per_sample else None
        largest.append({"granularity": r.granularity, "peak_bytes": peak_bytes(r),
                        "fits": peak_bytes(r) <= memory_budget, "largest_batch": most,
                        "per_s": r.tokens_per_s})
    tie = (_tie_sentence(fastest, tied_fitting)
           if fastest is not None and len(tied_fitting) > 1 else "")
    verdict = _budget_verdict(rows, fastest, largest, memory_budget, batch, unit, tie)
    result.update(fits=[r.granularity for r in fitting],
                  fastest_fitting=None if fastest is None else fastest.granularity,
                  fastest_fitting_tied=[r.granularity for r in tied_fitting]
                  if len(tied_fitting) > 1 else [],
                  largest_batch=largest, verdict=verdict)
    return result


def _clearly_more(start: GranularityProfile, before: GranularityProfile,
                  after: GranularityProfile, saved_so_far: int, step_saved: int,
                  size: int) -> bool:
    """Whether the step from ``before`` to ``after`` costs more than ``KNEE_FACTOR`` times
    the time per byte of the steps from ``start`` to ``before``, even where the noise is
    least kind to it: this step's time at its smallest (``after``'s p25 less ``before``'s
    p75) against the steps before it at their largest (``before``'s p75 less ``start``'s
    p25). A ratio of p50s alone swung from 1.7 to 2.9 between identical runs, and the
    recommendation with it; a step whose ranges overlap is never clearly more."""
    this_least = _ms_per(_band(after)[0] - _band(before)[1], step_saved, size)
    so_far_most = _ms_per(_band(before)[1] - _band(start)[0], saved_so_far, size)
    return this_least > KNEE_FACTOR * max(so_far_most, 0.0)


def _ms_per(seconds: float, saved_bytes: int, size: int) -> float:
    """Milliseconds of step time per ``size`` bytes saved."""
    return seconds * 1e3 / (saved_bytes / size) if saved_bytes > 0 else float("inf")


def _budget_verdict(rows: list[GranularityProfile], fastest: GranularityProfile | None,
                    largest: list[dict[str, Any]], budget: int, batch: int,
                    unit: str, tie: str = "") -> str:
    """One plain sentence: what fits, and whether recompute buys a larger batch (``tie``:
    which fitting rows are tied for the fastest, and why ``fastest`` of them)."""
    if fastest is None:
        least = min(rows, key=peak_bytes)
        most = next(x["largest_batch"] for x in largest if x["granularity"] == least.granularity)
        return (f"nothing fits {budget:,} bytes at batch {batch}: the smallest peak is "
                f"{least.granularity}'s {peak_bytes(least):,} bytes; with it the largest "
                f"batch that fits is {most}" + ("" if most else " (none: even one sample "
                                                 "needs more)"))
    base = next((x for x in largest if x["granularity"] == "none"), None)
    best = max(largest, key=lambda x: x["largest_batch"] or 0)
    text = (f"{fastest.granularity} is, within noise, the fastest granularity that fits "
            f"{budget:,} bytes: {tie}" if tie else
            f"{fastest.granularity} is the fastest granularity that fits {budget:,} bytes")
    if fastest.granularity == "none":
        text += f", so recompute is not needed at batch {batch}"
    if base is not None and best["granularity"] != "none" and \
            (best["largest_batch"] or 0) > (base["largest_batch"] or 0):
        change = best["per_s"] / base["per_s"] - 1 if base["per_s"] else 0.0
        text += (f"; recompute buys a larger batch: {best['granularity']} fits batch "
                 f"{best['largest_batch']} where none fits {base['largest_batch'] or 0}, at "
                 f"{best['per_s']:,.0f} {unit}/s as measured ({change:+.0%} against none): "
                 f"worth it if that batch is wanted and that rate is acceptable")
    elif base is not None:
        text += "; no granularity fits a larger batch than none, so recompute buys nothing here"
    return text


def plot(result: ProfileResult, path: Path) -> str | None:
    """Memory against step time as a PNG; the reason when matplotlib is missing."""
    from gradequiv.harness.reports.figures import MISSING_MATPLOTLIB, frontier_png

    png = frontier_png(result.to_dict())
    if png is None:
        return MISSING_MATPLOTLIB
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)
    return None


def run(args: Any) -> int:
    """The profile command: measure, print the table and the recommendation, write
    DIR/profile.json (+ .md, .png).

    torch's intra-op threads are set as ``check`` sets them (``--threads``, else
    GRADEQUIV_THREADS, else 1) before the first model is built, and put back after.
    """
    from gradequiv.harness.commands.check import torch_threads
    from gradequiv.harness.validate import threads, threads_given

    count = threads("--threads", threads_given(args.threads))
    with torch_threads(count):
        return _measure(args, count)


def _measure(args: Any, threads: int | None) -> int:
    """The profile command under its thread count (None: torch's default)."""
    from gradequiv.harness.commands.check import check_model
    from gradequiv.harness.engine.devices import resolve_device
    from gradequiv.harness.implementations.resolve import resolve
    from gradequiv.harness.options import profile_options
    from gradequiv.harness.reports.files import write_json_atomic
    from gradequiv.harness.reports.markdown import profile_markdown
    from gradequiv.harness.validate import impl_kwargs
    from gradequiv.models import (
        ELEMENT_DROPOUT_SITES,
        BatchConfig,
        TransformerConfig,
    )
    from gradequiv.models.external import seeded_user_model

    options = profile_options(granularity=args.granularity, memory_budget=args.memory_budget,
                              model=args.model)
    impl = resolve(args.impl, adapter=args.adapter, kwargs=impl_kwargs(args.impl_kwarg))
    device = resolve_device(args.device)
    if options.model is not None:
        check_model(options.model)  # a factory that cannot build, or not reproducibly: exit 2
        config = ExternalConfig(options.model)
        segments = seeded_user_model(config, 0).segments
        names = [s for s in segments if isinstance(s, str)]  # classes name no one segment
        granularities = [parse_selection(text, names) for text in options.granularity]
        case = Case(model=config, dtype=args.dtype, name="profile")
    else:
        granularities = [parse_selection(text) for text in options.granularity]
        rates = dict.fromkeys(ELEMENT_DROPOUT_SITES, args.dropout)
        model = TransformerConfig(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                                  max_seq_len=args.seq_len, **rates)
        case = Case(model=model, batch=BatchConfig(args.batch, args.seq_len, padding=False),
                    dtype=args.dtype, name="profile")
        from gradequiv.harness.commands.check import refuse_too_large

        refuse_too_large(case, said="--layers, --width, --batch, --seq-len")
    count = torch.get_num_threads()
    print(f"gradequiv profile: {impl.spec} on {device}, {case.describe()}, "
          f"{len(granularities)} granularities x {args.steps} steps, {count} "
          f"thread{'s' if count != 1 else ''} (--threads {threads or 'auto'})", flush=True)
    result = profile(impl, case, granularities, steps=args.steps, warmup=args.warmup,
                     device=device, progress=lambda line: print(line, flush=True),
                     memory_budget=options.memory_budget)
    print(profile_markdown(result.to_dict()), end="")
    if args.report_dir is not None:
        missing = plot(result, args.report_dir / "profile.png")
        data = result.to_dict() | {"plot": None if missing else "profile.png",
                                   "plot_missing": missing}
        write_json_atomic(args.report_dir / "profile.json", data)
        (args.report_dir / "profile.md").write_text(profile_markdown(data), encoding="utf-8")
        print(f"report: {args.report_dir / 'profile.json'}" + (f" (no plot: {missing})"
                                                              if missing else ""))
    return 0

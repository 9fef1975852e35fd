"""torch's pipeline schedules and how a case is laid out on them: which schedule, how many
micro-batches, how many stages each rank holds and where each stage sits. Plain data, no
torch: the command line offers the names, ``parallel.Parallel`` carries a layout, and
``pipeline`` builds the stages and the schedule from it."""

from __future__ import annotations

from dataclasses import dataclass

from gradequiv.harness.errors import InvalidArgument
from gradequiv.models.kinds import PIPELINE_SCHEDULE_NAMES

__all__ = ["ONE_STAGE_SCHEDULES", "PIPELINE_SCHEDULES", "Pipelining"]


@dataclass(frozen=True)
class _ScheduleKind:
    """One of torch's schedules: its class's name, the stages it puts on each rank by
    default, and how it places them (``loop`` or ``v``)."""

    torch_name: str
    stages_per_rank: int
    style: str = "loop"
    #: the fewest micro-batches it takes, in stages (1F1B, DualPipeV: one per stage)
    min_micro_batches_per_stage: int = 0
    #: whether backward is split into an input pass and a later weight pass (zero bubble)
    split_backward: bool = False


#: torch 2.13's schedules, by the name a case gives them, plainest first.
PIPELINE_SCHEDULES: dict[str, _ScheduleKind] = {
    "gpipe": _ScheduleKind("ScheduleGPipe", 1),
    # Schedule1F1B refuses fewer micro-batches than stages when it is made
    "1f1b": _ScheduleKind("Schedule1F1B", 1, min_micro_batches_per_stage=1),
    "interleaved-1f1b": _ScheduleKind("ScheduleInterleaved1F1B", 2),
    "looped-bfs": _ScheduleKind("ScheduleLoopedBFS", 2),
    "interleaved-zero-bubble": _ScheduleKind("ScheduleInterleavedZeroBubble", 2,
                                             split_backward=True),
    "zbv-zero-bubble": _ScheduleKind("ScheduleZBVZeroBubble", 2, "v", split_backward=True),
    "dualpipev": _ScheduleKind("ScheduleDualPipeV", 2, "v", min_micro_batches_per_stage=1,
                               split_backward=True),
}
assert tuple(PIPELINE_SCHEDULES) == PIPELINE_SCHEDULE_NAMES, "name every schedule in both"
#: the schedules that take exactly one stage per rank, and those that take exactly two
ONE_STAGE_SCHEDULES = ("gpipe", "1f1b")
_TWO_IN_A_V = ("zbv-zero-bubble", "dualpipev")


@dataclass(frozen=True)
class Pipelining:
    """How a case is trained through a pipeline: torch's schedule, the micro-batches of one
    optimizer step, the stages each rank holds (None: the schedule's own number), and, for
    a user's model, the ``module:function`` that splits it (``--split``): the reference
    transformer is split by layers, a user's model only the way its author says."""

    schedule: str = "gpipe"
    micro_batches: int = 2
    stages_per_rank: int | None = None
    split: str | None = None

    def __post_init__(self) -> None:
        if self.schedule not in PIPELINE_SCHEDULES:
            raise InvalidArgument(f"schedule={self.schedule!r} is not one of "
                                  f"{', '.join(PIPELINE_SCHEDULES)}")
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise InvalidArgument(f"micro_batches={self.micro_batches!r}: must be a whole "
                                  f"number >= 1")
        if self.split is not None and ":" not in self.split:
            raise InvalidArgument(f"--split={self.split!r} is not a 'module:function' "
                                  f"reference; write e.g. 'my_models:split'")
        per_rank = self.stages_per_rank
        if per_rank is None:
            return
        if not isinstance(per_rank, int) or per_rank < 1:
            raise InvalidArgument(f"stages_per_rank={per_rank!r}: must be a whole number >= 1")
        if self.schedule in ONE_STAGE_SCHEDULES and per_rank != 1:
            raise InvalidArgument(f"stages_per_rank={per_rank} under schedule="
                                  f"{self.schedule!r}: it runs one stage per rank; use 1, or "
                                  f"an interleaved schedule")
        if self.schedule in _TWO_IN_A_V and per_rank != 2:
            raise InvalidArgument(f"stages_per_rank={per_rank} under schedule="
                                  f"{self.schedule!r}: it runs exactly two stages per rank, "
                                  f"in a V; use 2")

    @property
    def per_rank(self) -> int:
        """The stages each rank holds."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return PIPELINE_SCHEDULES[self.schedule].stages_per_rank

    def n_stages(self, world_size: int) -> int:
        return self.per_rank * world_size

    def stage_ranks(self, world_size: int) -> dict[int, int]:
        """Each stage's rank: in a loop (stage ``s`` on rank ``s % world_size``) or, for the
        V schedules, down the ranks and back (rank 0 holds the first and the last stage)."""
        n = self.n_stages(world_size)
        if PIPELINE_SCHEDULES[self.schedule].style == "v":
            return {s: s if s < world_size else n - 1 - s for s in range(n)}
        return {s: s % world_size for s in range(n)}

    def describe(self) -> str:
        split = f", split by {self.split}" if self.split is not None else ""
        return (f"{PIPELINE_SCHEDULES[self.schedule].torch_name}, {self.micro_batches} "
                f"micro-batches, {self.per_rank} stage(s) per rank{split}")

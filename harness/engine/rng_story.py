"""What a recompute did to the caller's CPU random stream, told from two generator states.

A CPU generator is a Mersenne Twister: its state holds the block of 624 words it draws
from and how far into that block it has drawn (``next``). So the distance between two
states of one stream is found block by block, never draw by draw: jump to the next
block (one draw of ``left`` values) until the blocks agree, then the positions give the
rest. At most ``_MAX_DRAWS / 624`` jumps, each one call into torch, whatever the gap.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from gradequiv.harness.engine.runner import PathRun

#: How many single 32-bit draws ``draws_between`` looks across before it gives up.
_MAX_DRAWS = 1 << 16
#: The CPU generator's state: initial seed (u64), left (i32), seeded (i32), next (u64), then
#: the block of 624 u64 words; after it the cached normal samples.
_HEADER = struct.Struct("<QiiQ")
_BLOCK = slice(_HEADER.size, _HEADER.size + 624 * 8)


def rng_stories(full: PathRun, rc: PathRun) -> list[str]:
    """What the recompute path did to the caller's CPU stream, at the first step whose
    state differs: reseeded it, left it rewound (behind full storage's, to where the step
    began if so), or advanced it by extra draws. A state that is none of these (other
    draws) gets no story; the failing check says it differs."""
    for k, (step_rc, step_full) in enumerate(zip(rc.steps, full.steps), start=1):
        ours, theirs = step_rc.rng["cpu"], step_full.rng["cpu"]
        if torch.equal(ours, theirs):
            continue
        start = full.starts[k - 2].rng["cpu"] if 1 < k <= len(full.starts) + 1 else None
        story = rng_story(theirs, ours, start)
        return [f"after step {k} the caller's cpu generator was left {story}"] if story else []
    return []


def rng_story(theirs: Tensor, ours: Tensor, start: Tensor | None) -> str:
    """How the state ``ours`` stands to full storage's ``theirs`` (CPU generator states)."""
    seeds = []
    for state in (theirs, ours):
        generator = torch.Generator()
        try:
            generator.set_state(state)
        except RuntimeError:  # not a CPU generator's state
            return ""
        seeds.append(generator.initial_seed())
    if seeds[0] != seeds[1]:
        return (f"reseeded (seeded with {seeds[1]}, where full storage's stream runs from "
                f"seed {seeds[0]})")
    behind = draws_between(ours, theirs)
    if behind is not None:
        where = " (where the step began)" if start is not None and torch.equal(ours, start) \
            else ""
        return f"rewound, {behind} draws behind full storage's{where}"
    ahead = draws_between(theirs, ours)
    if ahead is not None:
        return f"advanced, {ahead} draws past full storage's (taken by the recompute)"
    return ""


def draws_between(start: Tensor, end: Tensor) -> int | None:
    """How many single 32-bit draws (at least one) take a CPU generator from ``start`` to
    ``end`` (a 64-bit draw is two); None if not within ``_MAX_DRAWS``."""
    generator = torch.Generator()
    generator.set_state(start)
    _, _, _, end_next = _header(end)
    taken = 0
    while taken <= _MAX_DRAWS:
        now = generator.get_state()
        _, left, _, now_next = _header(now)
        if torch.equal(now[_BLOCK], end[_BLOCK]):  # the same block: the positions say the rest
            gap = end_next - now_next
            if gap < 0 or taken + gap == 0 or taken + gap > _MAX_DRAWS:
                return None
            _draw(generator, gap)
            return taken + gap if torch.equal(generator.get_state(), end) else None
        # ``left - 1`` draws reach the block's end; one more draws the next block
        _draw(generator, left)
        taken += left
    return None


def _header(state: Tensor) -> tuple[int, int, int, int]:
    initial_seed, left, seeded, position = _HEADER.unpack(state[: _HEADER.size].numpy().tobytes())
    return initial_seed, left, seeded, position


def _draw(generator: torch.Generator, count: int) -> None:
    """``count`` single 32-bit draws in one call (torch draws an int32 tensor one word per
    element, in order, as it draws one element at a time)."""
    if count:
        torch.empty(count, dtype=torch.int32).random_(generator=generator)

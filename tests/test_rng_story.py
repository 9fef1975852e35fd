"""What a recompute left the caller's RNG stream at, told from the generator states alone."""

from __future__ import annotations

import pytest
import torch

from gradequiv.harness.engine import rng_story as story
from gradequiv.harness.engine.rng_story import draws_between, rng_story


def _state_after(draws: int, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    torch.rand(draws, generator=generator)  # one 32-bit draw per float
    return generator.get_state()


def test_a_stream_left_behind_full_storage_s_is_rewound_and_where_the_step_began_is_said() -> None:
    start, full = _state_after(0), _state_after(100)
    assert rng_story(full, start, start) == (
        "rewound, 100 draws behind full storage's (where the step began)")
    assert rng_story(full, _state_after(40), start) == "rewound, 60 draws behind full storage's"


def test_extra_draws_are_an_advance_and_another_seed_a_reseed() -> None:
    full = _state_after(100)
    assert rng_story(full, _state_after(130), None) == (
        "advanced, 30 draws past full storage's (taken by the recompute)")
    assert rng_story(full, _state_after(100, seed=0), None) == (
        "reseeded (seeded with 0, where full storage's stream runs from seed 3)")


def test_a_stream_too_far_off_gets_no_story() -> None:
    """Further apart than the draws it tries (65,536), or apart by a normal sample's cached
    state: the check says the state differs, and no story is made up."""
    far = torch.Generator().manual_seed(3)
    torch.rand(200_000, generator=far)
    assert rng_story(_state_after(100), far.get_state(), None) == ""
    normal = torch.Generator().manual_seed(3)
    torch.randn(7, generator=normal)
    assert rng_story(_state_after(100), normal.get_state(), None) == ""


@pytest.mark.parametrize("gap", [1, 2, 622, 623, 624, 625, 1248, 1249, 5000])
@pytest.mark.parametrize("before", [0, 1, 300, 623, 624])
def test_the_distance_is_the_draws_taken_across_block_boundaries(before: int, gap: int) -> None:
    assert draws_between(_state_after(before), _state_after(before + gap)) == gap
    assert draws_between(_state_after(before + gap), _state_after(before)) is None


def test_the_distance_costs_a_jump_per_block_not_a_call_per_draw(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """60,000 draws apart (96 blocks): found in at most one call per block and one for the
    rest, where a draw at a time would make 60,000."""
    calls: list[int] = []
    draw = story._draw
    monkeypatch.setattr(story, "_draw", lambda g, n: (calls.append(n), draw(g, n)))
    assert draws_between(_state_after(10), _state_after(60_010)) == 60_000
    assert len(calls) <= 60_000 // 624 + 2
    calls.clear()
    assert draws_between(_state_after(10), _state_after(10 + story._MAX_DRAWS + 1)) is None
    assert len(calls) <= story._MAX_DRAWS // 624 + 2

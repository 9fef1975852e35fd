"""What a recompute left the caller's RNG stream at, told from the generator states alone."""

from __future__ import annotations

import torch

from gradequiv.harness.engine.verify import _rng_story


def _state_after(draws: int, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    torch.rand(draws, generator=generator)  # one 32-bit draw per float
    return generator.get_state()


def test_a_stream_left_behind_full_storage_s_is_rewound_and_where_the_step_began_is_said() -> None:
    start, full = _state_after(0), _state_after(100)
    assert _rng_story(full, start, start) == (
        "rewound, 100 draws behind full storage's (where the step began)")
    assert _rng_story(full, _state_after(40), start) == "rewound, 60 draws behind full storage's"


def test_extra_draws_are_an_advance_and_another_seed_a_reseed() -> None:
    full = _state_after(100)
    assert _rng_story(full, _state_after(130), None) == (
        "advanced, 30 draws past full storage's (taken by the recompute)")
    assert _rng_story(full, _state_after(100, seed=0), None) == (
        "reseeded (seeded with 0, where full storage's stream runs from seed 3)")


def test_a_stream_too_far_off_gets_no_story() -> None:
    """Further apart than the draws it tries (65,536), or apart by a normal sample's cached
    state: the check says the state differs, and no story is made up."""
    far = torch.Generator().manual_seed(3)
    torch.rand(200_000, generator=far)
    assert _rng_story(_state_after(100), far.get_state(), None) == ""
    normal = torch.Generator().manual_seed(3)
    torch.randn(7, generator=normal)
    assert _rng_story(_state_after(100), normal.get_state(), None) == ""

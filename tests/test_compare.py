"""The metrics on hand-made tensors, and the tolerance policy's arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from gradequiv.harness.engine.compare import DTYPE_CAPS, Tolerance, measure_pairs, ulp_distance
from gradequiv.models import InvalidArgument


def test_identical_tensors_are_exactly_equal() -> None:
    a = torch.randn(5, 7)
    (m,) = measure_pairs([(a.clone(), a)])
    assert (m.rel_error, m.max_abs, m.cosine, m.mismatched, m.numel) == (0.0, 0.0, 1.0, 0, 35)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_ulps_count_the_representable_values_between(dtype: torch.dtype) -> None:
    one = torch.tensor([1.0], dtype=dtype)
    steps = [one]
    for _ in range(3):
        steps.append(torch.nextafter(steps[-1], torch.tensor([2.0], dtype=dtype)))
    assert int(ulp_distance(steps[3], one)) == 3
    tiny = torch.nextafter(torch.zeros(1, dtype=dtype), one)  # the smallest subnormal
    assert int(ulp_distance(-tiny, tiny)) == 2  # -tiny, then 0 (either sign), then tiny
    assert int(ulp_distance(torch.tensor([-0.0], dtype=dtype), torch.zeros(1, dtype=dtype))) == 0
    (m,) = measure_pairs([(steps[2], one)])
    assert m.max_ulps == 2


def test_ulps_of_many_pairs_at_once_are_each_pairs_own() -> None:
    """Pairs of every width, dtype and shape measured in one call (grouped by dtype, one
    reduction per group) give each pair the distance it has alone."""
    torch.manual_seed(0)
    pairs = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for shape in ((1,), (5, 3), (100,)):
            b = torch.randn(shape).to(dtype)
            pairs.append(((b + torch.randn(shape).to(dtype) * 1e-2).to(dtype), b))
    pairs.append((torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0])))
    alone = [int(ulp_distance(a, b)) for a, b in pairs]
    assert [m.max_ulps for m in measure_pairs(pairs)] == alone
    assert len(set(alone)) > 10  # distinct distances: one pair's answer given to another shows


def test_ulps_are_none_for_integers() -> None:
    (m,) = measure_pairs([(torch.tensor([1, 2]), torch.tensor([1, 3]))])
    assert m.max_ulps is None and m.mismatched == 1


def test_metrics_match_a_hand_computation() -> None:
    a = torch.tensor([3.0, 4.0, 0.0])
    b = torch.tensor([3.0, 0.0, 0.0])
    (m,) = measure_pairs([(a, b)])
    # ||a-b|| = 4, max(||a||, ||b||) = 5, a.b = 9, ||a|| ||b|| = 15
    assert m.rel_error == pytest.approx(4 / 5)
    assert m.max_abs == 4.0
    assert m.cosine == pytest.approx(9 / 15)
    assert (m.mismatched, m.numel) == (1, 3)


def test_a_systematic_relative_error_is_measured_as_such() -> None:
    b = torch.randn(1000, dtype=torch.float32)
    (m,) = measure_pairs([(b * (1 + 1e-4), b)])
    assert m.rel_error == pytest.approx(1e-4, rel=1e-2)
    assert m.mismatched > 900


def test_zero_reference_gives_a_bounded_error_not_a_division_by_zero() -> None:
    (m,) = measure_pairs([(torch.ones(3), torch.zeros(3))])
    assert m.rel_error == 1.0 and m.cosine == 0.0


def test_nan_on_one_side_only_is_infinitely_wrong() -> None:
    (m,) = measure_pairs([(torch.tensor([math.nan, 1.0]), torch.tensor([1.0, 1.0]))])
    assert m.rel_error == math.inf and m.mismatched == 1


def test_nan_in_the_same_place_on_both_sides_is_equal() -> None:
    a = torch.tensor([math.nan, 2.0, math.inf])
    (m,) = measure_pairs([(a.clone(), a)])
    assert (m.rel_error, m.mismatched) == (0.0, 0)


def test_integer_and_byte_tensors_compare_exactly() -> None:
    state = torch.get_rng_state()
    moved = state.clone()
    moved[100] ^= 1
    same, different = measure_pairs([(state.clone(), state), (moved, state)])
    assert same.mismatched == 0 and different.mismatched == 1
    assert different.rel_error > 0


def test_many_pairs_come_back_in_order() -> None:
    pairs = [(torch.full((k + 1,), float(k)), torch.zeros(k + 1)) for k in range(6)]
    metrics = measure_pairs(pairs)
    assert [m.numel for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert [m.max_abs for m in metrics] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_zero_floor_still_flags_a_systematic_error_of_1e_4_in_every_regime() -> None:
    for regime in DTYPE_CAPS:
        bound = Tolerance(regime).bound(0.0, torch.float32)
        assert 0 < bound < 1e-5, regime


def test_a_bf16_run_with_zero_floor_does_not_get_the_bf16_cap() -> None:
    tol = Tolerance("bf16-autocast")
    assert tol.bound(0.0, torch.float32) < DTYPE_CAPS["fp32"]
    assert tol.bound(0.0, torch.bfloat16) == torch.finfo(torch.bfloat16).eps < 1e-2


def test_the_floor_raises_the_bound_but_never_past_the_cap() -> None:
    tol = Tolerance("fp16-autocast")
    assert tol.bound(1e-5, torch.float32) == pytest.approx(4e-5)
    assert tol.bound(1.0, torch.float32) == DTYPE_CAPS["fp16-autocast"]
    assert tol.bound(math.inf, torch.float32) == DTYPE_CAPS["fp16-autocast"]


def test_integer_tensors_have_a_zero_bound() -> None:
    assert Tolerance().bound(0.0, torch.int64) == 0.0
    assert Tolerance().bound(0.0, torch.uint8) == 0.0


def test_explicit_rtol_and_atol_replace_the_derived_bound() -> None:
    tol = Tolerance(rtol=1e-2, atol=0.5)
    assert tol.bound(0.0, torch.float32) == 1e-2
    (m,) = measure_pairs([(torch.tensor([1.4]), torch.tensor([1.0]))])
    assert tol.passes(m, 1e-2)  # max_abs 0.4 <= atol
    assert not Tolerance(rtol=1e-2).passes(m, 1e-2)


@pytest.mark.parametrize("bad", [{"rtol": -1.0}, {"atol": math.nan}, {"regime": "fp8"}])
def test_bad_tolerances_name_the_value(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument, match=str(next(iter(bad.values())))):
        Tolerance(**bad)  # type: ignore[arg-type]


def test_the_reduction_path_agrees_with_the_equality_shortcut() -> None:
    from gradequiv.harness.engine.compare import _reduce

    a = torch.randn(64)
    pairs = [(a.clone(), a), (a * (1 + 1e-3), a), (torch.zeros(0), torch.zeros(0))]
    fast = measure_pairs(pairs)
    slow = _reduce(pairs[:2])
    assert fast[0] == slow[0] and fast[1] == slow[1] and fast[2].numel == 0
    assert slow[1].rel_error == pytest.approx(1e-3, rel=1e-3)
    assert slow[1].cosine == pytest.approx(1.0)


def test_ulps_left_out_on_request_leave_the_other_metrics_as_they_are() -> None:
    b = torch.randn(50)
    a = b * (1 + 1e-3)
    (with_ulps,), (without,) = measure_pairs([(a, b)]), measure_pairs([(a, b)], ulps=False)
    assert with_ulps.max_ulps is not None and with_ulps.max_ulps > 0
    assert without.max_ulps is None
    assert (without.rel_error, without.max_abs, without.mismatched) == \
        (with_ulps.rel_error, with_ulps.max_abs, with_ulps.mismatched)

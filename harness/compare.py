"""Metrics between two runs' tensors, and the tolerance policy.

All metrics of one case are reduced on the tensors' device and read back with
a single host sync, however many tensors the model has.

The bound is derived, not guessed: the full path runs twice, and the
difference between those two runs is the noise floor of each tensor on this
device. A recompute may sit a little above that floor, and a few ULPs of the
tensor's own dtype above zero (gradient accumulation order may legitimately
differ), but never above the dtype table's cap. Where the floor is zero, as
on CPU, a systematic relative error of 1e-4 always fails.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradequiv.models import InvalidArgument

#: Upper caps per precision regime (torch.testing.assert_close's rtol): never a licence.
DTYPE_CAPS = {"fp32": 1.3e-6, "bf16-autocast": 1.6e-2, "fp16-autocast": 1e-3}
#: How far above its own measured noise floor a recomputed tensor may sit.
FLOOR_FACTOR = 4.0
#: Relative slack, in units of the tensor dtype's epsilon, for a reordered accumulation.
REORDER_ULPS = 8.0


@dataclass(frozen=True)
class PairMetrics:
    """How two versions of one tensor differ."""

    rel_error: float  # ||a - b|| / max(||a||, ||b||); inf where non-finite values disagree
    max_abs: float
    cosine: float
    mismatched: int  # elements that are not bitwise equal
    numel: int


def measure_pairs(pairs: Sequence[tuple[Tensor, Tensor]]) -> list[PairMetrics]:
    """Metrics of every ``(recomputed, reference)`` pair with one host sync.

    Reductions run per tensor on its device (fast, contiguous kernels) and are
    stacked into one small tensor that is read back once. Non-finite values
    are rare, so they take a slower path that syncs only for them.
    """
    if not pairs:
        return []
    rows = [_pair_row(a, b) for a, b in pairs]
    values = torch.stack(rows).tolist()
    out = []
    for (a, b), (diff_norm, a_norm, b_norm, dot, max_abs, mismatched, numel) in zip(pairs, values):
        if not all(map(math.isfinite, (diff_norm, a_norm, b_norm))):
            out.append(_non_finite_pair(a, b))
            continue
        if mismatched == 0:
            out.append(PairMetrics(0.0, 0.0, 1.0, 0, int(numel)))
            continue
        scale = max(a_norm, b_norm)
        cosine = dot / (a_norm * b_norm) if a_norm > 0 and b_norm > 0 else 0.0
        rel = diff_norm / scale if scale > 0 else 0.0
        out.append(PairMetrics(rel, max_abs, max(-1.0, min(1.0, cosine)), int(mismatched),
                               int(numel)))
    return out


def _non_finite_pair(a: Tensor, b: Tensor) -> PairMetrics:
    """Equal only if NaN and inf sit in the same places and the rest is bitwise equal."""
    a, b = a.detach().to(b.device), b.detach()
    same = (a == b) | (a.isnan() & b.isnan())
    mismatched = int((~same).sum())
    if mismatched == 0:
        return PairMetrics(0.0, 0.0, 1.0, 0, b.numel())
    return PairMetrics(math.inf, math.inf, math.nan, mismatched, b.numel())


def _pair_row(a: Tensor, b: Tensor) -> Tensor:
    """Device-side sums for one pair: ||a-b||, ||a||, ||b||, a.b, max|a-b|, count(a != b), n."""
    work = torch.float64 if b.dtype == torch.float64 or not b.is_floating_point() else torch.float32
    a = a.detach().reshape(-1).to(b.device, work)
    b = b.detach().reshape(-1).to(work)
    if b.numel() == 0:
        return torch.zeros(7, dtype=torch.float64, device=b.device)
    diff = a - b
    norm = torch.linalg.vector_norm
    return torch.stack([
        norm(diff).double(), norm(a).double(), norm(b).double(), torch.dot(a, b).double(),
        diff.abs().max().double(), (a != b).sum().double(),
        torch.tensor(float(b.numel()), dtype=torch.float64, device=b.device),
    ])


@dataclass(frozen=True)
class Tolerance:
    """The tolerance policy of one case: the regime's cap, or the user's rtol/atol."""

    regime: str = "fp32"
    rtol: float | None = None
    atol: float | None = None

    def __post_init__(self) -> None:
        if self.regime not in DTYPE_CAPS:
            raise InvalidArgument(f"dtype regime {self.regime!r} is not one of {list(DTYPE_CAPS)}")
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise InvalidArgument(f"--{name}={value!r}: must be a finite number >= 0")

    def bound(self, floor: float, dtype: torch.dtype) -> float:
        """The largest relative error allowed for a tensor of ``dtype`` with this floor."""
        if self.rtol is not None:
            return self.rtol
        if not dtype.is_floating_point:
            return 0.0  # counters, RNG bytes: exactly equal or wrong
        if not math.isfinite(floor):
            floor = DTYPE_CAPS[self.regime]
        slack = REORDER_ULPS * torch.finfo(dtype).eps
        return min(DTYPE_CAPS[self.regime], max(FLOOR_FACTOR * floor, slack))

    def passes(self, metrics: PairMetrics, bound: float) -> bool:
        if self.atol is not None and metrics.max_abs <= self.atol:
            return True
        return metrics.rel_error <= bound

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

from gradequiv.harness.errors import InvalidArgument

#: Upper caps per precision regime (torch.testing.assert_close's rtol): never a licence.
DTYPE_CAPS = {"fp32": 1.3e-6, "bf16-autocast": 1.6e-2, "fp16-autocast": 1e-3,
              "bf16-model": 1.6e-2}
#: How far above its own measured noise floor a recomputed tensor may sit.
FLOOR_FACTOR = 4.0
#: Relative slack, in units of an fp32/fp64 tensor's epsilon, for a reordered accumulation.
REORDER_ULPS = 8.0


def reorder_slack(dtype: torch.dtype) -> float:
    """The error a legitimately reordered sum may leave in a tensor of ``dtype``.

    Gradients accumulate in fp32 (autocast keeps fp32 weights), so eight ULPs
    there; a 16-bit tensor gets one ULP, so that a bf16 output whose floor is
    zero is never allowed the 1e-2 of the bf16 cap.
    """
    eps = torch.finfo(dtype).eps
    return eps * (REORDER_ULPS if torch.finfo(dtype).bits >= 32 else 1.0)


@dataclass(frozen=True)
class PairMetrics:
    """How two versions of one tensor differ."""

    rel_error: float  # ||a - b|| / max(||a||, ||b||); inf where non-finite values disagree
    max_abs: float
    cosine: float
    mismatched: int  # elements that are not bitwise equal
    numel: int
    max_ulps: int | None = 0  # greatest distance in units in the last place; None: not floats


#: Signed integer views of each float dtype's bits, for counting ULPs.
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """The greatest number of representable values between ``a`` and ``b``, elementwise.

    The bits are mapped to integers that grow with the value (negative floats
    are stored as sign and magnitude, so their magnitude is negated), where
    +0.0 and -0.0 are the same integer. Returns a 0-dim int64 tensor.
    """
    return (_ordered_bits([a.to(b.device)], b.dtype) - _ordered_bits([b], b.dtype)).abs().max()


def _ordered_bits(parts: list[Tensor], dtype: torch.dtype) -> Tensor:
    """``parts`` flattened end to end, as integers that grow with the value (see
    ``ulp_distance``)."""
    bits = torch.cat([t.detach().reshape(-1) for t in parts]).view(_BITS[dtype])
    wide = bits.to(torch.int64)
    return torch.where(wide < 0, -(wide & torch.iinfo(_BITS[dtype]).max), wide)


def _ulp_distances(pairs: Sequence[tuple[Tensor, Tensor]], measure: bool = True
                   ) -> list[Tensor]:
    """``ulp_distance`` of every pair (-1 where the dtypes differ or have no bits view, or
    ``measure`` is False), in a few ops per dtype and device rather than several per pair: a
    failing verdict has a pair for every parameter of every step."""
    out = [torch.tensor(-1.0, dtype=torch.float64, device=b.device) for _, b in pairs]
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, (a, b) in enumerate(pairs):
        if measure and a.dtype == b.dtype and b.dtype in _BITS:
            groups.setdefault((b.dtype, b.device), []).append(i)
    for (dtype, device), members in groups.items():
        apart = (_ordered_bits([pairs[i][0].to(device) for i in members], dtype)
                 - _ordered_bits([pairs[i][1] for i in members], dtype)).abs().double()
        sizes = [pairs[i][1].numel() for i in members]
        parts = list(torch.split(apart, sizes))
        for i, most in zip(members, torch._foreach_norm(parts, math.inf)):
            out[i] = most
    return out


def measure_pairs(pairs: Sequence[tuple[Tensor, Tensor]], *,
                  ulps: bool = True) -> list[PairMetrics]:
    """Metrics of every ``(recomputed, reference)`` pair with one host sync.

    ``ulps=False`` leaves the distance in ULPs out (``max_ulps`` None where the pair
    differs): the noise floor's pairs are read for their relative error only.

    On the CPU, where a check costs no sync, bitwise-equal pairs (the common
    case for a correct recompute) are settled by one early-exit comparison.
    The others are reduced with ``torch._foreach_norm`` over whole lists,
    stacked, and read back once. Non-finite values are rare and take a slower
    path of their own.
    """
    out: list[PairMetrics | None] = [None] * len(pairs)
    todo = []
    for i, (a, b) in enumerate(pairs):
        if b.numel() == 0 or (b.device.type == "cpu" and a.dtype == b.dtype
                              and a.shape == b.shape and torch.equal(a, b)):
            out[i] = PairMetrics(0.0, 0.0, 1.0, 0, b.numel())
        else:
            todo.append(i)
    for i, metrics in zip(todo, _reduce([pairs[i] for i in todo], ulps)):
        out[i] = metrics
    return [m for m in out if m is not None]


def _reduce(pairs: list[tuple[Tensor, Tensor]], ulps: bool = True) -> list[PairMetrics]:
    if not pairs:
        return []
    flat_a, flat_b = [], []
    for a, b in pairs:
        work = torch.float64 if b.dtype == torch.float64 or not b.is_floating_point() \
            else torch.float32
        flat_b.append(b.detach().reshape(-1).to(work))
        flat_a.append(a.detach().reshape(-1).to(b.device, work))
    diff = torch._foreach_sub(flat_a, flat_b)
    sums: list[Sequence[Tensor]] = [
        torch._foreach_norm(diff), torch._foreach_norm(flat_a), torch._foreach_norm(flat_b),
        torch._foreach_norm(diff, math.inf), torch._foreach_norm(diff, 0),
    ]
    sums.append(_ulp_distances(pairs, ulps))
    rows = torch.stack([torch.stack([t.double() for t in s]) for s in sums], 1).tolist()
    out = []
    for (a, b), (diff_norm, a_norm, b_norm, max_abs, mismatched, ulps) in zip(pairs, rows):
        if not all(map(math.isfinite, (diff_norm, a_norm, b_norm))):
            out.append(_non_finite_pair(a, b))
        elif mismatched == 0:
            out.append(PairMetrics(0.0, 0.0, 1.0, 0, b.numel()))
        else:
            scale = max(a_norm, b_norm)
            # a.b from the three norms: ||a||^2 + ||b||^2 - ||a-b||^2 = 2 a.b
            cosine = ((a_norm**2 + b_norm**2 - diff_norm**2) / (2 * a_norm * b_norm)
                      if a_norm > 0 and b_norm > 0 else 0.0)
            out.append(PairMetrics(diff_norm / scale, max_abs, max(-1.0, min(1.0, cosine)),
                                   int(mismatched), b.numel(), int(ulps) if ulps >= 0 else None))
    return out


def _non_finite_pair(a: Tensor, b: Tensor) -> PairMetrics:
    """Equal only if NaN and inf sit in the same places and the rest is bitwise equal; a
    tensor with no finite element and NaN on both sides is unverified (NaN equals
    nothing): it fails, with a NaN error, whatever the bound."""
    a, b = a.detach().to(b.device), b.detach()
    if unverified(a, b):
        return PairMetrics(math.nan, math.nan, math.nan, b.numel(), b.numel(), None)
    same = (a == b) | (a.isnan() & b.isnan())
    mismatched = int((~same).sum())
    if mismatched == 0:
        return PairMetrics(0.0, 0.0, 1.0, 0, b.numel())
    return PairMetrics(math.inf, math.inf, math.nan, mismatched, b.numel(), None)


def unverified(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` hold nothing to compare: no finite element in either, and NaN
    in both. One NaN among finite elements, in the same place on both sides, is compared
    as equal there."""
    if b.numel() == 0 or not b.is_floating_point():
        return False
    return not bool(a.isfinite().any() or b.isfinite().any()) and bool(
        a.isnan().any() and b.isnan().any())


def non_finite_reference(loss: Tensor, grads: dict[str, Tensor | None]) -> str | None:
    """Why full storage's step verifies nothing (None: it does): a loss that is NaN or inf,
    gradients none of which holds a finite element, or gradients that are all zero. The
    model's fault, named by the tensor."""
    if loss.is_floating_point() and not bool(torch.isfinite(loss.detach()).all()):
        return f"its loss is {loss.detach().reshape(-1)[0].item()}"
    given = [(name, g) for name, g in grads.items() if g is not None and g.is_floating_point()
             and g.numel()]
    if given and not any(bool(torch.isfinite(g).any()) for _, g in given):
        name, grad = given[0]
        return (f"every gradient is non-finite (the {name.replace(':', ' ', 1)} holds "
                f"{grad.reshape(-1)[0].item()})")
    if given and not any(bool(g.detach().any()) for _, g in given):  # stops at the first
        return (f"every one of its {len(given)} gradients is zero: its loss does not depend "
                f"on what is trained (a constant loss, a vocabulary of one token), so any "
                f"recompute would match it")
    return None


@dataclass(frozen=True)
class Tolerance:
    """The tolerance policy of one case: the regime's cap, or the user's rtol/atol."""

    regime: str = "fp32"
    rtol: float | None = None
    atol: float | None = None
    #: the dtype the engine computes in where it is narrower than the tensors compared
    #: (FSDP2's bf16 parameters over fp32 shards): a reordered sum rounds there
    compute: torch.dtype | None = None

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
        rounded = dtype
        if self.compute is not None and torch.finfo(self.compute).bits < torch.finfo(dtype).bits:
            rounded = self.compute
        cap = max(DTYPE_CAPS[self.regime], reorder_slack(rounded)) if rounded is not dtype \
            else DTYPE_CAPS[self.regime]
        return min(cap, max(FLOOR_FACTOR * floor, reorder_slack(rounded)))

    def passes(self, metrics: PairMetrics, bound: float) -> bool:
        if self.atol is not None and metrics.max_abs <= self.atol:
            return True
        return metrics.rel_error <= bound

"""What a report.json says, in the seed's words: how close, how consistent, where the dice sat.

Three questions decide whether a recompute is trustworthy beyond a pass or
fail: was the largest gradient difference near zero (bitwise equal, or how
many ULPs), was it the same across cases and regimes, and which random sites
did the cases exercise. Every output format answers them from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gradequiv.models import DROPOUT_SITES

__all__ = ["Findings", "RegimeFindings", "find", "layer_errors", "random_sites"]


@dataclass
class RegimeFindings:
    """One dtype regime: its cases and the worst gradient difference among them."""

    cases: int = 0
    failed: int = 0
    worst_rel_error: float = 0.0
    worst_ulps: int = 0


@dataclass
class Findings:
    cases: int = 0
    failed: int = 0
    gradient_tensors: int = 0
    bitwise_equal: int = 0  # gradient tensors equal bit for bit
    worst_rel_error: float = 0.0
    worst_ulps: int = 0
    worst_at: str = ""  # "<case>: <tensor>"
    regimes: dict[str, RegimeFindings] = field(default_factory=dict)
    sites: dict[str, list[int]] = field(default_factory=dict)  # site -> [cases, failed]

    @property
    def all_bitwise_equal(self) -> bool:
        return self.gradient_tensors > 0 and self.bitwise_equal == self.gradient_tensors

    def closeness(self) -> str:
        """One sentence on how near zero the largest gradient difference was."""
        if not self.gradient_tensors:
            return "no gradient was compared"
        if self.all_bitwise_equal:
            return (f"every gradient was bitwise equal to full storage ({self.gradient_tensors} "
                    f"tensors over {self.cases} cases)")
        return (f"{self.bitwise_equal} of {self.gradient_tensors} gradient tensors bitwise equal; "
                f"the largest difference: relative error {self.worst_rel_error:.3g}, "
                f"{self.worst_ulps} ULPs, at {self.worst_at}")

    def consistency(self) -> str:
        """One sentence on whether the regimes agree."""
        parts = [f"{name}: {r.cases - r.failed}/{r.cases} pass, worst {r.worst_rel_error:.3g}"
                 f" ({r.worst_ulps} ULPs)" for name, r in sorted(self.regimes.items())]
        failing = [name for name, r in self.regimes.items() if r.failed]
        verdict = ("consistent: every regime passes" if not failing
                   else f"not consistent: failures in {', '.join(sorted(failing))}")
        return f"{verdict} ({'; '.join(parts)})" if parts else "no cases"


def random_sites(case: dict[str, Any]) -> list[str]:
    """The random ops a case's model draws from (empty: a deterministic model)."""
    model = case.get("model", {})
    sites = [name for key, name in DROPOUT_SITES.items() if float(model.get(key, 0.0) or 0.0) > 0]
    if model.get("activation") == "rrelu":
        sites.append("random-slope activation")
    return sites


def find(report: dict[str, Any]) -> Findings:
    """Answer the three questions for every case in ``report``."""
    findings = Findings()
    for record in report.get("cases", []):
        failed = record["verdict"] == "fail"
        findings.cases += 1
        findings.failed += failed
        regime = findings.regimes.setdefault(record["case"]["dtype"], RegimeFindings())
        regime.cases += 1
        regime.failed += failed
        for site in random_sites(record["case"]) or ["none (deterministic model)"]:
            counts = findings.sites.setdefault(site, [0, 0])
            counts[0] += 1
            counts[1] += failed
        for check in _gradient_checks(record):
            findings.gradient_tensors += 1
            findings.bitwise_equal += check["mismatched"] == 0
            error = _number(check["rel_error"])
            ulps = check.get("max_ulps") or 0
            regime.worst_rel_error = max(regime.worst_rel_error, error)
            regime.worst_ulps = max(regime.worst_ulps, ulps)
            if error > findings.worst_rel_error or (
                    error == findings.worst_rel_error and ulps > findings.worst_ulps):
                findings.worst_at = f"{record['name'] or record['description']}: {check['name']}"
            findings.worst_rel_error = max(findings.worst_rel_error, error)
            findings.worst_ulps = max(findings.worst_ulps, ulps)
    return findings


def _gradient_checks(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [check for prop in record["properties"] if prop["name"] == "gradients"
            for check in prop["checks"]]


def _number(value: Any) -> float:
    """report.json writes non-finite floats as strings."""
    number = float(value)
    return math.inf if math.isnan(number) else number


def layer_errors(record: dict[str, Any]) -> tuple[list[str], list[str], list[list[float]]]:
    """Relative gradient error per layer and parameter: (layers, parameters, grid).

    Parameters of ``blocks.<i>.<rest>`` go to row ``blocks.<i>``, column
    ``<rest>``; the others (embeddings, final norm, head) to a row ``other``.
    Cells with no such parameter hold NaN.
    """
    cells: dict[tuple[str, str], float] = {}
    for check in _gradient_checks(record):
        name = check["name"].removeprefix("grad of ")
        if name.startswith("input "):
            continue
        parts = name.split(".")
        if parts[0] == "blocks" and len(parts) > 2:
            row, column = f"blocks.{parts[1]}", ".".join(parts[2:])
        else:
            row, column = "other", name
        cells[(row, column)] = _number(check["rel_error"])
    rows = sorted({r for r, _ in cells}, key=_layer_order)
    in_layers = sorted({c for r, c in cells if r != "other"})
    columns = in_layers + sorted({c for r, c in cells if r == "other"} - set(in_layers))
    grid = [[cells.get((r, c), math.nan) for c in columns] for r in rows]
    return rows, columns, grid


def _layer_order(row: str) -> tuple[int, int]:
    if row.startswith("blocks."):
        index = row.split(".")[1]
        return (0, int(index)) if index.isdigit() else (0, 0)
    return (1, 0)

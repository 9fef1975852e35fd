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

__all__ = ["FailureGroup", "Findings", "RegimeFindings", "error_scale", "failure_groups", "find",
           "headline_command", "layer_errors", "random_sites"]

#: The site line of a user's model: its random ops are not in its config, so none are known.
UNKNOWN_SITES = "unknown (your own model)"
#: Decades of relative error a heatmap's colour scale spans at most, below its top.
SCALE_DECADES = 6


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
                f"{ulps(self.worst_ulps)}, at {self.worst_at}")

    def consistency(self) -> str:
        """One sentence on whether the regimes agree."""
        parts = [f"{name}: {r.cases - r.failed}/{r.cases} pass, worst {r.worst_rel_error:.3g}"
                 f" ({ulps(r.worst_ulps)})" for name, r in sorted(self.regimes.items())]
        failing = [name for name, r in self.regimes.items() if r.failed]
        verdict = ("consistent: every regime passes" if not failing
                   else f"not consistent: failures in {', '.join(sorted(failing))}")
        return f"{verdict} ({'; '.join(parts)})" if parts else "no cases"


#: Past this many units in the last place a difference is no rounding, and the count no
#: longer tells a reader anything (a sign flip is two billion).
ULPS_SHOWN = 1024


def ulps(count: int) -> str:
    """A ULP count in words: small ones exactly, large ones as what they mean."""
    if count > ULPS_SHOWN:
        return f"over {ULPS_SHOWN} ULPs: no rounding difference"
    return f"{count} ULPs"


def random_sites(case: dict[str, Any]) -> list[str]:
    """The random ops a case's model draws from (empty: a deterministic model). A user's
    model (``external``) says none in its config: unknown, never "deterministic"."""
    if case.get("model_kind") == "external":
        return [UNKNOWN_SITES]
    model = case.get("model", {})
    sites = [name for key, name in DROPOUT_SITES.items() if float(model.get(key, 0.0) or 0.0) > 0]
    if model.get("activation") == "rrelu":
        sites.append("random-slope activation")
    return sites


def find(report: dict[str, Any]) -> Findings:
    """Answer the three questions for every case in ``report``."""
    findings = Findings()
    seen = _diverging_random_ops(report)
    for record in report.get("cases", []):
        failed = record["verdict"] == "fail"
        findings.cases += 1
        findings.failed += failed
        regime = findings.regimes.setdefault(record["case"]["dtype"], RegimeFindings())
        regime.cases += 1
        regime.failed += failed
        sites = random_sites(record["case"])
        if sites == [UNKNOWN_SITES] and seen:
            sites = seen
        for site in sites or ["none (deterministic model)"]:
            counts = findings.sites.setdefault(site, [0, 0])
            counts[0] += 1
            counts[1] += failed
        for prop in _gradient_properties(record):
            if "compared" in prop:  # the checks are only the worst few: count from the totals
                findings.gradient_tensors += prop["compared"]
                findings.bitwise_equal += prop.get("bitwise_equal", 0)
            else:
                findings.gradient_tensors += len(prop["checks"])
                findings.bitwise_equal += sum(c["mismatched"] == 0 for c in prop["checks"])
        for check in _gradient_checks(record):
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


def _gradient_properties(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [prop for prop in record["properties"] if prop["name"] == "gradients"]


def _gradient_checks(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [check for prop in _gradient_properties(record) for check in prop["checks"]]


def _diverging_random_ops(report: dict[str, Any]) -> list[str]:
    """The random ops a user's model was seen to draw from: where a minimal failure of one
    of its cases first diverged (the only evidence of them a report holds)."""
    ops: list[str] = []
    for failure in report.get("minimal_failures") or []:
        op = failure.get("first_diverging_op") or {}
        if (failure.get("case") or {}).get("model_kind") == "external" and op.get("random"):
            where = f" in {op['module']}" if op.get("module") else ""
            name = f"{op.get('op', 'random op')}{where}"
            if name not in ops:
                ops.append(name)
    return ops


def _number(value: Any) -> float:
    """report.json writes non-finite floats as strings."""
    number = float(value)
    return math.inf if math.isnan(number) else number


def layer_errors(record: dict[str, Any]) -> tuple[list[str], list[str], list[list[float]]]:
    """Relative gradient error per layer and parameter: (layers, parameters, grid).

    Parameters of ``blocks.<i>.<rest>`` go to row ``blocks.<i>``, column
    ``<rest>``; the others (embeddings, final norm, head) to a row ``other``.
    Cells with no such parameter hold NaN. Every tensor's error comes from
    ``gradient_errors`` where the record has it (its checks keep only the worst).
    """
    errors = record.get("gradient_errors")
    if not isinstance(errors, dict):  # older reports: every tensor is in the checks
        errors = {check["name"]: check["rel_error"] for check in _gradient_checks(record)}
    cells: dict[tuple[str, str], float] = {}
    for tensor, error in errors.items():
        name = tensor.removeprefix("grad of ")
        if name.startswith("input "):
            continue
        parts = name.split(".")
        if parts[0] == "blocks" and len(parts) > 2:
            row, column = f"blocks.{parts[1]}", ".".join(parts[2:])
        else:
            row, column = "other", name
        cells[(row, column)] = _number(error)
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


def error_scale(records: list[dict[str, Any]]) -> tuple[float, float]:
    """One log colour scale (low, high) for the heatmaps of ``records``, so one colour is one
    error on every picture of a page.

    The top is the largest finite error rounded up to a power of ten; the bottom is the
    smallest non-zero error rounded down, but at most ``SCALE_DECADES`` decades lower and
    at least one: a scale from 1e-12 would squeeze every fault into its darkest colours,
    and a fault in one layer would look like a fault in all of them. Bitwise-equal (zero)
    and non-finite errors fall outside the scale and are drawn in colours of their own.
    """
    errors = [v for record in records for row in layer_errors(record)[2] for v in row
              if math.isfinite(v) and v > 0]
    if not errors:
        return 10.0 ** -SCALE_DECADES, 1.0
    high = 10.0 ** math.ceil(math.log10(max(errors)))
    low = 10.0 ** math.floor(math.log10(min(errors)))
    return min(max(low, high / 10.0 ** SCALE_DECADES), high / 10), high


@dataclass
class FailureGroup:
    """The minimal failures of one case: several property tests often shrink to the same
    case, and a reader wants that case once, with every property it breaks."""

    reproduce: str
    failures: list[dict[str, Any]]

    @property
    def first(self) -> dict[str, Any]:
        return self.failures[0]

    @property
    def description(self) -> str:
        return str(self.first.get("description") or "case")

    @property
    def properties(self) -> list[str]:
        return _unique(str(f["property"]) for f in self.failures if f.get("property"))

    @property
    def tests(self) -> list[str]:
        return _unique(str(f["test"]) for f in self.failures if f.get("test"))

    @property
    def flaky(self) -> bool:
        return all(f.get("flaky") for f in self.failures)

    @property
    def sentences(self) -> list[str]:
        return _unique(str(f["diagnosis"]["sentence"]) for f in self.failures
                       if (f.get("diagnosis") or {}).get("sentence"))

    @property
    def evidence(self) -> list[str]:
        return _unique(str(e) for f in self.failures
                       for e in (f.get("diagnosis") or {}).get("evidence") or [])

    @property
    def messages(self) -> list[str]:
        """Each failure's message (after its property where there are several), but those
        the evidence already quotes."""
        several, said = len(self.failures) > 1, set(self.evidence)
        texts = [f"{f['property']}: {f['message']}" if several and f.get("property")
                 else str(f["message"]) for f in self.failures]
        return _unique(t for t in texts if t not in said)

    @property
    def localisations(self) -> list[str]:
        """Those the evidence does not already say (a diagnosis often quotes one)."""
        said = set(self.evidence)
        return _unique(str(f["localisation"]) for f in self.failures
                       if f.get("localisation") and f["localisation"] not in said)

    @property
    def command(self) -> str:
        """The short reproduce command (a case file), else the one with the case inline."""
        return next((str(f["reproduce_file"]) for f in self.failures if f.get("reproduce_file")),
                    self.reproduce)


def failure_groups(report: dict[str, Any]) -> list[FailureGroup]:
    """The minimal failures by case, in the report's order. A report without a property
    suite (a replayed case) has none: then each failing case is its own failure."""
    failures = report.get("minimal_failures") or [
        {"property": None, "description": r["description"], "flaky": False,
         "message": r["first_failure"] or r["error"] or "failed", "reproduce": r["reproduce"]}
        for r in report.get("cases", []) if r["verdict"] == "fail"]
    groups: dict[str, FailureGroup] = {}
    for failure in failures:
        group = groups.setdefault(failure["reproduce"], FailureGroup(failure["reproduce"], []))
        group.failures.append(failure)
    return list(groups.values())


def headline_command(report: dict[str, Any]) -> str | None:
    """The short command that reproduces the headline failure (its case file where a
    minimal failure of the same case has one)."""
    failure = report.get("failure")
    if not failure:
        return None
    if failure.get("reproduce_file"):
        return str(failure["reproduce_file"])
    same = next((g for g in failure_groups(report) if g.reproduce == failure["reproduce"]), None)
    return same.command if same is not None else str(failure["reproduce"])


def _unique(items: Any) -> list[str]:
    return list(dict.fromkeys(items))

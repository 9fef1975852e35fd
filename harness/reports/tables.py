"""The tables of mutants.json and profile.json, built once from the JSON; formats lay them out.

mutants.md, profile.md, report.md and report.html all show these tables, so
each column and each figure's formatting is written here once, from the dict
that went to the JSON file (never from a live run): what a reader sees in any
format is what the JSON says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Table", "mutants_summary", "mutants_table", "profile_recommendation", "profile_summary",
           "profile_tables"]

#: Outcomes that go against the suite: a mutant it missed, a correct implementation it failed.
_AGAINST = ("survived", "flagged")


@dataclass(frozen=True)
class Table:
    """A header and rows of cell text; ``marks`` holds one CSS class per row ("" for none)."""

    head: list[str]
    rows: list[list[str]]
    marks: list[str] = field(default_factory=list)

    def markdown(self) -> list[str]:
        """The table as Markdown lines (a pipe table)."""
        return ["| " + " | ".join(self.head) + " |", "|" + "---|" * len(self.head),
                *("| " + " | ".join(row) + " |" for row in self.rows)]


def mutants_summary(mutants: dict[str, Any]) -> str:
    """One sentence: the mutation score, and whether every correct implementation passed."""
    s = mutants["summary"]
    text = (f"Mutation score {s['killed']}/{s['valid']} ({s['mutation_score']:.0%}); correct "
            f"implementations {'all pass' if s['correct_pass'] else 'FLAGGED'}: {s['verdict']}")
    if not mutants.get("complete", True):
        text += " (incomplete: the run stopped early)"
    return text


def mutants_table(mutants: dict[str, Any]) -> Table:
    """One row per implementation run, correct ones first; rows against the suite marked."""
    outcomes = mutants["outcomes"]
    return Table(
        ["role", "implementation", "result", "caught by", "cases (mutants: until caught)",
         "seconds", "source"],
        [[o["role"], o["name"], o["status"], o["caught_by"] or "-", str(o["examples"]),
          f"{o['seconds']:.1f}", o.get("source") or "-"] for o in outcomes],
        ["fail" if o["status"] in _AGAINST else "" for o in outcomes])


def profile_summary(profile: dict[str, Any]) -> str:
    """What was profiled, and under which conditions."""
    c = profile["conditions"]
    threads = f"{c['threads']} thread{'s' * (c['threads'] != 1)}"
    load = c.get("load_average")  # absent in files written before it was kept
    loaded = f", load average {' '.join(f'{x:.2f}' for x in load)}" if load else ""
    return (f"Profile of {profile['implementation']}: {c['shape']}; torch {c['torch']}, "
            f"{c['device']}, {threads}{loaded}, {c['steps']} steps after {c['warmup']} "
            f"warm-up")


def profile_tables(profile: dict[str, Any]) -> list[tuple[str, Table]]:
    """The profile's tables with their captions: memory and time per granularity; where the
    held bytes went (an offload over more than one device); CUDA's allocator (on CUDA)."""
    rows = profile["rows"]
    none = next((r for r in rows if r["granularity"] == "none"), None)

    def peak_saved(row: dict[str, Any]) -> str:
        return f"{1 - _peak(row) / _peak(none):.1%}" if none and _peak(none) else "-"

    tables = [("", Table(
        ["granularity", "held bytes", "peak bytes", "held saved vs none",
         "peak saved vs none", "step p50 ms", "p95 ms", "p99 ms", "overhead vs none",
         "forward ms", "backward ms", "of which recompute ms",
         f"{profile['conditions'].get('unit', 'tokens')}/s", "frontier"],
        [[r["granularity"], f"{r['held_bytes']:,}", f"{_peak(r):,}",
          f"{r['memory_saved_vs_none']:.1%}", peak_saved(r), f"{r['step_s']['p50'] * 1e3:.1f}",
          f"{r['step_s']['p95'] * 1e3:.1f}", f"{r['step_s']['p99'] * 1e3:.1f}",
          f"{r['overhead_vs_none']:+.1%}", f"{r['forward_s'] * 1e3:.1f}",
          f"{r['backward_s'] * 1e3:.1f}", f"{r['recompute_s'] * 1e3:.1f}",
          f"{r['tokens_per_s']:,.0f}", "yes" if r["on_frontier"] else ""] for r in rows]))]
    devices = sorted({d for r in rows for d in r.get("held_on", {})})
    if len(devices) > 1:
        tables.append(("Where the activation bytes were held:", Table(
            ["granularity", *devices],
            [[r["granularity"], *(f"{r['held_on'].get(d, 0):,}" for d in devices)]
             for r in rows])))
    if any(r.get("cuda_max_allocated_bytes") is not None for r in rows):
        tables.append(("CUDA caching allocator, same step (output and loss included, so a "
                       "little above the count):", Table(
            ["granularity", "allocated after forward", "requested after forward",
             "max allocated over the step"],
            [[r["granularity"], f"{r['cuda_allocated_held_bytes']:,}",
              f"{r['cuda_requested_held_bytes']:,}", f"{r['cuda_max_allocated_bytes']:,}"]
             for r in rows])))
    return tables


def _peak(row: dict[str, Any]) -> int:
    """The most activation bytes alive at once in the row's step (``peak_bytes``)."""
    return max(int(row["held_bytes"]), int(row["peak_backward_bytes"]))


def profile_recommendation(profile: dict[str, Any]) -> list[tuple[str, Table | None]]:
    """The recommendation as (sentence, table or None) in reading order, the first sentence
    the headline: the knee and why, the rule, and with a memory budget the verdict and the
    largest batch each granularity could run. Empty for files written before it existed."""
    rec = profile.get("recommendation")
    if not rec:
        return []
    parts: list[tuple[str, Table | None]] = [
        (f"Recommended: {rec['knee']}, the knee of the frontier: {rec['why']}.", None),
        (f"Rule: {rec['rule']}.", None)]
    budget = rec.get("memory_budget")
    if budget is None:
        return parts
    unit = profile["conditions"].get("unit", "tokens")
    batch = profile["conditions"].get("batch")
    table = Table(["granularity", "peak bytes", f"fits at batch {batch}",
                   "largest batch within the budget", f"{unit}/s as measured"],
                  [[x["granularity"], f"{x['peak_bytes']:,}", "yes" if x["fits"] else "no",
                    "none" if not x["largest_batch"] else f"{x['largest_batch']:,}",
                    f"{x['per_s']:,.0f}"] for x in rec["largest_batch"]])
    return parts + [
        (f"Memory budget {budget:,} bytes (activation bytes at the step's peak; parameters, "
         f"gradients and optimizer state not included): {rec['verdict']}.", table),
        ("The largest batch is the budget over the measured peak per sample (activation "
         f"bytes grow with the batch); the rate is the one measured at batch {batch}.", None)]

"""The report's pictures as PNG bytes (matplotlib, headless): error heatmap and frontier.

Bytes rather than files, so the HTML page can embed them and stay
self-contained. Without matplotlib each function returns ``None`` and the
caller says so in words.
"""

from __future__ import annotations

import io
import math
from typing import Any

from gradequiv.harness.reports.findings import layer_errors

__all__ = ["MISSING_MATPLOTLIB", "frontier_png", "gradient_heatmap_png"]

MISSING_MATPLOTLIB = "matplotlib is not installed (pip install 'gradequiv[plot]')"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _png(fig: Any, plt: Any) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def gradient_heatmap_png(record: dict[str, Any]) -> bytes | None:
    """Relative gradient error per layer (rows) and parameter (columns), log colour scale.

    Bitwise-equal gradients are drawn at the floor of the scale (1e-12) so a
    fault that stays inside one layer stands out against its neighbours.
    """
    plt = _pyplot()
    rows, columns, grid = layer_errors(record)
    if plt is None or not rows:
        return None
    from matplotlib.colors import LogNorm

    floor = 1e-12
    values = [[max(v, floor) if not math.isnan(v) else math.nan for v in row] for row in grid]
    finite = [v for row in values for v in row if math.isfinite(v)]
    top = max(max(finite, default=1.0), floor * 10)
    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * len(columns), 1.0 + 0.4 * len(rows)), dpi=110)
    image = ax.imshow(values, aspect="auto", cmap="magma_r", norm=LogNorm(floor, top))
    ax.set_xticks(range(len(columns)), columns, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_title(f"relative gradient error: {record['name']}", fontsize=8)
    fig.colorbar(image, ax=ax, fraction=0.05)
    return _png(fig, plt)


def frontier_png(profile: dict[str, Any]) -> bytes | None:
    """Activation memory against step time per granularity, the Pareto frontier in red."""
    plt = _pyplot()
    if plt is None:
        return None
    rows = profile["rows"]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    xs = [r["step_s"]["p50"] * 1e3 for r in rows]
    ys = [r["held_bytes"] / 2**20 for r in rows]
    ax.scatter(xs, ys, color=["tab:red" if r["on_frontier"] else "tab:gray" for r in rows])
    frontier = sorted((x, y) for x, y, r in zip(xs, ys, rows) if r["on_frontier"])
    if frontier:
        ax.plot(*zip(*frontier), color="tab:red", linewidth=1, label="frontier")
        ax.legend()
    for x, y, r in zip(xs, ys, rows):
        ax.annotate(r["granularity"], (x, y), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    ax.set_xlabel("step time p50 (ms)")
    ax.set_ylabel("activation memory held (MiB)")
    ax.set_title(profile["conditions"]["shape"], fontsize=8)
    return _png(fig, plt)

"""The report's pictures as PNG bytes (matplotlib, headless): error heatmap and frontier.

Bytes rather than files, so the HTML page can embed them and stay
self-contained. Without matplotlib each function returns ``None`` and the
caller says so in words.
"""

from __future__ import annotations

import io
import math
from typing import Any

from gradequiv.harness.reports.findings import error_scale, layer_errors
from gradequiv.harness.reports.text import printable

__all__ = ["MISSING_MATPLOTLIB", "frontier_png", "gradient_heatmap_png"]

MISSING_MATPLOTLIB = "matplotlib is not installed (pip install 'gradequiv[plot]')"
#: characters of a user's name a picture shows (a tick label, a title line)
LABEL_CHARS = 48


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


def gradient_heatmap_png(record: dict[str, Any], *, scale: tuple[float, float] | None = None,
                         title: str | None = None) -> bytes | None:
    """Relative gradient error per layer (rows) and parameter (columns), log colour scale.

    ``scale`` (low, high) is shared by every heatmap of a page (``error_scale``), so one
    colour is one error everywhere; bitwise-equal gradients are white, errors past the top
    (inf, NaN) blue, absent parameters grey, so a fault that stays inside one layer stands
    out against its neighbours.
    """
    plt = _pyplot()
    rows, columns, grid = layer_errors(record)
    if plt is None or not rows:
        return None
    import textwrap

    import numpy as np
    from matplotlib.colors import ListedColormap, LogNorm

    low, high = scale if scale is not None else error_scale([record])
    values = np.ma.masked_invalid([[_heat_value(v, low, high) for v in row] for row in grid])
    # magma_r without its ends: the smallest error must not pass for white (bitwise equal),
    # and errors near the top must not all be the same black
    cmap = ListedColormap(plt.get_cmap("magma_r")(np.linspace(0.12, 0.92, 256))).with_extremes(
        under="white", over="#1f6feb", bad="#d0d0d0")
    width = 2.2 + 0.55 * len(columns)
    below = [_label(c) for c in columns]  # slanted under the grid: the longest sets its room
    height = 1.6 + 0.4 * len(rows) + 0.045 * max(len(label) for label in below)
    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    image = ax.imshow(values, aspect="auto", cmap=cmap, norm=LogNorm(low, high))
    ax.set_xticks(range(len(columns)), below, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(rows)), [_label(r) for r in rows], fontsize=7)
    heading = title or record.get("name") or record.get("description") or "failing case"
    lines = textwrap.wrap(_label(heading, 4 * LABEL_CHARS), int(width * 11))
    ax.set_title("\n".join(lines), fontsize=8)
    bar = fig.colorbar(image, ax=ax, fraction=0.05, extend="both")
    bar.set_label("relative error (white: bitwise equal)", fontsize=7)
    bar.ax.tick_params(labelsize=7)
    return _png(fig, plt)


def _label(text: str, limit: int = LABEL_CHARS) -> str:
    """A name from the user's model as a picture shows it: cut to ``limit`` characters,
    control characters and lone surrogates spelled out (no font has them, and a surrogate
    stops matplotlib), and ``$`` escaped (a pair would be read as mathematics, and broken
    mathematics stops the page)."""
    shown = printable(text).replace("$", "\\$")
    return shown if len(shown) <= limit else shown[:limit - 3] + "..."


def _heat_value(error: float, low: float, high: float) -> float:
    """Where a cell sits on the heatmap's scale: bitwise equal (0) under it, inf over it,
    every other error inside it (a tiny error never looks bitwise equal); NaN stays NaN."""
    if error == 0:
        return low / 10
    if math.isinf(error):
        return high * 10
    return min(max(error, low), high) if math.isfinite(error) else error


def frontier_png(profile: dict[str, Any]) -> bytes | None:
    """Peak activation memory against step time per granularity, the Pareto frontier in
    red."""
    plt = _pyplot()
    fig = frontier_figure(profile)
    if plt is None or fig is None:
        return None
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")  # not _png: its tight_layout would move placed labels
    plt.close(fig)
    return buffer.getvalue()


_FRONTIER_MARGINS = (0.08, 0.18, 0.3, 0.5)  # of the data's span, widened until labels fit
_LABEL_GAPS_PX = (3.0, 9.0, 18.0, 30.0, 46.0)  # label to marker, nearest first
# Sides tried in turn, right-up and left-down first: the frontier falls to the right, so
# it leaves a point towards the other two corners.
_LABEL_SIDES = ((1, 1), (-1, -1), (1, -1), (-1, 1), (1, 0), (-1, 0), (0, 1), (0, -1))
_MARKER_PT = 6.0  # marker diameter
Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in display pixels
Point = tuple[float, float]  # x, y in display pixels


def frontier_title(profile: dict[str, Any]) -> str:
    """Which implementation and what was measured: a PNG is often seen apart from its table."""
    c = profile["conditions"]
    kwargs = "".join(f", {k}={v}" for k, v in (profile.get("kwargs") or {}).items())
    adapter = profile.get("adapter")
    impl = profile["implementation"] + (f" ({adapter}{kwargs})" if adapter else "")
    lines = [f"{impl}: activation memory against step time", str(c["shape"]),
             f"{c['device']}, {c['threads']} threads, p50 of {c['steps']} steps "
             f"after {c['warmup']} warm-up"]
    import textwrap

    return "\n".join(part for line in lines for part in textwrap.wrap(line, 96))


def frontier_figure(profile: dict[str, Any]) -> Any:
    """The frontier's Figure with every label placed (None without matplotlib); apart from
    ``frontier_png`` so the placement can be checked against the renderer.

    Labels go where they overlap no other label, marker or the legend and stay inside the
    axes; when some cannot, the margins widen and the placement starts again.
    """
    plt = _pyplot()
    if plt is None:
        return None
    rows = profile["rows"]
    fig, ax = plt.subplots(figsize=(6, 4.4), dpi=120)
    xs = [r["step_s"]["p50"] * 1e3 for r in rows]
    # the step's peak, the memory that must fit (files before it was recorded: held bytes)
    ys = [max(r["held_bytes"], r.get("peak_backward_bytes", 0)) / 2**20 for r in rows]
    ax.scatter(xs, ys, s=_MARKER_PT**2, zorder=3, clip_on=False,
               color=["tab:red" if r["on_frontier"] else "tab:gray" for r in rows])
    frontier = sorted((x, y) for x, y, r in zip(xs, ys, rows) if r["on_frontier"])
    if frontier:
        ax.plot(*zip(*frontier), color="tab:red", linewidth=1, label="frontier", zorder=2)
    ax.set_xlabel("step time p50 (ms)")
    ax.set_ylabel("activation memory at its peak (MiB)")
    ax.set_title(frontier_title(profile), fontsize=8)
    names = [str(r["granularity"]) for r in rows]
    for margin in _FRONTIER_MARGINS:
        for text in list(ax.texts):
            text.remove()
        _frontier_limits(ax, xs, ys, margin)
        fig.tight_layout()
        avoid = []
        if frontier:
            legend = ax.legend(loc="best", fontsize=8)
            fig.canvas.draw()
            avoid.append(_freeze_legend(ax, legend))
        else:
            fig.canvas.draw()
        if _place_labels(ax, list(zip(xs, ys)), names, avoid, frontier):
            break
    return fig


def _frontier_limits(ax: Any, xs: list[float], ys: list[float], margin: float) -> None:
    """Time spans the points plus ``margin``; memory starts at 0 (a saving reads as a ratio)."""
    low, high = min(xs), max(xs)
    span = (high - low) or (abs(high) * 0.1 or 1.0)
    ax.set_xlim(low - margin * span, high + margin * span)
    top = max(ys) or 1.0
    ax.set_ylim(0.0, top * (1 + margin))


def _freeze_legend(ax: Any, legend: Any) -> Box:
    """Pin the legend where "best" put it (before any label), so adding labels cannot move
    it onto one; its box, to keep labels off it."""
    box = legend.get_window_extent(ax.figure.canvas.get_renderer())
    legend.set_loc(tuple(ax.transAxes.inverted().transform((box.x0, box.y0))))
    return (box.x0, box.y0, box.x1, box.y1)


def _place_labels(ax: Any, points: list[tuple[float, float]], names: list[str],
                  avoid: list[Box],
                  frontier: list[tuple[float, float]]) -> bool:
    """Greedy, in row order: each label takes the first side and gap (nearest first) whose
    box is inside the axes and clear of markers, the legend, the labels and leader lines
    placed so far, preferring one the frontier line does not cross. A label with no leader
    line must sit clearly nearer its own marker than any other (:func:`_unmistakable`); one
    with a leader line needs a line that passes no other marker, label or line (:func:`_leader`),
    so no label can be read as another point's. Points closer than a marker's radius share
    one label ("a / b"). False if some label found no room."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    pad, space = 2.0, 6.0  # about a space between labels side by side, so none read as one
    axes = ax.get_window_extent(renderer)
    area = (axes.x0 + pad, axes.y0 + pad, axes.x1 - pad, axes.y1 - pad)
    radius = _MARKER_PT / 2 * fig.dpi / 72
    anchors = [tuple(ax.transData.transform(p)) for p in points]
    clear_of = radius + pad
    taken = [(px - clear_of, py - clear_of, px + clear_of, py + clear_of) for px, py in anchors]
    taken += list(avoid)
    line = [tuple(ax.transData.transform(p)) for p in frontier]
    segments = list(zip(line, line[1:]))
    leaders: list[tuple[Point, Point]] = []
    fits = True
    for members in _same_spots(anchors, radius):
        (x, y), (px, py) = points[members[0]], anchors[members[0]]
        name = " / ".join(names[i] for i in members)
        others = [a for i, a in enumerate(anchors) if i not in members]
        probe = ax.annotate(name, (x, y), xytext=(0, 0), textcoords="offset points",
                            fontsize=8, ha="left", va="bottom")
        box = probe.get_window_extent(renderer)
        probe.remove()
        every = _label_spots(px, py, box.width, box.height, radius)
        free = [(gap, spot) for gap, spot in every
                if _inside(spot, area) and not any(_overlap(spot, t) for t in taken)
                and not any(_crosses(a, b, spot) for a, b in leaders)]
        spots = []
        for gap, spot in free:
            if gap <= _LABEL_GAPS_PX[1]:
                good = _unmistakable(spot, (px, py), others)
            else:
                good = _leader(spot, (px, py), radius, others, taken[len(anchors):], leaders)
            if good:
                spots.append((gap, spot))
        # off the line if that keeps the label close (no leader); else the nearest free spot
        clear = [(gap, spot) for gap, spot in spots if gap <= _LABEL_GAPS_PX[1]
                 and not any(_crosses(a, b, spot) for a, b in segments)]
        fits = fits and bool(spots)
        gap, spot = (clear or spots or free or every)[0]
        scale = 72 / fig.dpi  # pixels to points
        offset = ((spot[0] - box.x0) * scale, (spot[1] - box.y0) * scale)
        leader = (dict(arrowstyle="-", color="0.55", linewidth=0.6, shrinkA=0,
                       shrinkB=_MARKER_PT / 2 + 1) if gap > _LABEL_GAPS_PX[1] else None)
        ax.annotate(name, (x, y), xytext=offset, textcoords="offset points", fontsize=8,
                    ha="left", va="bottom", arrowprops=leader, annotation_clip=False)
        if leader is not None:
            leaders.append(_leader_line(spot, (px, py), radius))
        taken.append((spot[0] - space, spot[1] - pad, spot[2] + space, spot[3] + pad))
    return fits


_SAME_SPOT = 0.5  # of the marker's radius: points closer than this share a label
_NEARER = 2.0  # a label with no leader is this many times nearer its marker than any other


def _same_spots(anchors: list[Point], radius: float) -> list[list[int]]:
    """Indices of the points, grouped where markers lie on one spot, in row order."""
    groups: list[list[int]] = []
    for i, (x, y) in enumerate(anchors):
        home = next((g for g in groups if math.dist(anchors[g[0]], (x, y)) < _SAME_SPOT * radius),
                    None)
        if home is None:
            groups.append([i])
        else:
            home.append(i)
    return groups


def _box_distance(box: Box, point: Point) -> float:
    dx = max(box[0] - point[0], 0.0, point[0] - box[2])
    dy = max(box[1] - point[1], 0.0, point[1] - box[3])
    return math.hypot(dx, dy)


def _unmistakable(box: Box, own: Point, others: list[Point]) -> bool:
    """Whether a label at ``box`` with no leader line is clearly its own marker's: every
    other marker at least ``_NEARER`` times as far from it."""
    near = _box_distance(box, own)
    return all(_box_distance(box, p) >= _NEARER * near for p in others)


def _leader_line(box: Box, own: Point, radius: float) -> tuple[Point, Point]:
    """The leader as drawn: from the label's centre to the rim of its marker, 1 px out."""
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    length = math.dist((cx, cy), own) or 1.0
    back = (radius + 1) / length
    return (cx, cy), (own[0] + (cx - own[0]) * back, own[1] + (cy - own[1]) * back)


def _leader(box: Box, own: Point, radius: float, others: list[Point], labels: list[Box],
            lines: list[tuple[Point, Point]]) -> bool:
    """Whether a leader line from ``box`` to its marker would be read as that marker's
    only: it passes no other marker (nor within a pixel of one), crosses no label placed
    so far and no other leader line."""
    a, b = _leader_line(box, own, radius)
    return (all(_segment_distance(a, b, p) > radius + 1 for p in others)
            and not any(_crosses(a, b, t) for t in labels)
            and not any(_segments_cross(a, b, c, d) for c, d in lines))


def _segment_distance(a: Point, b: Point, p: Point) -> float:
    (ax_, ay), (bx, by) = a, b
    length2 = (bx - ax_) ** 2 + (by - ay) ** 2
    t = 0.0 if not length2 else max(0.0, min(1.0, ((p[0] - ax_) * (bx - ax_)
                                                   + (p[1] - ay) * (by - ay)) / length2))
    return math.dist(p, (ax_ + t * (bx - ax_), ay + t * (by - ay)))


def _segments_cross(a: Point, b: Point, c: Point, d: Point) -> bool:
    """Whether segments a-b and c-d cross (touching ends count)."""
    def side(p: Point, q: Point, r: Point) -> float:
        return (q[0] - p[0]) * (r[1] - p[1]) - (q[1] - p[1]) * (r[0] - p[0])

    d1, d2, d3, d4 = side(c, d, a), side(c, d, b), side(a, b, c), side(a, b, d)
    return d1 * d2 <= 0 and d3 * d4 <= 0 and not (d1 == d2 == 0)


def _label_spots(px: float, py: float, width: float, height: float,
                 radius: float) -> list[tuple[float, Box]]:
    """Boxes for a label of this size beside the marker at (px, py), in preference order."""
    spots = []
    for gap in _LABEL_GAPS_PX:
        reach = radius + gap
        for ux, uy in _LABEL_SIDES:
            x0 = px + reach if ux > 0 else px - reach - width if ux < 0 else px - width / 2
            y0 = py + reach if uy > 0 else py - reach - height if uy < 0 else py - height / 2
            spots.append((gap, (x0, y0, x0 + width, y0 + height)))
    return spots


def _inside(box: Box, area: Box) -> bool:
    return area[0] <= box[0] and area[1] <= box[1] and box[2] <= area[2] and box[3] <= area[3]


def _overlap(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _crosses(a: tuple[float, float], b: tuple[float, float], box: Box) -> bool:
    """Whether the segment a-b passes through the box (clipped to it, Liang-Barsky)."""
    (x0, y0), (x1, y1) = a, b
    low, high = 0.0, 1.0
    for p, q in ((x0 - x1, x0 - box[0]), (x1 - x0, box[2] - x0),
                 (y0 - y1, y0 - box[1]), (y1 - y0, box[3] - y0)):
        if p == 0:
            if q < 0:
                return False
            continue
        t = q / p
        if p < 0:
            low = max(low, t)
        else:
            high = min(high, t)
        if low > high:
            return False
    return True

"""gradequiv profile: the frontier, percentiles, memory per granularity, the report files."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from library_models import pins_host_memory

from gradequiv.harness import Case, Implementation, resolve
from gradequiv.harness.cli import main
from gradequiv.harness.commands import profiling
from gradequiv.harness.commands.profiling import pareto_frontier, percentiles, profile
from gradequiv.harness.reports.figures import frontier_figure, frontier_title
from gradequiv.models import BatchConfig, ExternalConfig, TransformerConfig, parse_granularity

CASE = Case(model=TransformerConfig(n_layer=2, n_embd=16, n_head=2, max_seq_len=8,
                                    attn_dropout=0.1, mlp_dropout=0.1),
            batch=BatchConfig(2, 8, padding=False))
GRANULARITIES = [parse_granularity(t) for t in ("none", "layer", "mlp")]


def test_the_frontier_keeps_points_no_other_beats_on_both_axes() -> None:
    points = [(10.0, 1.0), (5.0, 2.0), (6.0, 3.0), (1.0, 5.0), (1.0, 6.0), (5.0, 2.0)]
    assert pareto_frontier(points) == [True, True, False, True, False, True]


def test_percentiles_of_a_known_list() -> None:
    values = [float(v) for v in range(1, 101)]
    p = percentiles(values)
    assert p["p50"] == 50.5 and p["p95"] == pytest.approx(95.05) and p["p99"] == 99.01
    assert percentiles([3.0]) == {"p50": 3.0, "p95": 3.0, "p99": 3.0}


def test_recompute_holds_less_than_none_and_reports_relative_figures() -> None:
    result = profile(resolve("torch"), CASE, GRANULARITIES, steps=2, warmup=0)
    none, layer, mlp = result.rows
    assert 0 < layer.held_bytes < mlp.held_bytes < none.held_bytes
    assert none.memory_saved_vs_none == 0.0 and none.overhead_vs_none == 0.0
    assert 0 < layer.memory_saved_vs_none < 1
    assert layer.on_frontier  # the least memory is on the frontier whatever the timings
    assert none.peak_backward_bytes == none.held_bytes  # nothing recomputed: backward frees
    assert layer.held_bytes < layer.peak_backward_bytes < none.held_bytes
    assert all(r.step_s["p50"] <= r.step_s["p95"] <= r.step_s["p99"] for r in result.rows)
    assert none.cuda_max_allocated_bytes is None  # allocator figures are CUDA's alone
    # the frontier is of the step's peak (what must fit), not of the bytes held: layer's
    # peak in backward is above its held bytes, and that is the figure that counts
    assert [r.on_frontier for r in result.rows] == pareto_frontier(
        [(max(r.held_bytes, r.peak_backward_bytes), r.step_s["p50"]) for r in result.rows])


def test_recompute_time_is_measured_inside_backward_only() -> None:
    """The clock sees segment forwards during backward: none for full storage and for a
    no-op, some for a real recompute, and never more than the backward around it."""
    def no_op(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        return fn(*args, **kwargs)

    none, layer = profile(resolve("torch"), CASE, GRANULARITIES[:2], steps=3, warmup=1).rows
    assert none.recompute_s == 0.0
    assert 0.0 < layer.recompute_s < layer.backward_s
    _, fake = profile(Implementation("no-op", no_op), CASE, GRANULARITIES[:2], steps=1,
                      warmup=0).rows
    assert fake.recompute_s == 0.0


def test_a_no_op_implementation_saves_nothing() -> None:
    def no_op(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        return fn(*args, **kwargs)

    result = profile(Implementation("no-op", no_op), CASE, GRANULARITIES[:2], steps=1,
                     warmup=0)
    none, layer = result.rows
    assert layer.held_bytes == none.held_bytes and layer.memory_saved_vs_none == 0.0


def test_the_command_writes_json_markdown_and_a_png(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["profile", "--impl", "torch", "--layers", "2", "--width", "16", "--heads", "2",
                 "--seq-len", "8", "--batch", "2", "--steps", "2", "--warmup", "1",
                 "--granularity", "none,layer", "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "| layer |" in out
    data = json.loads((tmp_path / "profile.json").read_text())
    assert [r["granularity"] for r in data["rows"]] == ["none", "layer"]
    assert data["implementation"] == "torch" and data["adapter"] == "function"
    assert data["conditions"]["threads"] >= 1 and "batch 2" in data["conditions"]["shape"]
    pytest.importorskip("matplotlib")
    assert data["plot"] == "profile.png"
    assert (tmp_path / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "profile.png" in (tmp_path / "profile.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--granularity", "layers"], "granularity='layers' is not one of"),
    (["--granularity", ","], "names none"),
    (["--heads", "3"], "not divisible by n_head=3"),
    (["--threads", "lots"], "--threads='lots' is not a thread count"),
    (["--threads", "0"], "--threads=0: must be from 1 to"),
])
def test_bad_profile_options_are_exit_2(args: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--impl", "torch", *args]) == 2
    assert message in capsys.readouterr().err


TINY = ["profile", "--impl", "torch", "--layers", "2", "--width", "16", "--heads", "2",
        "--seq-len", "8", "--batch", "2", "--steps", "2", "--warmup", "1",
        "--granularity", "none,layer"]


def test_the_command_says_each_phase_as_it_starts_and_ends_in_plain_lines(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A CI log shows where a long run is; a short one gets two lines a phase, no more."""
    assert main(TINY) == 0
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = [line for line in out.splitlines() if line.startswith("profile: ")]
    assert [line.split(":")[1].strip() for line in lines] == [
        "setup", "setup", "warm-up", "warm-up", "timing", "timing"]
    assert lines[0].startswith("profile: setup: building 2 models (none, layer)")
    assert lines[2].endswith("1 round of 2 steps, one per granularity, interleaved, "
                             "not timed ...")
    assert lines[4].endswith("2 rounds of 2 steps, one per granularity, interleaved ...")
    assert all(lines[i].startswith(f"profile: {p}: done in ") and lines[i].endswith(" s")
               for i, p in ((1, "setup"), (3, "warm-up"), (5, "timing")))
    assert out.index(lines[-1]) < out.index("| granularity |")  # before the table


def test_a_long_phase_says_how_far_it_has_got_at_most_once_an_interval() -> None:
    ticks = itertools.count(0.0, 4.0)  # a clock 4 s further on at every look
    lines: list[str] = []
    say = profiling._Progress(lines.append, every_s=15.0, clock=lambda: next(ticks))
    say.start("timing", "10 rounds")  # t = 0
    for step in range(1, 11):
        say.tick(f"{step} of 10 steps", step / 10)  # t = 4, 8, ..., 40
    say.end()  # t = 44
    assert lines == ["profile: timing: 10 rounds ...",
                     "profile: timing: 4 of 10 steps, 16 s so far, about 24 s left",
                     "profile: timing: 8 of 10 steps, 32 s so far, about 8 s left",
                     "profile: timing: done in 44.0 s"]


def test_profile_ticks_after_every_step_of_every_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no interval every tick shows: the round and step counts the loops pass on."""
    monkeypatch.setattr(profiling, "PROGRESS_EVERY_S", 0.0)
    lines: list[str] = []
    profile(resolve("torch"), CASE, GRANULARITIES[:2], steps=2, warmup=1,
            progress=lines.append)
    ticks = [line for line in lines if "so far" in line]
    assert [t.split(", ")[0] for t in ticks] == [
        "profile: setup: 1 of 2 models built", "profile: setup: 2 of 2 models built",
        "profile: setup: memory of 1 of 2 counted (none last)",
        "profile: setup: memory of 2 of 2 counted (layer last)",
        "profile: warm-up: round 1 of 1", "profile: warm-up: round 1 of 1",
        "profile: timing: round 1 of 2", "profile: timing: round 1 of 2",
        "profile: timing: round 2 of 2", "profile: timing: round 2 of 2"]
    assert "about" in ticks[6] and "1 of 4 steps" in ticks[6] and "about" not in ticks[-1]


# Step p50 (ms), held bytes, on the frontier: docs/profile-default, where layer's label
# ran into group:2's and out of the axes, and mlp's into every:2's.
DEFAULT_RUN = {"none": (37.36, 15288836, True), "layer": (67.11, 985604, False),
               "every:2": (54.11, 8071684, True), "group:2": (64.46, 723460, True),
               "attention": (52.10, 9521668, True), "mlp": (55.54, 8473092, False)}


def _profile_json(points: dict[str, tuple[float, int, bool]], **extra: Any) -> dict[str, Any]:
    rows = [{"granularity": name, "step_s": {"p50": ms / 1e3}, "held_bytes": held,
             "on_frontier": on} for name, (ms, held, on) in points.items()]
    conditions = {"shape": "4L x 128w x 64t x batch 4, fp32, seed 0", "device": "cpu",
                  "threads": 2, "steps": 20, "warmup": 3}
    return {"implementation": "torch", "conditions": conditions, "rows": rows, **extra}


LAYOUTS = {
    "default run": DEFAULT_RUN,
    "two nearly coincide": DEFAULT_RUN | {"mlp": (54.15, 8080000, False)},
    "five on one spot": {name: (50.0 + 0.001 * i, 8_000_000 + i, i == 0)
                         for i, name in enumerate(DEFAULT_RUN)} | {"none": (200.0, 0, True)},
    "long name at the corner": DEFAULT_RUN | {"selective:attention,mlp": (70.0, 15288836,
                                                                         False)},
    "two markers overlap": {  # layer's and group:2's in docs/profile-default before
        "none": (29.0, 15288836, True), "layer": (48.5, 985604, True),
        "every:2": (38.6, 8071684, True), "group:2": (48.7, 723460, True),
        "attention": (40.1, 9521668, False), "mlp": (39.4, 8473092, False)},
    "three in a tight row": DEFAULT_RUN | {"layer": (64.9, 723460, False),
                                           "mlp": (65.3, 723460, False)},
    "a label's first choice under the legend": {  # every:2's right-up spot
        "none": (52.8, 10607109, True), "layer": (63.6, 8035734, False),
        "every:2": (65.6, 15247612, False), "group:2": (69.2, 15186739, False),
        "attention": (50.1, 11526385, False), "mlp": (47.8, 15830329, False)},
}


@pytest.mark.parametrize("points", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_frontier_labels_overlap_nothing_and_stay_inside_the_axes(
        points: dict[str, tuple[float, int, bool]]) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from matplotlib.text import Text

    fig = frontier_figure(_profile_json(points, adapter="function"))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    labels = {t.get_text(): Text.get_window_extent(t, renderer) for t in ax.texts}
    assert sorted(n for label in labels for n in label.split(" / ")) == sorted(points)
    inside, whole = ax.get_window_extent(renderer), fig.bbox
    for name, box in labels.items():
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1, name
        assert inside.y0 <= box.y0 and box.y1 <= inside.y1, name
    for (a, box_a), (b, box_b) in itertools.combinations(labels.items(), 2):
        assert not _overlap(box_a, box_b), (a, b)
    radius = 3 * fig.dpi / 72  # the marker's, 6 points across
    markers = [ax.transData.transform((ms, held / 2**20)) for ms, held, _ in points.values()]
    for name, box in labels.items():
        assert not any(box.x0 < x + radius and x - radius < box.x1
                       and box.y0 < y + radius and y - radius < box.y1
                       for x, y in markers), name
        legend = ax.get_legend()
        assert legend is None or not _overlap(box, legend.get_window_extent(renderer)), name
    title = ax.title.get_window_extent(renderer)
    assert whole.x0 <= title.x0 and title.x1 <= whole.x1 and title.y1 <= whole.y1
    plt.close(fig)


@pytest.mark.parametrize("points", [DEFAULT_RUN, LAYOUTS["long name at the corner"]],
                         ids=["default run", "long name at the corner"])
def test_frontier_labels_keep_off_the_frontier_line(
        points: dict[str, tuple[float, int, bool]]) -> None:
    """Where a spot as near is free, no label sits on the red line (group:2's first choice
    does in the default run)."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from matplotlib.text import Text

    fig = frontier_figure(_profile_json(points, adapter="function"))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    line = ax.transData.transform(ax.lines[0].get_xydata())
    along = [a + (b - a) * k / 200 for a, b in zip(line, line[1:]) for k in range(201)]
    for text in ax.texts:
        box = Text.get_window_extent(text, renderer)
        assert not any(box.x0 < x < box.x1 and box.y0 < y < box.y1 for x, y in along), \
            text.get_text()
    plt.close(fig)


def _overlap(a: Any, b: Any) -> bool:
    return bool(a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1)


def test_the_frontier_title_names_the_implementation_and_the_conditions() -> None:
    data = _profile_json(DEFAULT_RUN, adapter="module", kwargs={"use_reentrant": "False"})
    title = frontier_title(data)
    assert title.splitlines()[0] == "torch (module, use_reentrant=False): activation memory " \
                                    "against step time"
    assert "4L x 128w x 64t x batch 4, fp32" in title and "cpu, 2 threads" in title
    assert frontier_title(_profile_json(DEFAULT_RUN)).startswith("torch: ")  # older files
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = frontier_figure(data)
    assert fig.axes[0].get_title() == title
    plt.close(fig)


@pytest.mark.parametrize("points", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_no_frontier_label_can_be_read_as_another_points(
        points: dict[str, tuple[float, int, bool]]) -> None:
    """A label without a leader line is clearly nearest its own marker (every other at
    least twice as far); a leader line ends at its own marker, passes no other marker,
    crosses no other label and no other leader line. Points on one spot share a label."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from matplotlib.text import Text

    fig = frontier_figure(_profile_json(points, adapter="function"))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    radius = 3 * fig.dpi / 72
    marker = {name: tuple(ax.transData.transform((ms, held / 2**20)))
              for name, (ms, held, _) in points.items()}
    boxes = {t.get_text(): Text.get_window_extent(t, renderer) for t in ax.texts}
    leaders = {t.get_text(): t.arrow_patch.get_path().vertices for t in ax.texts
               if t.arrow_patch is not None}
    for label, box in boxes.items():
        own = label.split(" / ")
        assert max(math.dist(marker[own[0]], marker[n]) for n in own) < radius, label
        others = [p for n, p in marker.items() if n not in own]
        if label not in leaders:
            near = _distance_to_box(box, marker[own[0]])
            assert all(_distance_to_box(box, p) >= 2 * near for p in others), label
            continue
        path = leaders[label]
        assert math.dist(path[-1], marker[own[0]]) <= radius + 2, label  # reaches its marker
        pieces = list(zip(path, path[1:]))
        for p in others:
            assert all(_segment_distance(a, b, p) > radius for a, b in pieces), (label, p)
        for other, other_box in boxes.items():
            if other != label:
                assert not any(_segment_enters(a, b, other_box) for a, b in pieces), \
                    (label, other)
        for other, other_path in leaders.items():
            if other != label:
                assert not any(_segments_cross(a, b, c, d) for a, b in pieces
                               for c, d in zip(other_path, other_path[1:])), (label, other)
    plt.close(fig)


def test_points_whose_markers_overlap_each_get_a_leader_line() -> None:
    """layer and group:2 of the old docs/profile-default: markers 8 px apart, so labels
    beside them could be read either way; each gets a line of its own."""
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = frontier_figure(_profile_json(LAYOUTS["two markers overlap"], adapter="function"))
    fig.canvas.draw()
    ax = fig.axes[0]
    texts = {t.get_text(): t for t in ax.texts}
    assert "layer" in texts and "group:2" in texts  # apart, not one shared label
    layer, group = texts["layer"].arrow_patch, texts["group:2"].arrow_patch
    assert layer is not None and group is not None
    plt.close(fig)


def _distance_to_box(box: Any, p: tuple[float, float]) -> float:
    dx = max(box.x0 - p[0], 0.0, p[0] - box.x1)
    dy = max(box.y0 - p[1], 0.0, p[1] - box.y1)
    return math.hypot(dx, dy)


def _segment_distance(a: Any, b: Any, p: tuple[float, float]) -> float:
    samples = [(a[0] + (b[0] - a[0]) * k / 100, a[1] + (b[1] - a[1]) * k / 100)
               for k in range(101)]
    return min(math.dist(p, q) for q in samples)


def _segment_enters(a: Any, b: Any, box: Any) -> bool:
    return any(box.x0 < a[0] + (b[0] - a[0]) * k / 100 < box.x1
               and box.y0 < a[1] + (b[1] - a[1]) * k / 100 < box.y1 for k in range(101))


def _segments_cross(a: Any, b: Any, c: Any, d: Any) -> bool:
    def side(p: Any, q: Any, r: Any) -> float:
        return float((q[0] - p[0]) * (r[1] - p[1]) - (q[1] - p[1]) * (r[0] - p[0]))

    return side(c, d, a) * side(c, d, b) < 0 and side(a, b, c) * side(a, b, d) < 0


@pytest.mark.parametrize("factory, segments", [
    ("tests.user_models:residual_stack", ["blocks.0", "blocks.1", "blocks.2"]),
    ("tests.profile_models:conv_net", ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]),
])
def test_profile_model_writes_the_table_frontier_recommendation_and_png(
        factory: str, segments: list[str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    named = f"{segments[0]}+{segments[2]}"
    code = main(["profile", "--impl", "torch", "--model", factory, "--device", "cpu",
                 "--steps", "1", "--warmup", "0", "--granularity", f"none,layer,{named}",
                 "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads((tmp_path / "profile.json").read_text())
    rows = {r["granularity"]: r for r in data["rows"]}
    assert list(rows) == ["none", "layer", named]
    assert data["conditions"]["unit"] == "samples" and data["conditions"]["batch"] == 8
    # every segment recomputed holds less than two of them, which holds less than none
    assert rows["layer"]["held_bytes"] < rows[named]["held_bytes"] < rows["none"]["held_bytes"]
    least = min(rows.values(), key=lambda r: (max(r["held_bytes"], r["peak_backward_bytes"]),
                                               r["step_s"]["p50"]))
    assert least["on_frontier"]  # the least peak is on it, whatever the timings
    assert rows[data["recommendation"]["knee"]]["on_frontier"]
    assert "| samples/s | frontier |" in out
    assert f"**Recommended: {data['recommendation']['knee']}, the knee" in out
    md = (tmp_path / "profile.md").read_text()
    assert "**Recommended:" in md and "samples/s" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(name: str, ms: float, held: int, peak: int | None = None,
         on: bool = True, band: tuple[float, float] | None = None) -> profiling.GranularityProfile:
    step_s = {"p50": ms / 1e3}
    if band is not None:
        step_s |= {"p25": band[0] / 1e3, "p75": band[1] / 1e3}
    return profiling.GranularityProfile(
        granularity=name, held_bytes=held, peak_backward_bytes=held if peak is None else peak,
        step_s=step_s, forward_s=0.0, backward_s=0.0, tokens_per_s=1e3 / ms,
        on_frontier=on)


MIB = 2**20


def test_the_knee_is_the_last_point_before_a_step_costs_clearly_more_per_byte() -> None:
    rows = [_row("none", 10, 16 * MIB), _row("every:2", 14, 8 * MIB),  # 0.5 ms per MiB
            _row("mlp", 18, 10 * MIB, on=False), _row("layer", 40, 4 * MIB)]  # 6.5 ms per MiB
    rec = profiling.recommend(rows, batch=4)
    assert rec["knee"] == "every:2"
    assert "0.50 ms of step time per MiB of peak saved" in rec["why"]
    assert "6.50 ms per MiB, 13.00x as much" in rec["why"]
    assert "layer" in rec["why"] and rec["memory_budget"] is None and "fits" not in rec
    # the same step at under twice the cost: the knee moves on to the least memory
    rows[3] = _row("layer", 18, 4 * MIB)  # 1.0 ms per MiB
    assert profiling.recommend(rows, batch=4)["knee"] == "layer"


def test_a_step_is_clearly_more_only_at_the_ends_of_the_interquartile_ranges() -> None:
    """By p50s the step to layer costs 2.5x the time per byte of the one before it; a rerun
    can turn that into 1.7x (the ratio of p50s swung between every:2 and layer on identical
    runs): with these spreads it is not clearly more, so the walk goes on to layer. With
    tight spreads the same p50s keep the knee at every:2."""
    def rows(spread: float) -> list[profiling.GranularityProfile]:
        return [_row(g, ms, held * MIB, band=(ms - spread, ms + spread))
                for g, ms, held in (("none", 10, 16), ("every:2", 14, 8), ("layer", 19, 4))]

    assert profiling.recommend(rows(0.1), batch=4)["knee"] == "every:2"  # 1.25 ms vs 0.5
    wide = profiling.recommend(rows(1.0), batch=4)
    assert wide["knee"] == "layer" and "no step along the frontier" in wide["why"]


@pytest.mark.parametrize("budget, fits, fastest", [
    (20 * MIB, ["none", "every:2", "layer"], "none"),  # all fit
    (9 * MIB, ["every:2", "layer"], "every:2"),  # some: none's 16 MiB is over
    (3 * MIB, [], None),  # none does
])
def test_a_memory_budget_picks_the_fastest_granularity_whose_peak_fits(
        budget: int, fits: list[str], fastest: str | None) -> None:
    rows = [_row("none", 10, 16 * MIB), _row("every:2", 14, 8 * MIB, peak=9 * MIB),
            _row("layer", 40, 4 * MIB, peak=6 * MIB)]  # fits by its peak, not its held bytes
    rec = profiling.recommend(rows, batch=4, memory_budget=budget)
    assert rec["fits"] == fits and rec["fastest_fitting"] == fastest
    largest = {x["granularity"]: x["largest_batch"] for x in rec["largest_batch"]}
    assert largest == {"none": budget // (4 * MIB), "every:2": budget * 4 // (9 * MIB),
                       "layer": budget * 4 // (6 * MIB)}
    if fastest is None:
        assert rec["verdict"].startswith(f"nothing fits {budget:,} bytes at batch 4: the "
                                         f"smallest peak is layer's {6 * MIB:,} bytes")
    elif fastest == "none":
        assert "recompute is not needed at batch 4" in rec["verdict"]
        assert f"layer fits batch {largest['layer']} where none fits {largest['none']}" \
            in rec["verdict"]
    else:
        assert rec["verdict"].startswith("every:2 is the fastest granularity that fits")


def test_the_command_prints_the_budget_verdict_and_writes_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*TINY, "--memory-budget", "1KiB", "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "Memory budget 1,024 bytes (activation" in out and "nothing fits" in out
    data = json.loads((tmp_path / "profile.json").read_text())
    assert data["recommendation"]["memory_budget"] == 1024
    assert data["recommendation"]["fastest_fitting"] is None
    assert "nothing fits" in (tmp_path / "profile.md").read_text()
    assert main(["report", str(tmp_path)]) == 0  # the rendered pages say the same
    for page in ("report.md", "report.html"):
        text = (tmp_path / page).read_text()
        assert "Recommended: " in text and "nothing fits 1,024 bytes at batch 2" in text, page
        assert "largest batch within the budget" in text, page


@pytest.mark.parametrize("args, message", [
    (["--memory-budget", "lots"], "--memory-budget='lots' is not a byte count"),
    (["--memory-budget", "0"], "--memory-budget='0': must be at least 1 byte"),
    (["--memory-budget=-5MiB"], "--memory-budget='-5MiB': must be at least 1 byte"),
    (["--memory-budget", "3 parsecs"], "write e.g. --memory-budget 512MiB"),
    (["--model", "tests.user_models:residual_stack", "--granularity", "none,blocks.7"],
     "'blocks.7' is not a segment of the model; its segments are blocks.0, blocks.1, "
     "blocks.2"),
    (["--model", "tests.user_models:residual_stack", "--granularity", "blocks.0+head"],
     "'head' is not a segment of the model"),
    (["--model", "tests.user_models:residual_stack", "--granularity", "group:2"],
     "only none, layer, every:K or segment names apply"),
    (["--model", "tests.user_models:wrong_segment"], "segment 'blocks.9' is not a submodule"),
    (["--model", "tests.user_models"], "is not 'package.module:attr'"),
    (["--granularity", "none,hf"], "--granularity item 'hf' profiles transformers' own "
     "toggle, which needs a transformers model: add --model gradequiv.models.hf:llama"),
    (["--model", "tests.user_models:residual_stack", "--granularity", "none,hf:offload"],
     "--granularity item 'hf:offload' profiles transformers' own toggle, and the model is a "
     "Stack, not a transformers PreTrainedModel: leave the item out"),
    (["--model", "tests.user_models:residual_stack", "--granularity", "hf:every=2"],
     "--granularity item 'hf:every=2': 'every' is no option of transformers' toggle; its "
     "options are every_n_layers, offload"),
])
def test_bad_budgets_and_segment_names_are_exit_2_in_one_line(
        args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--impl", "torch", "--steps", "1", "--warmup", "0", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_the_knee_is_told_per_kib_where_the_steps_save_less_than_a_mib() -> None:
    rows = [_row("none", 10, 64 * 1024), _row("every:2", 14, 32 * 1024),  # 0.125 ms per KiB
            _row("layer", 42, 16 * 1024)]  # 1.75 ms per KiB
    rec = profiling.recommend(rows, batch=8)
    assert rec["knee"] == "every:2"
    assert "0.12 ms of step time per KiB of peak saved" in rec["why"]
    assert "1.75 ms per KiB, 14.00x as much" in rec["why"]


def test_the_budget_verdict_states_the_rate_in_the_profiles_unit() -> None:
    """The knee's walk says per MiB; the budget's rate stays in tokens (or samples)/s."""
    rows = [_row("none", 10, 16 * MIB), _row("every:2", 14, 8 * MIB), _row("layer", 16, 4 * MIB)]
    verdict = profiling.recommend(rows, batch=4, memory_budget=40 * MIB)["verdict"]
    assert "62 tokens/s as measured" in verdict and "MiB/s" not in verdict


TINY_REPORT = [*TINY, "--steps", "1", "--warmup", "0"]


def test_impl_defaults_to_torch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A first profile needs no implementation named: torch's own checkpoint is measured."""
    args = [a for a in TINY_REPORT if a not in ("--impl", "torch")]
    assert main([*args, "--report-dir", str(tmp_path)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("gradequiv profile: torch on ")
    assert json.loads((tmp_path / "profile.json").read_text())["implementation"] == "torch"


@pytest.mark.parametrize("args, env, measured, said", [
    ([], None, 1, "1 thread (--threads 1)"),  # the default, whatever torch had
    ([], "3", 3, "3 threads (--threads 3)"),  # a CI job's setting
    (["--threads", "3"], "1", 3, "3 threads (--threads 3)"),  # the flag over the variable
    (["--threads", "auto"], None, 2, "2 threads (--threads auto)"),  # torch's, left alone
])
def test_profile_measures_under_threads_as_check_does_and_puts_them_back(
        args: list[str], env: str | None, measured: int, said: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Step times at torch's default threads swing with whatever else runs on the cores;
    the count measured under is in the header and in the conditions, and the caller's
    count is back afterwards."""
    if env is None:
        monkeypatch.delenv("GRADEQUIV_THREADS", raising=False)
    else:
        monkeypatch.setenv("GRADEQUIV_THREADS", env)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's: not the default, so a run that keeps it shows
    try:
        assert main([*TINY_REPORT, *args, "--report-dir", str(tmp_path)]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert said in capsys.readouterr().out.splitlines()[0]
    conditions = json.loads((tmp_path / "profile.json").read_text())["conditions"]
    assert conditions["threads"] == measured
    assert len(conditions["load_average"]) == 3  # beside the threads: what else ran


def _timed(name: str, ms: float, spread: float, held: int) -> profiling.GranularityProfile:
    """A row whose middle half of steps took ``ms`` +- ``spread`` milliseconds."""
    row = _row(name, ms, held)
    row.step_s |= {"p25": (ms - spread) / 1e3, "p75": (ms + spread) / 1e3}
    return row


def _on_frontier(rows: list[profiling.GranularityProfile]) -> list[profiling.GranularityProfile]:
    points = [(profiling.peak_bytes(r), r.step_s["p50"]) for r in rows]
    for row, on in zip(rows, pareto_frontier(points)):
        row.on_frontier = on
    return rows


def test_rows_within_noise_are_tied_and_the_one_saving_more_memory_is_recommended() -> None:
    """By p50 every:2 is the knee (the step on to layer costs 6x the time per byte), but
    their middle halves of steps overlap: tied, not ranked, and layer saves more. A rerun
    that swaps their p50s inside the same noise recommends the same."""
    rows = _on_frontier([_timed("none", 10.0, 0.02, 16 * MIB),
                         _timed("every:2", 10.2, 0.1, 8 * MIB),
                         _timed("layer", 10.8, 0.6, 4 * MIB)])
    rec = profiling.recommend(rows, batch=4)
    assert rec["knee"] == "layer" and rec["tied"] == ["every:2", "layer"]
    assert rec["why"].startswith("every:2 and layer are tied within noise (step-time "
                                 "interquartile ranges overlap: every:2 10.1-10.3 ms, layer "
                                 "10.2-11.4 ms)")
    assert ("so time does not rank them and memory picks: the smallest peak is recommended, "
            f"layer, peak {4 * MIB:,} bytes (held between forward and backward: "
            f"{4 * MIB:,} bytes)") in rec["why"]
    # by p50s the step on to layer costs 6x, but not at the ends of the ranges: no knee
    assert "no step along the frontier costs more than 2x" in rec["why"]
    assert "tied with it within noise" in rec["rule"]
    swapped = _on_frontier([_timed("none", 10.0, 0.02, 16 * MIB),
                            _timed("every:2", 10.8, 0.6, 8 * MIB),
                            _timed("layer", 10.2, 0.1, 4 * MIB)])
    assert profiling.recommend(swapped, batch=4)["knee"] == "layer"
    # the same p50s, measured with less spread: a real difference, ranked as before
    apart = _on_frontier([_timed("none", 10.0, 0.02, 16 * MIB),
                          _timed("every:2", 10.2, 0.02, 8 * MIB),
                          _timed("layer", 10.8, 0.05, 4 * MIB)])
    rec = profiling.recommend(apart, batch=4)
    assert rec["knee"] == "every:2" and rec["tied"] == [] and "tied" not in rec["why"]


def test_tied_rows_with_equal_peaks_go_to_the_first_listed_whatever_their_times() -> None:
    for attention_ms, mlp_ms in ((20.0, 20.4), (20.4, 20.0)):
        rows = _on_frontier([_timed("none", 10.0, 0.1, 16 * MIB),
                             _timed("attention", attention_ms, 1.0, 4 * MIB),
                             _timed("mlp", mlp_ms, 1.0, 4 * MIB)])
        rec = profiling.recommend(rows, batch=4)
        assert (rec["knee"], rec["tied"]) == ("attention", ["attention", "mlp"])


def test_a_budget_recommends_the_smaller_peak_of_rows_tied_for_the_fastest_that_fits() -> None:
    rows = _on_frontier([_timed("none", 10.0, 0.1, 16 * MIB),
                         _timed("every:2", 14.0, 1.0, 8 * MIB),
                         _timed("layer", 14.5, 1.0, 4 * MIB)])
    rec = profiling.recommend(rows, batch=4, memory_budget=9 * MIB)
    assert rec["fastest_fitting"] == "layer"
    assert rec["fastest_fitting_tied"] == ["every:2", "layer"]
    assert rec["verdict"].startswith(f"layer is, within noise, the fastest granularity that "
                                     f"fits {9 * MIB:,} bytes: every:2 and layer are tied")


def test_the_command_writes_each_rows_quartiles_and_the_ties(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--report-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "profile.json").read_text())
    for row in data["rows"]:
        s = row["step_s"]
        assert s["p25"] <= s["p50"] <= s["p75"] <= s["p99"]
    assert isinstance(data["recommendation"]["tied"], list)


def test_the_table_names_held_and_peak_bytes_apart_and_the_conditions_say_the_load() -> None:
    """group:2 holds the least but peaks the most: its held bytes saved and its peak saved
    are two columns, never one "saved"; the load average is beside the thread count."""
    from gradequiv.harness.reports.tables import profile_summary, profile_tables

    rows = _on_frontier([_timed("none", 10.0, 0.1, 16 * MIB),
                         _row("group:2", 14.0, 1 * MIB, peak=20 * MIB)])
    for row in rows:
        row.step_s |= {"p95": row.step_s["p50"], "p99": row.step_s["p50"]}
    data = {"implementation": "torch", "rows": [vars(r) for r in rows],
            "conditions": {"shape": "2L", "torch": "2", "device": "cpu", "threads": 1,
                           "load_average": [3.5, 2.25, 1.0], "steps": 5, "warmup": 1}}
    [(_, table)] = profile_tables(data)
    assert table.head[1:5] == ["held bytes", "peak bytes", "held saved vs none",
                                 "peak saved vs none"]
    group = table.rows[1]
    assert group[1:3] == [f"{MIB:,}", f"{20 * MIB:,}"] and group[4] == "-25.0%"
    assert "cpu, 1 thread, load average 3.50 2.25 1.00, 5 steps" in profile_summary(data)


def test_transformers_toggle_rows_appear_beside_the_granularities_with_their_figures() -> None:
    """``hf`` rows run transformers' own toggle, whatever --impl the other rows run; with
    every_n_layers=2 it checkpoints one of the two layers, so it holds more than ``hf``."""
    pytest.importorskip("transformers")
    rows = ["none", "layer", "hf", "hf:every_n_layers=2"]
    granularities = [profiling.parse_selection(t, ["model.layers.0", "model.layers.1"])
                     for t in rows]
    case = Case(model=ExternalConfig("gradequiv.models.hf:llama"))
    result = profile(resolve("torch"), case, granularities, steps=1, warmup=0)
    assert [r.granularity for r in result.rows] == rows
    for row in result.rows:
        assert row.held_bytes > 0 and row.peak_backward_bytes > 0
        assert row.step_s["p50"] > 0 and row.tokens_per_s > 0
    by_name = {r.granularity: r for r in result.rows}
    assert by_name["hf"].held_bytes < by_name["hf:every_n_layers=2"].held_bytes \
        < by_name["none"].held_bytes


def test_offload_is_a_row_where_host_memory_pins_and_exit_2_with_the_reason_where_not(
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    code = main(["profile", "--model", "gradequiv.models.hf:llama", "--granularity",
                 "none,hf:offload", "--steps", "1", "--warmup", "0"])
    out, err = capsys.readouterr()
    if pins_host_memory():
        assert code == 0 and "| hf:offload |" in out, err
    else:
        assert code == 2, out
        assert err.startswith("gradequiv: error: --granularity item 'hf:offload': transformers' "
                              "toggle raised in the first step: RuntimeError: pin_memory=True")

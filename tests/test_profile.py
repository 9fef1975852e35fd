"""gradequiv profile: the frontier, percentiles, memory per granularity, the report files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradequiv.harness import Case, Implementation, resolve
from gradequiv.harness.cli import main
from gradequiv.harness.commands.profiling import pareto_frontier, percentiles, profile
from gradequiv.models import BatchConfig, TransformerConfig, parse_granularity

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
    assert data["conditions"]["threads"] >= 1 and "batch 2" in data["conditions"]["shape"]
    pytest.importorskip("matplotlib")
    assert data["plot"] == "profile.png"
    assert (tmp_path / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "profile.png" in (tmp_path / "profile.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--granularity", "layers"], "granularity='layers' is not one of"),
    (["--granularity", ","], "names none"),
    (["--heads", "3"], "not divisible by n_head=3"),
])
def test_bad_profile_options_are_exit_2(args: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--impl", "torch", *args]) == 2
    assert message in capsys.readouterr().err

"""The report formats from real reports: schema, Markdown, JUnit, HTML, and interrupted runs."""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness import PROPERTIES
from gradequiv.harness.cli import main
from gradequiv.harness.commands.mutants import Outcome, score, write
from gradequiv.harness.reports.bundle import load_bundle, report_schema
from gradequiv.harness.reports.findings import find, layer_errors
from gradequiv.harness.reports.markdown import mutants_markdown, profile_markdown
from gradequiv.harness.reports.tables import mutants_table, profile_tables

jsonschema = pytest.importorskip("jsonschema")

@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real runs: torch passing on the drawn suite, and torch without RNG restore."""
    root = tmp_path_factory.mktemp("reports")
    runs = {
        "pass": ["--impl", "torch", "--examples", "2"],
        "fail": ["--impl", "torch", "--impl-kwarg", "preserve_rng_state=false",
                 "--case", "4L-group2-dropout-untied"],
    }
    for name, args in runs.items():
        main(["check", *args, "--report-dir", str(root / name)])
    return {name: root / name for name in runs}


def validate(report: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(report_schema()).validate(report)


def test_real_reports_validate_against_the_shipped_schema(reports: dict[str, Path]) -> None:
    jsonschema.Draft202012Validator.check_schema(report_schema())
    for folder in reports.values():
        validate(json.loads((folder / "report.json").read_text()))
    broken = json.loads((reports["fail"] / "report.json").read_text())
    broken["cases"][0]["properties"][0]["status"] = "maybe"
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_findings_answer_the_seed_s_questions(reports: dict[str, Path]) -> None:
    good = find(json.loads((reports["pass"] / "report.json").read_text()))
    assert good.all_bitwise_equal and good.worst_ulps == 0  # CPU: a correct recompute is exact
    assert "bitwise equal" in good.closeness() and good.consistency().startswith("consistent")
    bad = find(json.loads((reports["fail"] / "report.json").read_text()))
    assert bad.worst_ulps > 0 and bad.worst_rel_error > 1e-3 and not bad.all_bitwise_equal
    assert bad.sites["attention dropout"] == [1, 1]
    assert bad.consistency().startswith("not consistent: failures in fp32")


def test_markdown_puts_the_verdict_first_and_the_reproduce_command_in(
        reports: dict[str, Path]) -> None:
    assert main(["report", str(reports["fail"]), "--format", "md"]) == 0
    text = (reports["fail"] / "report.md").read_text()
    assert text.startswith("## gradequiv: FAIL\n\n") and "\n**FAIL**: `torch`" in text
    report = json.loads((reports["fail"] / "report.json").read_text())
    first = report["minimal_failures"][0]
    assert (first.get("reproduce_file") or first["reproduce"]) in text  # the short one if any
    assert "ULPs" in text and "Random sites exercised" in text
    assert "**Noise floor:** the two full-storage runs differ by at most 0 " in text
    main(["report", str(reports["pass"]), "--format", "md"])
    passed = (reports["pass"] / "report.md").read_text()
    assert passed.startswith("## gradequiv: PASS")
    # every case passed against a zero floor: none ran the floor path, and it says so
    assert "**Noise floor:** not measured: every case passed against a floor of zero" in passed


def test_junit_has_one_testcase_per_property_and_family_with_the_minimal_case(
        reports: dict[str, Path]) -> None:
    main(["report", str(reports["fail"]), "--format", "junit"])
    suite = ET.parse(reports["fail"] / "junit.xml").getroot()
    names = [t.get("name") for t in suite.iter("testcase")]
    assert len(names) == len(set(names)) == len(PROPERTIES)  # one family: transformer, fp32, group
    failed = {t.get("name"): t.find("failure") for t in suite.iter("testcase")
              if t.find("failure") is not None}
    assert set(failed) == {"gradients [transformer, fp32, group]",
                           "rng [transformer, fp32, group]",
                           "trajectory [transformer, fp32, group]"}
    assert suite.get("failures") == "3" and suite.get("tests") == str(len(PROPERTIES))
    text = failed["gradients [transformer, fp32, group]"].text or ""
    assert '"granularity": "group:2"' in text and "reproduce: gradequiv check" in text
    main(["report", str(reports["pass"]), "--format", "junit"])
    good = ET.parse(reports["pass"] / "junit.xml").getroot()
    assert good.get("failures") == "0" and int(good.get("tests") or 0) >= len(PROPERTIES)


def test_html_is_self_contained_and_its_images_decode(reports: dict[str, Path]) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    main(["report", str(reports["fail"]), "--format", "html"])
    page = (reports["fail"] / "report.html").read_text()
    assert not re.search(r"(src|href)\s*=\s*['\"]?(https?:)?//", page)
    assert "http://" not in page and "https://" not in page
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert images, "a failing report shows where the gradients diverge"
    for data in images:
        pixels = imread(io.BytesIO(base64.b64decode(data)), format="png")
        assert pixels.shape[0] > 50 and pixels.shape[1] > 50


def test_the_heatmap_grid_puts_each_gradient_in_its_layer(reports: dict[str, Path]) -> None:
    record = json.loads((reports["fail"] / "report.json").read_text())["cases"][0]
    rows, columns, grid = layer_errors(record)
    assert rows == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "other"]
    assert "attn.qkv.weight" in columns and "wte.weight" in columns
    qkv = columns.index("attn.qkv.weight")
    assert all(grid[i][qkv] > 0 for i in range(4))  # RNG not restored: every layer is off


def test_report_command_errors_are_exit_2(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "holds none of report.json" in capsys.readouterr().err
    (tmp_path / "report.json").write_text("{half")
    assert main(["report", str(tmp_path)]) == 2
    assert "is not readable JSON" in capsys.readouterr().err


def test_fail_on_verdict_gates(reports: dict[str, Path]) -> None:
    assert main(["report", str(reports["fail"]), "--format", "md", "--fail-on-verdict"]) == 1
    assert main(["report", str(reports["pass"]), "--format", "md", "--fail-on-verdict"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_killed_run_leaves_a_valid_report_marked_incomplete(
        tmp_path: Path, how: signal.Signals) -> None:
    marker = tmp_path / "slow-from-now"
    env = dict(os.environ, GRADEQUIV_TEST_SLEEP_AFTER=str(marker),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                           os.environ.get("PYTHONPATH", "")]))
    report_file = tmp_path / "r" / "report.json"
    log = tmp_path / "stderr.txt"
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "gradequiv.harness", "check", "--in-process",
             "--impl", "wrong_impls:sleepy",
             "--examples", "2", "--report-dir", str(tmp_path / "r")],
            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + 240
            # report.json is written as cases finish; wait for a property test to end too
            while not (report_file.exists() and json.loads(report_file.read_text())["tests"]):
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "no report.json after 240 s"
                time.sleep(0.2)
            marker.touch()  # from here every case is slow: the kill lands mid-run
            time.sleep(1.0)
            process.send_signal(how)
            code = process.wait(timeout=120)
        finally:
            process.kill()
            process.wait()
    report = json.loads(report_file.read_text())
    validate(report)
    assert report["complete"] is False and report["tests"]
    assert code == (130 if how == signal.SIGTERM else -signal.SIGKILL)
    assert not list(report_file.parent.glob(".report.json.*"))  # no temporary file left
    assert load_bundle(report_file.parent).verdict in ("fail", "incomplete")


def _outcomes() -> list[Outcome]:
    """One outcome of each status: a flagged correct one, a caught, a survived, a skipped."""
    return [Outcome("torch", "torch", "correct", "flagged", "test_gradients", 3, 1.25, "t"),
            Outcome("stale-recompute", "m:s", "mutant", "caught", "test_rng", 2, 0.5, "t,b"),
            Outcome("lost-rng", "m:l", "mutant", "survived", "", 20, 9.0, "t,b"),
            Outcome("cuda-only", "m:c", "mutant", "skipped", "needs CUDA", 0, 0.0, "t,b")]


MUTANTS_MD = """\
**Mutation score 1/2 (50%); correct implementations FLAGGED: fail \
(incomplete: the run stopped early)**

| role | implementation | result | caught by | cases (mutants: until caught) | seconds | source |
|---|---|---|---|---|---|---|
| correct | torch | flagged | test_gradients | 3 | 1.2 | - |
| mutant | stale-recompute | caught | test_rng | 2 | 0.5 | - |
| mutant | lost-rng | survived | - | 20 | 9.0 | - |
| mutant | cuda-only | skipped | needs CUDA | 0 | 0.0 | - |
"""


def test_the_mutants_table_is_rendered_once_from_mutants_json(tmp_path: Path) -> None:
    """mutants.md, report.md and report.html show the rows of mutants.json, and no more."""
    outcomes = _outcomes()
    write(tmp_path, outcomes, score(outcomes), {"device": "cpu"}, complete=False)
    data = json.loads((tmp_path / "mutants.json").read_text())
    assert (tmp_path / "mutants.md").read_text() == MUTANTS_MD == mutants_markdown(data)
    assert main(["report", str(tmp_path), "--format", "md"]) == 0
    assert MUTANTS_MD in (tmp_path / "report.md").read_text()
    assert main(["report", str(tmp_path), "--format", "html"]) == 0
    rows = _html_rows((tmp_path / "report.html").read_text())
    assert [cells for _, cells in rows[-4:]] == mutants_table(data).rows
    assert [mark for mark, _ in rows[-4:]] == ["fail", "", "fail", ""]  # against the suite


def _profile() -> dict[str, Any]:
    """A profile.json of an offload on CUDA: two devices hold bytes, the allocator reports."""
    def row(granularity: str, held: dict[str, int], frontier: bool) -> dict[str, Any]:
        return {"granularity": granularity, "held_bytes": sum(held.values()),
                "peak_backward_bytes": 5000, "step_s": {"p50": 0.0123, "p95": 0.0156,
                                                        "p99": 0.0199},
                "forward_s": 0.004, "backward_s": 0.008, "tokens_per_s": 12345.6,
                "recompute_s": 0.001, "extra_backward_s": 0.0, "overhead_vs_none": 0.25,
                "memory_saved_vs_none": 0.5, "on_frontier": frontier, "held_on": held,
                "cuda_allocated_held_bytes": 1000, "cuda_requested_held_bytes": 999,
                "cuda_max_allocated_bytes": 5000}

    return {"schema_version": 1, "command": "profile", "implementation": "torch-offload",
            "case": {}, "conditions": {"torch": "2.x", "device": "cuda", "threads": 2,
                                       "steps": 3, "warmup": 1, "shape": "2L x 16w"},
            "rows": [row("none", {"cuda:0": 4000}, False),
                     row("layer", {"cpu": 3000, "cuda:0": 100}, True)],
            "plot": "profile.png", "plot_missing": None}


PROFILE_MD = """\
Profile of torch-offload: 2L x 16w; torch 2.x, cuda, 2 threads, 3 steps after 1 warm-up

| granularity | held bytes | peak bytes | held saved vs none | peak saved vs none \
| step p50 ms | p95 ms | p99 ms | overhead vs none | forward ms | backward ms \
| of which recompute ms | tokens/s | frontier |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| none | 4,000 | 5,000 | 50.0% | 0.0% | 12.3 | 15.6 | 19.9 | +25.0% | 4.0 | 8.0 | 1.0 \
| 12,346 |  |
| layer | 3,100 | 5,000 | 50.0% | 0.0% | 12.3 | 15.6 | 19.9 | +25.0% | 4.0 | 8.0 | 1.0 \
| 12,346 | yes |

Where the activation bytes were held:

| granularity | cpu | cuda:0 |
|---|---|---|
| none | 0 | 4,000 |
| layer | 3,000 | 100 |

CUDA caching allocator, same step (output and loss included, so a little above the count):

| granularity | allocated after forward | requested after forward | max allocated over the step |
|---|---|---|---|
| none | 1,000 | 999 | 5,000 |
| layer | 1,000 | 999 | 5,000 |

![memory against step time](profile.png)
"""


def test_the_profile_tables_are_rendered_once_from_profile_json(tmp_path: Path) -> None:
    """profile.md is this text (what `gradequiv profile` wrote before the renderer moved to
    reports/); report.md holds the same, report.html the same cells."""
    data = _profile()
    assert profile_markdown(data) == PROFILE_MD
    plain = {k: v for k, v in data.items() if k not in ("plot", "plot_missing")}
    assert profile_markdown(plain) == PROFILE_MD.split("\n\n![")[0] + "\n"  # what it prints
    (tmp_path / "profile.json").write_text(json.dumps(data))
    assert main(["report", str(tmp_path), "--format", "md"]) == 0
    assert PROFILE_MD in (tmp_path / "report.md").read_text()
    assert main(["report", str(tmp_path), "--format", "html"]) == 0
    cells = [cells for _, cells in _html_rows((tmp_path / "report.html").read_text())]
    assert cells == [row for _, table in profile_tables(data) for row in table.rows]


def _html_rows(page: str) -> list[tuple[str, list[str]]]:
    """Every body row of the page's tables: its class and its cells, unescaped."""
    return [(mark, [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", row)])
            for mark, row in re.findall(r"<tr(?: class='(\w+)')?>(<td>.*?)</tr>", page)]

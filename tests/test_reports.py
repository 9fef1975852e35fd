"""The report formats from real reports: schema, Markdown, JUnit, HTML, and interrupted runs."""

from __future__ import annotations

import base64
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

from gradequiv.harness.cli import main
from gradequiv.harness.reports.bundle import load_bundle, report_schema
from gradequiv.harness.reports.findings import find, layer_errors

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
    assert text.startswith("## gradequiv: FAIL\n\n**FAIL**: `torch`")
    report = json.loads((reports["fail"] / "report.json").read_text())
    assert report["minimal_failures"][0]["reproduce"] in text
    assert "ULPs" in text and "Random sites exercised" in text
    assert "**Noise floor:** the two full-storage runs differ by at most 0 " in text
    main(["report", str(reports["pass"]), "--format", "md"])
    assert (reports["pass"] / "report.md").read_text().startswith("## gradequiv: PASS")


def test_junit_has_one_testcase_per_property_and_family_with_the_minimal_case(
        reports: dict[str, Path]) -> None:
    main(["report", str(reports["fail"]), "--format", "junit"])
    suite = ET.parse(reports["fail"] / "junit.xml").getroot()
    names = [t.get("name") for t in suite.iter("testcase")]
    assert len(names) == len(set(names)) == 6  # one family: transformer, fp32, group
    failed = {t.get("name"): t.find("failure") for t in suite.iter("testcase")
              if t.find("failure") is not None}
    assert set(failed) == {"gradients [transformer, fp32, group]",
                           "rng [transformer, fp32, group]",
                           "trajectory [transformer, fp32, group]"}
    assert suite.get("failures") == "3" and suite.get("tests") == "6"
    text = failed["gradients [transformer, fp32, group]"].text or ""
    assert '"granularity": "group:2"' in text and "reproduce: gradequiv check" in text
    main(["report", str(reports["pass"]), "--format", "junit"])
    good = ET.parse(reports["pass"] / "junit.xml").getroot()
    assert good.get("failures") == "0" and int(good.get("tests") or 0) >= 6


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
            [sys.executable, "-m", "gradequiv.harness", "check", "--impl", "wrong_impls:sleepy",
             "--examples", "2", "--report-dir", str(tmp_path / "r")],
            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + 240
            while not report_file.exists():  # written after the first property test
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

"""``gradequiv zoo``: a library's architectures, each checked four ways by its own toggle, as
a table; ``--check`` re-runs a table's rows and fails where a verdict moved."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from gradequiv.harness import InvalidArgument
from gradequiv.harness.cli import main
from gradequiv.harness.commands import zoo

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "zoo-transformers.md"
#: the sweep of the table tests: one architecture that passes, one that differs for real
#: (reentrant checkpoint under bf16 autocast: the autocast cast cache, test_library_route)
SWEPT = ("LlamaForCausalLM", "BertForMaskedLM")


@pytest.fixture(autouse=True)
def _quiet_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``gradequiv zoo`` over :data:`SWEPT`, through the command line: its exit code, what
    it said, and the files it wrote."""
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("zoo")
    table, rows = folder / "zoo.md", folder / "zoo.json"
    argv = ["zoo", "--library", "transformers", "--out", str(table), "--json", str(rows)]
    for name in SWEPT:
        argv += ["--arch", name]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return {"code": code, "out": out.getvalue(), "err": err.getvalue(), "table": table,
            "json": json.loads(rows.read_text(encoding="utf-8"))}


def test_the_listing_is_every_head_with_checkpointing_sorted_and_filters_by_pattern() -> None:
    pytest.importorskip("transformers")
    import transformers

    every = zoo.architectures()
    assert every == sorted(every) and len(every) > 300
    assert {"LlamaForCausalLM", "BertForMaskedLM", "T5ForConditionalGeneration",
            "ViTForImageClassification"} <= set(every)
    # a head whose class does not support checkpointing, and a class without a head, are out
    assert transformers.AlbertForMaskedLM.supports_gradient_checkpointing is False
    assert "AlbertForMaskedLM" not in every and "BertModel" not in every
    masked = zoo.architectures(["*ForMaskedLM"])
    assert "BertForMaskedLM" in masked and "LlamaForCausalLM" not in masked
    assert masked == [n for n in every if n.endswith("ForMaskedLM")]
    assert zoo.architectures(["Bert*", "Llama*"]) == [
        n for n in every if n.startswith(("Bert", "Llama"))]
    with pytest.raises(InvalidArgument, match="matches none .* case-sensitive"):
        zoo.architectures(["*formaskedlm"])


def test_a_sweep_writes_the_table_under_the_command_that_makes_it(
        swept: dict[str, Any]) -> None:
    table = swept["table"]
    text = table.read_text(encoding="utf-8")
    command = (f"gradequiv zoo --library transformers --arch LlamaForCausalLM --arch "
               f"BertForMaskedLM --out {table} --json {table.with_suffix('.json')}")
    lines = text.splitlines()
    assert lines.index("```sh") < 5 and lines[lines.index("```sh") + 1] == command, text[:1200]
    assert "transformers 5." in text and "1 thread," in text and "torch 2." in text
    assert "**1 pass, 1 fail, 0 cannot build.**" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "PASS" in line]
    assert rows[0].startswith("| BertForMaskedLM | PASS | PASS | PASS | FAIL | reentrant bf16 "
                              "autocast: `autocast-cast-cache` (grad of bert."), rows
    assert rows[1].startswith("| LlamaForCausalLM | PASS | PASS | PASS | PASS |  | "), rows
    assert swept["code"] == 1  # an architecture failed
    assert "[2/2] LlamaForCausalLM: PASS PASS PASS PASS (" in swept["err"]
    assert "estimated left" in swept["err"]
    bert = swept["json"]["rows"][0]["checks"]["reentrant bf16 autocast"]
    assert bert["failing"] == ["gradients", "trajectory"] and "cast cache" in bert["sentence"]
    assert zoo.read_verdicts(table) == zoo.read_verdicts(table.with_suffix(".json")) == {
        "BertForMaskedLM": ("PASS", "PASS", "PASS", "FAIL"),
        "LlamaForCausalLM": ("PASS",) * 4}


def test_check_passes_on_the_verdicts_recorded_and_fails_on_one_that_differs(
        swept: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recorded = tmp_path / "recorded.md"
    shutil.copy(swept["table"], recorded)
    check = ["zoo", "--library", "transformers", "--check", str(recorded),
             "--arch", "Llama*"]
    assert main(check) == 0, capsys.readouterr()
    text = recorded.read_text(encoding="utf-8")
    row = "| LlamaForCausalLM | PASS | PASS | PASS | PASS |"
    recorded.write_text(text.replace(row, "| LlamaForCausalLM | PASS | PASS | FAIL | PASS |"),
                        encoding="utf-8")
    capsys.readouterr()
    assert main(check) == 1
    out = capsys.readouterr().out
    assert f"LlamaForCausalLM: reentrant fp32: FAIL in {recorded}, now PASS" in out
    assert "1 verdict(s) differ" in out
    assert not (tmp_path / "docs").exists()  # a check writes no table unless told to


def test_an_architecture_that_cannot_be_built_is_a_row_with_the_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from gradequiv.models import library

    def broken(name: str, seed: int) -> None:
        raise OSError(f"no config for {name} today")

    monkeypatch.setattr(library, "transformers_model", broken)
    row = zoo.check_architecture("LlamaForCausalLM")
    assert row["status"] == zoo.CANNOT_BUILD and zoo.outcome(row) == "cannot build"
    assert row["reason"] == "OSError: no config for LlamaForCausalLM today"
    assert zoo.verdicts(row) == (zoo.CANNOT_BUILD,) * 4
    monkeypatch.undo()
    # the route's own refusal, said without its --model prefix
    row = zoo.check_architecture("BlipForConditionalGeneration")
    assert row["status"] == zoo.CANNOT_BUILD
    assert row["reason"].startswith("its main input is 'pixel_values'"), row["reason"]


def _passes(name: str) -> dict[str, Any]:
    """A stand-in check for :func:`test_a_hang_or_a_crash_is_a_row_and_the_sweep_goes_on`,
    run in the sweep's child: ``hang`` hangs, ``crash`` ends the process, the rest pass."""
    if name == "hang":
        time.sleep(600)
    if name == "crash":
        os._exit(3)
    cell = {"verdict": zoo.PASS, "failing": [], "cause": None, "sentence": "",
            "first_failure": "", "seconds": 0.0}
    return {"architecture": name, "status": zoo.CHECKED, "reason": "", "seconds": 0.0,
            "checks": {column: dict(cell) for column in zoo.CONFIGS}}


@pytest.mark.slow
def test_a_hang_or_a_crash_is_a_row_and_the_sweep_goes_on() -> None:
    lines: list[str] = []
    rows = zoo.sweep(["hang", "crash", "fine"], seconds=2, check=_passes,
                     progress=lines.append)
    assert [(r["architecture"], r["status"]) for r in rows] == [
        ("hang", zoo.TIMED_OUT), ("crash", zoo.CRASHED), ("fine", zoo.CHECKED)]
    assert "no answer within 2 s (--seconds-per-arch)" in rows[0]["reason"]
    assert "exit code 3" in rows[1]["reason"]
    assert [zoo.outcome(r) for r in rows] == ["fail", "fail", "pass"]
    assert zoo.verdicts(rows[0]) == (zoo.ERROR,) * 4
    assert lines[-1].startswith("[3/3] fine: PASS PASS PASS PASS")


def test_a_reason_with_a_pipe_reads_back_from_the_table(tmp_path: Path) -> None:
    row = {"architecture": "XForCausalLM", "status": zoo.CANNOT_BUILD,
           "reason": "a | b", "checks": {}, "seconds": 0.1}
    data = {"conditions": {"torch": "2", "transformers": "5", "python": "3", "threads": 1,
                           "cpu": "x"},
            "counts": {"pass": 0, "fail": 0, "cannot build": 1}, "rows": [row],
            "patterns": None, "limit": None, "complete": True, "architectures": 1,
            "heads": ["ForCausalLM"], "steps": 2, "wall_seconds": 1.0, "median_seconds": 0.1,
            "median_built_seconds": 0.0,
            "reproduce": "gradequiv zoo --library transformers --out t.md"}
    text = zoo.markdown(data)
    assert "| a \\| b |" in text
    table = tmp_path / "t.md"
    table.write_text(text, encoding="utf-8")
    assert zoo.read_verdicts(table) == {"XForCausalLM": (zoo.CANNOT_BUILD,) * 4}


def test_the_header_names_the_toggle_the_installed_transformers_has() -> None:
    pytest.importorskip("transformers")
    import transformers

    from gradequiv.harness.commands.zoo import _conditions

    conditions = _conditions()
    has_new = hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
    toggle = "activation_checkpointing_enable" if has_new else "gradient_checkpointing_enable"
    assert conditions["toggle"] == toggle
    assert conditions["transformers"] == transformers.__version__
    row = {"architecture": "XForCausalLM", "status": zoo.CANNOT_BUILD,
           "reason": "r", "checks": {}, "seconds": 0.1}
    data = {"conditions": conditions, "counts": {"pass": 0, "fail": 0, "cannot build": 1},
            "rows": [row], "patterns": None, "limit": None, "complete": True,
            "architectures": 1, "heads": ["ForCausalLM"], "steps": 2, "wall_seconds": 1.0,
            "median_seconds": 0.1, "median_built_seconds": 0.0,
            "reproduce": "gradequiv zoo --out t.md"}
    text = zoo.markdown(data)
    assert f"(its own `{toggle}()`)" in text
    assert f"transformers {transformers.__version__}," in text


@pytest.mark.parametrize("library, said", [
    ("timm", "does not list timm's models yet: check them one by one"),
    ("diffusers", "does not list or build diffusers' models yet"),
])
def test_a_library_not_swept_is_refused_with_exit_2_and_the_reason(
        library: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["zoo", "--library", library])
    err = capsys.readouterr().err
    assert code == 2 and said in err and err.count("\n") == 1, err
    assert f"--library={library}:" in err


#: a sample across kinds: decoders, an encoder, an encoder-decoder, a vision model, speech,
#: one that fails for real and one the route cannot build
SAMPLE = ("LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM",
          "T5ForConditionalGeneration", "ViTForImageClassification",
          "BlipForConditionalGeneration", "HubertForCTC",
          # its key biases' gradients are rounding noise (it passes); BatchNorm re-updated
          "BartForConditionalGeneration", "MobileViTForImageClassification")


@pytest.mark.slow
def test_a_sample_of_the_committed_table_checks_as_recorded(
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    argv = ["zoo", "--library", "transformers", "--check", str(TABLE)]
    for name in SAMPLE:
        argv += ["--arch", name]
    code = main(argv)
    out = capsys.readouterr().out
    assert f"re-checking {TABLE}'s {len(SAMPLE)} transformers architectures" in out
    assert code == 0, out

"""``--model timm:NAME`` with ``--impl timm``: timm's own models and its own checkpointing,
checked with no factory. timm needs torchvision built for the installed torch, which the
CPU build of torch has none of on PyPI: CI runs these in a venv of their own
(``ci/timm-check.sh``); elsewhere they skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradequiv.harness import Case, resolve, verify
from gradequiv.harness.cli import main
from gradequiv.models import ExternalConfig, build, parse_granularity

timm = pytest.importorskip("timm")

from gradequiv.models.timm_models import ARCHITECTURES  # noqa: E402  (timm present)

#: what timm's set_grad_checkpointing() checkpoints in each: a ViT's blocks, a ConvNeXt
#: stage's blocks, a ResNet's blocks (its stages flattened)
SEGMENTS = {"vit_tiny_patch16_224": ["blocks.0", "blocks.1"],
            "deit_tiny_patch16_224": ["blocks.0", "blocks.1"],
            "convnext_atto": ["stages.0.blocks.0", "stages.1.blocks.0", "stages.2.blocks.0",
                              "stages.3.blocks.0"],
            "resnet18": ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]}


def _case(name: str, **kwargs: object) -> Case:
    return Case(model=ExternalConfig(f"timm:{name}"),
                granularity=parse_granularity("toggle"), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_segments_are_what_timm_checkpoints(name: str) -> None:
    workload = build(ExternalConfig(f"timm:{name}"), Case().batch, 0)
    assert [s.name for s in workload.segments(parse_granularity("toggle"))] == SEGMENTS[name]
    assert sum(p.numel() for p in workload.model.parameters()) < 10_000_000


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "deit_tiny_patch16_224",
                                  "convnext_atto"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_without_batchnorm_passes_under_timm_s_own_checkpointing(
        name: str, reentrant: bool) -> None:
    impl = resolve("timm", kwargs={"use_reentrant": reentrant})
    for dtype in ("fp32", "bf16-autocast"):
        verdict = verify(impl, _case(name, dtype=dtype))
        assert verdict.passed, verdict.error or verdict.first_failure
        assert any(c.name.startswith("grad of ") for p in verdict.properties
                   for c in p.checks)


def test_resnet_s_batchnorm_counters_are_updated_twice_by_the_re_run() -> None:
    """timm checkpoints a ResNet's blocks with their BatchNorm layers inside, so the re-run
    in backward updates the running statistics and counters a second time: a real
    difference from full storage, as transformers' MobileViT has (the zoo's table)."""
    verdict = verify(resolve("timm"), _case("resnet18"))
    buffers = next(p for p in verdict.properties if p.name == "buffers")
    assert buffers.passed is False
    assert "num_batches_tracked" in buffers.first_failure


def test_a_check_runs_from_the_command_line(capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    code = main(["check", "--in-process", "--impl", "timm", "--model",
                 "timm:vit_tiny_patch16_224", "--examples", "2",
                 "--report-dir", str(tmp_path / "report")])
    assert code == 0, capsys.readouterr().out


def test_the_toggle_without_a_timm_model_says_what_to_add(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--in-process", "--impl", "timm", "--examples", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "add --model timm:vit_tiny_patch16_224" in err, err


@pytest.mark.parametrize("spec, said", [
    ("timm:no_such_model", "is not a timm model name"),
    ("timm:vit_large_patch16_224", "has no tiny configuration in gradequiv yet"),
])
def test_what_the_route_cannot_build_is_exit_2_with_the_reason(
        spec: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--in-process", "--impl", "timm", "--model", spec,
                 "--examples", "1"])
    err = capsys.readouterr().err
    assert code == 2 and said in err and err.count("\n") == 1, err


@pytest.mark.parametrize("reentrant", [False, True])
def test_use_reentrant_reaches_timm_s_checkpoint(reentrant: bool) -> None:
    """The option is timm's own process-wide switch, set on every install: the graph shows
    torch's reentrant checkpoint (a CheckpointFunction node) exactly where it was asked."""
    from gradequiv.models.timm_models import timm_model

    built = timm_model("vit_tiny_patch16_224", 0)
    resolve("timm").target(built.model, use_reentrant=reentrant)  # as an install calls it
    assert isinstance(built.inputs, tuple)
    names, todo, seen = set(), [built.model(*built.inputs).grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [n for n, _ in node.next_functions]
    assert ("CheckpointFunctionBackward" in names) == reentrant

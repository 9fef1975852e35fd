"""``--model diffusers:NAME``: a diffusers model checked with no factory, built tiny from its
own constructor, its denoising loss, and the modules its own checkpointing wraps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradequiv.harness import Case, resolve, verify
from gradequiv.harness.cli import main
from gradequiv.models import ExternalConfig, parse_granularity
from gradequiv.models.library import library_factory

ARCHITECTURES = ["UNet2DModel", "UNet2DConditionModel", "DiTTransformer2DModel"]


def _case(name: str, **kwargs: object) -> Case:
    return Case(model=ExternalConfig(f"diffusers:{name}"),
                granularity=parse_granularity("layer"), **kwargs)  # type: ignore[arg-type]


def test_the_diffusers_prefix_routes_to_the_library() -> None:
    assert library_factory("diffusers:UNet2DModel") is not None
    assert library_factory("my_models:diffusers") is None


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_segments_are_what_the_library_s_own_checkpointing_wraps(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the library's own default function on, torch's checkpoint is handed exactly the
    modules the route made segments, no more, no fewer."""
    pytest.importorskip("diffusers")
    from gradequiv.models.diffusers_models import diffusers_model

    built = diffusers_model(name, 0)
    names = {id(m): n for n, m in built.model.named_modules()}
    handed: list[str] = []
    real = torch.utils.checkpoint.checkpoint

    def spy(function: Any, *args: Any, **kwargs: Any) -> Any:
        handed.append(names[id(getattr(function, "__self__", function))])
        return real(function, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", spy)
    built.model.enable_gradient_checkpointing()  # type: ignore[operator]
    built.model(**built.keywords)
    assert len(built.segments) >= 2
    assert sorted(set(handed)) == sorted(built.segments)  # type: ignore[type-var]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_an_architecture_by_name_passes_with_its_own_checkpointing(name: str) -> None:
    pytest.importorskip("diffusers")
    for dtype in ("fp32", "bf16-autocast"):
        verdict = verify(resolve("diffusers"), _case(name, dtype=dtype))
        assert verdict.passed, (dtype, verdict.error or verdict.first_failure)
        assert any(c.name.startswith("grad of ") for p in verdict.properties for c in p.checks)


def test_a_missing_rng_restore_in_the_library_s_checkpoint_is_caught() -> None:
    pytest.importorskip("diffusers")
    impl = resolve("diffusers", kwargs={"preserve_rng_state": False})
    verdict = verify(impl, _case("UNet2DModel"))
    assert verdict.passed is False
    assert "rng" in [p.name for p in verdict.properties if p.passed is False]


@pytest.mark.parametrize("argv, said", [
    (["--model", "diffusers:NoSuchModel"], "NoSuchModel is not a diffusers model class"),
    (["--model", "diffusers:UNetMotionModel"], "has no tiny configuration in gradequiv yet"),
    ([], "--impl='diffusers' toggles a diffusers model's own checkpointing"),
])
def test_what_cannot_be_built_is_exit_2_with_the_reason(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("diffusers")
    code = main(["check", "--in-process", "--impl", "diffusers", *argv, "--examples", "1"])
    err = capsys.readouterr().err
    assert code == 2 and said in err, err

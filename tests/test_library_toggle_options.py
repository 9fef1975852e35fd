"""transformers' own toggle options through ``--impl hf`` (5.25 on): ``every_n_layers``
checkpoints every n-th layer, and the recompute property checks that exactly those re-run;
``offload`` wraps each checkpoint in ``save_on_cpu``. On a transformers with only the old
``gradient_checkpointing_enable`` both are refused with the value, the rule and the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from library_models import pins_host_memory

from gradequiv.harness import Case, InvalidArgument, resolve, verify
from gradequiv.harness.implementations.libraries import hf_gradient_checkpointing
from gradequiv.models import ExternalConfig, parse_granularity

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")


def _case(granularity: str, factory: str = "library_models:llama4") -> Case:
    return Case(model=ExternalConfig(factory), granularity=parse_granularity(granularity))


def _recompute(verdict: Any) -> Any:
    return next(p for p in verdict.properties if p.name == "recompute")


def _llama4() -> torch.nn.Module:
    import library_models

    return library_models.llama4(0).model


def _checkpointing(model: torch.nn.Module) -> list[bool]:
    return [layer.gradient_checkpointing for layer in model.model.layers]  # type: ignore


@pytest.mark.parametrize("granularity, every, on", [
    ("layer", 2, [True, False, True, False]),
    ("layer", 3, [True, False, False, True]),
    # both at once: a layer recomputes where both select it (every:2 is 0, 2; n=3 is 0, 3)
    ("every:2", 3, [True, False, False, False]),
])
def test_every_n_layers_reaches_the_toggle_and_it_says_which_layers_recompute(
        granularity: str, every: int, on: list[bool]) -> None:
    model = _llama4()
    step = 1 if granularity == "layer" else 2  # the layers gradequiv's granularity selects
    segments = [f"model.layers.{i}" for i in range(0, 4, step)]
    said = hf_gradient_checkpointing(model, segments=segments, every_n_layers=every)
    assert _checkpointing(model) == on
    assert said == [f"model.layers.{i}" for i, flag in enumerate(on) if flag]


def test_without_every_n_layers_the_toggle_says_nothing_and_every_selected_layer_recomputes(
        ) -> None:
    model = _llama4()
    assert hf_gradient_checkpointing(model, segments=["model.layers.0", "model.layers.2"]) \
        is None
    assert _checkpointing(model) == [True, False, True, False]


@pytest.mark.parametrize("granularity, plain", [
    ("layer", "model.layers.1, model.layers.3"), ("every:2", "model.layers.2")])
def test_the_recompute_property_checks_exactly_the_layers_the_toggle_recomputes(
        granularity: str, plain: str) -> None:
    every = 2 if granularity == "layer" else 3
    verdict = verify(resolve("hf", kwargs={"every_n_layers": every}), _case(granularity))
    assert verdict.passed, verdict.error or _recompute(verdict).summary
    assert f"{plain} left out of the checkpointing by the implementation and not re-run" \
        in _recompute(verdict).summary


def test_a_layer_the_toggle_says_it_left_out_but_re_runs_fails_the_recompute_property() -> None:
    verdict = verify(resolve("library_models:every_layer_said_every_second", adapter="toggle"),
                     _case("toggle"))
    recompute = _recompute(verdict)
    assert recompute.passed is False
    assert recompute.summary.startswith("step 1: model.layers.1 ran again in backward")
    assert "said it left it out of its checkpointing" in recompute.summary


def test_every_n_layers_from_the_command_line_is_a_whole_number() -> None:
    impl = resolve("hf", kwargs={"every_n_layers": 2})
    assert impl.command_args() == ["--impl", "hf", "--impl-kwarg", "every_n_layers=2"]
    with pytest.raises(InvalidArgument, match=r"every_n_layers=0: .* must be a whole number "
                                              r">= 1; write e.g. every_n_layers=2"):
        hf_gradient_checkpointing(_llama4(), every_n_layers=0)


class _OldModel(torch.nn.Module):
    """A transformers model as before 5.25: only ``gradient_checkpointing_enable``."""

    config = object()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Any = None) -> None:
        raise AssertionError("the refused option must not reach the old toggle")


@pytest.mark.parametrize("option", [{"every_n_layers": 2}, {"offload": True}])
def test_a_transformers_without_the_new_toggle_refuses_its_options(option: dict[str, Any]
                                                                  ) -> None:
    (key, value), = option.items()
    with pytest.raises(InvalidArgument) as refused:
        hf_gradient_checkpointing(_OldModel(), **option)
    said = str(refused.value)
    assert said.startswith(f"--impl-kwarg {key}={value}: an option of transformers' "
                           f"activation_checkpointing_enable (5.25 and later)")
    assert "has only gradient_checkpointing_enable: upgrade it" in said


def _pushed_pack_hooks(monkeypatch: pytest.MonkeyPatch, offload: bool) -> list[str]:
    """The pack hooks pushed while a tiny Llama with its own checkpointing runs forward."""
    import library_models

    built = library_models.llama4(0)
    model = built.model
    model.train()
    hf_gradient_checkpointing(model, offload=offload) if offload else \
        hf_gradient_checkpointing(model)
    pushed: list[str] = []
    push = torch._C._autograd._push_saved_tensors_default_hooks

    def spy(pack: Any, unpack: Any) -> None:
        pushed.append(pack.__qualname__)
        push(pack, unpack)

    monkeypatch.setattr(torch._C._autograd, "_push_saved_tensors_default_hooks", spy)
    try:
        model(*built.positional, **built.keywords)
    except RuntimeError as exc:  # save_on_cpu pins its copies; see the test below
        assert "pin_memory" in str(exc)
    return pushed


def test_offload_saves_the_checkpoints_boundaries_through_save_on_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The toggle wraps each checkpoint in ``torch.autograd.graph.save_on_cpu``: its pack
    hook is pushed during the forward, under the checkpoint's own, and without offload it
    is not."""
    offloaded = _pushed_pack_hooks(monkeypatch, offload=True)
    assert any("save_on_cpu" in name for name in offloaded), offloaded
    assert not any("save_on_cpu" in name for name in _pushed_pack_hooks(monkeypatch,
                                                                        offload=False))


@pytest.mark.skipif(not pins_host_memory(),
                    reason="save_on_cpu(pin_memory=True) needs an accelerator")
def test_offload_passes_on_a_tiny_llama() -> None:
    verdict = verify(resolve("hf", kwargs={"offload": True}),
                     _case("layer", "gradequiv.models.hf:llama"))
    assert verdict.passed, verdict.error or _recompute(verdict).summary


@pytest.mark.skipif(pins_host_memory(), reason="pinned host memory is available here")
def test_offload_without_an_accelerator_is_the_library_s_error_as_the_verdict() -> None:
    """transformers 5.25 calls ``save_on_cpu(pin_memory=True, device_type="cpu")`` when no
    accelerator is present; torch 2.13 then refuses to pin the host copy. The check says
    so as the implementation's error, it does not crash."""
    verdict = verify(resolve("hf", kwargs={"offload": True}),
                     _case("layer", "gradequiv.models.hf:llama"))
    assert verdict.passed is False and verdict.error is not None
    assert "pin_memory=True requires a CUDA or other accelerator backend" in verdict.error
